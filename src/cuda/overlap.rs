//! Bookkeeping of the overlap path (issue 12), plain Rust so it is tested without a GPU.
//!
//! With overlap a frame's upload runs on a copy stream into one device *landing slot* while the
//! previous frame's kernels and download run on the compute stream. The compute stream copies
//! the landing slot into the arena's input (a device copy, ~2 µs at 1080p) at the start of each
//! frame's work, so the captured graphs keep their fixed pointers; the next upload waits (an
//! event) until that copy is done, so the landing slot is never overwritten before it is read.
//! Each frame in flight owns a *host slot* (page-locked parameter block and analysis report,
//! its CUDA events) until its completion has been seen: [`SlotRing`] says which host slot the
//! next frame takes, which ones are in flight (oldest first), and which frame last read the
//! landing slot. [`FlightSlot`] is that host slot, shared with the network's overlap path
//! (`neural_overlap.rs`).

use std::collections::VecDeque;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, sys};

use super::context::guard;
use super::error::{CudaError, driver};
use super::pinned::PinnedHostBuffer;

/// What a frame in flight remembers until its completion is seen.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct InFlight {
    pub launches: u32,
    pub replayed: bool,
    pub host_time_us: f64,
}

/// A frame's host slot on an overlap path, with `EVENTS` timing events (the classic path's five
/// are listed at `ev`; the network's path numbers its own, `neural_overlap.rs`).
pub(crate) struct FlightSlot<const EVENTS: usize = 5> {
    /// What goes up and comes back with the frame (each path lays it out).
    pub host: PinnedHostBuffer,
    /// 0/1: upload start and end (copy stream); 2: compute start; 3: the input read (the next
    /// upload waits for it); 4: kernels end (compute stream).
    pub ev: [CudaEvent; EVENTS],
    /// After the download: blocking sync, so a thread that waits for it sleeps instead of
    /// spinning.
    pub done: Arc<CudaEvent>,
    pub frame: InFlight,
}

impl<const EVENTS: usize> FlightSlot<EVENTS> {
    /// [`HOST_SLOTS`] slots of `host_bytes` page-locked bytes each, with their events, in `ctx`.
    pub(crate) fn make_all(
        ctx: &Arc<CudaContext>,
        host_bytes: usize,
    ) -> Result<Vec<FlightSlot<EVENTS>>, CudaError> {
        guard("setting up the overlap's host slots", || {
            let ev = |flags| ctx.new_event(Some(flags)).map_err(driver("cuEventCreate"));
            let timing = sys::CUevent_flags::CU_EVENT_DEFAULT;
            (0..HOST_SLOTS)
                .map(|_| {
                    let events = (0..EVENTS)
                        .map(|_| ev(timing))
                        .collect::<Result<Vec<_>, CudaError>>()?;
                    Ok(FlightSlot {
                        host: PinnedHostBuffer::in_context(ctx.clone(), host_bytes)?,
                        ev: events
                            .try_into()
                            .map_err(|_| CudaError::Failed("an overlap slot's events".into()))?,
                        done: Arc::new(ev(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)?),
                        frame: InFlight::default(),
                    })
                })
                .collect()
        })
    }

    /// Whether the frame is complete: with `wait`, after waiting for it.
    pub(crate) fn complete(&self, wait: bool) -> Result<bool, CudaError> {
        if wait {
            self.done
                .synchronize()
                .map_err(driver("cuEventSynchronize"))?;
            return Ok(true);
        }
        self.done.try_is_complete().map_err(driver("cuEventQuery"))
    }
}

/// Host slots of a pipeline with overlap: one frame in the compute stream, one uploading, one
/// whose completion the element has not yet seen.
pub const HOST_SLOTS: usize = 3;

/// Which host slots are in flight, in submission order.
#[derive(Debug, Clone)]
pub struct SlotRing {
    slots: usize,
    /// Slots in flight, oldest first.
    order: VecDeque<usize>,
    /// The slot the next frame takes (round robin: always the one used longest ago).
    next: usize,
    /// The slot of the last frame submitted: its "landing slot read" event guards the next upload.
    last: Option<usize>,
}

impl SlotRing {
    pub fn new(slots: usize) -> Self {
        assert!(slots > 0);
        SlotRing {
            slots,
            order: VecDeque::with_capacity(slots),
            next: 0,
            last: None,
        }
    }

    /// The slot the next frame may take, when it is not in flight any more.
    pub fn next_free(&self) -> Option<usize> {
        (!self.order.contains(&self.next)).then_some(self.next)
    }

    /// Marks `slot` (from [`SlotRing::next_free`]) in flight.
    pub fn begin(&mut self, slot: usize) {
        debug_assert_eq!(self.next_free(), Some(slot));
        self.order.push_back(slot);
        self.next = (slot + 1) % self.slots;
        self.last = Some(slot);
    }

    /// The oldest slot in flight (frames complete in submission order: one compute stream).
    pub fn oldest(&self) -> Option<usize> {
        self.order.front().copied()
    }

    /// The oldest frame is complete and its figures read: its slot is free again.
    pub fn finish_oldest(&mut self) -> Option<usize> {
        self.order.pop_front()
    }

    /// The slot of the frame that last read (or will read) the landing slot.
    pub fn last_submitted(&self) -> Option<usize> {
        self.last
    }

    pub fn in_flight(&self) -> usize {
        self.order.len()
    }

    /// Forgets every frame in flight (after the streams were synchronised).
    pub fn clear(&mut self) {
        self.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_round_robin_and_freed_oldest_first() {
        let mut r = SlotRing::new(3);
        assert_eq!(r.last_submitted(), None);
        for want in [0, 1, 2] {
            let s = r.next_free().unwrap();
            assert_eq!(s, want);
            r.begin(s);
            assert_eq!(r.last_submitted(), Some(s));
        }
        assert_eq!(r.in_flight(), 3);
        // All three in flight: the next frame must wait for the oldest.
        assert_eq!(r.next_free(), None);
        assert_eq!(r.oldest(), Some(0));
        assert_eq!(r.finish_oldest(), Some(0));
        assert_eq!(r.next_free(), Some(0));
        r.begin(0);
        // Slot 1 is next in line and still in flight.
        assert_eq!(r.next_free(), None);
        assert_eq!(r.finish_oldest(), Some(1));
        assert_eq!(r.finish_oldest(), Some(2));
        assert_eq!(r.next_free(), Some(1));
        assert_eq!(r.oldest(), Some(0));
        assert_eq!(r.last_submitted(), Some(0));
    }

    #[test]
    fn a_slot_in_flight_is_never_handed_out_again() {
        let mut r = SlotRing::new(HOST_SLOTS);
        let mut busy = [false; HOST_SLOTS];
        // Frames submitted and completed with up to two in flight, as the element runs them.
        for frame in 0..50 {
            while r.in_flight() >= 2 {
                let s = r.finish_oldest().unwrap();
                busy[s] = false;
            }
            let s = r.next_free().expect("a free slot with two in flight");
            assert!(!busy[s], "frame {frame}: slot {s} in flight");
            busy[s] = true;
            r.begin(s);
        }
        r.clear();
        assert_eq!(r.in_flight(), 0);
        assert_eq!(r.oldest(), None);
    }
}
