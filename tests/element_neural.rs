//! The element with `model=`: small ONNX models written here with fixed weights, run through
//! gst-launch pipelines and the Harness. The models are chosen so the picture they must make
//! is known: the colour negative (y = −x), the identity through a stride-2 branch (y = x +
//! 0·up(down(x)), which needs the padding), and an instance normalization (offset-invariant,
//! so the statistics smoothing shows). Bad models must post a clear error and never panic.

mod common;
#[path = "common/onnx_models.rs"]
mod onnx_models;

use common::*;
use gst::prelude::*;
use gsttoonflow::neural::onnx::{
    self, GraphProto, attr_ints, attr_string, float_tensor, node, value_info,
};

const FLOAT: i32 = onnx::data_type::FLOAT;
const OPSET: i64 = 13;

fn write_model(dir: &TempDir, name: &str, graph: GraphProto) -> String {
    let path = dir.path(name);
    std::fs::write(&path, onnx::encode_model(&onnx::model(graph, OPSET))).unwrap();
    path.to_str().unwrap().to_string()
}

fn graph(name: &str) -> GraphProto {
    GraphProto {
        name: name.into(),
        ..Default::default()
    }
}

/// y = −x on NCHW RGB: the colour negative of the frame.
fn negate_nchw() -> GraphProto {
    let mut g = graph("negate");
    g.input.push(value_info("x", FLOAT, &[1, 3, -1, -1]));
    g.output.push(value_info("y", FLOAT, &[1, 3, -1, -1]));
    let mut w = vec![0.0f32; 9];
    for c in 0..3 {
        w[c * 3 + c] = -1.0;
    }
    g.initializer.push(float_tensor("w", &[3, 3, 1, 1], &w));
    g.node.push(node("Conv", &["x", "w"], &["y"], vec![]));
    g
}

/// NHWC in and out (AnimeGANv3's layout) with a branch of `levels` stride-2 convolutions
/// and a nearest 2^levels upscale, multiplied by zero and added: the picture comes back
/// unchanged, but only if the network's size is a multiple of 2^levels (the multiple the
/// engine derives from the strides).
fn identity_nhwc(levels: u32) -> GraphProto {
    let mut g = graph("identity");
    g.input.push(value_info("x", FLOAT, &[1, -1, -1, 3]));
    g.output.push(value_info("y", FLOAT, &[1, -1, -1, 3]));
    let mut eye = vec![0.0f32; 9];
    for c in 0..3 {
        eye[c * 3 + c] = 1.0;
    }
    let up = (1u32 << levels) as f32;
    g.initializer.push(float_tensor("eye", &[3, 3, 1, 1], &eye));
    g.initializer
        .push(float_tensor("scales", &[4], &[1.0, 1.0, up, up]));
    g.initializer.push(float_tensor("zero", &[], &[0.0]));
    g.node.push(node(
        "Transpose",
        &["x"],
        &["t"],
        vec![attr_ints("perm", &[0, 3, 1, 2])],
    ));
    let mut last = "t".to_string();
    for level in 0..levels {
        let out = format!("down{level}");
        g.node.push(node(
            "Conv",
            &[&last, "eye"],
            &[&out],
            vec![attr_ints("strides", &[2, 2])],
        ));
        last = out;
    }
    g.node.push(node(
        "Resize",
        &[&last, "", "scales"],
        &["up"],
        vec![attr_string("mode", "nearest")],
    ));
    g.node
        .push(node("Mul", &["up", "zero"], &["nothing"], vec![]));
    g.node
        .push(node("Add", &["t", "nothing"], &["sum"], vec![]));
    g.node.push(node(
        "Transpose",
        &["sum"],
        &["y"],
        vec![attr_ints("perm", &[0, 2, 3, 1])],
    ));
    g
}

fn identity_nhwc_stride2() -> GraphProto {
    identity_nhwc(1)
}

