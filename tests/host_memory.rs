//! Frames in host memory at page-locked speed from any upstream and into any downstream (issue
//! 12): videotestsrc writes into the pinned pool toonflow proposes; buffers of other elements'
//! pools are registered with the driver on reuse and unregistered when the pools free them, with
//! pools that grow, shrink and reallocate, strides and plane offsets from VideoMeta, and the
//! output byte-identical to frames that took the pageable path; pageable frames that cannot be
//! registered are staged in bands by a few threads, with the bytes of page-locked frames.
//!
//! These need a CUDA device (the H200 bundle); without one each test prints that it skipped.

mod common;

use common::{Nv12, app_sink, init, nv12_caps, photo};
use gst::prelude::*;
use gst_video::prelude::*;
use gsttoonflow::cuda::hostreg::Registry;
use gsttoonflow::cuda::{CudaPipeline, PinnedHostBuffer};
use gsttoonflow::pipeline::{
    FrameGeometry, Nv12Frame, Nv12FrameMut, Precision, StageParams, ToonParams,
};

const W: usize = 640;
const H: usize = 360;

fn gpu_or_skip() -> bool {
    init();
    match gsttoonflow::cuda::probe(0) {
        Ok(_) => true,
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            false
        }
    }
}

/// The address of a buffer's first byte.
fn data_ptr(buffer: &gst::BufferRef) -> *const u8 {
    buffer.map_readable().unwrap().as_ptr()
}

#[test]
fn videotestsrc_writes_into_the_pinned_pool_toonflow_proposes() {
    if !gpu_or_skip() {
        return;
    }
    let pipeline = gst::parse::launch(&format!(
        "videotestsrc num-buffers=20 pattern=ball ! video/x-raw,format=NV12,width={W},height={H} ! \
         queue max-size-buffers=3 ! toonflow name=t backend=cuda ! fakesink name=sink"
    ))
    .unwrap();
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new((0usize, 0usize)));
    for (element, slot) in [("t", 0), ("sink", 1)] {
        let seen = seen.clone();
        bin.by_name(element)
            .unwrap()
            .static_pad("sink")
            .unwrap()
            .add_probe(gst::PadProbeType::BUFFER, move |_, info| {
                if let Some(b) = info.buffer() {
                    let pinned = gsttoonflow::cuda::is_page_locked(data_ptr(b));
                    let mut s = seen.lock().unwrap();
                    if slot == 0 {
                        s.0 += usize::from(!pinned);
                    } else {
                        s.1 += usize::from(!pinned);
                    }
                }
                gst::PadProbeReturn::Ok
            });
    }
    common::play_to_eos(&pipeline, 60, "the pipeline");
    let (pageable_in, pageable_out) = *seen.lock().unwrap();
    println!(
        "videotestsrc: {pageable_in} of 20 input and {pageable_out} of 20 output frames pageable"
    );
    assert_eq!(pageable_in, 0, "videotestsrc wrote into pageable memory");
    assert_eq!(
        pageable_out, 0,
        "output buffers without a downstream pool are pinned"
    );
}

/// A video pool of system memory with padded rows and planes (VideoMeta strides and offsets
/// differ from the default layout), `n` buffers.
fn padded_pool(n: u32, pad: u32) -> (gst_video::VideoBufferPool, gst_video::VideoInfo) {
    let caps = nv12_caps(W, H);
    let mut align = gst_video::VideoAlignment::new(pad * 2, pad * 2, pad * 16, 0, &[0; 4]);
    let mut info = gst_video::VideoInfo::from_caps(&caps).unwrap();
    info.align(&mut align).unwrap();
    let pool = gst_video::VideoBufferPool::new();
    let mut config = pool.config();
    // n = 0: at least two, as many as asked for (a downstream pool).
    let min = if n == 0 { 2 } else { n };
    config.set_params(Some(&caps), info.size() as u32, min, n);
    config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_META);
    config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_ALIGNMENT);
    config.set_video_alignment(&align);
    pool.set_config(config).expect("pool config");
    (pool, info)
}

/// Resizes `pool` to `n` buffers (all of them reallocated).
fn resize(pool: &gst_video::VideoBufferPool, n: u32) {
    pool.set_active(false).unwrap();
    let mut config = pool.config();
    let (caps, size, _, _) = config.params().unwrap();
    config.set_params(caps.as_ref(), size, n, n);
    pool.set_config(config).expect("pool config");
    pool.set_active(true).unwrap();
}

