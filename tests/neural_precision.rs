//! Calibrated storage precision on whole networks and real photos: the plan
//! (`neural::precision::calibrate`) from two photos, checked on two others by emulation (every
//! stage output the plan stores in fp16 rounded to fp16, statistics and accumulation f32),
//! against the f32 reference. The GPU's fp16 goal is ≥ 40 dB PSNR on the RGB output; the
//! emulation is what storage alone costs. The real AnimeGANv3 models are checked when
//! `TOONFLOW_ANIMEGAN_DIR` names a folder of .onnx files (local fixtures, never committed).

mod common;
#[path = "common/onnx_models.rs"]
mod onnx_models;

use gsttoonflow::neural::Tensor;
use gsttoonflow::neural::engine::NeuralModel;
use gsttoonflow::neural::frame::{
    ColorMatrix, ColorRange, ConverterConfig, FrameConverter, ValueRange,
};
use gsttoonflow::neural::onnx::encode_model;
use gsttoonflow::neural::precision::{PrecisionPlan, Reason, StoragePrecision, calibrate, emulate};

/// PSNR (dB) of two [-1, 1] outputs as [0, 1] RGB.
fn psnr(a: &Tensor<f32>, b: &Tensor<f32>) -> f64 {
    let mse = a
        .data
        .iter()
        .zip(&b.data)
        .map(|(x, y)| {
            let d = f64::from(x - y) / 2.0;
            if d.is_finite() { d * d } else { 1.0 }
        })
        .sum::<f64>()
        / a.data.len() as f64;
    if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (1.0 / mse).log10()
    }
}

/// The four photos of tests/data as the network's input tensors at `width`×`height`.
fn photos(model: &NeuralModel, width: usize, height: usize) -> Vec<Tensor<f32>> {
    let mut converter = FrameConverter::new(ConverterConfig {
        width,
        height,
        matrix: ColorMatrix::Bt601,
        range: ColorRange::Limited,
        layout: model.input_layout(),
        value_range: ValueRange::MinusOneToOne,
        multiple: model.size_multiple(),
        scale: 1.0,
    })
    .unwrap();
    ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"]
        .iter()
        .map(|name| {
            let frame = common::photo(name, width, height);
            let mut t = converter.new_tensor();
            converter
                .to_tensor(frame.y(), width, frame.uv(), width, &mut t)
                .unwrap();
            t
        })
        .collect()
}

/// Calibrates on photos 0 and 1, checks on 2 and 3; returns (calibrated PSNR, all-fp16 PSNR),
/// the worst of the two photos each.
fn check(name: &str, bytes: &[u8], width: usize, height: usize) -> (f64, f64, PrecisionPlan) {
    let model = NeuralModel::from_bytes(bytes, name).unwrap();
    let (w, h) = (
        width.div_ceil(model.size_multiple()) * model.size_multiple(),
        height.div_ceil(model.size_multiple()) * model.size_multiple(),
    );
    let spec = model.specialise(h, w).unwrap();
    let frames = photos(&model, width, height);
    let plan = calibrate(&spec, &frames[..2]).unwrap();
    let fp16 = PrecisionPlan::all(spec.stage_count(), StoragePrecision::Fp16);
    let (mut calibrated, mut uniform) = (f64::INFINITY, f64::INFINITY);
    for f in &frames[2..] {
        let exact = spec.run(f, None).unwrap();
        calibrated = calibrated.min(psnr(&exact, &emulate(&spec, &plan, f).unwrap()));
        uniform = uniform.min(psnr(&exact, &emulate(&spec, &fp16, f).unwrap()));
    }
    let fp32: Vec<String> = plan
        .decisions
        .iter()
        .enumerate()
        .filter(|(_, d)| d.precision == StoragePrecision::Fp32)
        .map(|(i, d)| format!("{i} {} {}", d.kind, d.reason.label()))
        .collect();
    println!(
        "{name} {w}x{h}: {} stages, {} fp16, {} fp32 [{}]; PSNR vs f32 on unseen photos: \
         calibrated {calibrated:.1} dB, all-fp16 storage {uniform:.1} dB",
        plan.len(),
        plan.count(StoragePrecision::Fp16),
        plan.count(StoragePrecision::Fp32),
        fp32.join(", ")
    );
    (calibrated, uniform, plan)
}