/// InstanceNormalization with scale 0.5 and bias 0 per channel (NCHW): each frame's mean and
/// variance are removed, so a brightened frame looks the same unless statistics are smoothed.
fn instance_norm_nchw() -> GraphProto {
    let mut g = graph("instance-norm");
    g.input.push(value_info("x", FLOAT, &[1, 3, -1, -1]));
    g.output.push(value_info("y", FLOAT, &[1, 3, -1, -1]));
    g.initializer
        .push(float_tensor("s", &[3], &[0.5, 0.5, 0.5]));
    g.initializer
        .push(float_tensor("b", &[3], &[0.0, 0.0, 0.0]));
    g.node.push(node(
        "InstanceNormalization",
        &["x", "s", "b"],
        &["y"],
        vec![onnx::attr_float("epsilon", 1e-5)],
    ));
    g
}

/// A graph with an operator the engine does not implement.
fn unsupported_op() -> GraphProto {
    let mut g = graph("unsupported");
    g.input.push(value_info("x", FLOAT, &[1, 3, -1, -1]));
    g.output.push(value_info("y", FLOAT, &[1, 3, -1, -1]));
    g.node.push(node(
        "Einsum",
        &["x"],
        &["y"],
        vec![attr_string("equation", "nchw->nchw")],
    ));
    g
}

/// A 4-channel input.
fn four_channels() -> GraphProto {
    let mut g = graph("four-channels");
    g.input.push(value_info("x", FLOAT, &[1, 4, -1, -1]));
    g.output.push(value_info("y", FLOAT, &[1, 4, -1, -1]));
    g.node.push(node("Relu", &["x"], &["y"], vec![]));
    g
}

/// A smooth test picture: gradients in luma and chroma, a bright square.
fn picture(width: usize, height: usize, shift: usize) -> Nv12 {
    let mut f = Nv12::new(width, height);
    for r in 0..height {
        for c in 0..width {
            let square =
                (c + width - shift) % width < width / 4 && r > height / 3 && r < height / 2;
            f.data[r * width + c] = if square {
                200
            } else {
                (40 + (r * 90 / height) + (c * 60 / width)) as u8
            };
        }
    }
    let uv = width * height;
    for r in 0..height / 2 {
        for c in 0..width / 2 {
            f.data[uv + r * width + 2 * c] = (100 + c * 50 / width) as u8;
            f.data[uv + r * width + 2 * c + 1] = (150 - r * 40 / height) as u8;
        }
    }
    f
}

fn neural_harness(model: &str, width: usize, height: usize, extra: &str) -> gst_check::Harness {
    init();
    let mut h = gst_check::Harness::new_parse(&format!(
        "toonflow name=t backend=cpu model=\"{model}\" {extra}"
    ));
    h.set_src_caps(nv12_caps(width, height));
    h
}

/// The element's statistics (`new_parse` wraps it in a bin).
fn stats(h: &gst_check::Harness) -> gst::Structure {
    h.element()
        .unwrap()
        .downcast_ref::<gst::Bin>()
        .and_then(|b| b.by_name("t"))
        .expect("toonflow named t")
        .property::<gst::Structure>("stats")
}

fn push(h: &mut gst_check::Harness, frame: &Nv12) -> Nv12 {
    push_frame(h, frame)
}

fn max_abs_diff(a: &[u8], b: &[u8]) -> i32 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as i32 - y as i32).abs())
        .max()
        .unwrap()
}

#[test]
fn negate_model_makes_the_colour_negative_at_a_size_that_needs_no_padding() {
    let dir = TempDir::new("neural-negate");
    let model = write_model(&dir, "negate.onnx", negate_nchw());
    let mut h = neural_harness(&model, 64, 48, "temporal-history=0");
    let input = picture(64, 48, 0);
    let out = push(&mut h, &input);
    // Limited range: the negative of code Y is 16 + 235 − Y; of chroma C, 256 − C.
    let want_y: Vec<u8> = input.y().iter().map(|&y| 251 - y).collect();
    assert!(max_abs_diff(out.y(), &want_y) <= 1, "luma of the negative");
    let want_uv: Vec<u8> = input.uv().iter().map(|&c| (256 - c as i32) as u8).collect();
    assert!(
        max_abs_diff(out.uv(), &want_uv) <= 2,
        "chroma of the negative"
    );
    let s = stats(&h);
    assert_eq!(s.get::<&str>("model").unwrap(), "negate.onnx");
    assert!(s.get::<u32>("stages").unwrap() >= 1, "{s}");
    assert!(
        s.get::<u64>("arena-bytes").unwrap() >= 3 * 64 * 48 * 4,
        "{s}"
    );
    assert!(
        s.get::<u64>("peak-live-bytes").unwrap() <= s.get::<u64>("arena-bytes").unwrap(),
        "{s}"
    );
    assert_eq!(s.get::<u32>("network-width").unwrap(), 64);
    assert_eq!(s.get::<u32>("network-height").unwrap(), 48);
}

