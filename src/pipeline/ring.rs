//! The fixed-size ring of temporal features.
//!
//! [`RingCursor`] is the bookkeeping alone (which slot holds the k-th most recent entry); the
//! CUDA backend uses it to address feature slots inside its arena. [`TemporalRing`] owns the
//! slots for the CPU reference. Neither allocates after construction.

/// Slot bookkeeping of a ring of `capacity` entries; the oldest entry is overwritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingCursor {
    capacity: usize,
    /// Slot the next push writes.
    next: usize,
    len: usize,
}

impl RingCursor {
    pub fn new(capacity: usize) -> Self {
        RingCursor {
            capacity,
            next: 0,
            len: 0,
        }
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Forgets every entry (scene cut, flush, discont, caps change).
    pub fn clear(&mut self) {
        self.next = 0;
        self.len = 0;
    }
    /// Slot of the k-th most recent entry, k = 1 being the newest.
    pub fn slot_of_recent(&self, k: usize) -> Option<usize> {
        if k == 0 || k > self.len {
            return None;
        }
        Some((self.next + self.capacity - k) % self.capacity)
    }
    /// Slot the next push will write (the oldest entry when full).
    pub fn push_slot(&self) -> Option<usize> {
        (self.capacity > 0).then_some(self.next)
    }
    /// Records that `push_slot()` was written.
    pub fn commit_push(&mut self) {
        if self.capacity == 0 {
            return;
        }
        self.next = (self.next + 1) % self.capacity;
        self.len = (self.len + 1).min(self.capacity);
    }
}

/// A ring of preallocated entries; pushing copies into the oldest slot.
#[derive(Debug)]
pub struct TemporalRing<T> {
    cursor: RingCursor,
    slots: Vec<T>,
}

impl<T> TemporalRing<T> {
    /// `capacity` slots made by `make`, allocated once.
    pub fn new(capacity: usize, make: impl FnMut() -> T) -> Self {
        let mut make = make;
        TemporalRing {
            cursor: RingCursor::new(capacity),
            slots: (0..capacity).map(|_| make()).collect(),
        }
    }
    pub fn cursor(&self) -> RingCursor {
        self.cursor
    }
    pub fn len(&self) -> usize {
        self.cursor.len()
    }
    pub fn is_empty(&self) -> bool {
        self.cursor.is_empty()
    }
    pub fn clear(&mut self) {
        self.cursor.clear();
    }
    /// The k-th most recent entry, k = 1 being the newest.
    pub fn recent(&self, k: usize) -> Option<&T> {
        self.cursor.slot_of_recent(k).map(|s| &self.slots[s])
    }
    /// Overwrites the oldest slot through `write`.
    pub fn push_with(&mut self, write: impl FnOnce(&mut T)) {
        if let Some(slot) = self.cursor.push_slot() {
            write(&mut self.slots[slot]);
            self.cursor.commit_push();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_first_and_oldest_overwritten() {
        let mut ring = TemporalRing::new(3, || 0u32);
        for v in 1..=5 {
            ring.push_with(|s| *s = v);
        }
        assert_eq!(ring.len(), 3);
        assert_eq!(ring.recent(1), Some(&5));
        assert_eq!(ring.recent(2), Some(&4));
        assert_eq!(ring.recent(3), Some(&3));
        assert_eq!(ring.recent(4), None);
        assert_eq!(ring.recent(0), None);
    }

    #[test]
    fn clear_empties_without_reallocating() {
        let mut ring = TemporalRing::new(2, || vec![0u8; 4]);
        ring.push_with(|s| s.fill(7));
        let ptr = ring.recent(1).unwrap().as_ptr();
        ring.clear();
        assert!(ring.is_empty());
        assert_eq!(ring.recent(1), None);
        ring.push_with(|s| s.fill(9));
        assert_eq!(ring.recent(1).unwrap().as_ptr(), ptr);
        assert_eq!(ring.recent(1).unwrap()[0], 9);
    }

    #[test]
    fn zero_capacity_ring_stays_empty() {
        let mut ring = TemporalRing::new(0, || 0u8);
        ring.push_with(|s| *s = 1);
        assert!(ring.is_empty());
        assert_eq!(ring.cursor().push_slot(), None);
    }

    #[test]
    fn cursor_slots_wrap() {
        let mut c = RingCursor::new(4);
        for _ in 0..6 {
            c.commit_push();
        }
        // pushes went to slots 0,1,2,3,0,1: newest is slot 1
        assert_eq!(c.slot_of_recent(1), Some(1));
        assert_eq!(c.slot_of_recent(4), Some(2));
        assert_eq!(c.push_slot(), Some(2));
    }
}