#[test]
fn generated_models_keep_40_db_under_their_calibrated_plan() {
    for (name, proto, w, h) in [
        ("tiny_like.onnx", onnx_models::tiny_like(), 128, 96),
        ("hayao_like.onnx", onnx_models::hayao_like(), 128, 96),
    ] {
        let (calibrated, uniform, plan) = check(name, &encode_model(&proto), w, h);
        assert!(calibrated >= 40.0, "{name}: {calibrated} dB");
        assert!(
            calibrated + 0.5 >= uniform,
            "{name}: {calibrated} < {uniform}"
        );
        // hayao_like's modulated normalizations' convolutions sit far from zero against their
        // deviation: stored centered in fp16 instead of fp32
        if name.starts_with("hayao") {
            assert!(
                plan.decisions.iter().any(|d| d.reason == Reason::Centered),
                "{}",
                plan.ledger()
            );
        }
        // every normalization's statistics stay fp32; most activations go to fp16
        assert!(
            plan.decisions
                .iter()
                .any(|d| d.reason == Reason::Statistics)
        );
        assert!(
            plan.count(StoragePrecision::Fp16) * 2 > plan.len(),
            "{}",
            plan.ledger()
        );
    }
}

#[test]
fn real_animeganv3_models_keep_40_db_under_their_calibrated_plan() {
    let Some(dir) = std::env::var_os("TOONFLOW_ANIMEGAN_DIR") else {
        println!(
            "skipped: no AnimeGANv3 models (set TOONFLOW_ANIMEGAN_DIR to a folder of .onnx \
             files; their weights are non-commercial and never part of the repository)"
        );
        return;
    };
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "onnx"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no .onnx in {}", dir.to_string_lossy());
    for p in paths {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let (calibrated, _, plan) = check(&name, &std::fs::read(&p).unwrap(), 256, 256);
        print!("{}", plan.ledger());
        assert!(calibrated >= 40.0, "{name}: {calibrated} dB");
    }
}