#[test]
fn model_range_changes_what_the_network_sees() {
    let dir = TempDir::new("neural-range");
    let model = write_model(&dir, "negate.onnx", negate_nchw());
    let input = picture(32, 32, 0);
    let mut h = neural_harness(&model, 32, 32, "temporal-history=0 model-range=0..1");
    let out = push(&mut h, &input);
    // In 0..1, −x is below black everywhere: the picture clamps to black (code 0 after the
    // limited-range foot is undershot).
    assert!(out.y().iter().all(|&y| y <= 16), "{:?}", &out.y()[..8]);
    let mut h = neural_harness(&model, 32, 32, "temporal-history=0 model-range=0..255");
    let out = push(&mut h, &input);
    assert!(out.y().iter().all(|&y| y <= 16));
}

#[test]
fn padding_sizes_and_odd_multiples_crop_back_to_the_frame() {
    let dir = TempDir::new("neural-pad");
    let model = write_model(&dir, "identity.onnx", identity_nhwc_stride2());
    // 70x46: the model's stride needs even sizes, which these are; 16 pads to 80x48; 6 to
    // 72x48; 10 to 70x50.
    for (extra, nw, nh) in [
        ("", 70, 46),
        ("model-size-multiple=16", 80, 48),
        ("model-size-multiple=6", 72, 48),
        ("model-size-multiple=10", 70, 50),
    ] {
        let mut h = neural_harness(&model, 70, 46, &format!("temporal-history=0 {extra}"));
        let input = picture(70, 46, 3);
        let out = push(&mut h, &input);
        assert_eq!((out.width, out.height), (70, 46));
        assert!(
            max_abs_diff(out.y(), input.y()) <= 1,
            "{extra}: identity must return the luma"
        );
        assert!(max_abs_diff(out.uv(), input.uv()) <= 2, "{extra}: chroma");
        let s = stats(&h);
        assert_eq!(
            (
                s.get::<u32>("network-width").unwrap(),
                s.get::<u32>("network-height").unwrap()
            ),
            (nw, nh),
            "{extra}"
        );
    }
}

#[test]
fn the_multiple_derived_from_the_strides_pads_and_crops() {
    let dir = TempDir::new("neural-derived");
    let model = write_model(&dir, "identity8.onnx", identity_nhwc(3));
    // Three stride-2 levels: multiple 8, so 70x46 runs at 72x48 and 66x34 at 72x40.
    for (w, h, nw, nh) in [(70, 46, 72, 48), (66, 34, 72, 40), (64, 48, 64, 48)] {
        let mut hs = neural_harness(&model, w, h, "temporal-history=0");
        let input = picture(w, h, 7);
        let out = push(&mut hs, &input);
        assert_eq!((out.width, out.height), (w, h));
        assert!(max_abs_diff(out.y(), input.y()) <= 1, "{w}x{h}: luma");
        assert!(max_abs_diff(out.uv(), input.uv()) <= 2, "{w}x{h}: chroma");
        let s = stats(&hs);
        assert_eq!(
            (
                s.get::<u32>("network-width").unwrap(),
                s.get::<u32>("network-height").unwrap()
            ),
            (nw, nh),
            "{w}x{h}"
        );
    }
}