/// `frame` written into a buffer of `pool` at its strides and offsets.
fn from_pool(
    pool: &gst_video::VideoBufferPool,
    info: &gst_video::VideoInfo,
    frame: &Nv12,
) -> gst::Buffer {
    let mut buffer = pool.acquire_buffer(None).expect("pool buffer");
    {
        let b = buffer.get_mut().unwrap();
        let mut v = gst_video::VideoFrameRef::from_buffer_ref_writable(b, info).unwrap();
        let strides = [v.plane_stride()[0] as usize, v.plane_stride()[1] as usize];
        assert!(strides[0] > W, "the pool pads rows");
        for (plane, rows, src) in [(0, H, frame.y()), (1, H / 2, frame.uv())] {
            let dst = v.plane_data_mut(plane).unwrap();
            for r in 0..rows {
                dst[r * strides[plane as usize]..][..W].copy_from_slice(&src[r * W..][..W]);
            }
        }
    }
    buffer
}

/// Adds `pool` to the allocation queries reaching `pad` (downstream bringing its own pool).
fn answer_with_pool(pad: &gst::Pad, pool: gst_video::VideoBufferPool, size: u32) {
    pad.add_probe(
        gst::PadProbeType::QUERY_DOWNSTREAM | gst::PadProbeType::PUSH,
        move |_, info| {
            if let Some(gst::PadProbeData::Query(q)) = &mut info.data
                && let gst::QueryViewMut::Allocation(a) = q.view_mut()
            {
                a.add_allocation_pool(Some(&pool), size, 2, 0);
                a.add_allocation_meta::<gst_video::VideoMeta>(None);
            }
            gst::PadProbeReturn::Ok
        },
    );
}

/// Runs `inputs` through `appsrc ! toonflow ! appsink` one at a time; `downstream_pool` makes
/// the appsink side offer a padded pool of its own.
fn stylize_all(inputs: impl Iterator<Item = gst::Buffer>, downstream_pool: bool) -> Vec<Nv12> {
    let caps = nv12_caps(W, H);
    let pipeline = gst::parse::launch(&format!(
        "appsrc name=src format=time caps=\"{caps}\" ! toonflow backend=cuda ! appsink name=sink sync=false"
    ))
    .unwrap();
    let sink = app_sink(&pipeline, "sink");
    if downstream_pool {
        let (pool, info) = padded_pool(0, 8);
        answer_with_pool(&sink.static_pad("sink").unwrap(), pool, info.size() as u32);
    }
    let src = pipeline
        .downcast_ref::<gst::Bin>()
        .unwrap()
        .by_name("src")
        .unwrap()
        .downcast::<gst_app::AppSrc>()
        .unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let mut out = Vec::new();
    for (i, mut b) in inputs.enumerate() {
        b.make_mut()
            .set_pts(gst::ClockTime::from_mseconds(33 * i as u64));
        src.push_buffer(b).unwrap();
        let sample = sink
            .try_pull_sample(gst::ClockTime::from_seconds(20))
            .expect("an output frame");
        let buffer = sample.buffer().unwrap();
        if downstream_pool {
            assert!(
                buffer.meta::<gst_video::VideoMeta>().unwrap().stride()[0] as usize > W,
                "output written into downstream's padded pool"
            );
        }
        out.push(Nv12::from_buffer(buffer, sample.caps().unwrap()));
    }
    pipeline.set_state(gst::State::Null).unwrap();
    out
}

#[test]
fn foreign_pools_are_registered_while_they_live() {
    if !gpu_or_skip() {
        return;
    }
    let before = Registry::global().counts();
    let base = photo("chelsea.png", W, H);
    let frames: Vec<Nv12> = (0..40).map(|i| base.with_noise(4.0, i)).collect();
    // Reference: every input in fresh memory (never registered), output into toonflow's pinned
    // pool.
    let reference = stylize_all(frames.iter().map(|f| f.to_buffer()), false);
    assert_eq!(
        Registry::global().counts().registrations,
        before.registrations
    );

    // Upstream pool of 3 buffers, grown to 5, shrunk to 2, then replaced by a pool with another
    // layout; downstream brings a padded pool of its own.
    let (pool, info) = padded_pool(3, 8);
    pool.set_active(true).unwrap();
    let (second, second_info) = padded_pool(2, 16);
    second.set_active(true).unwrap();
    let mut pool = Some(pool);
    let inputs = frames.iter().enumerate().map(|(i, f)| {
        match i {
            12 => resize(pool.as_ref().unwrap(), 5),
            24 => resize(pool.as_ref().unwrap(), 2),
            32 => {
                // Freed while registered: the records go with the memory.
                let p = pool.take().unwrap();
                p.set_active(false).unwrap();
            }
            _ => {}
        }
        match &pool {
            Some(p) => from_pool(p, &info, f),
            None => from_pool(&second, &second_info, f),
        }
    });
    let pooled = stylize_all(inputs, true);
    for (i, (a, b)) in reference.iter().zip(&pooled).enumerate() {
        assert!(
            a.data == b.data,
            "frame {i} differs between the pageable and the registered path"
        );
    }
    let during = Registry::global().counts();
    second.set_active(false).unwrap();
    drop(second);
    let after = Registry::global().counts();
    println!(
        "registry: before {before:?}, after the pipeline {during:?}, after the pools {after:?}"
    );
    // Each pool buffer used at least twice is registered once: 3 + 5 + 2 + 2 upstream, and
    // downstream's pool buffers.
    assert!(
        during.registrations - before.registrations >= 12,
        "pool buffers registered on reuse"
    );
    assert!(
        during.registrations - before.registrations <= 12 + 8,
        "no registration per frame"
    );
    assert_eq!(
        after.live_bytes, before.live_bytes,
        "every registration dropped with its memory"
    );
    assert_eq!(
        after.registrations - before.registrations,
        after.unregistrations - before.unregistrations
    );
}

