//! The element on the CPU backend: caps, properties, sizes, and what it does to a
//! real photo.

mod common;

use common::*;
use gst::glib;
use gst::prelude::*;

#[test]
fn registered_with_class_and_nv12_templates() {
    init();
    let factory = gst::ElementFactory::find("toonflow").expect("toonflow factory");
    assert_eq!(
        factory.metadata(gst::ELEMENT_METADATA_KLASS),
        Some("Filter/Effect/Video")
    );
    for template in factory.static_pad_templates() {
        let caps = template.caps();
        let s = caps.structure(0).unwrap();
        assert_eq!(s.get::<&str>("format").unwrap(), "NV12");
        let w = s.get::<gst::IntRange<i32>>("width").unwrap();
        assert_eq!((w.min(), w.max(), w.step()), (2, 8192, 2));
    }
}

#[test]
fn every_property_is_documented_with_its_default() {
    init();
    let el = gst::ElementFactory::make("toonflow").build().unwrap();
    let expected: &[(&str, glib::Value)] = &[
        ("bilateral-iterations", 3u32.to_value()),
        ("edge-iterations", 1u32.to_value()),
        ("spatial-sigma", 3.0f32.to_value()),
        ("range-sigma", 4.25f32.to_value()),
        ("edge-sigma", 1.0f32.to_value()),
        ("edge-tau", 0.98f32.to_value()),
        ("edge-sharpness", 2.0f32.to_value()),
        ("edge-strength", 1.0f32.to_value()),
        ("levels", 8u32.to_value()),
        ("level-sharpness", 3.4f32.to_value()),
        ("saturation", 1.25f32.to_value()),
        ("auto-levels", false.to_value()),
        ("temporal-history", 4u32.to_value()),
        ("temporal-strength", 0.6f32.to_value()),
        ("device-id", 0u32.to_value()),
        ("cuda-graph", true.to_value()),
        ("overlap", true.to_value()),
        ("max-device-memory", 0u64.to_value()),
        ("stats-interval", 0u32.to_value()),
    ];
    for (name, default) in expected {
        let pspec = el
            .find_property(name)
            .unwrap_or_else(|| panic!("property {name} missing"));
        assert!(
            pspec.blurb().is_some_and(|b| b.len() > 10),
            "{name} has no blurb"
        );
        assert_eq!(
            pspec.default_value().serialize().unwrap(),
            default.serialize().unwrap(),
            "{name}"
        );
        assert_eq!(
            el.property_value(name).serialize().unwrap(),
            default.serialize().unwrap(),
            "{name}"
        );
    }
    for name in [
        "backend",
        "precision",
        "motion-sigma",
        "scene-cut-threshold",
        "stats",
    ] {
        assert!(el.find_property(name).is_some(), "property {name} missing");
    }
    assert_eq!(el.property_value("backend").serialize().unwrap(), "auto");
    assert_eq!(el.property_value("precision").serialize().unwrap(), "fp16");
    assert!(
        !el.find_property("stats")
            .unwrap()
            .flags()
            .contains(glib::ParamFlags::WRITABLE)
    );
    el.set_property("levels", 5u32);
    el.set_property_from_str("precision", "fp32");
    assert_eq!(el.property::<u32>("levels"), 5);
    assert_eq!(el.property_value("precision").serialize().unwrap(), "fp32");
}

#[test]
fn refuses_formats_and_sizes_outside_the_template() {
    init();
    let el = gst::ElementFactory::make("toonflow").build().unwrap();
    let sink = el.static_pad("sink").unwrap();
    let accepts = |caps: gst::Caps| sink.query_accept_caps(&caps);
    assert!(accepts(nv12_caps(320, 240)));
    assert!(accepts(nv12_caps(18, 14)));
    assert!(!accepts(nv12_caps(17, 14)), "odd width");
    assert!(!accepts(nv12_caps(0, 14)), "zero width");
    assert!(!accepts(nv12_caps(8194, 64)), "too wide");
    assert!(!accepts(
        gst::Caps::builder("video/x-raw")
            .field("format", "I420")
            .field("width", 64)
            .field("height", 64)
            .build()
    ));
}

#[test]
fn wrong_caps_give_not_negotiated() {
    init();
    let mut h = gst_check::Harness::new("toonflow");
    h.element().unwrap().set_property_from_str("backend", "cpu");
    h.set_src_caps_str("video/x-raw,format=I420,width=64,height=64,framerate=30/1");
    let r = h.push(gst::Buffer::with_size(64 * 64 * 3 / 2).unwrap());
    assert_eq!(r, Err(gst::FlowError::NotNegotiated));
}

