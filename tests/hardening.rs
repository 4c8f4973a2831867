//! Hardening: renegotiation, flushes and state cycles, sizes and strides, fuzzed properties,
//! caps and contents, many instances, and a short soak. They run on the backend named by
//! TOONFLOW_TEST_BACKEND (default cpu; the GPU machine runs them again with cuda).

mod common;

use common::*;
use gst::glib;
use gst::prelude::*;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

fn backend() -> String {
    std::env::var("TOONFLOW_TEST_BACKEND").unwrap_or_else(|_| "cpu".into())
}

fn element_harness(width: usize, height: usize) -> gst_check::Harness {
    init();
    let mut h = gst_check::Harness::new("toonflow");
    h.element()
        .unwrap()
        .set_property_from_str("backend", &backend());
    h.set_src_caps(nv12_caps(width, height));
    h
}

/// RSS is per process and the tests run on parallel threads: the two that measure it hold this
/// lock exclusively and every other test shares it, so nothing else allocates (the 8192x4320
/// frame, eight instances) while RSS is sampled.
static RSS_GUARD: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    RSS_GUARD
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn exclusive() -> RwLockWriteGuard<'static, ()> {
    RSS_GUARD
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4
}

#[test]
fn renegotiation_mid_stream_follows_the_size_and_resets_the_ring() {
    let _rss_guard = shared();
    let sizes = if backend() == "cuda" {
        vec![(1920, 1080), (1280, 720), (3840, 2160), (1920, 1080)]
    } else {
        vec![(320, 240), (160, 120), (640, 360), (320, 240)]
    };
    let mut h = element_harness(sizes[0].0, sizes[0].1);
    for &(w, hh) in &sizes {
        h.set_src_caps(nv12_caps(w, hh));
        let frame = photo("coffee.png", w, hh);
        let first = push_frame(&mut h, &frame);
        assert_eq!((first.width, first.height), (w, hh));
        let fresh = {
            let mut single = element_harness(w, hh);
            push_frame(&mut single, &frame)
        };
        assert_eq!(
            first.data, fresh.data,
            "{w}x{hh}: first frame after caps equals a fresh element's"
        );
        for i in 0..3 {
            let out = push_frame(&mut h, &frame.with_noise(2.0, i));
            assert_eq!(out.data.len(), w * hh * 3 / 2);
        }
    }
}

#[test]
fn flushes_gaps_and_eos_pass_and_keep_the_element_usable() {
    let _rss_guard = shared();
    let frame = photo("chelsea.png", 96, 64);
    let mut h = element_harness(96, 64);
    for round in 0..20 {
        push_frame(&mut h, &frame.with_noise(2.0, round));
        assert!(h.push_event(gst::event::FlushStart::new()));
        assert!(h.push_event(gst::event::FlushStop::new(true)));
        h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
            gst::ClockTime,
        >::new()));
        assert!(h.push_event(gst::event::Gap::builder(gst::ClockTime::ZERO).build()));
    }
    assert!(h.push_event(gst::event::Eos::new()));
    let mut saw_eos = false;
    while let Some(ev) = h.try_pull_event() {
        saw_eos |= ev.type_() == gst::EventType::Eos;
    }
    assert!(saw_eos);
}

