//! CUDA graphs of launch sequences: which runs go eagerly, when a sequence is captured, which
//! graphs are kept.
//!
//! [`GraphCache`] is pure bookkeeping (no CUDA), generic over the key and the graph type so it
//! is unit-tested without a device; any engine keys its own launch sequences (the classic
//! pipeline uses [`GraphKey`]). With [`OwnedGraph`]s, [`GraphCache::run`] runs a sequence given
//! as a closure: eagerly, by capturing it ([`capture_launches`]) or by replaying its graph. Rules:
//! - a key runs eagerly until it has been seen on `warmup` consecutive frames ("stable"), then
//!   the next frame captures it and later frames replay it;
//! - at most `capacity` graphs are kept, the least recently used is evicted;
//! - a key whose capture failed runs eagerly for the rest of the cache's life.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use cudarc::driver::{CudaGraph, CudaStream};

use super::error::{CudaError, driver};
use super::fault::{Fault, injected};
use crate::pipeline::Shape;
use crate::pipeline::params::{MAX_HISTORY, MAX_ITERATIONS};

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
pub(crate) struct OwnedGraph(pub CudaGraph);

// SAFETY: the graph is only touched through the owning pipeline's `&mut self`, so accesses are
// serialised as the CUDA graph API requires; the raw handles are valid on any thread.
unsafe impl Send for OwnedGraph {}

/// Captures what `enqueue` puts on `stream` into a graph, instantiates it and uploads it.
///
/// `enqueue` must only enqueue work on `stream` (no allocation, no synchronous copy, no host
/// read); the capture is thread-local, so other threads' CUDA work is not caught in it. With
/// `TOONFLOW_CUDA_FAULT=capture` a stream synchronisation inside the capture makes it fail.
pub(crate) fn capture_launches(
    stream: &Arc<CudaStream>,
    enqueue: impl FnOnce() -> Result<(), CudaError>,
) -> Result<OwnedGraph, CudaError> {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(driver("cuStreamBeginCapture"))?;
    let mut enqueued = enqueue();
    if injected(Fault::Capture) && enqueued.is_ok() {
        enqueued = stream.synchronize().map_err(driver(
            "cuStreamSynchronize inside the capture (injected fault)",
        ));
    }
    // The capture is always ended, also after a failed enqueue, so the stream is usable again.
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags_enum(0));
    enqueued?;
    match graph.map_err(driver("cuStreamEndCapture/instantiate"))? {
        Some(g) => {
            g.upload().map_err(driver("cuGraphUpload"))?;
            Ok(OwnedGraph(g))
        }
        None => Err(CudaError::Failed("the capture produced no graph".into())),
    }
}

/// How [`GraphCache::run`] ran a launch sequence.
#[derive(Debug)]
pub(crate) enum Ran<K> {
    Eager,
    Replayed,
    /// Captured (then launched); `evicted` is the key whose graph made room.
    Captured {
        capture_us: f64,
        evicted: Option<K>,
    },
    /// The capture failed and the sequence ran eagerly; the key stays eager.
    CaptureFailed {
        reason: CudaError,
    },
}

impl<K: Clone + Eq + Hash> GraphCache<K, OwnedGraph> {
    /// Runs the launch sequence of `key`, which `enqueue` puts on `stream`: eagerly while the
    /// key warms up or after its capture failed, captured once it is stable, replayed after.
    pub(crate) fn run(
        &mut self,
        key: &K,
        stream: &Arc<CudaStream>,
        enqueue: impl Fn() -> Result<(), CudaError>,
    ) -> Result<Ran<K>, CudaError> {
        match self.decide(key) {
            Decision::Eager => {
                enqueue()?;
                Ok(Ran::Eager)
            }
            Decision::Replay => {
                let graph = self.get(key).expect("decide said replay");
                graph.0.launch().map_err(driver("cuGraphLaunch"))?;
                Ok(Ran::Replayed)
            }
            Decision::Capture => {
                let start = Instant::now();
                match capture_launches(stream, &enqueue) {
                    Ok(graph) => {
                        let capture_us = start.elapsed().as_secs_f64() * 1e6;
                        graph.0.launch().map_err(driver("cuGraphLaunch"))?;
                        let evicted = self.insert(key.clone(), graph).map(|(k, _)| k);
                        Ok(Ran::Captured {
                            capture_us,
                            evicted,
                        })
                    }
                    Err(reason) => {
                        self.mark_failed(key.clone());
                        enqueue()?;
                        Ok(Ran::CaptureFailed { reason })
                    }
                }
            }
        }
    }
}