#[test]
fn state_cycles_with_a_model_neither_hang_nor_fail() {
    let dir = TempDir::new("neural-cycles");
    let model = write_model(&dir, "identity8.onnx", identity_nhwc(3));
    let p = launch(&format!(
        "videotestsrc is-live=false ! video/x-raw,format=NV12,width=70,height=46 ! \
         toonflow backend=cpu model=\"{model}\" ! fakesink"
    ));
    for i in 0..20 {
        let target = [gst::State::Playing, gst::State::Paused, gst::State::Ready][i % 3];
        p.set_state(target).unwrap();
        let (r, now, _) = p.state(gst::ClockTime::from_seconds(30));
        assert!(r.is_ok() && now == target, "cycle {i}: {r:?} {now:?}");
        p.set_state(gst::State::Null).unwrap();
    }
    let bus = p.bus().unwrap();
    while let Some(m) = bus.pop() {
        if let gst::MessageView::Error(e) = m.view() {
            panic!("{} {:?}", e.error(), e.debug());
        }
    }
}

#[test]
fn an_odd_multiple_the_model_cannot_take_is_an_error_not_a_panic() {
    let dir = TempDir::new("neural-odd");
    let model = write_model(&dir, "identity.onnx", identity_nhwc_stride2());
    // Multiple 7 makes 70x49: the stride-2 branch comes back 50 rows high and cannot be added.
    let p = launch(&format!(
        "videotestsrc num-buffers=2 ! video/x-raw,format=NV12,width=70,height=46 ! \
         toonflow backend=cpu model=\"{model}\" model-size-multiple=7 ! fakesink"
    ));
    let (eos, errors, _) = run(&p);
    assert!(!eos, "must not reach EOS");
    assert!(
        errors.iter().any(|e| e.contains("identity.onnx")),
        "{errors:?}"
    );
}

#[test]
fn model_scale_half_runs_the_network_at_half_size_and_keeps_the_picture() {
    let dir = TempDir::new("neural-scale");
    let model = write_model(&dir, "identity.onnx", identity_nhwc_stride2());
    let input = picture(128, 96, 5);
    let mut h = neural_harness(&model, 128, 96, "temporal-history=0 model-scale=0.5");
    let out = push(&mut h, &input);
    let s = stats(&h);
    assert_eq!(s.get::<u32>("network-width").unwrap(), 64);
    assert_eq!(s.get::<u32>("network-height").unwrap(), 48);
    // Down and up again: close on the smooth picture, not exact at the square's edges.
    let mad = mean_abs_diff(out.y(), input.y());
    assert!(mad > 0.0 && mad < 4.0, "mean abs diff {mad}");
    let full = {
        let mut h = neural_harness(&model, 128, 96, "temporal-history=0");
        push(&mut h, &input)
    };
    assert!(mean_abs_diff(full.y(), input.y()) < mad);
}

#[test]
fn renegotiation_re_specialises_for_the_new_size() {
    let dir = TempDir::new("neural-reneg");
    let model = write_model(&dir, "negate.onnx", negate_nchw());
    let mut h = neural_harness(&model, 64, 48, "temporal-history=2");
    for t in 0..3 {
        push(&mut h, &picture(64, 48, t));
    }
    assert_eq!(stats(&h).get::<u32>("history-used").unwrap(), 2);
    h.set_src_caps(nv12_caps(96, 80));
    let input = picture(96, 80, 0);
    let out = push(&mut h, &input);
    assert_eq!((out.width, out.height), (96, 80));
    let want: Vec<u8> = input.y().iter().map(|&y| 251 - y).collect();
    assert!(max_abs_diff(out.y(), &want) <= 1);
    let s = stats(&h);
    assert_eq!(s.get::<u32>("network-width").unwrap(), 96);
    assert_eq!(
        s.get::<u32>("history-used").unwrap(),
        0,
        "caps empty the ring"
    );
    assert_eq!(s.get::<u32>("width").unwrap(), 96);
}