#[test]
fn state_cycles_do_not_leak_or_hang() {
    let _rss_guard = exclusive();
    init();
    let p = gst::parse::launch(&format!(
        "videotestsrc is-live=false ! video/x-raw,format=NV12,width=64,height=48 ! toonflow backend={} ! fakesink",
        backend()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let cycle = |p: &gst::Pipeline| {
        for state in [
            gst::State::Playing,
            gst::State::Paused,
            gst::State::Ready,
            gst::State::Null,
        ] {
            p.set_state(state).unwrap();
            let (r, _, _) = p.state(gst::ClockTime::from_seconds(20));
            assert!(r.is_ok(), "state change to {state:?} failed");
        }
    };
    for _ in 0..20 {
        cycle(&p);
    }
    let before = rss_kib();
    for _ in 0..100 {
        cycle(&p);
    }
    let after = rss_kib();
    println!("RSS over 100 state cycles: {before} KiB -> {after} KiB");
    assert!(
        after < before + 8 * 1024,
        "RSS grew from {before} KiB to {after} KiB"
    );
}

#[test]
fn strides_and_plane_offsets_from_video_meta_are_honoured() {
    let _rss_guard = shared();
    let (w, hh) = (100, 60);
    let frame = photo("astronaut.png", w, hh);
    let reference = {
        let mut h = element_harness(w, hh);
        push_frame(&mut h, &frame)
    };
    // the same picture with 28 bytes of padding per row and a gap before the UV plane
    let (ys, uvs, uv_off) = (w + 28, w + 28, (w + 28) * hh + 512);
    let mut data = vec![0xAAu8; uv_off + uvs * hh / 2];
    for r in 0..hh {
        data[r * ys..r * ys + w].copy_from_slice(&frame.y()[r * w..(r + 1) * w]);
    }
    for r in 0..hh / 2 {
        data[uv_off + r * uvs..uv_off + r * uvs + w]
            .copy_from_slice(&frame.uv()[r * w..(r + 1) * w]);
    }
    let mut buffer = gst::Buffer::from_slice(data);
    gst_video::VideoMeta::add_full(
        buffer.get_mut().unwrap(),
        gst_video::VideoFrameFlags::empty(),
        gst_video::VideoFormat::Nv12,
        w as u32,
        hh as u32,
        &[0, uv_off],
        &[ys as i32, uvs as i32],
    )
    .unwrap();
    let mut h = element_harness(w, hh);
    h.push(buffer).unwrap();
    let out = pull_output(&mut h);
    let out = Nv12::from_buffer(&out, &nv12_caps(w, hh));
    assert_eq!(out.data, reference.data);
}

#[test]
fn huge_frame_8192x4320_is_processed() {
    let _rss_guard = shared();
    let (w, hh) = (8192, 4320);
    let mut frame = Nv12::new(w, hh);
    let mut rng = Rng(3);
    for y in 0..hh {
        for x in 0..w {
            frame.data[y * w + x] =
                ((x / 64 + y / 64) % 2 * 160 + 40) as u8 ^ (rng.next_u64() as u8 & 7);
        }
    }
    frame.data[w * hh..].fill(128);
    let mut h = element_harness(w, hh);
    let el = h.element().unwrap();
    el.set_property("bilateral-iterations", 1u32);
    let out = push_frame(&mut h, &frame);
    assert_eq!(out.data.len(), w * hh * 3 / 2);
    // checkerboard edges get lines: the output is darker than the input along them
    assert!(mean_abs_diff(out.y(), frame.y()) > 2.0);
}

#[test]
fn fuzzed_properties_while_playing_never_break_the_stream() {
    let _rss_guard = shared();
    init();
    let p = gst::parse::launch(&format!(
        "videotestsrc num-buffers=60 pattern=ball ! video/x-raw,format=NV12,width=64,height=48 ! \
         toonflow name=t backend={} ! fakesink name=sink signal-handoffs=true",
        backend()
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let t = p.by_name("t").unwrap();
    let sink = p.by_name("sink").unwrap();
    let t2 = t.clone();
    let rng = std::sync::Mutex::new(Rng(11));
    sink.connect("handoff", false, move |_| {
        let mut rng = rng.lock().unwrap();
        let specs = t2.list_properties();
        for _ in 0..3 {
            let spec = &specs[(rng.next_u64() % specs.len() as u64) as usize];
            if !spec.flags().contains(glib::ParamFlags::WRITABLE)
                || !spec.flags().contains(gst::PARAM_FLAG_MUTABLE_PLAYING)
            {
                continue;
            }
            let u = rng.uniform() as f64;
            // values at, inside and past the ends of the range; out-of-range ones are clamped
            // to the range here, as GObject would refuse them
            let value: glib::Value = if let Some(s) = spec.downcast_ref::<glib::ParamSpecFloat>() {
                let v = s.minimum() as f64 + (s.maximum() - s.minimum()) as f64 * (u * 1.4 - 0.2);
                (v.clamp(s.minimum() as f64, s.maximum() as f64) as f32).to_value()
            } else if let Some(s) = spec.downcast_ref::<glib::ParamSpecUInt>() {
                let span = (s.maximum() as f64 - s.minimum() as f64).min(100.0);
                let v = s.minimum() as f64 + span * (u * 1.4 - 0.2);
                (v.clamp(s.minimum() as f64, s.maximum() as f64) as u32).to_value()
            } else if spec.downcast_ref::<glib::ParamSpecBoolean>().is_some() {
                (u > 0.5).to_value()
            } else if let Some(s) = spec.downcast_ref::<glib::ParamSpecEnum>() {
                let class = s.enum_class();
                let values = class.values();
                values[(rng.next_u64() % values.len() as u64) as usize].to_value(&class)
            } else {
                continue;
            };
            t2.set_property_from_value(spec.name(), &value);
        }
        None
    });
    p.set_state(gst::State::Playing).unwrap();
    let bus = p.bus().unwrap();
    let msg = bus
        .timed_pop_filtered(
            gst::ClockTime::from_seconds(120),
            &[gst::MessageType::Eos, gst::MessageType::Error],
        )
        .expect("EOS or error within 120 s");
    p.set_state(gst::State::Null).unwrap();
    assert_eq!(msg.type_(), gst::MessageType::Eos, "{msg:?}");
    assert_eq!(
        t.property::<gst::Structure>("stats")
            .get::<u64>("frames")
            .unwrap(),
        60
    );
}

#[test]
fn random_caps_and_random_contents() {
    let _rss_guard = shared();
    let mut rng = Rng(77);
    for _ in 0..25 {
        let w = 2 * (1 + (rng.next_u64() % 120) as usize);
        let hh = 2 * (1 + (rng.next_u64() % 90) as usize);
        let mut frame = Nv12::new(w, hh);
        for v in frame.data.iter_mut() {
            *v = rng.next_u64() as u8;
        }
        let mut h = element_harness(w, hh);
        let out = push_frame(&mut h, &frame);
        let out2 = push_frame(&mut h, &frame);
        assert_eq!((out.width, out.height), (w, hh));
        assert_eq!(out2.data.len(), w * hh * 3 / 2);
    }
}

#[test]
fn eight_instances_on_eight_threads_match_a_single_element() {
    let _rss_guard = shared();
    let frames: Vec<Nv12> = (0..6)
        .map(|i| photo("chelsea.png", 128, 96).with_noise(3.0, i))
        .collect();
    let single: Vec<Nv12> = {
        let mut h = element_harness(128, 96);
        frames.iter().map(|f| push_frame(&mut h, f)).collect()
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    let mut h = element_harness(128, 96);
                    frames
                        .iter()
                        .map(|f| push_frame(&mut h, f))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for (i, handle) in handles.into_iter().enumerate() {
            let outs = handle.join().unwrap();
            for (k, (a, b)) in outs.iter().zip(&single).enumerate() {
                assert_eq!(a.data, b.data, "instance {i}, frame {k}");
            }
        }
    });
}

#[test]
fn soak_memory_and_frame_time_stay_flat() {
    let _rss_guard = exclusive();
    let (frames, w, hh) = match backend().as_str() {
        "cuda" => (100_000usize, 1920, 1080),
        _ => (3_000usize, 64, 48),
    };
    let window = 1000.min(frames / 3);
    let inputs: Vec<gst::Buffer> = (0..4)
        .map(|i| photo("coffee.png", w, hh).with_noise(3.0, i).to_buffer())
        .collect();
    let mut h = element_harness(w, hh);
    let mut times = Vec::with_capacity(frames);
    let mut rss_early = 0;
    let mut device_free_early = 0u64;
    let device_free = |h: &gst_check::Harness| {
        h.element()
            .unwrap()
            .property::<gst::Structure>("stats")
            .get::<u64>("device-free-bytes")
            .unwrap()
    };
    for i in 0..frames {
        let t0 = std::time::Instant::now();
        h.push(inputs[i % inputs.len()].clone()).unwrap();
        let _ = pull_output(&mut h);
        times.push(t0.elapsed().as_secs_f64());
        if i == window {
            rss_early = rss_kib();
            device_free_early = device_free(&h);
        }
    }
    let rss_late = rss_kib();
    let device_free_late = device_free(&h);
    let median = |s: &[f64]| {
        let mut v = s.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let early = median(&times[window / 4..window]);
    let late = median(&times[frames - window..]);
    let stats = h.element().unwrap().property::<gst::Structure>("stats");
    println!(
        "soak {frames} frames {w}x{hh} on {}: median frame {:.1} µs early, {:.1} µs late; RSS {rss_early} -> {rss_late} KiB; {stats}",
        backend(),
        early * 1e6,
        late * 1e6
    );
    assert!(
        rss_late < rss_early + 16 * 1024,
        "RSS grew {rss_early} -> {rss_late} KiB"
    );
    // device memory: the free memory the element sees does not shrink (0 on the CPU backend)
    println!("device free: {device_free_early} -> {device_free_late} bytes");
    assert!(
        device_free_late + (16 << 20) >= device_free_early,
        "device memory shrank from {device_free_early} to {device_free_late} bytes free"
    );
    assert!(
        // generous: CI machines are shared; a leak or a growing queue grows without bound
        late < early * 2.0 + 100e-6,
        "frame time grew from {early} to {late}"
    );
}
