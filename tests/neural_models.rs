//! Whole networks through the engine: the project's generated AnimeGANv3-like models against
//! tract-onnx (an independent runtime), the lowered stages against node-by-node evaluation, the
//! memory ledger against the arena plan, every bad model's error, and (when present on this
//! machine) the real AnimeGANv3 models.

#[path = "common/onnx_models.rs"]
mod onnx_models;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gsttoonflow::neural::engine::NeuralModel;
use gsttoonflow::neural::frame::TensorLayout;
use gsttoonflow::neural::lower::StageKind;
use gsttoonflow::neural::onnx::encode_model;
use gsttoonflow::neural::{NeuralError, Tensor};
use onnx_models::{Rng, bad_models, hayao_like, nchw_model, tiny_like};

const TOLERANCE: f32 = 1e-4;

fn random_input(shape: [usize; 4], seed: u64) -> Tensor<f32> {
    let mut rng = Rng::new(seed);
    let n = shape.iter().product();
    Tensor::new(shape.to_vec(), (0..n).map(|_| rng.uniform()).collect())
}

fn tract_run(bytes: &[u8], input: &Tensor<f32>) -> (Vec<f32>, Duration) {
    use tract_onnx::prelude::*;
    let model = tract_onnx::onnx()
        .model_for_read(&mut &bytes[..])
        .expect("tract reads the model")
        .with_input_fact(0, f32::fact(input.shape.clone()).into())
        .expect("input fact")
        .into_optimized()
        .expect("tract optimises the model")
        .into_runnable()
        .expect("runnable");
    let x = tract_onnx::prelude::Tensor::from_shape(&input.shape, &input.data).expect("tensor");
    let start = Instant::now();
    let out = model.run(tvec!(x.into())).expect("tract runs the model");
    let elapsed = start.elapsed();
    let view = out[0].to_plain_array_view::<f32>().expect("f32 output");
    (view.iter().copied().collect(), elapsed)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs `bytes` at `h`×`w` through the engine and tract; returns (max diff, ours, tract).
fn compare_with_tract(bytes: &[u8], name: &str, h: usize, w: usize) -> (f32, Duration, Duration) {
    let model = NeuralModel::from_bytes(bytes, name).unwrap();
    let spec = model.specialise(h, w).unwrap();
    let input = random_input(spec.input_shape(), (h * 1000 + w) as u64);
    let start = Instant::now();
    let ours = spec.run(&input, None).unwrap();
    let ours_time = start.elapsed();
    assert_eq!(ours.shape, input.shape);
    let (theirs, tract_time) = tract_run(bytes, &input);
    let diff = max_abs_diff(&ours.data, &theirs);
    println!(
        "{name} {w}x{h}: max |ours - tract| = {diff:.2e}; ours {:.1} ms, tract {:.1} ms, {} \
         stages",
        ours_time.as_secs_f64() * 1e3,
        tract_time.as_secs_f64() * 1e3,
        spec.stage_count()
    );
    // the output is a tanh: a dead network (all ±1 or constant) would compare too easily
    let spread = ours.data.iter().fold(f32::MAX, |a, &b| a.min(b))
        ..ours.data.iter().fold(f32::MIN, |a, &b| a.max(b));
    assert!(
        spread.end - spread.start > 0.05,
        "{name}: output range {spread:?}"
    );
    assert!(
        spread.start > -1.0 && spread.end < 1.0,
        "{name}: saturated {spread:?}"
    );
    (diff, ours_time, tract_time)
}

#[test]
fn generated_models_have_the_animeganv3_shape() {
    for (model, multiple, norms, name) in [
        (tiny_like(), 16, 2, "tiny_like"),
        (hayao_like(), 8, 17, "hayao_like"),
    ] {
        let bytes = encode_model(&model);
        let m = NeuralModel::from_bytes(&bytes, name).unwrap();
        assert_eq!(m.name(), name);
        assert_eq!(m.input_layout(), TensorLayout::Nhwc);
        assert_eq!(m.size_multiple(), multiple, "{name}");
        let declared: u64 = model
            .graph
            .initializer
            .iter()
            .map(|t| t.declared_bytes().unwrap())
            .sum();
        assert_eq!(m.weight_bytes(), declared);
        let spec = m.specialise(64, 64).unwrap();
        assert_eq!(spec.input_shape(), [1, 64, 64, 3]);
        assert_eq!(spec.normalize_channels().len(), norms, "{name}");
        // lowering removed nodes: the shape subgraphs, the moments, the transposes, the pads
        assert!(
            spec.stage_count() * 2 < spec.unlowered_node_count(),
            "{name}: {} stages from {} nodes",
            spec.stage_count(),
            spec.unlowered_node_count()
        );
        let stages = &spec.lowered().stages;
        let transposes = stages
            .iter()
            .flat_map(|s| &s.nodes)
            .filter(|n| n.op_type == "Transpose")
            .count();
        // only the input's NHWC→NCHW and the output's NCHW→NHWC remain
        assert_eq!(transposes, 2, "{name}");
        let pads_alone = stages
            .iter()
            .filter(|s| s.kind == StageKind::Op && s.nodes[0].op_type == "Pad")
            .count();
        assert_eq!(pads_alone, 0, "{name}: every Pad joins its conv");
        for kind in [
            StageKind::Conv,
            StageKind::Normalize,
            StageKind::Elementwise,
        ] {
            assert!(stages.iter().any(|s| s.kind == kind), "{name}: no {kind:?}");
        }
    }
}

#[test]
fn tiny_like_matches_tract() {
    let bytes = encode_model(&tiny_like());
    for (h, w) in [(64, 64), (80, 96)] {
        let (diff, ..) = compare_with_tract(&bytes, "tiny_like", h, w);
        assert!(diff <= TOLERANCE, "tiny_like {w}x{h}: {diff}");
    }
}

#[test]
fn hayao_like_matches_tract() {
    let bytes = encode_model(&hayao_like());
    for (h, w) in [(64, 64), (72, 96)] {
        let (diff, ..) = compare_with_tract(&bytes, "hayao_like", h, w);
        assert!(diff <= TOLERANCE, "hayao_like {w}x{h}: {diff}");
    }
}

#[test]
fn an_nchw_model_matches_tract() {
    let bytes = encode_model(&nchw_model());
    let m = NeuralModel::from_bytes(&bytes, "nchw").unwrap();
    assert_eq!(m.input_layout(), TensorLayout::Nchw);
    assert_eq!(m.size_multiple(), 4);
    for (h, w) in [(32, 32), (36, 52)] {
        let spec = m.specialise(h, w).unwrap();
        assert_eq!(spec.input_shape(), [1, 3, h, w]);
        let input = random_input(spec.input_shape(), 11);
        let ours = spec.run(&input, None).unwrap();
        let (theirs, _) = tract_run(&bytes, &input);
        let diff = max_abs_diff(&ours.data, &theirs);
        println!("nchw {w}x{h}: max |ours - tract| = {diff:.2e}");
        assert!(diff <= TOLERANCE, "nchw {w}x{h}: {diff}");
        let unlowered = spec.run_unlowered(&input).unwrap();
        assert!(max_abs_diff(&ours.data, &unlowered.data) <= 1e-5);
    }
}

#[test]
fn lowered_stages_agree_with_node_by_node_evaluation() {
    for (model, name, h, w) in [
        (tiny_like(), "tiny_like", 64, 96),
        (hayao_like(), "hayao_like", 72, 64),
    ] {
        let m = NeuralModel::from_bytes(&encode_model(&model), name).unwrap();
        let spec = m.specialise(h, w).unwrap();
        let input = random_input(spec.input_shape(), 7);
        let lowered = spec.run(&input, None).unwrap();
        let unlowered = spec.run_unlowered(&input).unwrap();
        let diff = max_abs_diff(&lowered.data, &unlowered.data);
        println!("{name}: lowered vs node by node {diff:.2e}");
        assert!(diff <= 1e-5, "{name}: {diff}");
    }
}

#[test]
fn sizes_that_are_not_multiples_are_refused() {
    let m = NeuralModel::from_bytes(&encode_model(&tiny_like()), "tiny_like").unwrap();
    let e = m.specialise(72, 96).unwrap_err();
    assert!(
        matches!(&e, NeuralError::Model(msg) if msg.contains("multiples of 16") && msg.contains("96x72")),
        "{e}"
    );
    let spec = m.specialise(64, 64).unwrap();
    let e = spec
        .run(&random_input([1, 64, 80, 3], 1), None)
        .unwrap_err();
    assert!(e.to_string().contains("[1, 64, 80, 3]"), "{e}");
}

#[test]
fn the_stats_hook_sees_every_normalize_stage_and_steers_it() {
    let m = NeuralModel::from_bytes(&encode_model(&hayao_like()), "hayao_like").unwrap();
    let spec = m.specialise(64, 64).unwrap();
    let input = random_input(spec.input_shape(), 3);
    let plain = spec.run(&input, None).unwrap();

    let mut seen: Vec<(usize, usize, usize)> = Vec::new();
    let mut record = |i: usize, mean: &mut [f32], var: &mut [f32]| {
        assert!(var.iter().all(|&v| v >= 0.0));
        seen.push((i, mean.len(), var.len()));
    };
    let observed = spec.run(&input, Some(&mut record)).unwrap();
    assert_eq!(
        observed.data, plain.data,
        "a hook that changes nothing changes nothing"
    );
    let expected: Vec<(usize, usize, usize)> = spec
        .normalize_channels()
        .iter()
        .enumerate()
        .map(|(i, &c)| (i, c, c))
        .collect();
    assert_eq!(seen, expected);

    // statistics from "another frame": the output moves
    let mut shift = |_: usize, mean: &mut [f32], var: &mut [f32]| {
        mean.iter_mut().for_each(|m| *m += 0.5);
        var.iter_mut().for_each(|v| *v *= 2.0);
    };
    let steered = spec.run(&input, Some(&mut shift)).unwrap();
    let moved = max_abs_diff(&steered.data, &plain.data);
    assert!(moved > 1e-3, "the hook's statistics are not used ({moved})");
}

/// Parses "live N B" out of a ledger line.
fn field(line: &str, key: &str) -> u64 {
    let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn the_ledger_adds_up() {
    for (model, name, h, w) in [
        (tiny_like(), "tiny_like", 96, 128),
        (hayao_like(), "hayao_like", 72, 96),
    ] {
        let m = NeuralModel::from_bytes(&encode_model(&model), name).unwrap();
        let spec = m.specialise(h, w).unwrap();
        for bpe in [2u64, 4] {
            let plan = spec.plan(bpe);
            plan.validate().unwrap();
            let ledger = spec.ledger(bpe);
            let lines: Vec<&str> = ledger.lines().collect();
            assert_eq!(lines.len(), spec.stage_count() + 2, "{ledger}");
            let stage_lines = &lines[1..lines.len() - 1];
            let lives: Vec<u64> = stage_lines.iter().map(|l| field(l, "live")).collect();
            let outs: u64 = stage_lines.iter().map(|l| field(l, "out")).sum();
            let peak = *lives.iter().max().unwrap();
            let peak_at = lives.iter().position(|&l| l == peak).unwrap();
            assert_eq!(peak, plan.peak_live_bytes, "{name}");
            assert_eq!(peak_at as u32, plan.peak_stage, "{name}");
            // every planned buffer but the input is some stage's output
            let planned: u64 = plan.buffers.iter().skip(1).map(|b| b.bytes).sum();
            assert_eq!(outs, planned, "{name}");
            let last = lines.last().unwrap();
            assert_eq!(field(last, "peak"), plan.peak_live_bytes);
            assert_eq!(field(last, "arena"), plan.arena_bytes);
            assert!(plan.arena_bytes >= plan.peak_live_bytes);
            // the input and the output are both live somewhere and sized as the picture
            let picture = (h * w * 3) as u64 * bpe;
            assert_eq!(plan.buffers[0].bytes, picture);
            assert_eq!(plan.buffer("output").unwrap().bytes, picture);
        }
        // fp32 needs twice the bytes of fp16, up to alignment
        let (a16, a32) = (spec.plan(2).peak_live_bytes, spec.plan(4).peak_live_bytes);
        assert!(
            a32 >= 2 * a16 - 256 * 64 && a32 <= 2 * a16 + 256 * 64,
            "{a16} {a32}"
        );
    }
}

#[test]
fn memory_figures_at_720p_and_1080p() {
    let mut models: Vec<(String, Vec<u8>)> = vec![
        ("tiny_like".into(), encode_model(&tiny_like())),
        ("hayao_like".into(), encode_model(&hayao_like())),
    ];
    models.extend(real_models());
    for (name, bytes) in &models {
        let m = NeuralModel::from_bytes(bytes, name).unwrap();
        let mult = m.size_multiple();
        for (w, h) in [(1280usize, 720usize), (1920, 1080)] {
            let (h, w) = (h.div_ceil(mult) * mult, w.div_ceil(mult) * mult);
            let spec = m.specialise(h, w).unwrap();
            let (p16, p32) = (spec.plan(2), spec.plan(4));
            p16.validate().unwrap();
            let largest = p16.buffers.iter().map(|b| b.bytes).max().unwrap();
            assert!(p16.arena_bytes >= p16.peak_live_bytes && p16.peak_live_bytes >= largest);
            println!(
                "{name} {w}x{h}: {} stages; fp16 arena {:.1} MiB (peak live {:.1} MiB at {}); \
                 fp32 arena {:.1} MiB",
                spec.stage_count(),
                mib(p16.arena_bytes),
                mib(p16.peak_live_bytes),
                p16.stage_names[p16.peak_stage as usize],
                mib(p32.arena_bytes)
            );
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn temp_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("toonflow-neural-models-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn bad_models_give_clear_errors() {
    let dir = temp_dir();
    for (name, bytes, words) in bad_models() {
        let path = dir.join(format!("{name}.onnx"));
        std::fs::write(&path, &bytes).unwrap();
        let e = NeuralModel::load(&path).unwrap_err().to_string();
        for w in words {
            assert!(e.contains(w), "{name}: '{w}' not in: {e}");
        }
        println!("{name}: {e}");
    }
    let missing = dir.join("no-such-model.onnx");
    let e = NeuralModel::load(&missing).unwrap_err();
    assert!(
        matches!(&e, NeuralError::Io(m) if m.contains("no-such-model.onnx")),
        "{e}"
    );
    let e = NeuralModel::load(&dir).unwrap_err();
    assert!(
        matches!(&e, NeuralError::Io(m) if m.contains("directory")),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The real AnimeGANv3 models in $TOONFLOW_ANIMEGAN_DIR (non-commercial weights: local
/// fixtures only, never committed).
fn real_models() -> Vec<(String, Vec<u8>)> {
    let Some(dir) = std::env::var_os("TOONFLOW_ANIMEGAN_DIR") else {
        return Vec::new();
    };
    let mut found: Vec<(String, Vec<u8>)> = std::fs::read_dir(Path::new(&dir))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "onnx"))
                .map(|p| {
                    let name = p.file_name().unwrap().to_string_lossy().into_owned();
                    (name, std::fs::read(&p).unwrap())
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

#[test]
fn real_animeganv3_models_match_tract_at_256() {
    let models = real_models();
    if models.is_empty() {
        println!(
            "skipped: no AnimeGANv3 models (set TOONFLOW_ANIMEGAN_DIR to a folder of .onnx \
             files; their weights are non-commercial and never part of the repository)"
        );
        return;
    }
    for (name, bytes) in models {
        let (diff, ..) = compare_with_tract(&bytes, &name, 256, 256);
        assert!(diff <= TOLERANCE, "{name}: {diff}");
    }
}