#[test]
fn short_buffer_is_an_error_not_a_read_past_the_end() {
    let mut h = harness(64, 48, &[]);
    let r = h.push(gst::Buffer::from_slice(vec![128u8; 64 * 48]));
    assert_eq!(r, Err(gst::FlowError::Error));
}

#[test]
fn frame_sizes_small_odd_and_full_hd() {
    for (w, h) in [(2, 2), (16, 16), (18, 14), (1920, 1080)] {
        let input = if w >= 16 {
            photo("chelsea.png", w, h)
        } else {
            Nv12 {
                width: w,
                height: h,
                data: vec![90; w * h * 3 / 2],
            }
        };
        let out = stylize(&input, &[]);
        assert_eq!(out.data.len(), w * h * 3 / 2, "{w}x{h}");
        if w >= 16 {
            assert!(
                mean_abs_diff(out.y(), input.y()) > 1.0,
                "{w}x{h}: output should differ"
            );
        }
    }
}

/// Luma plateaus of the quantizer: the centres of the `levels` bands, in codes.
fn plateaus(levels: u32) -> Vec<f32> {
    (0..levels)
        .map(|k| 255.0 * (k as f32 + 0.5) / levels as f32)
        .collect()
}

/// Pixels whose 5x5 neighbourhood in `y` spans at most `spread` codes, away from the border.
fn flat_pixels(f: &Nv12, spread: u8) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for y in 2..f.height - 2 {
        for x in 2..f.width - 2 {
            let (mut lo, mut hi) = (255u8, 0u8);
            for dy in 0..5 {
                for dx in 0..5 {
                    let v = f.luma(x + dx - 2, y + dy - 2);
                    lo = lo.min(v);
                    hi = hi.max(v);
                }
            }
            if hi - lo <= spread {
                out.push((x, y));
            }
        }
    }
    out
}

#[test]
fn flat_regions_are_quantized_to_the_levels() {
    let input = photo("astronaut.png", 256, 256);
    for levels in [4u32, 8] {
        let out = stylize(&input, &[("levels", &levels), ("temporal-history", &0u32)]);
        let flat = flat_pixels(&input, 6);
        assert!(
            flat.len() > 2000,
            "fixture has too few flat pixels: {}",
            flat.len()
        );
        let centres = plateaus(levels);
        let on_plateau = flat
            .iter()
            .filter(|&&(x, y)| {
                let v = out.luma(x, y) as f32;
                centres.iter().any(|c| (v - c).abs() <= 3.0)
            })
            .count();
        let share = on_plateau as f64 / flat.len() as f64;
        assert!(
            share > 0.9,
            "levels={levels}: only {:.1}% of flat pixels on a plateau",
            100.0 * share
        );
        // and the distinct values that matter number at most `levels`
        let mut hist = [0usize; 256];
        for &(x, y) in &flat {
            hist[out.luma(x, y) as usize] += 1;
        }
        let mut clusters = 0;
        let mut in_cluster = false;
        for &count in hist.iter() {
            let busy = count * 200 > flat.len(); // over 0.5% of the flat pixels
            if busy && !in_cluster {
                clusters += 1;
            }
            in_cluster = busy;
        }
        assert!(
            clusters <= levels as usize,
            "levels={levels}: {clusters} clusters of values"
        );
    }
}

/// Magnitude of the luma gradient (central differences) of the input.
fn gradient(f: &Nv12, x: usize, y: usize) -> f32 {
    let gx = f.luma(x + 1, y) as f32 - f.luma(x - 1, y) as f32;
    let gy = f.luma(x, y + 1) as f32 - f.luma(x, y - 1) as f32;
    (gx * gx + gy * gy).sqrt()
}

#[test]
fn strong_luminance_steps_are_drawn_dark() {
    let input = photo("astronaut.png", 256, 256);
    let out = stylize(&input, &[("temporal-history", &0u32)]);
    let no_lines = stylize(
        &input,
        &[("temporal-history", &0u32), ("edge-strength", &0.0f32)],
    );
    let (mut darkened, mut steps) = (0usize, 0usize);
    for y in 2..254 {
        for x in 2..254 {
            if gradient(&input, x, y) > 80.0 {
                steps += 1;
                // a line sits on the dark side of the step, within a pixel
                let darkest = (0..3)
                    .flat_map(|dy| (0..3).map(move |dx| (x + dx - 1, y + dy - 1)))
                    .map(|(xx, yy)| out.luma(xx, yy) as i32 - no_lines.luma(xx, yy) as i32)
                    .min()
                    .unwrap();
                if darkest <= -40 {
                    darkened += 1;
                }
            }
        }
    }
    assert!(steps > 300, "fixture has too few strong steps: {steps}");
    let share = darkened as f64 / steps as f64;
    assert!(
        share > 0.8,
        "only {:.1}% of strong steps drawn dark",
        100.0 * share
    );
    // and flat areas get no lines
    let flat = flat_pixels(&input, 4);
    let lined = flat
        .iter()
        .filter(|&&(x, y)| (out.luma(x, y) as i32) + 20 < no_lines.luma(x, y) as i32)
        .count();
    assert!(
        (lined as f64) < 0.02 * flat.len() as f64,
        "{lined} of {} flat pixels got lines",
        flat.len()
    );
}

