//! CUDA graph cache: which frames run eagerly, when a shape is captured, which graphs are kept.
//!
//! [`GraphCache`] is pure bookkeeping (no CUDA), generic over the key and the graph type so it
//! is unit-tested without a device. Rules:
//! - a key runs eagerly until it has been seen on `warmup` consecutive frames ("stable"), then
//!   the next frame captures it and later frames replay it;
//! - at most `capacity` graphs are kept, the least recently used is evicted;
//! - a key whose capture failed runs eagerly for the rest of the cache's life.

use std::collections::HashSet;
use std::hash::Hash;

/// What to do for this frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Eager,
    Capture,
    Replay,
}

#[derive(Debug)]
pub struct GraphCache<K, G> {
    capacity: usize,
    warmup: u32,
    /// Least recently used first.
    entries: Vec<(K, G)>,
    failed: HashSet<K>,
    last_key: Option<K>,
    streak: u32,
}

impl<K: Clone + Eq + Hash, G> GraphCache<K, G> {
    pub fn new(capacity: usize, warmup: u32) -> Self {
        GraphCache {
            capacity: capacity.max(1),
            warmup,
            entries: Vec::new(),
            failed: HashSet::new(),
            last_key: None,
            streak: 0,
        }
    }

    /// Decides how to run a frame of `key` and records that it was seen.
    pub fn decide(&mut self, key: &K) -> Decision {
        if self.last_key.as_ref() == Some(key) {
            self.streak = self.streak.saturating_add(1);
        } else {
            self.last_key = Some(key.clone());
            self.streak = 1;
        }
        if self.failed.contains(key) {
            return Decision::Eager;
        }
        if let Some(pos) = self.entries.iter().position(|(k, _)| k == key) {
            let e = self.entries.remove(pos);
            self.entries.push(e);
            return Decision::Replay;
        }
        if self.streak > self.warmup {
            Decision::Capture
        } else {
            Decision::Eager
        }
    }

    /// Stores the graph captured for `key`; returns the evicted entry, if any.
    pub fn insert(&mut self, key: K, graph: G) -> Option<(K, G)> {
        self.entries.retain(|(k, _)| k != &key);
        self.entries.push((key, graph));
        if self.entries.len() > self.capacity {
            Some(self.entries.remove(0))
        } else {
            None
        }
    }

    /// The graph of `key`, if cached.
    pub fn get(&self, key: &K) -> Option<&G> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, g)| g)
    }

    /// Capture of `key` failed: eager from now on.
    pub fn mark_failed(&mut self, key: K) {
        self.entries.retain(|(k, _)| k != &key);
        self.failed.insert(key);
    }

    pub fn is_failed(&self, key: &K) -> bool {
        self.failed.contains(key)
    }

    /// Drops every graph (their buffers are about to go); failures are remembered.
    pub fn clear(&mut self) -> Vec<(K, G)> {
        self.last_key = None;
        self.streak = 0;
        std::mem::take(&mut self.entries)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// An instantiated graph, owned by one pipeline and only used under `&mut`.
pub(crate) struct OwnedGraph(pub cudarc::driver::CudaGraph);

// SAFETY: the graph is only touched through the owning pipeline's `&mut self`, so accesses are
// serialised as the CUDA graph API requires; the raw handles are valid on any thread.
unsafe impl Send for OwnedGraph {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eager_then_capture_then_replay() {
        let mut c: GraphCache<u32, &str> = GraphCache::new(2, 2);
        assert_eq!(c.decide(&1), Decision::Eager);
        assert_eq!(c.decide(&1), Decision::Eager);
        assert_eq!(c.decide(&1), Decision::Capture);
        assert!(c.insert(1, "g1").is_none());
        assert_eq!(c.decide(&1), Decision::Replay);
        assert_eq!(c.get(&1), Some(&"g1"));
    }

    #[test]
    fn an_unstable_key_stays_eager() {
        let mut c: GraphCache<u32, ()> = GraphCache::new(2, 2);
        for i in 0..10 {
            assert_eq!(c.decide(&(i % 2)), Decision::Eager);
        }
    }

    #[test]
    fn least_recently_used_is_evicted() {
        let mut c: GraphCache<u32, u32> = GraphCache::new(2, 0);
        for k in [1, 2] {
            assert_eq!(c.decide(&k), Decision::Capture);
            c.insert(k, k * 10);
        }
        assert_eq!(c.decide(&1), Decision::Replay); // 2 is now the oldest
        assert_eq!(c.decide(&3), Decision::Capture);
        assert_eq!(c.insert(3, 30), Some((2, 20)));
        assert_eq!(c.decide(&1), Decision::Replay);
        assert_eq!(c.decide(&2), Decision::Capture);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn failed_capture_is_eager_forever() {
        let mut c: GraphCache<u32, ()> = GraphCache::new(2, 1);
        assert_eq!(c.decide(&7), Decision::Eager);
        assert_eq!(c.decide(&7), Decision::Capture);
        c.mark_failed(7);
        for _ in 0..5 {
            assert_eq!(c.decide(&7), Decision::Eager);
        }
        assert!(c.is_failed(&7));
        c.clear();
        assert_eq!(c.decide(&7), Decision::Eager);
    }

    #[test]
    fn clear_drops_graphs_and_restarts_warmup() {
        let mut c: GraphCache<u32, ()> = GraphCache::new(2, 1);
        c.decide(&1);
        c.decide(&1);
        c.insert(1, ());
        assert_eq!(c.clear().len(), 1);
        assert!(c.is_empty());
        assert_eq!(c.decide(&1), Decision::Eager);
        assert_eq!(c.decide(&1), Decision::Capture);
    }
}