/// Runs `frames` (each as (Y, UV, stride) host planes) through a fresh pipeline whose pageable
/// uploads are staged by `threads` threads (0: by the driver), returning the packed outputs.
fn stylize_planes(
    w: usize,
    h: usize,
    threads: usize,
    frames: &[(&[u8], &[u8], usize)],
) -> Vec<Vec<u8>> {
    let geometry = FrameGeometry::new(w, h).unwrap();
    let shape = gsttoonflow::cuda::plan::default_shape(w as u32, h as u32, Precision::Fp16);
    let mut gpu = CudaPipeline::new(0, geometry, shape, 0, true).expect("CudaPipeline::new");
    gpu.set_staging_threads(threads);
    let params = ToonParams::new(&StageParams::default(), w as u32, h as u32);
    frames
        .iter()
        .map(|&(y, uv, stride)| {
            let input = Nv12Frame::new(geometry, y, stride, uv, stride).unwrap();
            let mut out = vec![0u8; w * h * 3 / 2];
            let (oy, ouv) = out.split_at_mut(w * h);
            let mut output = Nv12FrameMut::new(geometry, oy, w, ouv, w).unwrap();
            gpu.process(&params, &input, &mut output).expect("a frame");
            let stats = gpu.last_frame_stats();
            assert_eq!(stats.upload_bytes as usize, w * h * 3 / 2);
            out
        })
        .collect()
}

#[test]
fn pageable_frames_staged_in_bands_give_the_bytes_of_page_locked_frames() {
    if !gpu_or_skip() {
        return;
    }
    // 1280x720: a frame is 6 bands; padded rows, each frame in memory of its own (as an
    // application allocating per frame), as the driver, 1, 2 and 4 threads stage it.
    let (w, h, stride) = (1280, 720, 1344);
    let base = photo("chelsea.png", w, h);
    let frames: Vec<Nv12> = (0..6).map(|i| base.with_noise(4.0, i)).collect();
    let padded: Vec<(Vec<u8>, Vec<u8>)> = frames
        .iter()
        .map(|f| {
            let mut y = vec![0u8; stride * h];
            let mut uv = vec![0u8; stride * h / 2];
            for (dst, src, rows) in [(&mut y, f.y(), h), (&mut uv, f.uv(), h / 2)] {
                for r in 0..rows {
                    dst[r * stride..][..w].copy_from_slice(&src[r * w..][..w]);
                }
            }
            (y, uv)
        })
        .collect();
    // Reference: the same frames packed in page-locked memory (never staged).
    let mut pinned = PinnedHostBuffer::new(0, frames.len() * w * h * 3 / 2).unwrap();
    for (chunk, f) in pinned.chunks_mut(w * h * 3 / 2).zip(&frames) {
        chunk[..w * h].copy_from_slice(f.y());
        chunk[w * h..].copy_from_slice(f.uv());
    }
    let locked: Vec<(&[u8], &[u8], usize)> = pinned
        .chunks(w * h * 3 / 2)
        .map(|c| (&c[..w * h], &c[w * h..], w))
        .collect();
    assert!(gsttoonflow::cuda::is_page_locked(locked[0].0.as_ptr()));
    let reference = stylize_planes(w, h, 0, &locked);
    let pageable: Vec<(&[u8], &[u8], usize)> = padded
        .iter()
        .map(|(y, uv)| (y.as_slice(), uv.as_slice(), stride))
        .collect();
    assert!(!gsttoonflow::cuda::is_page_locked(pageable[0].0.as_ptr()));
    for threads in [0, 1, 2, 4] {
        let out = stylize_planes(w, h, threads, &pageable);
        for (i, (a, b)) in reference.iter().zip(&out).enumerate() {
            assert!(
                a == b,
                "frame {i}: staged by {threads} thread(s) differs from page-locked"
            );
        }
        println!(
            "staged by {threads} thread(s): {} frames identical",
            out.len()
        );
    }
}