#[test]
fn noise_is_smoothed() {
    let clean = photo("coffee.png", 240, 160);
    let noisy = clean.with_noise(6.0, 7);
    // The smoothing alone: no lines, and 64 bands with sharpness 0 (L' = nearest band edge,
    // steps of 4 codes) so the quantizer hides little.
    let smooth: [(&str, &dyn ToValue); 4] = [
        ("temporal-history", &0u32),
        ("edge-strength", &0.0f32),
        ("levels", &64u32),
        ("level-sharpness", &0.0f32),
    ];
    let out_clean = stylize(&clean, &smooth);
    let out_noisy = stylize(&noisy, &smooth);
    let input_noise = mean_abs_diff(noisy.y(), clean.y());
    let output_noise = mean_abs_diff(out_noisy.y(), out_clean.y());
    assert!(input_noise > 3.0);
    assert!(
        output_noise < 0.5 * input_noise,
        "noise {input_noise:.2} in, {output_noise:.2} out"
    );
}

/// The element's `stats` structure.
fn stats_of(el: &gst::Element) -> gst::Structure {
    el.property::<gst::Structure>("stats")
}

/// The QoS messages on `bus` posted by `src`, as (processed, dropped) buffer counts.
fn qos_messages(bus: &gst::Bus, src: &gst::Element) -> Vec<(u64, u64)> {
    std::iter::from_fn(|| bus.pop_filtered(&[gst::MessageType::Qos]))
        .filter(|m| m.src() == Some(src.upcast_ref()))
        .map(|m| match m.view() {
            gst::MessageView::Qos(q) => {
                let (processed, dropped) = q.stats();
                let as_u64 = |v: gst::GenericFormattedValue| match v {
                    gst::GenericFormattedValue::Buffers(Some(n)) => *n,
                    other => panic!("QoS stats in {other:?}, not buffers"),
                };
                (as_u64(processed), as_u64(dropped))
            }
            _ => unreachable!(),
        })
        .collect()
}

#[test]
fn frames_the_sink_reports_late_are_dropped_counted_and_announced() {
    // A QoS event from downstream says the frame at running time 0 was 450 ms late: base
    // transform skips every frame up to running time 450 ms before it is processed.
    let (w, h) = (32, 24);
    let mut harness = harness(w, h, &[]);
    let el = harness.element().unwrap();
    let bus = gst::Bus::new();
    el.set_bus(Some(&bus));
    let frame = Nv12 {
        width: w,
        height: h,
        data: vec![100; w * h * 3 / 2],
    };
    let frame_ms = 100u64;
    let push = |harness: &mut gst_check::Harness, i: u64| {
        let mut buffer = frame.to_buffer();
        let b = buffer.get_mut().unwrap();
        b.set_pts(gst::ClockTime::from_mseconds(i * frame_ms));
        b.set_duration(gst::ClockTime::from_mseconds(frame_ms));
        harness.push(buffer)
    };
    // one frame before any QoS: processed
    assert_eq!(push(&mut harness, 0), Ok(gst::FlowSuccess::Ok));
    assert!(harness.push_upstream_event(gst::event::Qos::new(
        gst::QOSType::Underflow,
        0.5,
        gst::ClockTime::from_mseconds(450).nseconds() as i64,
        gst::ClockTime::ZERO,
    )));
    for i in 1..10 {
        assert_eq!(push(&mut harness, i), Ok(gst::FlowSuccess::Ok), "frame {i}");
    }
    // frames at 100..=400 ms are late (4), 500..=900 ms on time (5), plus the first one
    let mut out_pts: Vec<u64> = (0..6)
        .map(|_| pull_output(&mut harness).pts().unwrap().mseconds())
        .collect();
    while let Some(b) = harness.try_pull() {
        out_pts.push(b.pts().unwrap().mseconds());
    }
    assert_eq!(out_pts, [0, 500, 600, 700, 800, 900]);
    let stats = stats_of(&el);
    assert_eq!(stats.get::<u64>("frames").unwrap(), 6);
    assert_eq!(stats.get::<u64>("dropped").unwrap(), 4);
    let messages = qos_messages(&bus, &el);
    assert_eq!(messages.len(), 4, "one QoS message per dropped frame");
    assert_eq!(
        messages.iter().map(|m| m.1).collect::<Vec<_>>(),
        [1, 2, 3, 4],
        "the QoS messages count the drops"
    );
    el.set_bus(None);
}

