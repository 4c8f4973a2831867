//! The overlap path (issue 12, `overlap=true`): frames are queued on the GPU and pushed by a
//! second thread once their own download completes. Order, timestamps, flags and every frame
//! must come out as without it, serialized events (EOS, caps) after the frames before them, a
//! flush must drop what is in flight without a deadlock, and stopping mid-stream must join the
//! thread.
//!
//! With a CUDA device these run the real overlap path (backend=auto). Without one the element's
//! test hook `TOONFLOW_OVERLAP_EMULATE_US` sends the CPU backend's frames through the same push
//! thread, each "complete" a few milliseconds after it was made, so the element's side
//! (ordering, events, flushes, caps changes, stop) is tested on every machine; the GPU side
//! (copy stream, landing slot) only where a device exists.

mod common;

use std::sync::Once;

use common::*;
use gst::prelude::*;

const FRAME_NS: u64 = 33_333_333;

/// The emulation hook for machines without CUDA (ignored by an element on the GPU).
fn setup() -> bool {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: set once, before any element of this test executable reads it (every test
        // calls setup() first).
        unsafe { std::env::set_var("TOONFLOW_OVERLAP_EMULATE_US", "3000") };
    });
    init();
    let cuda = gsttoonflow::cuda::probe(0).is_ok();
    if !cuda {
        println!("no CUDA device: the overlap path is emulated on the CPU backend");
    }
    cuda
}

fn toonflow(overlap: bool) -> gst::Element {
    gst::ElementFactory::make("toonflow")
        .property_from_str("backend", "auto")
        .property("overlap", overlap)
        .build()
        .expect("toonflow")
}

/// A different frame for each index (a photo with noise), so a reordered or repeated output
/// shows.
fn frames(w: usize, h: usize, n: usize) -> Vec<Nv12> {
    let base = photo("astronaut.png", w, h);
    (0..n)
        .map(|i| base.with_noise(2.0 + (i % 5) as f32, i as u64 + 1))
        .collect()
}

fn timed(frame: &Nv12, i: usize, base_ns: u64) -> gst::Buffer {
    let mut b = frame.to_buffer();
    {
        let b = b.get_mut().unwrap();
        b.set_pts(gst::ClockTime::from_nseconds(base_ns + i as u64 * FRAME_NS));
        b.set_duration(gst::ClockTime::from_nseconds(FRAME_NS));
        b.set_offset(i as u64);
        if i == 0 {
            b.set_flags(gst::BufferFlags::DISCONT);
        }
    }
    b
}

/// `appsrc ! toonflow ! sink` for NV12 frames of `w`×`h`, playing: the pipeline and its source.
fn play_into(
    sink: &gst::Element,
    w: usize,
    h: usize,
    overlap: bool,
) -> (gst::Pipeline, gst_app::AppSrc) {
    let pipeline = gst::Pipeline::new();
    let src = gst_app::AppSrc::builder()
        .caps(&nv12_caps(w, h))
        .format(gst::Format::Time)
        .build();
    let toon = toonflow(overlap);
    pipeline.add_many([src.upcast_ref(), &toon, sink]).unwrap();
    gst::Element::link_many([src.upcast_ref(), &toon, sink]).unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    (pipeline, src)
}

/// `appsrc ! toonflow ! appsink`: pushes the frames in a burst, EOS right after the last, and
/// returns every output buffer up to EOS.
fn run_burst(input: &[Nv12], overlap: bool) -> Vec<gst::Buffer> {
    let sink = gst_app::AppSink::builder().sync(false).build();
    let (pipeline, src) = play_into(sink.upcast_ref(), input[0].width, input[0].height, overlap);
    for (i, f) in input.iter().enumerate() {
        src.push_buffer(timed(f, i, 0)).expect("push");
    }
    src.end_of_stream().unwrap();
    let mut out = Vec::new();
    while let Some(sample) = sink.try_pull_sample(gst::ClockTime::from_seconds(60)) {
        out.push(sample.buffer_owned().unwrap());
    }
    assert!(sink.is_eos(), "no EOS after {} buffers", out.len());
    let bus = pipeline.bus().unwrap();
    if let Some(msg) = bus.pop_filtered(&[gst::MessageType::Error]) {
        panic!("error: {msg:?}");
    }
    pipeline.set_state(gst::State::Null).unwrap();
    out
}