#[test]
fn model_properties_changed_while_playing_take_effect_on_the_next_frame() {
    let dir = TempDir::new("neural-live");
    let model = write_model(&dir, "identity8.onnx", identity_nhwc(3));
    let mut h = neural_harness(&model, 128, 96, "temporal-history=0");
    let input = picture(128, 96, 0);
    let full = push(&mut h, &input);
    let t = h
        .element()
        .unwrap()
        .downcast_ref::<gst::Bin>()
        .unwrap()
        .by_name("t")
        .unwrap();
    t.set_property("model-scale", 0.5f64);
    let half = push(&mut h, &input);
    let s = stats(&h);
    assert_eq!(s.get::<u32>("network-width").unwrap(), 64);
    assert_ne!(full.data, half.data, "half scale must soften the picture");
    t.set_property("model-size-multiple", 48u32);
    push(&mut h, &input);
    assert_eq!(stats(&h).get::<u32>("network-width").unwrap(), 96);
    t.set_property("model-scale", 1.0f64);
    t.set_property("model-size-multiple", 0u32);
    assert_eq!(
        push(&mut h, &input).data,
        full.data,
        "back to the first picture"
    );
}

#[test]
fn history_fills_and_flush_discont_and_scene_cuts_empty_it() {
    let dir = TempDir::new("neural-temporal");
    let model = write_model(&dir, "negate.onnx", negate_nchw());
    let mut h = neural_harness(&model, 64, 48, "temporal-history=3");
    let used = |h: &gst_check::Harness| stats(h).get::<u32>("history-used").unwrap();
    let f = picture(64, 48, 0);
    let mut seen = vec![];
    for _ in 0..5 {
        push(&mut h, &f);
        seen.push(used(&h));
    }
    assert_eq!(seen, [0, 1, 2, 3, 3]);
    // DISCONT
    let mut b = f.to_buffer();
    b.get_mut().unwrap().set_flags(gst::BufferFlags::DISCONT);
    h.push(b).unwrap();
    h.pull().unwrap();
    assert_eq!(used(&h), 0, "discont");
    push(&mut h, &f);
    assert_eq!(used(&h), 1);
    // FLUSH
    assert!(h.push_event(gst::event::FlushStart::new()));
    assert!(h.push_event(gst::event::FlushStop::new(true)));
    h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
        gst::ClockTime,
    >::new()));
    push(&mut h, &f);
    assert_eq!(used(&h), 0, "flush");
    push(&mut h, &f);
    assert_eq!(used(&h), 1);
    // A scene cut: an inverted picture.
    let mut cut = f.clone();
    for v in cut.y_mut() {
        *v = 255 - *v;
    }
    push(&mut h, &cut);
    assert_eq!(used(&h), 0, "scene cut");
    assert_eq!(stats(&h).get::<u64>("scene-cuts").unwrap(), 1);
}

#[test]
fn the_output_filter_steadies_a_noisy_static_scene() {
    let dir = TempDir::new("neural-steady");
    let model = write_model(&dir, "negate.onnx", negate_nchw());
    let clean = picture(64, 48, 0);
    let run = |extra: &str| {
        let mut h = neural_harness(&model, 64, 48, extra);
        let outs: Vec<Nv12> = (0..6)
            .map(|i| push(&mut h, &clean.with_noise(4.0, i)))
            .collect();
        // Frame-to-frame change of the last frames.
        mean_abs_diff(outs[5].y(), outs[4].y())
    };
    let off = run("temporal-history=0");
    let on = run("temporal-history=4 temporal-strength=1 motion-sigma=20");
    assert!(on < 0.75 * off, "flicker {on} with history, {off} without");
}