/// Runs `N` frames of a live test source through toonflow into a clock-synced sink that sends
/// QoS events; returns (stats, QoS messages of toonflow) after EOS.
fn live_run(
    width: u32,
    height: u32,
    fps: i32,
    frames: u32,
    latency: Option<gst::ClockTime>,
) -> (gst::Structure, Vec<(u64, u64)>) {
    init();
    let pipeline = gst::parse::launch(&format!(
        "videotestsrc is-live=true pattern=ball num-buffers={frames} \
         ! video/x-raw,format=NV12,width={width},height={height},framerate={fps}/1 \
         ! toonflow name=toon backend=cpu ! fakesink sync=true qos=true"
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    if let Some(latency) = latency {
        pipeline.set_latency(latency);
    }
    let toon = pipeline.by_name("toon").unwrap();
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let mut qos = Vec::new();
    loop {
        let msg = bus
            .timed_pop(gst::ClockTime::from_seconds(120))
            .expect("no EOS within 120 s");
        match msg.view() {
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => panic!("{}: {:?}", e.error(), e.debug()),
            gst::MessageView::Qos(q) if msg.src() == Some(toon.upcast_ref()) => {
                let (processed, dropped) = q.stats();
                if let (
                    gst::GenericFormattedValue::Buffers(Some(p)),
                    gst::GenericFormattedValue::Buffers(Some(d)),
                ) = (processed, dropped)
                {
                    qos.push((*p, *d));
                }
            }
            _ => {}
        }
    }
    let stats = stats_of(&toon);
    pipeline.set_state(gst::State::Null).unwrap();
    (stats, qos)
}

#[test]
fn too_slow_live_pipeline_drops_late_frames_and_counts_them() {
    // 720p at 120 fps: no CPU path processes a frame in 8 ms on this kind of machine, so frames
    // reach the sink late, and the sink's QoS events make toonflow skip the frames already late.
    let sent = 60;
    let (stats, qos) = live_run(1280, 720, 120, sent, None);
    let frames = stats.get::<u64>("frames").unwrap();
    let dropped = stats.get::<u64>("dropped").unwrap();
    println!("720p at 120 fps: {frames} processed, {dropped} dropped of {sent}");
    assert!(dropped > 0, "a too slow pipeline dropped nothing");
    assert!(frames > 0, "nothing processed");
    assert_eq!(
        frames + dropped,
        sent as u64,
        "every frame processed or dropped"
    );
    assert_eq!(
        qos.len() as u64,
        dropped,
        "one QoS message per dropped frame"
    );
    assert_eq!(qos.last().unwrap().1, dropped);
}

#[test]
fn fast_live_pipeline_drops_nothing() {
    // 64x48 at 30 fps takes well under a millisecond a frame; a second of latency leaves room
    // for a loaded machine's scheduling hiccups.
    let sent = 30;
    let (stats, qos) = live_run(64, 48, 30, sent, Some(gst::ClockTime::from_seconds(1)));
    assert_eq!(stats.get::<u64>("dropped").unwrap(), 0);
    assert_eq!(stats.get::<u64>("frames").unwrap(), sent as u64);
    assert!(qos.is_empty(), "QoS messages from a fast pipeline: {qos:?}");
}

#[test]
fn a_new_segment_or_stream_drops_the_temporal_history() {
    let frame = photo("chelsea.png", 64, 48);
    let mut h = harness(64, 48, &[]);
    let el = h.element().unwrap();
    let history = |h: &mut gst_check::Harness, frame: &Nv12| {
        push_frame(h, frame);
        stats_of(&h.element().unwrap())
            .get::<u32>("history-used")
            .unwrap()
    };
    for _ in 0..3 {
        history(&mut h, &frame);
    }
    assert!(history(&mut h, &frame) > 0, "history builds up");
    assert!(
        h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
            gst::ClockTime,
        >::new()))
    );
    assert_eq!(history(&mut h, &frame), 0, "after a new segment");
    assert!(history(&mut h, &frame) > 0);
    assert!(h.push_event(gst::event::StreamStart::new("second")));
    assert!(
        h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
            gst::ClockTime,
        >::new()))
    );
    assert_eq!(history(&mut h, &frame), 0, "after a new stream");
    drop(el);
}