fn assert_in_order(out: &[gst::Buffer], n: usize, what: &str) {
    assert_eq!(out.len(), n, "{what}: frames lost or added");
    for (i, b) in out.iter().enumerate() {
        assert_eq!(
            b.pts(),
            Some(gst::ClockTime::from_nseconds(i as u64 * FRAME_NS)),
            "{what}: frame {i}"
        );
        assert_eq!(
            b.duration(),
            Some(gst::ClockTime::from_nseconds(FRAME_NS)),
            "{what}: frame {i}"
        );
        assert_eq!(b.offset(), i as u64, "{what}: frame {i}");
    }
    assert!(out[0].flags().contains(gst::BufferFlags::DISCONT), "{what}");
}

#[test]
fn the_overlap_property_is_documented_and_on_by_default() {
    setup();
    let el = gst::ElementFactory::make("toonflow").build().unwrap();
    let pspec = el.find_property("overlap").expect("overlap property");
    assert!(pspec.blurb().is_some_and(|b| b.len() > 40));
    assert_eq!(pspec.nick(), "Overlap frames");
    assert!(el.property::<bool>("overlap"));
}

#[test]
fn a_burst_then_eos_keeps_every_frame_in_order_with_its_timestamps() {
    let cuda = setup();
    let (w, h) = if cuda { (640, 360) } else { (160, 120) };
    let input = frames(w, h, 40);
    let on = run_burst(&input, true);
    assert_in_order(&on, input.len(), "overlap on");
    let off = run_burst(&input, false);
    assert_in_order(&off, input.len(), "overlap off");
    // The same pictures: the temporal filter saw the same frames in the same order (on the
    // GPU: the landing slot was never overwritten before it was read).
    let caps = nv12_caps(w, h);
    for (i, (a, b)) in on.iter().zip(&off).enumerate() {
        let (a, b) = (Nv12::from_buffer(a, &caps), Nv12::from_buffer(b, &caps));
        assert!(a.data == b.data, "frame {i} differs with overlap on");
    }
    println!(
        "{} frames at {w}x{h}: overlap on and off identical ({})",
        input.len(),
        if cuda { "CUDA" } else { "emulated" }
    );
}

/// Harness around toonflow with overlap on.
fn harness_overlap(w: usize, h: usize) -> gst_check::Harness {
    let el = toonflow(true);
    let mut harness = gst_check::Harness::with_element(&el, Some("sink"), Some("src"));
    harness.set_src_caps(nv12_caps(w, h));
    harness
}

/// Every buffer the harness holds (after an EOS the element pushed them all).
fn pull_all(h: &mut gst_check::Harness) -> Vec<gst::Buffer> {
    std::iter::from_fn(|| h.try_pull()).collect()
}

#[test]
fn a_flush_in_the_middle_drops_what_is_in_flight_and_the_stream_goes_on() {
    let cuda = setup();
    let (w, h) = if cuda { (640, 360) } else { (160, 120) };
    let input = frames(w, h, 20);
    let mut harness = harness_overlap(w, h);
    for (i, f) in input[..10].iter().enumerate() {
        harness.push(timed(f, i, 0)).expect("push before the flush");
    }
    assert!(harness.push_event(gst::event::FlushStart::new()));
    assert!(harness.push_event(gst::event::FlushStop::new(true)));
    let mut segment = gst::FormattedSegment::<gst::ClockTime>::new();
    segment.set_start(gst::ClockTime::ZERO);
    assert!(harness.push_event(gst::event::Segment::new(&segment)));
    let after = 1_000 * FRAME_NS;
    for (i, f) in input[10..].iter().enumerate() {
        harness
            .push(timed(f, i, after))
            .expect("push after the flush");
    }
    assert!(harness.push_event(gst::event::Eos::new()));
    let out = pull_all(&mut harness);
    let pts: Vec<u64> = out.iter().map(|b| b.pts().unwrap().nseconds()).collect();
    assert!(pts.windows(2).all(|p| p[0] < p[1]), "out of order: {pts:?}");
    let kept: Vec<u64> = pts.iter().copied().filter(|&p| p >= after).collect();
    assert_eq!(
        kept,
        (0..10).map(|i| after + i * FRAME_NS).collect::<Vec<_>>(),
        "every frame after the flush, once, in order"
    );
    assert!(out.len() <= 20);
    println!(
        "{} of 10 frames before the flush pushed, all 10 after it",
        out.len() - kept.len()
    );
}