#[test]
fn stat_smoothing_carries_statistics_across_frames() {
    let dir = TempDir::new("neural-smooth");
    let model = write_model(&dir, "norm.onnx", instance_norm_nchw());
    let dark = picture(64, 48, 0);
    let mut bright = dark.clone();
    for v in bright.y_mut() {
        *v = v.saturating_add(40);
    }
    let second = |extra: &str| {
        let mut h = neural_harness(
            &model,
            64,
            48,
            &format!("temporal-history=0 scene-cut-threshold=100 {extra}"),
        );
        let a = push(&mut h, &dark);
        let b = push(&mut h, &bright);
        (a, b)
    };
    let (a0, b0) = second("");
    // Per-frame statistics: the offset is normalized away.
    assert!(
        mean_abs_diff(a0.y(), b0.y()) < 3.0,
        "{}",
        mean_abs_diff(a0.y(), b0.y())
    );
    let (a9, b9) = second("model-stat-smoothing=0.9");
    assert_eq!(a9.data, a0.data, "the first frame uses its own statistics");
    let mean = |f: &Nv12| f.y().iter().map(|&v| v as f64).sum::<f64>() / f.y().len() as f64;
    assert!(
        mean(&b9) > mean(&b0) + 10.0,
        "smoothed statistics keep the brightening: {} vs {}",
        mean(&b9),
        mean(&b0)
    );
}

// ---------------------------------------------------------------------------------------------
// gst-launch pipelines and bad input
// ---------------------------------------------------------------------------------------------

fn launch(desc: &str) -> gst::Pipeline {
    init();
    gst::parse::launch(desc)
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap()
}

/// Runs to EOS or an error: (reached EOS, error texts with debug, warning texts).
fn run(pipeline: &gst::Pipeline) -> (bool, Vec<String>, Vec<String>) {
    let bus = pipeline.bus().unwrap();
    let _ = pipeline.set_state(gst::State::Playing);
    let (mut eos, mut errors, mut warnings) = (false, vec![], vec![]);
    while let Some(msg) = bus.timed_pop(gst::ClockTime::from_seconds(60)) {
        match msg.view() {
            gst::MessageView::Eos(_) => {
                eos = true;
                break;
            }
            gst::MessageView::Error(e) => {
                errors.push(format!("{} ({:?})", e.error(), e.debug()));
                break;
            }
            gst::MessageView::Warning(w) => warnings.push(w.error().to_string()),
            _ => {}
        }
    }
    pipeline.set_state(gst::State::Null).unwrap();
    (eos, errors, warnings)
}

#[test]
fn gst_launch_with_a_model_reaches_eos_and_reports_the_network() {
    let dir = TempDir::new("neural-launch");
    let model = write_model(&dir, "identity.onnx", identity_nhwc_stride2());
    let p = launch(&format!(
        "videotestsrc num-buffers=6 pattern=ball ! video/x-raw,format=NV12,width=70,height=46 ! \
         toonflow name=t backend=cpu model=\"{model}\" stats-interval=3 ! fakesink"
    ));
    let bus = p.bus().unwrap();
    p.set_state(gst::State::Playing).unwrap();
    let mut frames = vec![];
    while let Some(msg) = bus.timed_pop(gst::ClockTime::from_seconds(60)) {
        match msg.view() {
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => panic!("{} {:?}", e.error(), e.debug()),
            gst::MessageView::Element(e) => {
                if let Some(s) = e.structure().filter(|s| s.name() == "toonflow-stats") {
                    assert_eq!(s.get::<&str>("model").unwrap(), "identity.onnx");
                    assert!(s.get::<u32>("stages").unwrap() >= 1);
                    frames.push(s.get::<u64>("frames").unwrap());
                }
            }
            _ => {}
        }
    }
    p.set_state(gst::State::Null).unwrap();
    assert_eq!(frames, [3, 6]);
}

/// Whether CUDA device 0 can be used here.
fn have_gpu() -> bool {
    gsttoonflow::cuda::probe(0).is_ok()
}

#[test]
fn backend_auto_with_a_model_runs_on_the_gpu_or_warns_that_the_cpu_is_slow() {
    let dir = TempDir::new("neural-auto");
    let model = write_model(&dir, "negate.onnx", negate_nchw());
    let p = launch(&format!(
        "videotestsrc num-buffers=2 ! video/x-raw,format=NV12,width=32,height=32 ! \
         toonflow backend=auto model=\"{model}\" ! fakesink"
    ));
    let (eos, errors, warnings) = run(&p);
    assert!(eos, "{errors:?}");
    if have_gpu() {
        assert!(warnings.is_empty(), "{warnings:?}");
    } else {
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("CPU reference"), "{}", warnings[0]);
    }
}