/// Why the GPU's wide Gram moments and the passes they replace disagree by up to 2 % of a
/// statistic's magnitude (tests/neural_cuda.rs, `wide_gram_moments_match_the_pass_they_replace`),
/// in f32 on the CPU: the fp16 plan multiplies by fp16 weights, and the mean of a 1x1
/// convolution of 64 to 256 channels (products of either sign summing to a small value) carries
/// their rounding; the Gram moments take that convolution's fp32 weights. hayao_class on a photo
/// at 256x144 with every convolution's weights rounded to fp16 but the 32-channel
/// normalization's 1x1 (narrow Gram moments either way; the passes replaced) and with all but
/// the statistics-only 1x1 convolutions' rounded (the wide Gram moments): the two stay
/// within that bound of each other, and the second is no further from the fp32 weights'
/// statistics than the first.
#[test]
fn fp16_weights_move_the_modulated_statistics_more_than_the_gram_moments() {
    use gsttoonflow::cuda::neural::program::f32_to_f16_bits;
    use gsttoonflow::neural::onnx::{ModelProto, f16_to_f32};
    use std::collections::HashSet;
    let m = onnx_models::hayao_like_channels([32, 64, 128, 256], "hayao_class");
    let readers = |value: &str| -> Vec<String> {
        m.graph
            .node
            .iter()
            .filter(|n| n.input.iter().any(|i| i == value))
            .map(|n| n.op_type.clone())
            .collect()
    };
    let convs: Vec<_> = m
        .graph
        .node
        .iter()
        .filter(|n| n.op_type == "Conv")
        .collect();
    // a modulated normalization's 1x1: read only by its statistics (GlobalAveragePool, Sub)
    let stat_only: HashSet<String> = convs
        .iter()
        .filter(|n| {
            readers(&n.output[0])
                .iter()
                .all(|r| r == "GlobalAveragePool" || r == "Sub")
        })
        .map(|n| n.input[1].clone())
        .collect();
    assert_eq!(stat_only.len(), 8, "hayao_class's modulated normalizations");
    let weights: HashSet<String> = convs.iter().map(|n| n.input[1].clone()).collect();
    // the 32-channel one takes the narrow Gram moments (fp32 weights) either way
    let narrow: HashSet<String> = m
        .graph
        .initializer
        .iter()
        .filter(|t| stat_only.contains(&t.name) && t.dims[0] <= 32)
        .map(|t| t.name.clone())
        .collect();
    assert_eq!(narrow.len(), 1, "hayao_class's 32-channel normalization");
    let rounded = |keep: &HashSet<String>| -> ModelProto {
        let mut r = m.clone();
        for t in r.graph.initializer.iter_mut() {
            if weights.contains(&t.name) && !keep.contains(&t.name) {
                t.raw_data = t
                    .raw_data
                    .chunks_exact(4)
                    .map(|b| f16_to_f32(f32_to_f16_bits(f32::from_le_bytes(b.try_into().unwrap()))))
                    .flat_map(f32::to_le_bytes)
                    .collect();
            }
        }
        r
    };
    let (w, h) = (256, 144);
    // (the variants differ only in weights: one input for all)
    let input = photos(
        &NeuralModel::from_bytes(&encode_model(&m), "hayao_class").unwrap(),
        w,
        h,
    )
    .swap_remove(1);
    let statistics = |model: &ModelProto| {
        let model = NeuralModel::from_bytes(&encode_model(model), "hayao_class").unwrap();
        let mut out: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        let mut hook = |k: usize, mean: &mut [f32], var: &mut [f32]| {
            if out.len() <= k {
                out.resize(k + 1, (Vec::new(), Vec::new()));
            }
            out[k] = (mean.to_vec(), var.to_vec());
        };
        model
            .specialise(h, w)
            .unwrap()
            .run(&input, Some(&mut hook))
            .unwrap();
        out
    };
    let exact = statistics(&m);
    let passes = statistics(&rounded(&narrow));
    let gram = statistics(&rounded(&stat_only));
    // mean and standard deviation apart, in units of sqrt(mean^2 + variance) of `b`
    let apart = common::statistic_apart;
    let (mut between, mut sq_passes, mut sq_gram, mut n) = (0.0f64, 0.0, 0.0, 0);
    for (k, e) in exact.iter().enumerate() {
        for c in 0..e.0.len() {
            let at = |s: &[(Vec<f32>, Vec<f32>)]| (s[k].0[c], s[k].1[c]);
            between = between.max(apart(at(&gram), at(&passes)));
            sq_passes += apart(at(&passes), at(&exact)).powi(2);
            sq_gram += apart(at(&gram), at(&exact)).powi(2);
            n += 1;
        }
    }
    let (rms_passes, rms_gram) = ((sq_passes / n as f64).sqrt(), (sq_gram / n as f64).sqrt());
    println!(
        "hayao_class {w}x{h}, {} statistics, {n} channels: fp16 weights but the 32-channel 1x1 against fp32 \
         rms {rms_passes:.1e}; fp32 weights in the statistics-only 1x1s rms {rms_gram:.1e}; \
         the two at most {between:.1e} apart (of the statistic's magnitude)",
        exact.len()
    );
    assert!(between < 2e-2, "{between:.1e}");
    assert!(
        rms_gram <= rms_passes,
        "{rms_gram:.1e} against {rms_passes:.1e}"
    );
}
