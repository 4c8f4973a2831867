//! Both CPU paths (the reference and the fast path) on their worker pools compute exactly what
//! they compute on one thread, on real photos, and processing a frame allocates nothing (so it
//! spawns no thread either: a spawn allocates). One test in this file, because allocations are
//! counted process-wide.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use gsttoonflow::pipeline::fast::CpuClassic;
use gsttoonflow::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, StageParams, ToonParams};

/// Counts every allocation of the process.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `frames` through a pipeline (the reference or the fast path) of `threads` threads; the
/// outputs, and the allocations made while processing every frame after the first.
fn run(
    frames: &[common::Nv12],
    params: &ToonParams,
    reference: bool,
    threads: usize,
) -> (Vec<Vec<u8>>, Vec<(bool, u32)>, u64) {
    let (w, h) = (frames[0].width, frames[0].height);
    let geometry = FrameGeometry::new(w, h).unwrap();
    let mut cpu = CpuClassic::new(geometry, params.history as usize, reference);
    match &mut cpu {
        CpuClassic::Fast(p) => {
            p.set_threads(threads);
            assert_eq!(p.threads(), threads);
        }
        CpuClassic::Reference(p) => {
            p.set_threads(threads);
            assert_eq!(p.threads(), threads);
        }
    }
    let mut outputs: Vec<Vec<u8>> = frames.iter().map(|_| vec![0u8; w * h * 3 / 2]).collect();
    let mut reports = Vec::with_capacity(frames.len());
    let mut allocations = 0;
    for (i, (frame, out)) in frames.iter().zip(outputs.iter_mut()).enumerate() {
        let input = Nv12Frame::packed(geometry, &frame.data).unwrap();
        let mut output = Nv12FrameMut::packed(geometry, out).unwrap();
        // The first frame is a warm-up: parking_lot sets up each thread's parking data the
        // first time the thread waits, and the fast path sizes its vertical-pass scratch.
        let before = ALLOCATIONS.load(Ordering::SeqCst);
        let report = cpu.process(params, &input, &mut output);
        if i > 0 {
            allocations += ALLOCATIONS.load(Ordering::SeqCst) - before;
        }
        reports.push((report.scene_cut, report.history_used as u32));
    }
    (outputs, reports, allocations)
}

#[test]
fn worker_pool_is_bit_exact_with_one_thread_and_allocates_nothing_per_frame() {
    // An odd chroma-unfriendly size, a clip that moves (noise) and cuts (another photo), so the
    // temporal ring and the scene detector take part.
    let (w, h) = (362, 206);
    let astronaut = common::photo("astronaut.png", w, h);
    let coffee = common::photo("coffee.png", w, h);
    let frames = vec![
        astronaut.clone(),
        astronaut.with_noise(3.0, 1),
        astronaut.with_noise(3.0, 2),
        astronaut.with_noise(3.0, 3),
        coffee.clone(),
        coffee.with_noise(3.0, 4),
    ];
    let params = ToonParams::new(&StageParams::default(), w as u32, h as u32);
    for (path, reference) in [("reference", true), ("fast path", false)] {
        let (single, single_reports, _) = run(&frames, &params, reference, 1);
        assert!(
            single_reports.iter().any(|r| r.0),
            "{path}: the cut to another photo is seen"
        );
        assert!(
            single_reports.iter().any(|r| r.1 > 1),
            "{path}: the temporal ring takes part"
        );
        for threads in [2, 3, 8] {
            let (pooled, reports, allocations) = run(&frames, &params, reference, threads);
            assert_eq!(
                reports, single_reports,
                "{path}, {threads} threads: frame reports"
            );
            for (i, (a, b)) in single.iter().zip(&pooled).enumerate() {
                let differing = a.iter().zip(b).filter(|(x, y)| x != y).count();
                assert_eq!(
                    differing, 0,
                    "{path}, {threads} threads, frame {i}: {differing} bytes differ from one thread"
                );
            }
            assert_eq!(
                allocations,
                0,
                "{path}, {threads} threads: processing frames 2–{} allocated",
                frames.len()
            );
        }
        // The output is a cartoon, not a copy: the check above compares real work.
        let changed = single[0]
            .iter()
            .zip(&frames[0].data)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            changed > single[0].len() / 4,
            "{path}: only {changed} bytes changed"
        );
    }
}