/// Starts a pipeline with `props` on a 64x48 stream; it must fail with an error whose text
/// (message and debug) contains every one of `needles`, and without EOS.
fn assert_fails(props: &str, needles: &[&str]) {
    let p = launch(&format!(
        "videotestsrc num-buffers=3 ! video/x-raw,format=NV12,width=64,height=48 ! \
         toonflow backend=cpu {props} ! fakesink"
    ));
    let started = std::time::Instant::now();
    let (eos, errors, _) = run(&p);
    assert!(!eos, "{props}: reached EOS");
    assert_eq!(errors.len(), 1, "{props}: {errors:?}");
    for n in needles {
        assert!(
            errors[0].contains(n),
            "{props}: {:?} lacks {n:?}",
            errors[0]
        );
    }
    assert!(started.elapsed().as_secs() < 30, "{props}: took too long");
}

#[test]
fn a_missing_file_is_a_clear_error() {
    assert_fails(
        "model=/nonexistent/dir/missing.onnx",
        &["missing.onnx", "cannot read"],
    );
}

#[test]
fn corrupt_and_truncated_files_are_clear_errors() {
    let dir = TempDir::new("neural-corrupt");
    let garbage = dir.path("garbage.onnx");
    let mut rng = Rng(7);
    let bytes: Vec<u8> = (0..4096).map(|_| rng.next_u64() as u8).collect();
    std::fs::write(&garbage, bytes).unwrap();
    assert_fails(
        &format!("model=\"{}\"", garbage.display()),
        &["garbage.onnx"],
    );
    let good = onnx::encode_model(&onnx::model(identity_nhwc_stride2(), OPSET));
    let truncated = dir.path("truncated.onnx");
    std::fs::write(&truncated, &good[..good.len() * 2 / 3]).unwrap();
    assert_fails(
        &format!("model=\"{}\"", truncated.display()),
        &["truncated.onnx"],
    );
    let empty = dir.path("empty.onnx");
    std::fs::write(&empty, b"").unwrap();
    assert_fails(&format!("model=\"{}\"", empty.display()), &["empty.onnx"]);
}

#[test]
fn an_unsupported_operator_is_named_in_the_error() {
    let dir = TempDir::new("neural-unsupported");
    let model = write_model(&dir, "einsum.onnx", unsupported_op());
    assert_fails(&format!("model=\"{model}\""), &["einsum.onnx", "Einsum"]);
}

#[test]
fn a_model_that_is_not_three_channel_is_refused() {
    let dir = TempDir::new("neural-channels");
    let model = write_model(&dir, "four.onnx", four_channels());
    assert_fails(&format!("model=\"{model}\""), &["four.onnx", "3"]);
}

#[test]
fn a_plan_over_max_device_memory_is_refused() {
    let dir = TempDir::new("neural-cap");
    let model = write_model(&dir, "negate.onnx", negate_nchw());
    assert_fails(
        &format!("model=\"{model}\" max-device-memory=4096"),
        &["negate.onnx", "max-device-memory"],
    );
}

#[test]
fn backend_cuda_with_a_model_runs_on_the_gpu_or_is_a_clear_error() {
    let dir = TempDir::new("neural-cuda");
    let model = write_model(&dir, "negate.onnx", negate_nchw());
    let p = launch(&format!(
        "videotestsrc num-buffers=2 ! video/x-raw,format=NV12,width=32,height=32 ! \
         toonflow backend=cuda model=\"{model}\" ! fakesink"
    ));
    let (eos, errors, _) = run(&p);
    if have_gpu() {
        assert!(eos, "{errors:?}");
    } else {
        assert!(!eos);
        assert!(
            errors.iter().any(|e| e.contains("backend=cuda")),
            "{errors:?}"
        );
    }
}