#[test]
fn a_caps_change_mid_stream_comes_after_the_frames_before_it() {
    setup();
    let (a, b) = (frames(160, 120, 6), frames(96, 64, 6));
    let mut harness = harness_overlap(160, 120);
    for (i, f) in a.iter().enumerate() {
        harness.push(timed(f, i, 0)).expect("push");
    }
    harness.set_src_caps(nv12_caps(96, 64));
    for (i, f) in b.iter().enumerate() {
        harness.push(timed(f, a.len() + i, 0)).expect("push");
    }
    assert!(harness.push_event(gst::event::Eos::new()));
    let out = pull_all(&mut harness);
    assert_eq!(out.len(), 12);
    let size_a = gst_video::VideoInfo::from_caps(&nv12_caps(160, 120))
        .unwrap()
        .size();
    let size_b = gst_video::VideoInfo::from_caps(&nv12_caps(96, 64))
        .unwrap()
        .size();
    for (i, buf) in out.iter().enumerate() {
        assert_eq!(
            buf.pts(),
            Some(gst::ClockTime::from_nseconds(i as u64 * FRAME_NS))
        );
        assert_eq!(
            buf.size(),
            if i < 6 { size_a } else { size_b },
            "frame {i} has the wrong caps' size"
        );
    }
}

#[test]
fn stopping_mid_stream_joins_the_push_thread() {
    let cuda = setup();
    let (w, h) = if cuda { (640, 360) } else { (160, 120) };
    let input = frames(w, h, 6);
    for round in 0..5 {
        let sink = gst::ElementFactory::make("fakesink")
            .property("sync", false)
            .build()
            .unwrap();
        let (pipeline, src) = play_into(&sink, w, h, true);
        for i in 0..30 {
            src.push_buffer(timed(&input[i % input.len()], i, 0))
                .expect("push");
        }
        // No EOS: frames are still queued or in flight when the pipeline stops.
        std::thread::sleep(std::time::Duration::from_millis(round * 3));
        assert_eq!(
            pipeline.set_state(gst::State::Null),
            Ok(gst::StateChangeSuccess::Success)
        );
    }
}

#[test]
fn stats_count_every_frame_after_eos() {
    let cuda = setup();
    let input = frames(160, 120, 12);
    let desc = "appsrc name=src format=time ! toonflow name=t backend=auto overlap=true ! fakesink sync=false";
    let pipeline = gst::parse::launch(desc).unwrap();
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let src = bin
        .by_name("src")
        .unwrap()
        .downcast::<gst_app::AppSrc>()
        .unwrap();
    src.set_caps(Some(&nv12_caps(160, 120)));
    pipeline.set_state(gst::State::Playing).unwrap();
    for (i, f) in input.iter().enumerate() {
        src.push_buffer(timed(f, i, 0)).unwrap();
    }
    src.end_of_stream().unwrap();
    let msg = pipeline.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(60),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    assert!(
        matches!(
            msg.as_ref().map(|m| m.view()),
            Some(gst::MessageView::Eos(_))
        ),
        "{msg:?}"
    );
    let stats = bin
        .by_name("t")
        .unwrap()
        .property::<gst::Structure>("stats");
    pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!(stats.get::<u64>("frames").unwrap(), 12, "{stats:?}");
    // A frame's time runs from its arrival to its completion (the push thread's figure), not
    // the streaming thread's share: the emulation completes each frame 3 ms after it is queued.
    let p50 = stats.get::<f64>("p50-us").unwrap();
    let floor = if cuda { 1.0 } else { 3000.0 };
    assert!(p50 >= floor, "p50-us {p50} below {floor}: {stats:?}");
}