/// The classic pipeline's graph key: the shape, and the bilateral iteration after which the
/// temporal filter and the edges run (it fixes the order of the launches).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub shape: Shape,
    pub edge_iteration: u32,
}

impl GraphKey {
    pub fn iterations(&self) -> u32 {
        self.shape.bilateral_iterations.min(MAX_ITERATIONS)
    }
    /// Slots of the temporal ring (0: no temporal filter).
    pub fn ring_capacity(&self) -> u32 {
        self.shape.temporal_history.min(MAX_HISTORY)
    }
    pub fn has_ring(&self) -> bool {
        self.ring_capacity() > 0
    }
    /// The DoG x pass needs its own launch when no bilateral x pass follows the edge iteration.
    pub fn edge_at_end(&self) -> bool {
        self.edge_iteration == self.iterations()
    }
    /// Kernel launches of a frame: unpack, 2 per iteration, the analysis and the temporal filter
    /// on their own when there is a ring and the filter comes before the first iteration (after
    /// one, the y pass that ends the edge iteration filters; see also analysis_in_x_pass), the
    /// stand-alone DoG x pass when needed, final.
    /// The frame's analysis rides in an extra block of the first x pass (nothing before the
    /// temporal filter needs it) unless the filter comes first or there is no x pass.
    pub fn analysis_in_x_pass(&self) -> bool {
        self.iterations() > 0 && !(self.has_ring() && self.edge_iteration == 0)
    }
    pub fn launches(&self) -> u32 {
        let own_temporal = self.has_ring() && self.edge_iteration == 0;
        let own_analysis = !self.analysis_in_x_pass();
        2 + 2 * self.iterations()
            + own_analysis as u32
            + own_temporal as u32
            + self.edge_at_end() as u32
    }
}

impl std::fmt::Display for GraphKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shape;
        write!(
            f,
            "{}x{} {:?} iterations {} history {} auto-levels {} edge-iteration {}",
            s.width,
            s.height,
            s.precision,
            s.bilateral_iterations,
            s.temporal_history,
            s.auto_levels,
            self.edge_iteration
        )
    }
}

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
    fn a_graph_key_counts_its_launches() {
        let shape = crate::cuda::plan::default_shape(64, 48, crate::pipeline::Precision::Fp16);
        let key = |iterations, history, edge_iteration| GraphKey {
            shape: Shape {
                bilateral_iterations: iterations,
                temporal_history: history,
                ..shape
            },
            edge_iteration,
        };
        // unpack, 3 x (x, y; the first x pass analyses, the first y pass filters), final
        assert_eq!(key(3, 4, 1).launches(), 8);
        assert!(key(3, 4, 1).analysis_in_x_pass());
        // the temporal filter before the first iteration: analyze and temporal of their own
        assert_eq!(key(3, 4, 0).launches(), 10);
        assert!(!key(3, 4, 0).analysis_in_x_pass());
        // edges after the last iteration: its y pass filters, the DoG x pass on its own
        assert_eq!(key(3, 4, 3).launches(), 9);
        // no ring, edges after the last iteration: the stand-alone DoG x pass instead
        assert_eq!(key(3, 0, 3).launches(), 9);
        // no x pass: unpack, analyze, (temporal,) DoG x, final
        assert_eq!(key(0, 0, 0).launches(), 4);
        assert_eq!(key(0, 2, 0).launches(), 5);
        assert_eq!(key(20, 20, 1).iterations(), MAX_ITERATIONS);
        assert_eq!(key(20, 20, 1).ring_capacity(), MAX_HISTORY);
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