#[test]
fn the_classic_pipeline_is_unchanged_when_model_is_empty() {
    let input = picture(64, 48, 0);
    let classic = stylize(&input, &[]);
    let explicit = stylize(&input, &[("model", &"")]);
    assert_eq!(classic.data, explicit.data);
    let mut h = harness(64, 48, &[]);
    push_frame(&mut h, &input);
    let s = h.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(s.get::<&str>("model").unwrap(), "");
    assert_eq!(s.get::<u32>("stages").unwrap(), 0);
}

// ---------------------------------------------------------------------------------------------
// The project's AnimeGANv3-like models (tests/common/onnx_models.rs)
// ---------------------------------------------------------------------------------------------

fn write_proto(dir: &TempDir, name: &str, model: &onnx::ModelProto) -> String {
    let path = dir.path(name);
    std::fs::write(&path, onnx::encode_model(model)).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn tiny_like_pads_to_16_and_stylizes_deterministically() {
    let dir = TempDir::new("neural-tiny");
    let model = write_proto(&dir, "tiny_like.onnx", &onnx_models::tiny_like());
    let input = picture(70, 46, 0);
    let run = || {
        let mut h = neural_harness(&model, 70, 46, "temporal-history=0");
        let out = push(&mut h, &input);
        (out, stats(&h))
    };
    let (a, s) = run();
    assert_eq!((a.width, a.height), (70, 46));
    assert_eq!(
        (
            s.get::<u32>("network-width").unwrap(),
            s.get::<u32>("network-height").unwrap()
        ),
        (80, 48)
    );
    assert!(s.get::<u32>("stages").unwrap() > 10, "{s}");
    assert!(
        mean_abs_diff(a.y(), input.y()) > 1.0,
        "a random network changes the picture"
    );
    let (b, _) = run();
    assert_eq!(a.data, b.data, "same model, same frame, same picture");
}

#[test]
fn tiny_like_statistics_smoothing_changes_only_later_frames() {
    let dir = TempDir::new("neural-tiny-smooth");
    let model = write_proto(&dir, "tiny_like.onnx", &onnx_models::tiny_like());
    let first = picture(64, 48, 0);
    let mut second = picture(64, 48, 9);
    for v in second.y_mut() {
        *v = v.saturating_add(30);
    }
    let frames = |extra: &str| {
        let mut h = neural_harness(
            &model,
            64,
            48,
            &format!("temporal-history=0 scene-cut-threshold=100 {extra}"),
        );
        (push(&mut h, &first), push(&mut h, &second))
    };
    let (a0, b0) = frames("");
    let (a9, b9) = frames("model-stat-smoothing=0.9");
    assert_eq!(a0.data, a9.data, "the first frame uses its own statistics");
    assert!(
        mean_abs_diff(b0.y(), b9.y()) > 0.1,
        "smoothed statistics must change the second frame"
    );
}

#[test]
fn hayao_like_runs_in_a_pipeline_at_half_scale() {
    let dir = TempDir::new("neural-hayao");
    let model = write_proto(&dir, "hayao_like.onnx", &onnx_models::hayao_like());
    let p = launch(&format!(
        "videotestsrc num-buffers=3 pattern=ball ! video/x-raw,format=NV12,width=100,height=62 ! \
         toonflow name=t backend=cpu model=\"{model}\" model-scale=0.5 ! fakesink"
    ));
    let (eos, errors, _) = run(&p);
    assert!(eos, "{errors:?}");
    let s = p.by_name("t").unwrap().property::<gst::Structure>("stats");
    assert_eq!(s.get::<u64>("frames").unwrap(), 3);
    // 100x62 at half scale is 50x31, padded to the multiple 8: 56x32.
    assert_eq!(
        (
            s.get::<u32>("network-width").unwrap(),
            s.get::<u32>("network-height").unwrap()
        ),
        (56, 32)
    );
}

#[test]
fn every_broken_model_of_the_project_posts_its_error() {
    let dir = TempDir::new("neural-broken");
    for (name, bytes, needles) in onnx_models::bad_models() {
        let path = dir.path(&format!("{name}.onnx"));
        std::fs::write(&path, bytes).unwrap();
        assert_fails(&format!("model=\"{}\"", path.display()), &needles);
    }
}
