//! The style network on the GPU (src/cuda/neural) against the CPU reference (src/neural):
//! fp32 storage within 1e-3 (max abs, on the [-1, 1] output) on the project's generated
//! models, fp16 storage at 40 dB PSNR or better on real photos, graph replay equal to eager
//! launches, the stats hook and the device's statistics smoother as the CPU engine applies them.
//! The real AnimeGANv3 tiny fixture is checked when present (TOONFLOW_ANIMEGAN_DIR, or
//! /work/fixtures). `TOONFLOW_NEURAL_BENCH=1` prints per-frame times at 720p, 1080p and 4K
//! (`TOONFLOW_NEURAL_BENCH=tiny_Cute:1080p` only the rows whose model and size contain those).
//! Without a GPU every test prints that it skipped, and why.

mod common;
mod cuda_common;
#[path = "common/onnx_models.rs"]
mod onnx_models;

use std::path::PathBuf;
use std::time::Instant;

use cuda_common::assert_same_bits;
use gst::prelude::*;
use gsttoonflow::cuda::neural::NeuralGpu;
use gsttoonflow::cuda::neural::program::{Fusions, Kernel, NnConv, Storage};
use gsttoonflow::neural::Tensor;
use gsttoonflow::neural::engine::{NeuralModel, Specialised};
use gsttoonflow::neural::frame::{
    ColorMatrix, ColorRange, ConverterConfig, FrameConverter, TensorLayout, ValueRange,
};
use gsttoonflow::neural::onnx::{attr_ints, encode_model};
use gsttoonflow::neural::temporal::StatSmoother;
use onnx_models::{Builder, Rng, hayao_like, hayao_like_channels, tiny_like, tiny_like_channels};

macro_rules! need_gpu {
    () => {
        if cuda_common::cuda_or_skip().is_none() {
            return;
        }
    };
}

fn generated() -> Vec<(NeuralModel, usize, usize)> {
    vec![
        (
            NeuralModel::from_bytes(&encode_model(&tiny_like()), "tiny_like").unwrap(),
            96,
            80,
        ),
        (
            NeuralModel::from_bytes(&encode_model(&hayao_like()), "hayao_like").unwrap(),
            96,
            72,
        ),
        (tiny_16(), 256, 192),
        (hayao_32(), 96, 72),
    ]
}

/// hayao_like with 32 channels below full resolution: its modulated normalizations' statistics
/// come from Gram moments of two 16-channel tiles (three pairs), over channels-last tensors.
fn hayao_32() -> NeuralModel {
    let m = hayao_like_channels([16, 32, 32, 32], "hayao_32");
    NeuralModel::from_bytes(&encode_model(&m), "hayao_32").unwrap()
}

/// hayao_like with 96 and 192 channels below full resolution: wide Gram moments over three
/// whole tiles (six pairs) at 192 channels; the 96 (64 + a part tile of 32) stay on the passes
/// until the part-tile path has run on a GPU.
fn hayao_96_192() -> NeuralModel {
    let m = hayao_like_channels([16, 96, 192, 192], "hayao_96_192");
    NeuralModel::from_bytes(&encode_model(&m), "hayao_96_192").unwrap()
}

/// The Hayao-class generated model (AnimeGANv3 Hayao's channel widths), the benchmark's.
fn hayao_class() -> NeuralModel {
    let m = hayao_like_channels([32, 64, 128, 256], "hayao_class");
    NeuralModel::from_bytes(&encode_model(&m), "hayao_class").unwrap()
}

/// tiny_like with 16 channels at full resolution, as the real tiny: channels-last there, the
/// Gram moments and the modulated normalization's chain over channels-last, the last
/// full-resolution convolution in bands.
fn tiny_16() -> NeuralModel {
    let m = tiny_like_channels([16, 16, 16, 32, 32], false, "tiny_16");
    NeuralModel::from_bytes(&encode_model(&m), "tiny_16").unwrap()
}

/// The real tiny fixture, when there is one on this machine (never committed).
fn real_tiny() -> Option<NeuralModel> {
    let dirs: Vec<PathBuf> = std::env::var_os("TOONFLOW_ANIMEGAN_DIR")
        .map(PathBuf::from)
        .into_iter()
        .chain([
            PathBuf::from("/work/fixtures"),
            common::repo_root().join("shared"),
        ])
        .collect();
    dirs.iter()
        .map(|d| d.join("AnimeGANv3_tiny_Cute.onnx"))
        .find(|p| p.exists())
        .map(|p| NeuralModel::load(&p).unwrap())
}

fn random_input(spec: &Specialised, seed: u64) -> Tensor<f32> {
    let shape = spec.input_shape();
    let mut rng = Rng::new(seed);
    let n = shape.iter().product();
    Tensor::new(shape.to_vec(), (0..n).map(|_| rng.uniform()).collect())
}

fn gpu(spec: &Specialised, half: bool, graph: bool) -> NeuralGpu {
    gpu_with(spec, half, graph, true, Fusions::from_env())
}

/// With `tensor_cores` false the fp16 convolutions run on CUDA cores too.
fn gpu_with(
    spec: &Specialised,
    half: bool,
    graph: bool,
    tensor_cores: bool,
    fusions: Fusions,
) -> NeuralGpu {
    let storage = Storage {
        half: vec![half; spec.stage_count()],
        tensor_cores,
        fusions,
        split: Vec::new(),
        frame_input: false,
    };
    NeuralGpu::new(0, spec, &storage, 0, graph)
        .unwrap_or_else(|e| panic!("building the GPU network: {e}"))
}

fn mma_launches(g: &NeuralGpu) -> usize {
    tensor_core_convs(g.program())
}

fn tensor_core_convs(p: &gsttoonflow::cuda::neural::program::Program) -> usize {
    p.launches
        .iter()
        .filter(|l| {
            matches!(
                l.kernel,
                gsttoonflow::cuda::neural::program::Kernel::ConvMma(..)
            )
        })
        .count()
}

/// The parameter block of launch `l` in a program built at static base 0 (a block's address is
/// then its offset in the static bytes).
fn params<T: bytemuck::Pod>(
    p: &gsttoonflow::cuda::neural::program::Program,
    l: &gsttoonflow::cuda::neural::program::Launch,
) -> T {
    let at = l.params as usize;
    bytemuck::pod_read_unaligned(&p.static_init[at..at + std::mem::size_of::<T>()])
}

/// The uniform fp16 plan of `spec` with `fusions`, built at static base 0 (no GPU needed).
fn fp16_plan(spec: &Specialised, fusions: Fusions) -> gsttoonflow::cuda::neural::program::Program {
    fp16_plan_at(spec, fusions, 0, 0)
}

/// [`fp16_plan`] with its arena and static block at the given bases.
fn fp16_plan_at(
    spec: &Specialised,
    fusions: Fusions,
    arena_base: u64,
    static_base: u64,
) -> gsttoonflow::cuda::neural::program::Program {
    let storage = Storage {
        fusions,
        ..Storage::uniform(spec.stage_count(), true)
    };
    gsttoonflow::cuda::neural::program::build(spec, &storage, arena_base, static_base).unwrap()
}

/// hayao_class's uniform fp16 plans at 1920x1080 and 960x544 with a fusion on and off
/// (`fusions(true)`, `fusions(false)`): (width, height, on, off).
fn hayao_class_plans(
    fusions: impl Fn(bool) -> Fusions,
) -> Vec<(
    usize,
    usize,
    gsttoonflow::cuda::neural::program::Program,
    gsttoonflow::cuda::neural::program::Program,
)> {
    let model = hayao_class();
    [(1920, 1080), (960, 544)]
        .into_iter()
        .map(|(w, h)| {
            let spec = model.specialise(h, w).unwrap();
            (
                w,
                h,
                fp16_plan(&spec, fusions(true)),
                fp16_plan(&spec, fusions(false)),
            )
        })
        .collect()
}

/// The elementwise chains of a program built at static base 0: those launched, and those a
/// tensor-core convolution takes into its gather (`NnConv::pre`), with whether each is folded.
fn elementwise_chains(
    p: &gsttoonflow::cuda::neural::program::Program,
) -> Vec<(gsttoonflow::cuda::neural::program::NnEltwise, bool)> {
    use gsttoonflow::cuda::neural::program::NnEltwise;
    let at = |addr: u64| {
        let at = addr as usize;
        bytemuck::pod_read_unaligned::<NnEltwise>(
            &p.static_init[at..at + std::mem::size_of::<NnEltwise>()],
        )
    };
    let mut chains = Vec::new();
    for l in &p.launches {
        match l.kernel {
            Kernel::Eltwise => chains.push((params::<NnEltwise>(p, l), false)),
            Kernel::ConvMma(..) => {
                let c = params::<NnConv>(p, l);
                // a banded convolution's launches share one chain
                if c.pre != 0 && c.row0 == 0 {
                    chains.push((at(c.pre), true));
                }
            }
            _ => {}
        }
    }
    chains
}

fn run_gpu(g: &mut NeuralGpu, input: &Tensor<f32>) -> Tensor<f32> {
    let mut out = Tensor::zeros(&input.shape);
    g.run(input, &mut out).unwrap();
    out
}

/// The fp16 tensor-core output of `input` with every fusion, and with `off` instead.
fn run_with_and_without(
    spec: &Specialised,
    input: &Tensor<f32>,
    off: Fusions,
) -> (Tensor<f32>, Tensor<f32>) {
    let on = run_gpu(&mut gpu_with(spec, true, false, true, Fusions::ALL), input);
    let off = run_gpu(&mut gpu_with(spec, true, false, true, off), input);
    (on, off)
}

/// All fusions against `off` on tiny_16 and the real tiny (when here), a photo at 1920x1088
/// and 640x368: the same output bits (`what` names the switch in the messages).
fn fusion_keeps_the_bits_on_photos(off: Fusions, what: &str) {
    let mut models = vec![tiny_16()];
    models.extend(real_tiny());
    for model in &models {
        for (w, h) in [(1920, 1088), (640, 368)] {
            let input = photo_tensor(model, "chelsea.png", w, h);
            let spec = model.specialise(input.shape[1], input.shape[2]).unwrap();
            let (a, b) = run_with_and_without(&spec, &input, off);
            println!("{} {w}x{h}: {} values", model.name(), a.data.len());
            assert_same_bits(&a, &b, &format!("{}: {what}", model.name()));
        }
    }
}

fn max_abs(a: &Tensor<f32>, b: &Tensor<f32>) -> f32 {
    assert_eq!(a.shape, b.shape);
    cuda_common::max_abs_diff_f32(&a.data, &b.data)
}

/// PSNR of two [-1, 1] pictures on the [0, 1] scale.
fn psnr(a: &Tensor<f32>, b: &Tensor<f32>) -> f64 {
    let mse = a
        .data
        .iter()
        .zip(&b.data)
        .map(|(x, y)| {
            let d = (*x as f64 - *y as f64) / 2.0;
            d * d
        })
        .sum::<f64>()
        / a.data.len() as f64;
    10.0 * (1.0 / mse.max(1e-20)).log10()
}

/// A photo of tests/data as the network's input tensor (NHWC, [-1, 1]).
fn photo_tensor(model: &NeuralModel, name: &str, width: usize, height: usize) -> Tensor<f32> {
    let frame = common::photo(name, width, height);
    let mut conv = FrameConverter::new(ConverterConfig {
        width,
        height,
        matrix: ColorMatrix::Bt601,
        range: ColorRange::Limited,
        layout: TensorLayout::Nhwc,
        value_range: ValueRange::MinusOneToOne,
        multiple: model.size_multiple(),
        scale: 1.0,
    })
    .unwrap();
    let mut t = conv.new_tensor();
    conv.to_tensor(frame.y(), width, frame.uv(), width, &mut t)
        .unwrap();
    t
}

#[test]
fn fp32_matches_the_cpu_reference_on_the_generated_models() {
    need_gpu!();
    for (model, w, h) in generated() {
        let spec = model.specialise(h, w).unwrap();
        let mut g = gpu(&spec, false, false);
        for seed in [1, 2] {
            let input = random_input(&spec, seed);
            let cpu = spec.run(&input, None).unwrap();
            let out = run_gpu(&mut g, &input);
            let d = max_abs(&cpu, &out);
            println!(
                "{} {w}x{h} fp32: max abs difference {d:.2e} ({} launches, arena {} B, static {} B)",
                model.name(),
                g.launches_per_frame(),
                g.program().arena.arena_bytes,
                g.program().static_bytes
            );
            assert!(d <= 1e-3, "{}: max abs difference {d}", model.name());
        }
    }
}

#[test]
fn graph_replay_equals_eager_launches() {
    need_gpu!();
    for (model, w, h) in generated() {
        let spec = model.specialise(h, w).unwrap();
        let input = random_input(&spec, 7);
        let eager = run_gpu(&mut gpu(&spec, true, false), &input);
        let mut g = gpu(&spec, true, true);
        let mut replayed = false;
        for _ in 0..5 {
            let out = run_gpu(&mut g, &input);
            assert_eq!(out.data, eager.data, "{}: graph vs eager", model.name());
            replayed |= g.last_frame_stats().graph_replayed;
        }
        assert!(
            replayed,
            "{}: no frame was replayed from a graph",
            model.name()
        );
    }
}

/// What the hook tests do to the statistics: variances x1.5, means +0.01.
fn change_stats(calls: &mut Vec<usize>, mean: &mut [f32], var: &mut [f32]) {
    calls.push(mean.len());
    for v in var.iter_mut() {
        *v *= 1.5;
    }
    for m in mean.iter_mut() {
        *m += 0.01;
    }
}

#[test]
fn the_stats_hook_sees_and_changes_the_statistics_as_on_the_cpu() {
    need_gpu!();
    for (model, w, h) in generated() {
        let spec = model.specialise(h, w).unwrap();
        let input = random_input(&spec, 3);
        let channels = spec.normalize_channels();
        let mut cpu_calls = Vec::new();
        let mut hook =
            |_: usize, mean: &mut [f32], var: &mut [f32]| change_stats(&mut cpu_calls, mean, var);
        let cpu = spec.run(&input, Some(&mut hook)).unwrap();
        let mut gpu_calls = Vec::new();
        let mut hook =
            |_: usize, mean: &mut [f32], var: &mut [f32]| change_stats(&mut gpu_calls, mean, var);
        let mut g = gpu(&spec, false, false);
        let mut out = Tensor::zeros(&input.shape);
        g.run_with_hook(&input, &mut out, &mut hook).unwrap();
        assert_eq!(gpu_calls, channels, "{}: hook calls", model.name());
        assert_eq!(cpu_calls, channels);
        let d = max_abs(&cpu, &out);
        println!(
            "{} with the stats hook: max abs difference {d:.2e}",
            model.name()
        );
        assert!(d <= 1e-3, "{}: {d}", model.name());
        let plain = spec.run(&input, None).unwrap();
        assert!(max_abs(&plain, &out) > 1e-3, "the hook changed nothing");
    }
}

/// In fp16 the Gram launch also computes the chains over its statistics
/// (`Fusions::stat_chains`); a hook that changes those statistics after it must reach them
/// too: the output with the hook is the same, bit for bit, as with the chains launched on
/// their own after it, and not the output without the hook.
#[test]
fn the_stats_hook_reaches_the_chains_the_gram_launch_runs() {
    need_gpu!();
    let mut chained = 0;
    for (model, w, h) in generated() {
        let spec = model.specialise(h, w).unwrap();
        let input = random_input(&spec, 5);
        let run = |fusions: Fusions, hooked: bool| {
            let mut g = gpu_with(&spec, true, false, true, fusions);
            let chains = g.program().stat_chains.len();
            let mut out = Tensor::zeros(&input.shape);
            let mut calls = Vec::new();
            let mut hook = |_: usize, mean: &mut [f32], var: &mut [f32]| {
                if hooked {
                    change_stats(&mut calls, mean, var)
                }
            };
            g.run_with_hook(&input, &mut out, &mut hook).unwrap();
            (out, chains)
        };
        let (with, chains) = run(Fusions::from_env(), true);
        let (launched, none) = run(
            Fusions {
                stat_chains: false,
                ..Fusions::from_env()
            },
            true,
        );
        let (plain, _) = run(Fusions::from_env(), false);
        assert_eq!(none, 0);
        println!(
            "{}: {chains} statistics chains in Gram launches",
            model.name()
        );
        // (the chains launched on their own after the hook are the reference)
        assert_same_bits(
            &with,
            &launched,
            &format!(
                "{}: the chains in the Gram launch, with the hook,",
                model.name()
            ),
        );
        assert!(
            max_abs(&plain, &with) > 0.0,
            "{}: the hook changed nothing",
            model.name()
        );
        chained += chains;
    }
    assert!(chained > 0, "no generated model has statistics chains");
}

#[test]
fn the_device_smoother_follows_the_cpu_stat_smoother() {
    need_gpu!();
    for (model, w, h) in generated() {
        let spec = model.specialise(h, w).unwrap();
        let frames = [
            random_input(&spec, 11),
            random_input(&spec, 12),
            random_input(&spec, 13),
        ];
        let mut smoother = StatSmoother::with_channels(&spec.normalize_channels(), 0.6);
        let mut g = gpu(&spec, false, true);
        g.set_smoothing(0.6);
        for (k, f) in frames.iter().enumerate() {
            if k == 2 {
                smoother.reset();
                g.reset();
            }
            let mut hook = smoother.hook();
            let cpu = spec.run(f, Some(&mut hook)).unwrap();
            let out = run_gpu(&mut g, f);
            let d = max_abs(&cpu, &out);
            println!(
                "{} smoothed frame {k}: max abs difference {d:.2e}",
                model.name()
            );
            assert!(d <= 1e-3, "{} frame {k}: {d}", model.name());
        }
    }
}

#[test]
fn fp16_storage_keeps_40_db_on_photos() {
    need_gpu!();
    let mut models = generated();
    if let Some(m) = real_tiny() {
        models.push((m, 256, 256));
    } else {
        println!("the real AnimeGANv3 tiny fixture is not here: generated models only");
    }
    for (model, _, _) in &models {
        for (photo, w, h) in [("chelsea.png", 256, 160), ("coffee.png", 192, 128)] {
            let input = photo_tensor(model, photo, w, h);
            let (th, tw) = (input.shape[1], input.shape[2]);
            let spec = model.specialise(th, tw).unwrap();
            let cpu = spec.run(&input, None).unwrap();
            let out32 = run_gpu(&mut gpu(&spec, false, false), &input);
            let d32 = max_abs(&cpu, &out32);
            assert!(d32 <= 1e-3, "{} fp32 on {photo}: {d32}", model.name());
            // CUDA cores; tensor cores with every fusion and with none (one run checks both)
            for (tc, fusions) in [
                (false, Fusions::NONE),
                (true, Fusions::ALL),
                (true, Fusions::NONE),
            ] {
                let mut g = gpu_with(&spec, true, false, tc, fusions);
                let out16 = run_gpu(&mut g, &input);
                let p16 = psnr(&cpu, &out16);
                println!(
                    "{} on {photo} {tw}x{th}: fp32 max abs {d32:.2e}, fp16 ({} tensor-core \
                     convs, fusions {}, {} launches) {p16:.1} dB (max abs {:.2e})",
                    model.name(),
                    mma_launches(&g),
                    if fusions == Fusions::ALL {
                        "all"
                    } else {
                        "none"
                    },
                    g.program().launches.len(),
                    max_abs(&cpu, &out16)
                );
                assert!(p16 >= 40.0, "{} fp16 on {photo}: {p16:.1} dB", model.name());
                if fusions == Fusions::ALL {
                    // the staged Resize patch reads the same pixels and blends them the same
                    // way as the per-pixel taps: the same bits with it off
                    let no_patch = Fusions {
                        resize_patch: false,
                        ..Fusions::ALL
                    };
                    let plain = run_gpu(&mut gpu_with(&spec, true, false, tc, no_patch), &input);
                    assert_same_bits(
                        &out16,
                        &plain,
                        &format!("{} on {photo}: the staged Resize patch", model.name()),
                    );
                    // the double-buffered fixed 3x3 copies the same bytes and takes them
                    // through the same chain: the same bits single-buffered
                    let single = Fusions::ALL.single_buffered();
                    let plain = run_gpu(&mut gpu_with(&spec, true, false, tc, single), &input);
                    assert_same_bits(
                        &out16,
                        &plain,
                        &format!("{} on {photo}: the double-buffered gather", model.name()),
                    );
                }
            }
        }
    }
}

#[test]
fn an_unsupported_operator_is_a_clear_error_before_the_device_is_touched() {
    // ConvTranspose has no GPU kernel: the error names it (no GPU needed to build the program).
    let model = NeuralModel::from_bytes(&encode_model(&onnx_models::nchw_model()), "nchw").unwrap();
    let spec = model.specialise(32, 32).unwrap();
    let storage = Storage::uniform(spec.stage_count(), false);
    match gsttoonflow::cuda::neural::program::build(&spec, &storage, 0, 0) {
        Ok(p) => println!("nchw model: {} launches", p.launches.len()),
        Err(e) => {
            let text = e.to_string();
            println!("nchw model on the GPU: {text}");
            assert!(text.contains("GPU"), "{text}");
        }
    }
}

/// The program of each generated model (no GPU needed): every stage launches at least one
/// kernel, in stage order; the arena plan is valid and holds the activations at their storage.
#[test]
fn programs_cover_every_stage() {
    for (model, w, h) in generated().into_iter().chain([(
        NeuralModel::from_bytes(&encode_model(&tiny_like()), "tiny_like").unwrap(),
        160,
        96,
    )]) {
        let spec = model.specialise(h, w).unwrap();
        for half in [false, true] {
            let storage = Storage {
                half: vec![half; spec.stage_count()],
                tensor_cores: true,
                fusions: Fusions::from_env(),
                split: Vec::new(),
                frame_input: false,
            };
            let p = gsttoonflow::cuda::neural::program::build(&spec, &storage, 0, 0).unwrap();
            let mma = tensor_core_convs(&p);
            // every fp16 conv with one group reads fp16 here: all of them go to tensor cores
            if half {
                assert!(mma > 0, "{}: no tensor-core convolution", model.name());
            } else {
                assert_eq!(mma, 0, "fp32 input never takes the tensor-core path");
            }
            let stages: Vec<usize> = p.launches.iter().map(|l| l.stage).collect();
            assert!(stages.windows(2).all(|w| w[0] <= w[1]), "launch order");
            let chain_stages = p.stat_chain_stages();
            for i in 0..spec.stage_count() {
                if p.gram_stages.contains(&i) {
                    // a 1x1 convolution, or its output's statistics, that the Gram moments of
                    // its input stand for
                    assert!(half, "{}: stage {i} by Gram moments in fp32", model.name());
                    assert!(
                        p.launches.iter().any(|l| l.kernel.finishes_gram()),
                        "{}: stage {i} left to Gram moments that do not run",
                        model.name()
                    );
                    continue;
                }
                if chain_stages.contains(&i) {
                    // an elementwise chain over statistics, run by an earlier Gram launch
                    assert!(
                        p.launches
                            .iter()
                            .any(|l| l.kernel.finishes_gram() && l.stage < i),
                        "{}: stage {i} left to a Gram launch that does not run before it",
                        model.name()
                    );
                    continue;
                }
                if p.folded_stages.contains(&i) {
                    // a Resize, layout Transpose or affine chain folded into the
                    // neighbouring stage's tensor-core convolution
                    assert!(half, "{}: stage {i} folded in fp32", model.name());
                    assert!(
                        p.launches
                            .iter()
                            .any(|l| (l.stage + 1 == i || l.stage == i + 1)
                                && matches!(
                                    l.kernel,
                                    gsttoonflow::cuda::neural::program::Kernel::ConvMma(..)
                                )),
                        "{}: stage {i} folded, but no neighbouring tensor-core conv",
                        model.name()
                    );
                    continue;
                }
                assert!(
                    stages.contains(&i),
                    "{}: stage {i} has no launch",
                    model.name()
                );
            }
            p.arena.validate().unwrap();
            let fp32 = gsttoonflow::cuda::neural::program::build(
                &spec,
                &Storage::uniform(spec.stage_count(), false),
                0,
                0,
            )
            .unwrap();
            if half {
                assert!(p.arena.arena_bytes < fp32.arena.arena_bytes);
            }
            println!(
                "{} {w}x{h} {}: {} stages, {} launches ({mma} tensor-core, {} stages folded), \
                 arena {} B, static {} B",
                model.name(),
                if half { "fp16" } else { "fp32" },
                spec.stage_count(),
                p.launches.len(),
                p.folded_stages.len(),
                p.arena.arena_bytes,
                p.static_bytes
            );
        }
    }
}

/// Elementwise stages write over an input that dies with them, a residual Add folded into the
/// convolution before it writes over its other addend (no GPU needed to plan): some stage
/// output shares its input's address, the plan still validates, and the real tiny at 1080p in
/// fp16 (when the fixture is here) peaks at two full-resolution 16-channel buffers (191 MiB,
/// three of them, before).
#[test]
fn elementwise_outputs_take_the_buffer_of_an_input_that_dies() {
    let spec = NeuralModel::from_bytes(&encode_model(&tiny_like()), "tiny_like")
        .unwrap()
        .specialise(96, 160)
        .unwrap();
    let p = gsttoonflow::cuda::neural::program::build(
        &spec,
        &Storage::uniform(spec.stage_count(), true),
        0,
        0,
    )
    .unwrap();
    p.arena.validate().unwrap();
    // the network's output follows the plan like any stage output; tiny_like's NHWC input
    // goes only through its first convolution's gather, which rounds it to fp16 anyway (in
    // an all-fp32 plan nothing is folded and the input stays fp32)
    use gsttoonflow::cuda::neural::program::Fusions;
    assert!(p.output.half, "an all-fp16 plan stores the output in fp32");
    assert_eq!(
        p.input.half,
        Fusions::from_env().half_input,
        "tiny_like's input"
    );
    let p32 = gsttoonflow::cuda::neural::program::build(
        &spec,
        &Storage::uniform(spec.stage_count(), false),
        0,
        0,
    )
    .unwrap();
    assert!(!p32.input.half && !p32.output.half, "an all-fp32 plan");
    let addrs: Vec<u64> = p.stage_outputs.iter().flatten().map(|o| o.addr).collect();
    let shared = (1..addrs.len()).any(|i| addrs[..i].contains(&addrs[i]));
    assert!(shared, "no stage output was written in place");
    let Some(tiny) = real_tiny() else {
        println!("the real AnimeGANv3 tiny fixture is not here: its 1080p plan not checked");
        return;
    };
    let spec = tiny.specialise(1088, 1920).unwrap();
    let p = gsttoonflow::cuda::neural::program::build(
        &spec,
        &Storage::uniform(spec.stage_count(), true),
        0,
        0,
    )
    .unwrap();
    p.arena.validate().unwrap();
    // its NHWC input goes only through the stem's gather, which rounds it to fp16 anyway
    assert_eq!(
        p.input.half,
        Fusions::from_env().half_input,
        "the real tiny's input"
    );
    let full = 1088 * 1920 * 16 * 2;
    let mib = p.arena.arena_bytes as f64 / 1048576.0;
    println!(
        "AnimeGANv3_tiny_Cute 1920x1088 fp16: arena {mib:.1} MiB ({} bytes, peak live {}), {} launches",
        p.arena.arena_bytes,
        p.arena.peak_live_bytes,
        p.launches.len()
    );
    // the U-Net's skips at its bottleneck (the full-resolution one, then 1/2, 1/4, 1/8 and
    // 1/16: 1.47 full-resolution buffers) and a little: the last full-resolution stages (one
    // buffer and the band lag, `convolutions_over_their_dying_input_run_in_bands`) beside the
    // fp16 output stay below it
    assert!(
        p.arena.arena_bytes <= full * 3 / 2 + full / 64,
        "arena {mib:.1} MiB"
    );
    assert!(p.launches.len() <= 40, "{} launches", p.launches.len());
}

/// A residual Add whose stage ends in an activation (a residual block's output: Add, then
/// LeakyRelu) folds into the convolution before it with that activation applied to the sum
/// (`NnConv::res_act`; no GPU needed to plan): the Add's stage launches nothing, the
/// convolution's activation code is LeakyRelu's with the model's alpha; in fp32 (no tensor
/// cores) the stage runs on its own. tiny_like has one such block; the real tiny (when here)
/// has two.
#[test]
fn residual_adds_fold_the_activation_after_them() {
    use gsttoonflow::cuda::neural::program::{Kernel, NnConv, build};
    let mut models = vec![(
        NeuralModel::from_bytes(&encode_model(&tiny_like()), "tiny_like").unwrap(),
        160,
        96,
        1,
    )];
    models.extend(real_tiny().map(|m| (m, 1920, 1088, 2)));
    for (model, w, h, want) in &models {
        let spec = model.specialise(*h, *w).unwrap();
        let l = spec.lowered();
        let p = build(&spec, &Storage::uniform(spec.stage_count(), true), 0, 0).unwrap();
        let mut folded = 0;
        for launch in &p.launches {
            if !matches!(launch.kernel, Kernel::ConvMma(..)) {
                continue;
            }
            let c: NnConv = params(&p, launch);
            if c.res_act == 0 {
                continue;
            }
            assert_ne!(
                c.res,
                0,
                "{}: an activation without a residual",
                model.name()
            );
            let add_stage = launch.stage + 1;
            let ops: Vec<&str> = l.stages[add_stage]
                .nodes
                .iter()
                .map(|n| n.op_type.as_str())
                .collect();
            assert_eq!(ops, ["Add", "LeakyRelu"], "{}", model.name());
            let alpha = l.stages[add_stage].nodes[1]
                .attr("alpha")
                .map_or(0.01, |a| a.f);
            assert_eq!((c.res_act, c.res_act_a), (2, alpha), "{}", model.name());
            assert!(
                p.launches.iter().all(|x| x.stage != add_stage),
                "{}: the folded Add's stage still launches",
                model.name()
            );
            folded += 1;
        }
        assert_eq!(folded, *want, "{}: residual blocks folded", model.name());
        // switched off, each of those stages launches its own chain again
        let off = Storage {
            fusions: Fusions {
                residual_act: false,
                ..Fusions::ALL
            },
            ..Storage::uniform(spec.stage_count(), true)
        };
        let p_off = build(&spec, &off, 0, 0).unwrap();
        assert!(p_off.launches.iter().all(|x| {
            !matches!(x.kernel, Kernel::ConvMma(..)) || params::<NnConv>(&p_off, x).res_act == 0
        }));
        assert_eq!(p_off.launches.len(), p.launches.len() + want);
        // fp32 storage: no tensor cores, nothing folded
        let p32 = build(&spec, &Storage::uniform(spec.stage_count(), false), 0, 0).unwrap();
        assert!(
            p32.launches
                .iter()
                .all(|x| !matches!(x.kernel, Kernel::ConvMma(..)))
        );
        println!(
            "{} {w}x{h}: {folded} residual blocks fold their LeakyRelu, {} launches (fp32 {})",
            model.name(),
            p.launches.len(),
            p32.launches.len()
        );
    }
}

/// Activations that only tensor-core convolutions write and read are stored channels-last, so
/// their gathers load 16 channels of a pixel in two 16-byte loads (no GPU needed to plan): on
/// both generated models some convolutions gather channels-last; every channels-last value has
/// a multiple of 16 channels; no instance normalization's application reads one (the
/// statistics kernels read both layouts); none in fp32. The 3-channel 7x7 stem packs its horizontal taps into K chunks.
#[test]
fn tensor_core_chains_store_channels_last() {
    use gsttoonflow::cuda::neural::program::{
        Kernel, MmaGather, build, conv_shared_bytes_rows, fixed_shape_matches,
    };
    let mut models: Vec<NeuralModel> = generated().into_iter().map(|m| m.0).collect();
    models.extend(real_tiny());
    for model in &models {
        let spec = model.specialise(96, 160).unwrap();
        for half in [true, false] {
            let p = build(&spec, &Storage::uniform(spec.stage_count(), half), 0, 0).unwrap();
            // tensor-core launches whose gather is one of `kinds`
            let count = |kinds: &[MmaGather]| {
                p.launches
                    .iter()
                    .filter(|l| matches!(l.kernel, Kernel::ConvMma(_, _, g) if kinds.contains(&g)))
                    .count()
            };
            use MmaGather::{
                ChannelsLast, ChannelsLast1x1, ChannelsLast3x3, ChannelsLast3x3Residual,
                ChannelsLast3x3Resize, ChannelsLast3x3S2, ChannelsLastPaired, TapPacked,
                TapPacked7x7,
            };
            let cl_convs = count(&[
                ChannelsLast,
                ChannelsLast1x1,
                ChannelsLast3x3,
                ChannelsLast3x3Resize,
                ChannelsLast3x3Residual,
                ChannelsLast3x3S2,
            ]);
            let compiled_3x3 = count(&[
                ChannelsLast3x3,
                ChannelsLast3x3Resize,
                ChannelsLast3x3Residual,
                ChannelsLast3x3S2,
            ]);
            let packed = count(&[TapPacked, TapPacked7x7]);
            let stem_7x7 = count(&[TapPacked7x7]);
            let paired = count(&[ChannelsLastPaired]);
            // a fixed-shape kernel runs only the shape it compiles in, with the shared memory
            // it touches
            for l in &p.launches {
                if let Kernel::ConvMma(_, nt, gather) = l.kernel {
                    let c: gsttoonflow::cuda::neural::program::NnConv = params(&p, l);
                    assert!(fixed_shape_matches(gather, &c, nt), "{:?}", l.kernel);
                    assert_eq!(
                        l.shared,
                        conv_shared_bytes_rows(
                            gather,
                            nt,
                            &c,
                            l.block.0 / 32 * gather.rows_per_warp()
                        )
                    );
                    // (the tall 7x7 blocks may take what the kernels are opted in to)
                    let most = if gather.tall() {
                        gsttoonflow::cuda::neural::program::TC_SHARED_OPT_IN
                    } else {
                        48 * 1024
                    };
                    assert!(l.shared <= most, "{:?}: {} bytes", l.kernel, l.shared);
                }
            }
            let cl_values: Vec<(usize, u32)> = p
                .stage_outputs
                .iter()
                .enumerate()
                .flat_map(|(i, o)| {
                    o.iter()
                        .filter_map(move |p| p.channels_last.map(|c| (i, c)))
                })
                .collect();
            println!(
                "{} fp{}: {cl_convs} channels-last gathers ({compiled_3x3} 3x3 with the shape \
                 compiled in, stride 1 or 2), {packed} tap-packed ({stem_7x7} 7x7 compiled), {paired} paired, {} channels-last stage outputs",
                model.name(),
                if half { 16 } else { 32 },
                cl_values.len()
            );
            if !half {
                assert_eq!(cl_convs + packed + paired + cl_values.len(), 0);
                continue;
            }
            // the 16 -> 3 output convolution over a channels-last input pairs its taps; the
            // 3x3 layers over channels-last inputs and the 7x7 stem over 3 channels take their
            // compiled shapes (unless switched off for a comparison)
            let name = model.name();
            if ["tiny_16", "hayao_32"].contains(&name) || name.starts_with("AnimeGANv3_tiny") {
                let Fusions {
                    paired: pairs,
                    fixed_shapes: fixed,
                    ..
                } = Fusions::from_env();
                assert_eq!(
                    paired, pairs as usize,
                    "{name}: the output convolution's pairing"
                );
                assert_eq!(compiled_3x3 > 0, fixed, "{name}: the compiled 3x3");
                assert_eq!(stem_7x7, fixed as usize, "{name}: the compiled stem");
            }
            assert!(cl_convs > 0, "{}: no channels-last gather", model.name());
            // the 3-channel stem packs its taps (and the generated models' few-channel layers)
            assert!(packed >= 1, "{}: the stem's taps not packed", model.name());
            for &(_, c) in &cl_values {
                assert_eq!(c % 16, 0);
            }
            // the statistics kernels read channels-last tensors, and an instance
            // normalization's application reads its input in the layout it was stored in
            let l = spec.lowered();
            for (j, s) in l.stages.iter().enumerate() {
                let Some(x) = s.stats.as_ref().filter(|st| st.instance.is_some()) else {
                    continue;
                };
                let producer = l.stages.iter().position(|p| p.outputs.contains(&x.input));
                let Some(i) = producer else { continue };
                let stored = p.stage_outputs[i]
                    .iter()
                    .zip(&l.stages[i].outputs)
                    .find(|(_, v)| **v == x.input)
                    .and_then(|(place, _)| place.channels_last)
                    .map_or(0, |c| c as i32);
                let apply = p
                    .launches
                    .iter()
                    .find(|a| a.stage == j && a.kernel == Kernel::NormApply)
                    .expect("an instance normalization's application");
                let read: gsttoonflow::cuda::neural::program::NnNormApply = params(&p, apply);
                assert_eq!(
                    read.x_cl,
                    stored,
                    "{}: stage {j} reads stage {i}",
                    model.name()
                );
                if !Fusions::from_env().instance_cl {
                    assert_eq!(stored, 0, "{}: stage {i} channels-last", model.name());
                }
            }
        }
    }
}

/// A stride-1 convolution whose channels-last input dies at it runs in row bands, writing its
/// output over the input's buffer (no GPU needed to plan). On tiny_16 at 256x192 in fp16: one
/// stage takes BANDS launches whose first rows step by the band height and cover the output;
/// its output sits lag rows before its input in one buffer; the arena holds less than the two
/// full-resolution tensors it would need side by side, and validates. The Gram moments read
/// their 16 channels channels-last and the modulated normalization's chain takes the
/// per-channel affine path over channels-last.
#[test]
fn convolutions_over_their_dying_input_run_in_bands() {
    use gsttoonflow::cuda::neural::program::{
        BANDS, Kernel, NnConv, NnEltwise, NnMomentsGram, TC_ROWS, band_geometry, build,
    };
    let spec = tiny_16().specialise(192, 256).unwrap();
    let p = build(&spec, &Storage::uniform(spec.stage_count(), true), 0, 0).unwrap();
    p.arena.validate().unwrap();
    let mut per_stage: std::collections::HashMap<usize, Vec<NnConv>> = Default::default();
    for l in p
        .launches
        .iter()
        .filter(|l| matches!(l.kernel, Kernel::ConvMma(..)))
    {
        per_stage
            .entry(l.stage)
            .or_default()
            .push(params::<NnConv>(&p, l));
    }
    let banded: Vec<(&usize, &Vec<NnConv>)> =
        per_stage.iter().filter(|(_, v)| v.len() > 1).collect();
    assert_eq!(
        banded.len(),
        1,
        "banded stages: {:?}",
        banded.iter().map(|b| b.0).collect::<Vec<_>>()
    );
    let (stage, convs) = banded[0];
    let (rows, count, lag) = band_geometry(192, 3, 1, BANDS).unwrap();
    assert_eq!((convs.len(), count), (BANDS.min(count), count));
    assert_eq!(rows % TC_ROWS as usize, 0);
    // bottom band first
    for (k, c) in convs.iter().rev().enumerate() {
        assert_eq!(c.row0 as usize, k * rows);
        assert_eq!(
            (c.oh, c.ow, c.cin, c.cout, c.x_cs, c.y_cs),
            (192, 256, 16, 16, 1, 1)
        );
        // the output lag rows after the input, in one buffer
        assert_eq!(c.y - c.x, (lag * 256 * 16 * 2) as u64, "stage {stage}");
    }
    assert!(convs.first().unwrap().row0 as usize + rows >= 192);
    let full = 192 * 256 * 16 * 2;
    println!(
        "tiny_16 256x192 fp16: stage {stage} in {} bands of {rows} rows, lag {lag}; arena {} B, \
         {} launches",
        convs.len(),
        p.arena.arena_bytes,
        p.launches.len()
    );
    assert!(p.arena.arena_bytes < 2 * full);
    let grams: Vec<NnMomentsGram> = p
        .launches
        .iter()
        .filter(|l| l.kernel == Kernel::MomentsGram)
        .map(|l| params::<NnMomentsGram>(&p, l))
        .collect();
    assert_eq!(grams.len(), 1);
    assert_eq!((grams[0].c, grams[0].cl), (16, 1));
    // the modulated normalization's chain: per channel over channels-last, taken into the
    // output convolution's gather (TOONFLOW_NEURAL_PROLOGUE=0: its own launch)
    let last_axis: Vec<(NnEltwise, bool)> = elementwise_chains(&p)
        .into_iter()
        .filter(|(e, _)| e.affine_last != 0)
        .collect();
    assert_eq!(last_axis.len(), 1);
    assert_eq!(last_axis[0].0.dims, [1, 192, 256, 16]);
    assert_eq!(last_axis[0].1, Fusions::from_env().prologue);
}

/// The statistics kernel reads channels-last tensors 8 channels a pixel (no GPU needed to plan):
/// on hayao_class in fp16 (whose normalizations of 64 to 256 channels are too wide for the Gram
/// moments) some statistics launches read channels-last, with a grid row per 8 channels; in
/// fp32 none.
#[test]
fn statistics_read_channels_last_tensors() {
    use gsttoonflow::cuda::neural::program::{Kernel, NnMoments, build};
    let spec = hayao_class().specialise(72, 96).unwrap();
    for half in [true, false] {
        let p = build(&spec, &Storage::uniform(spec.stage_count(), half), 0, 0).unwrap();
        let moments: Vec<(NnMoments, u32)> = p
            .launches
            .iter()
            .filter(|l| l.kernel == Kernel::Moments)
            .map(|l| (params::<NnMoments>(&p, l), l.grid.1))
            .collect();
        let cl: Vec<&(NnMoments, u32)> = moments.iter().filter(|m| m.0.x_cl != 0).collect();
        println!(
            "hayao_class fp{}: {} of {} statistics launches read channels-last",
            if half { 16 } else { 32 },
            cl.len(),
            moments.len()
        );
        if !half {
            assert!(cl.is_empty());
            continue;
        }
        assert!(!cl.is_empty());
        for (m, rows) in cl {
            assert_eq!(m.x_cl % 16, 0);
            assert_eq!(*rows, m.x_cl as u32 / 8);
        }
    }
}

/// The element computes the stem a second time for its last reader where that shrinks the fp16
/// arena by a tenth or more (no GPU needed to plan): hayao_class at 1080p, whose 32-channel
/// full-resolution stem output would otherwise live across the whole network, then fits the
/// issue's 300 MB with its output ring (24.9 MB), NV12 planes (6.2 MB) and static block (5 MB).
/// The tiny layout's 16-channel stem pays only where the stem gathers the NV12 frame itself
/// (`Storage::frame_input`): with an input tensor, that tensor would live until the copy.
#[test]
fn the_stem_is_recomputed_where_the_arena_shrinks() {
    use gsttoonflow::cuda::neural::with_recomputed_stem;
    let spec = hayao_class().specialise(1080, 1920).unwrap();
    for frame_input in [false, true] {
        let (r, before, after) = with_recomputed_stem(&spec, frame_input, true)
            .expect("hayao_class recomputes its stem");
        println!(
            "hayao_class 1920x1080, NV12 gathered {frame_input}: fp16 arena {before} -> {after} \
             B ({} -> {} stages)",
            spec.stage_count(),
            r.stage_count()
        );
        assert!(after * 10 <= before * 9);
        assert!(after + 37_000_000 <= 300_000_000, "{after} B");
    }
    let mut tiny = vec![(tiny_16(), 1920, 1088)];
    tiny.extend(real_tiny().map(|m| (m, 1920, 1088)));
    for (model, w, h) in tiny {
        let spec = model.specialise(h, w).unwrap();
        assert!(
            with_recomputed_stem(&spec, false, true).is_none(),
            "{}: the 16-channel stem recomputed beside an input tensor",
            model.name()
        );
        // without tensor cores (pre-sm_80) the stem never gathers the frame: the copy would
        // keep an input tensor alive, as above
        assert!(
            with_recomputed_stem(&spec, true, false).is_none(),
            "{}: the stem recomputed on a device without tensor cores",
            model.name()
        );
        let (_, before, after) = with_recomputed_stem(&spec, true, true)
            .unwrap_or_else(|| panic!("{}: the stem not recomputed", model.name()));
        println!(
            "{} {w}x{h}, NV12 gathered: fp16 arena {before} -> {after} B",
            model.name()
        );
        assert!(after * 10 <= before * 9);
    }
}

/// Where the element's frame path feeds the network (`Storage::frame_input`), the stem gathers
/// its input from the NV12 frame itself (no GPU needed to plan): every launch reading the input
/// (the stem, and its recomputed copy) has a frame field to point at the frame path's block, the
/// input takes no arena buffer, and the network's first launches up to the last of them read
/// the planes. Not where the stem is not a tap-packed tensor-core convolution of the fp16 input
/// (fp32 storage, no tensor cores, NCHW input), or `frame_input` is off. The real tiny at
/// 1920x1088 (when the fixture is here) then plans within the issue's 120 MB with its output
/// ring (24.9 MB), NV12 planes (6.2 MB) and static block (3.5 MB).
#[test]
fn the_stem_gathers_the_nv12_frame_where_it_can() {
    use gsttoonflow::cuda::neural::program::build;
    use gsttoonflow::cuda::neural::with_recomputed_stem;
    let mut cases = vec![
        (tiny_16(), 1920, 1088),
        (hayao_class(), 1920, 1080),
        (hayao_class(), 256, 144),
    ];
    cases.extend(real_tiny().map(|m| (m, 1920, 1088)));
    for (model, w, h) in cases {
        let spec = model.specialise(h, w).unwrap();
        let storage = Storage::uniform(spec.stage_count(), true);
        let plain = build(&spec, &storage, 0, 0).unwrap();
        assert!(!plain.frame_fed() && plain.frame_reading_launches() == 0);
        let fed = build(&spec, &storage.clone().with_frame_input(true), 0, 0).unwrap();
        assert!(
            fed.frame_fed(),
            "{}: the stem does not gather the frame",
            model.name()
        );
        assert_eq!(fed.frame_fields.len(), fed.input_launches.len());
        assert_eq!(fed.input_launches, plain.input_launches);
        assert_eq!(fed.frame_reading_launches(), fed.input_launches[0] + 1);
        assert!(
            !fed.arena
                .buffers
                .iter()
                .any(|b| b.name == spec.lowered().input)
        );
        assert!(
            plain
                .arena
                .buffers
                .iter()
                .any(|b| b.name == spec.lowered().input)
        );
        assert_eq!(fed.input.addr, 0);
        fed.arena.validate().unwrap();
        println!(
            "{} {w}x{h}: arena {} -> {} B with the NV12 gather, {} launches",
            model.name(),
            plain.arena.arena_bytes,
            fed.arena.arena_bytes,
            fed.launches.len()
        );
        // its recomputed copy reads the frame too, the last reader near the end
        if let Some((r, _, after)) = with_recomputed_stem(&spec, true, true) {
            let storage = Storage::uniform(r.stage_count(), true).with_frame_input(true);
            let p = build(&r, &storage, 0, 0).unwrap();
            assert_eq!(p.frame_fields.len(), 2, "{}", model.name());
            assert_eq!(p.arena.arena_bytes, after);
            assert!(p.frame_reading_launches() > p.launches.len() / 2);
            if model.name().contains("tiny_Cute") {
                let element = after + p.static_bytes + 24_883_200 + 6_266_880;
                println!(
                    "the real tiny at 1920x1088: {element} B planned with the ring and planes"
                );
                assert!(element <= 120_000_000, "{element} B");
            }
        }
        // fp32 storage, CUDA cores, frame_input off: the input tensor
        let fp32 = Storage::uniform(spec.stage_count(), false).with_frame_input(true);
        assert!(!build(&spec, &fp32, 0, 0).unwrap().frame_fed());
        let cuda_cores = Storage {
            tensor_cores: false,
            ..storage.clone().with_frame_input(true)
        };
        assert!(!build(&spec, &cuda_cores, 0, 0).unwrap().frame_fed());
    }
    // an NCHW network reads its input without the NHWC gather
    let spec = offset_convs().specialise(48, 64).unwrap();
    let storage = Storage::uniform(spec.stage_count(), true).with_frame_input(true);
    assert!(!build(&spec, &storage, 0, 0).unwrap().frame_fed());
}

/// The recomputed stem on the GPU: the same output bits as the network that keeps the stem's
/// output (the copy computes the same fp16 values; its two readers of the fp16 input, the last
/// full-resolution 3x3 in bands where the plan takes them), fp16 with every fusion, on a photo:
/// hayao_class at 1920x1080 (the element's case: bands and 32-channel Gram moments) and at
/// 256x144, hayao_32 at 256x192.
#[test]
fn the_recomputed_stem_gives_the_same_bits_on_the_gpu() {
    need_gpu!();
    for (model, w, h) in [
        (hayao_class(), 1920, 1080),
        (hayao_class(), 256, 144),
        (hayao_32(), 256, 192),
    ] {
        let input = photo_tensor(&model, "chelsea.png", w, h);
        let spec = model.specialise(h, w).unwrap();
        let recomputed = spec.recomputed_stem().expect("a recomputable stem");
        let mut kept = gpu_with(&spec, true, false, true, Fusions::ALL);
        let mut again = gpu_with(&recomputed, true, false, true, Fusions::ALL);
        let (a, b) = (run_gpu(&mut kept, &input), run_gpu(&mut again, &input));
        println!(
            "{} {w}x{h} fp16: arena {} -> {} B, {} -> {} launches",
            model.name(),
            kept.program().arena.arena_bytes,
            again.program().arena.arena_bytes,
            kept.launches_per_frame(),
            again.launches_per_frame()
        );
        assert_same_bits(&a, &b, &format!("{}: recomputing the stem", model.name()));
    }
}

/// The Gram moments of 32 channels (three pairs of 16-channel tiles, over channels-last
/// tensors) against the 1x1 convolution and the statistics pass they stand for, on a photo:
/// hayao_32 and hayao_class in fp16, each against the CPU reference, with and without them. The
/// Gram moments read exact products of the stored halves (no fp16 rounding of the convolution's
/// output), so they must be as close to the reference as the pass they replace.
#[test]
fn gram_moments_of_32_channels_match_the_pass_they_replace() {
    need_gpu!();
    for (model, w, h) in [(hayao_32(), 256, 192), (hayao_class(), 256, 144)] {
        let input = photo_tensor(&model, "chelsea.png", w, h);
        let spec = model.specialise(h, w).unwrap();
        let cpu = spec.run(&input, None).unwrap();
        let off = Fusions {
            gram: false,
            ..Fusions::ALL
        };
        let (on, without) = run_with_and_without(&spec, &input, off);
        let g = gpu_with(&spec, true, false, true, Fusions::ALL);
        let grams = g
            .program()
            .launches
            .iter()
            .filter(|l| l.kernel == Kernel::MomentsGram && l.grid.1 == 3)
            .count();
        let (p_on, p_off, between) = (psnr(&cpu, &on), psnr(&cpu, &without), psnr(&on, &without));
        println!(
            "{} {w}x{h} fp16: {grams} Gram launches of 32 channels; PSNR vs the CPU reference \
             {p_on:.1} dB with them, {p_off:.1} dB without; {between:.1} dB between",
            model.name()
        );
        assert!(grams >= 1, "{}: no 32-channel Gram moments", model.name());
        assert!(p_on >= 40.0, "{}: {p_on:.1} dB", model.name());
        assert!(
            p_on >= p_off - 1.0,
            "{}: {p_on:.1} dB against {p_off:.1}",
            model.name()
        );
        assert!(between >= 45.0, "{}: {between:.1} dB between", model.name());
    }
}

/// The wide Gram moments (64 to 256 channels: pairs of 64-channel tiles summed in chunks of
/// the pixels, reduced and finished by two more launches) against the 1x1 convolutions and
/// statistics passes they stand for, on a photo, in fp16: hayao_class at two sizes (chunks of
/// one 64-pixel step and of several, a last step cut short): every normalization's statistics
/// with them against those without and against the CPU reference's, the same bits from a
/// second run, and the output against the CPU reference. (Part tiles, hayao_96_192's 96
/// channels, stay on the passes until this test has run them on a GPU.)
#[test]
fn wide_gram_moments_match_the_pass_they_replace() {
    need_gpu!();
    for (model, w, h) in [(hayao_class(), 256, 144), (hayao_class(), 640, 360)] {
        let name = model.name().to_string();
        let input = photo_tensor(&model, "chelsea.png", w, h);
        let spec = model.specialise(h, w).unwrap();
        // the CPU reference's output and its statistics (by normalize index), in one run
        let mut cpu_stats: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        let mut hook = |k: usize, m: &mut [f32], v: &mut [f32]| {
            if cpu_stats.len() <= k {
                cpu_stats.resize(k + 1, (Vec::new(), Vec::new()));
            }
            cpu_stats[k] = (m.to_vec(), v.to_vec());
        };
        let cpu = spec.run(&input, Some(&mut hook)).unwrap();
        let off = Fusions {
            gram_wide: false,
            ..Fusions::ALL
        };
        let observe = |fusions: Fusions| {
            // (the same plan at static base 0, whose parameter blocks the test can read)
            let plan = fp16_plan(&spec, fusions);
            let wide: Vec<(i32, i32)> = plan
                .launches
                .iter()
                .filter(|l| l.kernel == Kernel::GramWide)
                .map(|l| {
                    let p: gsttoonflow::cuda::neural::program::NnMomentsGram = params(&plan, l);
                    (p.c, p.cl)
                })
                .collect();
            let mut g = gpu_with(&spec, true, false, true, fusions);
            // (the program the GPU runs: a card without tensor cores plans no Gram moments)
            let launched = g
                .program()
                .launches
                .iter()
                .filter(|l| l.kernel == Kernel::GramWide)
                .count();
            assert_eq!(launched, wide.len(), "{name} {w}x{h}: the GPU's program");
            let mut out = Tensor::zeros(&input.shape);
            let mut stats: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
            g.run_observed(&input, &mut out, &mut |_, _| {}, &mut |k, m, v| {
                if stats.len() <= k {
                    stats.resize(k + 1, (Vec::new(), Vec::new()));
                }
                stats[k] = (m.to_vec(), v.to_vec());
            })
            .unwrap();
            (out, stats, wide)
        };
        let (on, s_on, wide) = observe(Fusions::ALL);
        let (_, s_again, _) = observe(Fusions::ALL);
        let (without, s_off, none) = observe(off);
        println!("{name} {w}x{h}: wide Gram moments (channels, channels-last) {wide:?}");
        assert_eq!(
            (wide.len(), none.len()),
            (7, 0),
            "{name} {w}x{h}: wide Gram launches"
        );
        let same_bits =
            |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        for (k, ((m1, v1), (m2, v2))) in s_on.iter().zip(&s_again).enumerate() {
            assert!(
                same_bits(m1, m2) && same_bits(v1, v2),
                "{name} {w}x{h} statistics {k}: a second run differs"
            );
        }
        assert_eq!(s_on.len(), s_off.len());
        // Both paths round to fp16 relative to the values' magnitude, not their spread, and
        // differ by more than that: the convolution they replace multiplies by fp16 weights
        // (256 products of either sign summing to a small mean carry their rounding: up to
        // 0.8 % of a statistic's magnitude in f32 on the CPU, tests/neural_precision.rs; 0.55 %
        // seen on an H100), the Gram moments by the fp32 ones. So each
        // statistic is compared in units of sqrt(mean^2 + variance) of the pass it replaces
        // (mean, and the standard deviation), within 2 % (a fault in the pass is far off),
        // and both with the CPU reference's fp32 statistics, where the wide Gram moments must
        // be about as close as the passes they replace.
        let err = common::statistic_apart;
        // each statistics place's normalize index (the CPU hook's first argument)
        let order: Vec<usize> = fp16_plan(&spec, Fusions::ALL)
            .stats
            .iter()
            .map(|sp| {
                spec.lowered().stages[sp.stage]
                    .stats
                    .as_ref()
                    .unwrap()
                    .index
            })
            .collect();
        assert_eq!(
            cpu_stats.len(),
            s_on.len(),
            "{name} {w}x{h}: the CPU's statistics"
        );
        let (mut worst, mut worst_at) = (0.0f64, (0, 0));
        let (mut sq_on, mut sq_off, mut max_on, mut max_off, mut n) = (0.0, 0.0, 0.0f64, 0.0f64, 0);
        for (k, ((m1, v1), (m0, v0))) in s_on.iter().zip(&s_off).enumerate() {
            let (mc, vc) = &cpu_stats[order[k]];
            assert_eq!(m1.len(), m0.len(), "statistics {k}");
            assert_eq!(
                m1.len(),
                mc.len(),
                "statistics {k} against the CPU's {}",
                order[k]
            );
            for c in 0..m1.len() {
                let d = err((m1[c], v1[c]), (m0[c], v0[c]));
                assert!(
                    d <= 2e-2,
                    "{name} {w}x{h} statistics {k} channel {c}: mean {} against {}, variance {} \
                     against {} ({d:.1e} of their magnitude)",
                    m1[c],
                    m0[c],
                    v1[c],
                    v0[c]
                );
                if d > worst {
                    (worst, worst_at) = (d, (k, c));
                }
                let (e_on, e_off) = (
                    err((m1[c], v1[c]), (mc[c], vc[c])),
                    err((m0[c], v0[c]), (mc[c], vc[c])),
                );
                sq_on += e_on * e_on;
                sq_off += e_off * e_off;
                max_on = max_on.max(e_on);
                max_off = max_off.max(e_off);
                n += 1;
            }
        }
        let (rms_on, rms_off) = ((sq_on / n as f64).sqrt(), (sq_off / n as f64).sqrt());
        let (k, c) = worst_at;
        println!(
            "{name} {w}x{h}: statistics against the passes they replace within {worst:.1e} of \
             their magnitude (worst: statistics {k} channel {c}, mean {} against {}, CPU {}); \
             against the CPU reference's, {n} channels: rms {rms_on:.1e} (max {max_on:.1e}) \
             with the wide Gram moments, rms {rms_off:.1e} (max {max_off:.1e}) without",
            s_on[k].0[c], s_off[k].0[c], cpu_stats[order[k]].0[c]
        );
        assert!(
            rms_on <= 1.5 * rms_off + 1e-3 && max_on <= 2.0 * max_off + 2e-3,
            "{name} {w}x{h}: the wide Gram moments' statistics are further from the CPU \
             reference's than the passes they replace"
        );
        let (p_on, p_off, between) = (psnr(&cpu, &on), psnr(&cpu, &without), psnr(&on, &without));
        println!(
            "{name} {w}x{h} fp16: {} wide Gram moments; statistics against the passes \
             they replace; PSNR vs the CPU reference {p_on:.1} dB with them, {p_off:.1} dB \
             without; {between:.1} dB between",
            wide.len()
        );
        // (fp16 variants of one network land within a few dB of each other at this level:
        // on an H100 70.3 against 69.7 dB at 256x144 and 66.7 against 68.7 at 640x360, with
        // statistics closer to the reference's; tiny_16 73.9 and 71.8 dB with and without
        // tensor cores in fp16_storage_keeps_40_db_on_photos)
        assert!(p_on >= 40.0, "{name} {w}x{h}: {p_on:.1} dB");
        assert!(
            p_on >= p_off - 3.0,
            "{name} {w}x{h}: {p_on:.1} dB against {p_off:.1}"
        );
        assert!(between >= 45.0, "{name} {w}x{h}: {between:.1} dB between");
    }
}

/// Each self-modulated normalization (a tensor normalized by its own statistics and re-scaled
/// by those of a 1x1 convolution of it) takes one Gram moments launch in fp16 (no GPU needed
/// to plan): the convolution and the statistics pass over its output are gone, its output is
/// not stored, and the arena is no larger. In fp32 (or without tensor cores) nothing changes.
/// tiny_like has one (4 channels), hayao_like eight (4 to 16 channels), hayao_32 eight (16 and
/// 32 channels: a 32-channel one sums three pairs of 16-channel tiles), hayao_class eight (its
/// last of 32 channels in one launch, seven of 64 to 256 in the three wide launches, which sum
/// pairs of 64-channel tiles; with `gram_wide` off only the one), hayao_96_192 six (its 16
/// channels in one launch, its five of 192 channels, three whole tiles, in the wide launches;
/// its two of 96 would need a part tile and stay on the passes); the real tiny one of 16
/// channels at full resolution, when the fixture is here.
#[test]
fn modulated_normalizations_take_gram_moments() {
    use gsttoonflow::cuda::neural::program::{NnEltwise, NnMomentsGram, build};
    let mut models: Vec<(NeuralModel, usize)> = vec![
        (
            NeuralModel::from_bytes(&encode_model(&tiny_like()), "tiny_like").unwrap(),
            1,
        ),
        (
            NeuralModel::from_bytes(&encode_model(&hayao_like()), "hayao_like").unwrap(),
            8,
        ),
        (hayao_32(), 8),
        (hayao_class(), 8),
        (hayao_96_192(), 6),
    ];
    models.extend(real_tiny().map(|m| (m, 1)));
    let spec = hayao_class().specialise(96, 160).unwrap();
    let narrow = fp16_plan(
        &spec,
        Fusions {
            gram_wide: false,
            ..Fusions::from_env()
        },
    );
    let wide = fp16_plan(&spec, Fusions::from_env());
    let finishes = |p: &gsttoonflow::cuda::neural::program::Program| {
        p.launches
            .iter()
            .filter(|l| l.kernel.finishes_gram())
            .count()
    };
    assert_eq!((finishes(&narrow), finishes(&wide)), (1, 8));
    // each wide one: three launches for a 1x1 convolution, two statistics passes and two chains
    assert_eq!(wide.launches.len() + 7 * (5 - 3), narrow.launches.len());
    for (model, expected) in &models {
        let spec = model.specialise(96, 160).unwrap();
        let count = |p: &gsttoonflow::cuda::neural::program::Program, k: Kernel| {
            p.launches.iter().filter(|l| l.kernel == k).count()
        };
        let fp16 = build(&spec, &Storage::uniform(spec.stage_count(), true), 0, 0).unwrap();
        let no_mma = build(
            &spec,
            &Storage {
                half: vec![true; spec.stage_count()],
                tensor_cores: false,
                fusions: Fusions::from_env(),
                split: Vec::new(),
                frame_input: false,
            },
            0,
            0,
        )
        .unwrap();
        let fp32 = build(&spec, &Storage::uniform(spec.stage_count(), false), 0, 0).unwrap();
        let grams = fp16
            .launches
            .iter()
            .filter(|l| l.kernel.finishes_gram())
            .count();
        println!(
            "{}: {grams} Gram moments; fp16 {} launches ({} moments), without them {} ({}); \
             arena {} B against {} B",
            model.name(),
            fp16.launches.len(),
            count(&fp16, Kernel::Moments),
            no_mma.launches.len(),
            count(&no_mma, Kernel::Moments),
            fp16.arena.arena_bytes,
            no_mma.arena.arena_bytes,
        );
        assert_eq!(grams, *expected, "{}", model.name());
        assert_eq!(fp16.gram_stages.len(), 2 * grams);
        // a row of blocks for each pair of 16-channel tiles
        for x in fp16
            .launches
            .iter()
            .filter(|x| x.kernel == Kernel::MomentsGram)
        {
            let c = params::<NnMomentsGram>(&fp16, x).c as usize;
            let pairs = if c > 16 { 3 } else { 1 };
            assert_eq!(x.grid.1, pairs, "{}: {c} channels", model.name());
        }
        // the wide ones: a row of blocks for each pair of 64-channel tiles, then their
        // reduction and the finishing, in that order at one stage
        for (k, x) in fp16.launches.iter().enumerate() {
            if x.kernel != Kernel::GramWide {
                continue;
            }
            let g = params::<NnMomentsGram>(&fp16, x);
            let tiles = (g.c as u32).div_ceil(64);
            assert!(g.c > 32 && g.c <= 256 && g.gram != 0, "{}", model.name());
            assert_eq!(x.grid, (g.chunks as u32, tiles * (tiles + 1) / 2, 1));
            let next: Vec<Kernel> = fp16.launches[k + 1..k + 3]
                .iter()
                .map(|l| l.kernel)
                .collect();
            assert_eq!(next, [Kernel::GramWideReduce, Kernel::GramWideFinish]);
            // a reducing block for 32 entries of the pairs' sums, a finishing block for four
            // of the convolution's outputs
            let entries = tiles * (tiles + 1) / 2 * 4160;
            assert_eq!(fp16.launches[k + 1].grid, (entries.div_ceil(32), 1, 1));
            assert_eq!(
                fp16.launches[k + 2].grid,
                ((g.cout as u32).div_ceil(4), 1, 1)
            );
            assert!(fp16.launches[k..k + 3].iter().all(|l| l.stage == x.stage));
        }
        // the normalizations' sqrt(var + eps) chains are finished by the Gram launch's last
        // block: no launch of their own, each in one Gram launch's tail, and with the fusion
        // off they launch again
        let chains = fp16.stat_chain_stages().len();
        let tails: Vec<u64> = fp16
            .launches
            .iter()
            .filter(|x| x.kernel.finishes_gram())
            .flat_map(|x| params::<NnMomentsGram>(&fp16, x).tail)
            .filter(|&t| t != 0)
            .collect();
        assert_eq!(tails.len(), chains, "{}", model.name());
        assert_eq!(
            chains,
            2 * grams,
            "{}: x's and the convolution's",
            model.name()
        );
        for i in fp16.stat_chain_stages() {
            assert!(fp16.launches.iter().all(|x| x.stage != i));
            assert_eq!(
                fp16.stage_outputs[i].len(),
                1,
                "stage {i} stores its output"
            );
            // the parameter block a tail points at writes that output
            let y = fp16.stage_outputs[i][0].addr;
            assert!(tails.iter().any(|&t| {
                let at = t as usize;
                let e: NnEltwise = bytemuck::pod_read_unaligned(
                    &fp16.static_init[at..at + std::mem::size_of::<NnEltwise>()],
                );
                e.y == y
            }));
        }
        let unchained = fp16_plan(
            &spec,
            Fusions {
                stat_chains: false,
                ..Fusions::from_env()
            },
        );
        assert!(unchained.stat_chains.is_empty());
        assert_eq!(unchained.launches.len(), fp16.launches.len() + chains);
        for k in [Kernel::MomentsGram, Kernel::GramWide] {
            assert_eq!(count(&no_mma, k) + count(&fp32, k), 0);
        }
        // each takes the place of two statistics passes (the tensor's and the convolution's)
        // and the convolution
        assert_eq!(
            count(&fp16, Kernel::Moments) + 2 * grams,
            count(&no_mma, Kernel::Moments),
            "{}",
            model.name()
        );
        let l = spec.lowered();
        for &i in &fp16.gram_stages {
            assert!(fp16.launches.iter().all(|x| x.stage != i));
            let s = &l.stages[i];
            if s.stats.is_none() {
                assert!(s.nodes.last().is_some_and(|n| n.op_type == "Conv"));
                assert!(
                    fp16.stage_outputs[i].is_empty(),
                    "conv stage {i} stores its output"
                );
            }
        }
        assert!(fp16.arena.arena_bytes <= no_mma.arena.arena_bytes);
        fp16.arena.validate().unwrap();
    }
}

/// The normalizations' elementwise chains take nn_eltwise's affine path, or go into the next
/// convolution's gather when they are per channel over its channels-last input (no GPU needed
/// to plan).
#[test]
fn normalization_chains_take_the_affine_path() {
    let mut models = vec![
        NeuralModel::from_bytes(&encode_model(&hayao_like()), "hayao_like").unwrap(),
        NeuralModel::from_bytes(&encode_model(&tiny_like()), "tiny_like").unwrap(),
    ];
    models.extend(real_tiny());
    for model in &models {
        let spec = model.specialise(96, 160).unwrap();
        let p = gsttoonflow::cuda::neural::program::build(
            &spec,
            &Storage::uniform(spec.stage_count(), true),
            0,
            0,
        )
        .unwrap();
        let chains: Vec<(i32, i32, bool)> = elementwise_chains(&p)
            .into_iter()
            .map(|(e, folded)| (e.affine_x, e.n_ops, folded))
            .collect();
        let affine = chains.iter().filter(|c| c.0 >= 0).count();
        let folded = chains.iter().filter(|c| c.2).count();
        println!(
            "{}: {affine} of {} elementwise chains affine, {folded} of them in a convolution's \
             gather (ops per chain {:?})",
            model.name(),
            chains.len(),
            chains.iter().map(|c| c.1).collect::<Vec<_>>()
        );
        // a chain is taken into a gather only when it is affine; the real tiny's modulated
        // normalization before its output convolution is
        assert!(chains.iter().all(|c| !c.2 || c.0 >= 0));
        if model.name().starts_with("AnimeGANv3_tiny") && Fusions::from_env().prologue {
            assert_eq!(folded, 1, "{}", model.name());
        }
        if model.name() != "tiny_like" {
            assert!(affine > 0, "{}: no affine chain", model.name());
        }
    }
}

/// A chain taken into a convolution's gather is read by every block of that convolution (each
/// works out the coefficients from the chain's operands): no operand of it may sit where the
/// convolution writes its output, or a late block reads what an early one wrote. The arena at
/// a base far from the static block's, so that an operand's address says where it lives (no GPU
/// needed to plan).
#[test]
fn folded_chains_operands_outlive_their_convolution() {
    use gsttoonflow::cuda::neural::program::{NnConv, NnEltwise, build};
    const ARENA: u64 = 1 << 40;
    let mut models: Vec<(NeuralModel, usize, usize)> = generated();
    models.extend(real_tiny().map(|m| (m, 320, 192)));
    let mut folded = 0;
    for (model, w, h) in &models {
        let spec = model.specialise(*h, *w).unwrap();
        let storage = Storage {
            fusions: Fusions::ALL,
            ..Storage::uniform(spec.stage_count(), true)
        };
        let p = build(&spec, &storage, ARENA, 0).unwrap();
        p.arena.validate().unwrap();
        for l in &p.launches {
            let Kernel::ConvMma(half, ..) = l.kernel else {
                continue;
            };
            let c: NnConv = params(&p, l);
            if c.pre == 0 {
                continue;
            }
            folded += (c.row0 == 0) as usize;
            let at = c.pre as usize;
            let chain: NnEltwise =
                bytemuck::pod_read_unaligned(&p.static_init[at..at + size_of::<NnEltwise>()]);
            // the whole output, whichever band this launch writes
            let bytes = (c.oh * c.ow * c.cout) as u64 * if half { 2 } else { 4 };
            let written = c.y..c.y + bytes;
            for (k, &operand) in chain.operand.iter().enumerate() {
                if k as i32 == chain.affine_x || operand < ARENA {
                    continue;
                }
                let dims = chain.dims.iter().map(|&d| d.max(1) as u64);
                let strides = &chain.strides[4 * k..4 * k + 4];
                let last = dims
                    .zip(strides)
                    .map(|(d, &s)| (d - 1) * s.max(0) as u64)
                    .sum::<u64>();
                let end = operand + (last + 1) * if chain.operand_half[k] != 0 { 2 } else { 4 };
                assert!(
                    end <= written.start || operand >= written.end,
                    "{}: operand {k} of the chain in the convolution at {:#x} ({:#x}..{:#x}) \
                     lies in its output ({:#x}..{:#x})",
                    model.name(),
                    c.y,
                    operand,
                    end,
                    written.start,
                    written.end
                );
            }
        }
    }
    println!("{folded} folded chains checked");
    // tiny_16 and the real tiny fold their modulated normalization
    assert!(folded >= 1);
}

/// A fixed 3x3 over a folded Resize stages the Resize's input pixels its taps reach
/// (`resize_patch`): for every block, every tile pixel's four taps (worked out here pixel by
/// pixel, with the padding reflected as the CPU reference does) lie in a box of at most
/// `rs_patch` pixels, and some block needs all of them. It runs at eight channel tiles only
/// (where it measured faster); without the fusion it never runs (no GPU needed to plan).
#[test]
fn resize_convolutions_stage_their_source_patch() {
    use gsttoonflow::cuda::neural::program::{MmaGather, NnConv, TC_COLS, TC_ROWS, build};
    let mut models = generated();
    models.push((
        NeuralModel::from_bytes(&encode_model(&hayao_like()), "hayao_like").unwrap(),
        200,
        136,
    ));
    // (wide enough for eight-tile convolutions over its Resizes)
    models.push((hayao_class(), 1920, 1080));
    models.extend(real_tiny().map(|m| (m, 320, 192)));
    let mut checked = 0;
    // staged patches double-buffered (`NnConv::stages`): two chunks or more
    let mut double_buffered = 0;
    // staged at four tiles (`Fusions::narrow_patch`): double-buffered only
    let mut narrow = 0;
    for (model, w, h) in &models {
        let spec = model.specialise(*h, *w).unwrap();
        for fusions in [
            Fusions::ALL,
            Fusions {
                resize_patch: false,
                ..Fusions::ALL
            },
            Fusions {
                narrow_patch: false,
                ..Fusions::ALL
            },
        ] {
            let storage = Storage {
                fusions,
                ..Storage::uniform(spec.stage_count(), true)
            };
            let p = build(&spec, &storage, 0, 0).unwrap();
            for l in &p.launches {
                let Kernel::ConvMma(_, nt, gather) = l.kernel else {
                    continue;
                };
                let c: NnConv = params(&p, l);
                if c.rs_taps == 0 || (c.kh, c.kw, c.sh, c.sw) != (3, 3, 1, 1) || c.x_ps == 1 {
                    continue;
                }
                let staged = gather == MmaGather::ChannelsLast3x3Resize;
                if !fusions.resize_patch || nt <= 2 || (nt != 8 && !fusions.narrow_patch) {
                    assert!(!staged, "{}: {nt} tiles staged", model.name());
                    assert_eq!(c.rs_patch, 0);
                    continue;
                }
                if nt != 8 {
                    if !staged {
                        // one chunk (nothing to overlap), or no room
                        assert_eq!(c.rs_patch, 0);
                        continue;
                    }
                    assert_eq!(c.stages, 2, "{}: {nt} tiles single-buffered", model.name());
                    narrow += 1;
                }
                assert!(staged, "{}", model.name());
                if c.stages == 2 {
                    assert!(
                        c.cin_pad >= 32,
                        "{}: one chunk double-buffered",
                        model.name()
                    );
                    double_buffered += 1;
                }
                let at = c.rs_taps as usize;
                let taps: Vec<i32> = (0..4 * (c.h + c.w_in) as usize)
                    .map(|k| {
                        i32::from_le_bytes(
                            p.static_init[at + 4 * k..at + 4 * k + 4]
                                .try_into()
                                .unwrap(),
                        )
                    })
                    .collect();
                // reflect (the models' pad) of padded coordinate i over n
                let source = |i: i32, padded: i32, pad: i32, n: i32| -> Option<usize> {
                    if i < 0 || i >= padded {
                        return None;
                    }
                    let mut s = i - pad;
                    while n > 1 && (s < 0 || s >= n) {
                        s = if s < 0 { -s } else { 2 * (n - 1) - s };
                    }
                    Some(if n > 1 { s as usize } else { 0 })
                };
                assert_eq!(c.pad_mode, 1, "the generated models reflect");
                let mut most = 0;
                for by in 0..(c.oh as u32).div_ceil(TC_ROWS) {
                    for bx in 0..(c.ow as u32).div_ceil(TC_COLS) {
                        let (y0, x0) = (
                            (by * TC_ROWS) as i32 - c.conv_pt,
                            (bx * TC_COLS) as i32 - c.conv_pl,
                        );
                        let (mut r0, mut r1, mut c0, mut c1) = (i32::MAX, -1, i32::MAX, -1);
                        for r in 0..TC_ROWS as i32 + 2 {
                            for q in 0..TC_COLS as i32 + 2 {
                                let (Some(sy), Some(sx)) = (
                                    source(y0 + r, c.hp, c.pad_t, c.h),
                                    source(x0 + q, c.wp, c.pad_l, c.w_in),
                                ) else {
                                    continue;
                                };
                                let ty = &taps[4 * sy..4 * sy + 2];
                                let tx =
                                    &taps[4 * (c.h as usize + sx)..4 * (c.h as usize + sx) + 2];
                                r0 = r0.min(ty[0].min(ty[1]));
                                r1 = r1.max(ty[0].max(ty[1]));
                                c0 = c0.min(tx[0].min(tx[1]));
                                c1 = c1.max(tx[0].max(tx[1]));
                            }
                        }
                        let area = (r1 - r0 + 1) * (c1 - c0 + 1);
                        assert!(
                            area <= c.rs_patch,
                            "{}: block ({bx}, {by}) needs {area} > {}",
                            model.name(),
                            c.rs_patch
                        );
                        most = most.max(area);
                    }
                }
                println!(
                    "{} {}x{} <- {}x{}: patch {} pixels (tile {}), the largest block needs {most}",
                    model.name(),
                    c.ow,
                    c.oh,
                    c.rs_w,
                    c.rs_h,
                    c.rs_patch,
                    (TC_ROWS + 2) * (TC_COLS + 2)
                );
                assert!(most <= c.rs_patch && 2 * most >= c.rs_patch);
                checked += 1;
            }
        }
    }
    assert!(checked >= 2, "{checked} staged Resize convolutions");
    assert!(narrow >= 1, "no staged Resize convolution at four tiles");
    assert!(
        double_buffered >= 1,
        "{double_buffered} of {checked} staged Resize convolutions double-buffered"
    );
}

/// f32 → f16 bits against nprec's emulation (round to nearest even) over many magnitudes.
#[test]
fn half_conversion_rounds_to_nearest_even() {
    use gsttoonflow::cuda::neural::program::f32_to_f16_bits;
    use gsttoonflow::neural::precision::round_to_fp16;
    let to_f32 = |h: u16| {
        let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
        let e = ((h >> 10) & 0x1f) as i32;
        let m = (h & 0x3ff) as f32;
        match e {
            0 => sign * m * 2f32.powi(-24),
            31 => sign * f32::INFINITY,
            e => sign * (1.0 + m / 1024.0) * 2f32.powi(e - 15),
        }
    };
    assert_eq!(f32_to_f16_bits(1.0), 0x3c00);
    assert_eq!(f32_to_f16_bits(-2.0), 0xc000);
    assert_eq!(f32_to_f16_bits(65504.0), 0x7bff);
    assert_eq!(f32_to_f16_bits(1e6), 0x7c00);
    assert_eq!(f32_to_f16_bits(0.0), 0);
    let mut rng = Rng::new(9);
    for _ in 0..100_000 {
        let v = rng.uniform() * 2f32.powi((rng.uniform() * 20.0) as i32);
        let got = to_f32(f32_to_f16_bits(v));
        let want = round_to_fp16(v);
        assert!(
            got == want || (got.is_infinite() && want.abs() > 65504.0),
            "{v}: {got} vs {want}"
        );
    }
}

/// Per-frame time of the launches alone (graph replay), TOONFLOW_NEURAL_BENCH=1.
#[test]
fn speed() {
    if std::env::var("TOONFLOW_NEURAL_BENCH").is_err() {
        println!("skipped: set TOONFLOW_NEURAL_BENCH=1 to measure per-frame times");
        return;
    }
    need_gpu!();
    let filter = std::env::var("TOONFLOW_NEURAL_BENCH").unwrap_or_default();
    let (model_filter, size_filter) = filter.split_once(':').unwrap_or(("", ""));
    let model_filter = if model_filter == "1" {
        ""
    } else {
        model_filter
    };
    let mut models: Vec<NeuralModel> = generated().into_iter().map(|m| m.0).collect();
    models.extend(real_tiny());
    // the Hayao layer pattern at the real model's channel counts (32-256)
    models.push(hayao_class());
    for model in models.iter().filter(|m| m.name().contains(model_filter)) {
        for (label, w, h) in [
            ("720p", 1280usize, 720usize),
            ("1080p", 1920, 1080),
            ("4K", 3840, 2160),
        ]
        .into_iter()
        .filter(|s| s.0.contains(size_filter))
        {
            let m = model.size_multiple();
            let (h, w) = (h.div_ceil(m) * m, w.div_ceil(m) * m);
            let spec = model.specialise(h, w).unwrap();
            for (half, tc) in [(true, true), (true, false), (false, false)] {
                let mut g = gpu_with(&spec, half, true, tc, Fusions::from_env());
                let input = random_input(&spec, 5);
                let mut out = Tensor::zeros(&input.shape);
                for _ in 0..4 {
                    g.run(&input, &mut out).unwrap();
                }
                // 30 frames, or fewer when a frame is slow (at least 3, about half a second)
                let start = Instant::now();
                let mut n = 0;
                while n < 30 && (n < 3 || start.elapsed().as_secs_f64() < 0.5) {
                    for _ in 0..3 {
                        g.run_launches().unwrap();
                    }
                    g.synchronize().unwrap();
                    n += 3;
                }
                let ms = start.elapsed().as_secs_f64() * 1e3 / n as f64;
                println!(
                    "speed {} {label} ({w}x{h}) {}: {ms:.3} ms/frame ({:.0} fps), {} launches \
                     ({} tensor-core convs), device memory {:.1} MiB (arena {:.1} MiB)",
                    model.name(),
                    if half { "fp16" } else { "fp32" },
                    1e3 / ms,
                    g.launches_per_frame(),
                    mma_launches(&g),
                    g.device_bytes() as f64 / 1048576.0,
                    g.program().arena.arena_bytes as f64 / 1048576.0
                );
            }
        }
    }
}

/// The element of a harness made by `new_parse("toonflow name=t ...")` (it wraps it in a bin).
fn toonflow_named_t(harness: &gst_check::Harness) -> gst::Element {
    harness
        .element()
        .unwrap()
        .downcast_ref::<gst::Bin>()
        .and_then(|b| b.by_name("t"))
        .expect("toonflow named t")
}

/// The network's overlap path (frames queued back to back, each upload beside the previous
/// frame's network, pushed from the push thread) makes the synchronous path's frames byte for
/// byte, with every frame pushed before any is pulled: through scene cuts (the device trims
/// the ring slots planned before their verdicts), a DISCONT and a longer temporal-history set
/// while playing (the ring reallocated); with graphs (fp16, calibrated on a synchronous first
/// frame), at model-scale 0.5 in fp32 (two kernels after the network; no calibration, every
/// frame queued) and eagerly (cuda-graph=false).
#[test]
fn the_overlap_path_makes_the_synchronous_frames_through_cuts_and_history_changes() {
    need_gpu!();
    let dir = common::TempDir::new("neural-cuda-overlap");
    let path = dir.path("tiny_like.onnx");
    std::fs::write(&path, encode_model(&tiny_like())).unwrap();
    let model = path.to_str().unwrap().to_string();
    let (w, h) = (160, 96);
    let (cat, rocket) = (
        common::photo("chelsea.png", w, h),
        common::photo("rocket.jpg", w, h),
    );
    // cat ×6, rocket ×4 (a cut), cat ×3 (a cut); history 3 → 6 at frame 8; DISCONT at 11
    let clip: Vec<common::Nv12> = (0..13)
        .map(|i| {
            let base = if (6..10).contains(&i) { &rocket } else { &cat };
            base.with_noise(4.0, i as u64 + 1)
        })
        .collect();
    let run = |props: &str, overlap: bool| {
        let mut harness = gst_check::Harness::new_parse(&format!(
            "toonflow name=t backend=cuda model=\"{model}\" temporal-history=3 {props} \
             overlap={overlap}"
        ));
        harness.set_src_caps(common::nv12_caps(w, h));
        let element = toonflow_named_t(&harness);
        for (i, frame) in clip.iter().enumerate() {
            if i == 8 {
                element.set_property("temporal-history", 6u32);
            }
            let mut buffer = frame.to_buffer();
            if i == 11 {
                buffer
                    .get_mut()
                    .unwrap()
                    .set_flags(gst::BufferFlags::DISCONT);
            }
            harness.push(buffer).expect("push");
        }
        let out: Vec<common::Nv12> = clip
            .iter()
            .map(|_| common::Nv12::from_buffer(&common::pull_output(&mut harness), &clip[0].caps()))
            .collect();
        // a serialized event: the outcomes of the frames still unseen are counted first
        assert!(harness.push_event(gst::event::Eos::new()));
        let stats = element.property::<gst::Structure>("stats");
        (out, stats)
    };
    let field = |s: &gst::Structure, name: &str| s.get::<u64>(name).unwrap();
    for (props, calibrating, graphs) in [
        ("precision=fp16", 1, true),
        ("precision=fp32 model-scale=0.5", 0, true),
        ("precision=fp16 cuda-graph=false", 1, false),
    ] {
        let (queued, queued_stats) = run(props, true);
        let (synchronous, synchronous_stats) = run(props, false);
        println!(
            "{props}: overlap {} frames ({} queued), {} scene cuts, graph replayed {}; \
             synchronous {} frames ({} queued), {} scene cuts",
            field(&queued_stats, "frames"),
            field(&queued_stats, "frames-queued"),
            field(&queued_stats, "scene-cuts"),
            queued_stats.get::<bool>("graph-replayed").unwrap(),
            field(&synchronous_stats, "frames"),
            field(&synchronous_stats, "frames-queued"),
            field(&synchronous_stats, "scene-cuts"),
        );
        for (i, (a, b)) in queued.iter().zip(&synchronous).enumerate() {
            assert!(
                a.y() == b.y() && a.uv() == b.uv(),
                "{props}, frame {i}: the overlap path differs from the synchronous one"
            );
        }
        // the rocket, and the cat again: two cuts on either path
        for s in [&queued_stats, &synchronous_stats] {
            assert_eq!(field(s, "frames"), clip.len() as u64, "{props}");
            assert_eq!(field(s, "scene-cuts"), 2, "{props}");
            assert_eq!(s.get::<bool>("graph-replayed").unwrap(), graphs, "{props}");
        }
        assert_eq!(
            queued_stats.get::<u32>("history-used").unwrap(),
            synchronous_stats.get::<u32>("history-used").unwrap()
        );
        // every frame but a calibrating first one was queued with overlap on, none without
        assert_eq!(
            field(&queued_stats, "frames-queued"),
            clip.len() as u64 - calibrating,
            "{props}"
        );
        assert_eq!(field(&synchronous_stats, "frames-queued"), 0);
    }
}

/// The element with backend=cuda and model=: the CPU reference's frames (fp32 storage: within
/// one code; calibrated fp16: within three), launches per frame in the stats, the graph replayed
/// after the warm-up.
#[test]
fn the_element_runs_the_network_on_the_gpu() {
    need_gpu!();
    let dir = common::TempDir::new("neural-cuda-element");
    let path = dir.path("tiny_like.onnx");
    std::fs::write(&path, encode_model(&tiny_like())).unwrap();
    let model = path.to_str().unwrap().to_string();
    let frame = common::photo("chelsea.png", 160, 96);
    let element = |backend: &str, precision: &str| {
        let mut h = gst_check::Harness::new_parse(&format!(
            "toonflow name=t backend={backend} precision={precision} model=\"{model}\" \
             temporal-history=0"
        ));
        h.set_src_caps(common::nv12_caps(160, 96));
        h
    };
    let stats = |h: &gst_check::Harness| toonflow_named_t(h).property::<gst::Structure>("stats");
    let mut cpu_h = element("cpu", "fp32");
    let cpu = common::push_frame(&mut cpu_h, &frame);
    assert_eq!(stats(&cpu_h).get::<u32>("stages").unwrap(), 38);
    for (precision, mean_max, code_max) in [("fp32", 0.05, 1), ("fp16", 0.3, 3)] {
        let mut h = element("cuda", precision);
        let mut last = None;
        for _ in 0..5 {
            last = Some(common::push_frame(&mut h, &frame));
        }
        let out = last.unwrap();
        let d = common::mean_abs_diff(out.y(), cpu.y());
        let max = out
            .y()
            .iter()
            .zip(cpu.y())
            .map(|(a, b)| (*a as i32 - *b as i32).abs())
            .max()
            .unwrap();
        let s = stats(&h);
        let launches = s.get::<u32>("launches").unwrap();
        println!(
            "element {precision}: luma mean abs {d:.3}, max {max} codes against the CPU \
             reference; backend {}, {launches} launches, graph replayed {}, device bytes {}",
            s.get::<&str>("backend").unwrap(),
            s.get::<bool>("graph-replayed").unwrap(),
            s.get::<u64>("arena-bytes").unwrap()
        );
        assert_eq!(s.get::<&str>("backend").unwrap(), "cuda");
        assert_eq!(s.get::<u32>("stages").unwrap(), 38);
        // At model-scale 1 the frame kernels (NV12 in, scene gate, output filter) run on the
        // device beside the network. fp32 launches every stage; fp16 on tensor cores (sm_80+)
        // folds Resizes, layout Transposes and residual Adds into convolutions (the exact
        // folds are checked on the program in the tests above). (Where an fp16 stem gathers
        // the NV12 frame, the frame path has one kernel fewer: the bound below holds too.)
        let frame_kernels = gsttoonflow::cuda::neural_frame::LAUNCHES_UNSCALED;
        let network = launches - frame_kernels;
        if precision == "fp32" {
            assert_eq!(network, 38);
        } else {
            assert!(network <= 38, "fp16 network launches {network}");
        }
        assert!(s.get::<bool>("graph-replayed").unwrap());
        assert!(
            d <= mean_max && max <= code_max,
            "{precision}: mean {d}, max {max}"
        );
    }
}

/// The tensor-core weights are mma.m16n8k16 B fragments (PTX ISA: lane 4·g + t holds
/// B[2t][g], B[2t+1][g] in its first register and B[2t+8][g], B[2t+9][g] in its second): read
/// back that way, every (tap, input, output channel) is its weight, zero past cin and cout.
#[test]
fn tensor_core_weights_are_b_fragments() {
    use gsttoonflow::cuda::neural::program::{f32_to_f16_bits, mma_weights};
    let (cout, cin, taps) = (11usize, 19usize, 3usize);
    let w: Vec<f32> = (0..cout * cin * taps).map(|i| i as f32 * 0.5).collect();
    let h = mma_weights(&w, cout, cin, taps);
    let (chunks, tiles) = (cin.div_ceil(16), cout.div_ceil(8));
    assert_eq!(h.len(), taps * chunks * tiles * 32 * 4);
    for tap in 0..taps {
        for kc in 0..chunks {
            for nt in 0..tiles {
                let frag = &h[((tap * chunks + kc) * tiles + nt) * 128..][..128];
                for k in 0..16 {
                    for n in 0..8 {
                        let t = (k % 8) / 2;
                        let lane = 4 * n + t;
                        let half = if k < 8 { 0 } else { 2 };
                        let got = frag[lane * 4 + half + k % 2];
                        let (oc, ic) = (nt * 8 + n, kc * 16 + k);
                        let want = if oc < cout && ic < cin {
                            f32_to_f16_bits(w[(oc * cin + ic) * taps + tap])
                        } else {
                            0
                        };
                        assert_eq!(got, want, "tap {tap} chunk {kc} tile {nt} k {k} n {n}");
                    }
                }
            }
        }
    }
}

/// The two-tile fixed 3x3 kernels with a folded fp16 residual Add take the kernel that reads
/// and writes it a channel pair at a time (`MmaGather::ChannelsLast3x3Residual`, no GPU needed
/// to plan): tiny_16 and the real tiny (when here) at 1920x1088 have such layers (their
/// full-resolution and half-resolution Resize convolutions), none with the switch off.
#[test]
fn residual_pairs_are_planned_for_two_tile_3x3_layers() {
    use gsttoonflow::cuda::neural::program::{MmaGather, build};
    let mut models = vec![tiny_16()];
    models.extend(real_tiny());
    for model in &models {
        let spec = model.specialise(1088, 1920).unwrap();
        let count = |fusions: Fusions| {
            let storage = Storage {
                fusions,
                ..Storage::uniform(spec.stage_count(), true)
            };
            let p = build(&spec, &storage, 0, 0).unwrap();
            p.launches
                .iter()
                .filter(|l| {
                    matches!(
                        l.kernel,
                        Kernel::ConvMma(true, 2, MmaGather::ChannelsLast3x3Residual)
                    )
                })
                .count()
        };
        let on = count(Fusions::ALL);
        let off = count(Fusions {
            residual_pairs: false,
            ..Fusions::ALL
        });
        println!("{} 1920x1088: {on} residual-pair launches", model.name());
        assert!(on >= 1, "{}: no residual-pair launch", model.name());
        assert_eq!(off, 0);
    }
}

/// The 7x7 kernels (the stem, the paired output convolution) run `TC_TALL_ROWS` warps a block
/// (no GPU needed to plan): on tiny_16 and the real tiny (when here) at 1920x1088 every 7x7
/// tensor-core launch has eight warps and a grid of that many warps' rows a block (the paired
/// convolution's warps take `TC_PAIRED_ROWS` rows each), within the shared
/// memory the kernels are opted in to; no other launch changes; with the switch off every
/// tensor-core launch has four warps.
#[test]
fn seven_by_seven_kernels_run_tall_blocks() {
    use gsttoonflow::cuda::neural::program::{
        TC_ROWS, TC_SHARED_OPT_IN, TC_TALL_ROWS, conv_shared_bytes_rows,
    };
    let mut models = vec![tiny_16()];
    models.extend(real_tiny());
    for model in &models {
        let spec = model.specialise(1088, 1920).unwrap();
        let plan = |fusions: Fusions| fp16_plan(&spec, fusions);
        // (the eight-tile 3x3's tall blocks off in both: this test is the 7x7 kernels')
        let tall = plan(Fusions {
            tall_3x3: false,
            ..Fusions::ALL
        });
        let short = plan(Fusions {
            tall_7x7: false,
            tall_3x3: false,
            ..Fusions::ALL
        });
        assert_eq!(tall.launches.len(), short.launches.len());
        let mut tall_launches = 0;
        for (a, b) in tall.launches.iter().zip(&short.launches) {
            assert_eq!(a.kernel, b.kernel);
            let Kernel::ConvMma(_, nt, gather) = a.kernel else {
                assert_eq!((a.grid, a.block), (b.grid, b.block));
                continue;
            };
            let c: gsttoonflow::cuda::neural::program::NnConv = params(&tall, a);
            assert_eq!(b.block.0, 32 * TC_ROWS, "{:?}", b.kernel);
            // (the paired convolution's warps take several rows each, in either block)
            let per_warp = gather.rows_per_warp();
            if gather.tall() {
                tall_launches += 1;
                assert_eq!(b.grid.1, (c.oh as u32).div_ceil(TC_ROWS * per_warp));
                assert_eq!(a.block.0, 32 * TC_TALL_ROWS, "{:?}", a.kernel);
                assert_eq!(a.grid.1, (c.oh as u32).div_ceil(TC_TALL_ROWS * per_warp));
                assert_eq!(
                    a.shared,
                    conv_shared_bytes_rows(gather, nt, &c, TC_TALL_ROWS * per_warp)
                );
                assert!(a.shared <= TC_SHARED_OPT_IN && a.shared > b.shared);
            } else {
                assert_eq!((a.grid, a.block, a.shared), (b.grid, b.block, b.shared));
            }
        }
        println!(
            "{} 1920x1088: {tall_launches} tall 7x7 launches",
            model.name()
        );
        // the stem and the output convolution
        assert_eq!(tall_launches, 2, "{}", model.name());
    }
}

/// A tall block (eight warps) computes each output as a short one (four warps) does, the same
/// taps in the same order: the same bits, on tiny_16 and the real tiny (when here) at
/// 1920x1088 and 640x368. (Both take two rows a warp in the 7x7 kernels; these heights are
/// multiples of 16, so no block here is cut short: hayao_like's 72 rows in the other GPU tests
/// are.)
#[test]
fn tall_7x7_blocks_keep_the_bits() {
    need_gpu!();
    let short = Fusions {
        tall_7x7: false,
        ..Fusions::ALL
    };
    fusion_keeps_the_bits_on_photos(short, "tall blocks");
}

/// The eight-tile fixed 3x3 layers run `TC_TALL_ROWS` warps a block where unbanded
/// (`Fusions::tall_3x3`, no GPU needed to plan): on hayao_class at 1920x1080 and 960x544 each
/// such launch has eight warps, a grid of eight rows a block and the shared memory of an
/// eight-row tile, within what the kernels are opted in to; no other launch changes; with the
/// switch off every one has four warps.
#[test]
fn eight_tile_3x3_layers_run_tall_blocks() {
    use gsttoonflow::cuda::neural::program::{
        MmaGather, NnConv, TC_ROWS, TC_SHARED_OPT_IN, TC_TALL_ROWS, conv_shared_bytes_rows,
    };
    for (w, h, on, off) in hayao_class_plans(|tall_3x3| Fusions {
        tall_3x3,
        ..Fusions::ALL
    }) {
        assert_eq!(on.launches.len(), off.launches.len());
        let mut tall = 0;
        for (a, b) in on.launches.iter().zip(&off.launches) {
            assert_eq!(a.kernel, b.kernel);
            if a.kernel != Kernel::ConvMma(true, 8, MmaGather::ChannelsLast3x3) {
                assert_eq!((a.grid, a.block, a.shared), (b.grid, b.block, b.shared));
                continue;
            }
            let c: NnConv = params(&on, a);
            assert_eq!(b.block.0, 32 * TC_ROWS);
            // (a banded layer keeps its four-warp blocks: its bands are whole blocks of those)
            if b.grid.1 != (c.oh as u32).div_ceil(TC_ROWS) {
                assert_eq!((a.grid, a.block, a.shared), (b.grid, b.block, b.shared));
                continue;
            }
            tall += 1;
            assert_eq!(a.block.0, 32 * TC_TALL_ROWS);
            assert_eq!((a.grid.0, a.grid.2), (b.grid.0, b.grid.2));
            assert_eq!(a.grid.1, (c.oh as u32).div_ceil(TC_TALL_ROWS));
            let rows = conv_shared_bytes_rows(MmaGather::ChannelsLast3x3, 8, &c, TC_TALL_ROWS);
            assert_eq!(a.shared, rows);
            assert!(a.shared <= TC_SHARED_OPT_IN && a.shared > b.shared);
        }
        println!("hayao_class {w}x{h}: {tall} tall eight-tile 3x3 launches");
        assert!(tall >= 3, "hayao_class {w}x{h}: {tall}");
    }
}

/// A tall eight-tile 3x3 block computes each output as a four-warp one does (the same taps and
/// chunks in the same order): the same bits on hayao_class over a photo at 1920x1080 and
/// 960x528 (the model takes multiples of 8; at half size 540 and 264 rows, at a quarter 270 and
/// 132: the last block of eight rows is cut short in three of those layers).
#[test]
fn tall_3x3_blocks_keep_the_bits() {
    need_gpu!();
    let off = Fusions {
        tall_3x3: false,
        ..Fusions::ALL
    };
    let model = hayao_class();
    for (w, h) in [(1920, 1080), (960, 528)] {
        let input = photo_tensor(&model, "chelsea.png", w, h);
        let spec = model.specialise(h, w).unwrap();
        let (a, b) = run_with_and_without(&spec, &input, off);
        println!("hayao_class {w}x{h}: {} values", a.data.len());
        assert_same_bits(&a, &b, "hayao_class: tall 3x3 blocks");
    }
}

/// The double-buffered 1x1 layers over channels-last inputs at eight channel tiles take the
/// fixed shapes' staging (`Fusions::fixed_1x1`, no GPU needed to plan): on hayao_class at
/// 1920x1080 and 960x544 (its 64- and 128-channel pointwise convolutions) each such layer
/// keeps its grid, block and double buffering, with the shared memory of its staged B
/// fragments; no other launch changes; with the switch off none does.
#[test]
fn pointwise_layers_stage_their_weights_with_the_tile() {
    use gsttoonflow::cuda::neural::program::{MmaGather, NnConv, conv_shared_bytes};
    // (the wide Gram moments off: they take seven of the nine 1x1 convolutions away)
    for (w, h, on, off) in hayao_class_plans(|fixed_1x1| Fusions {
        fixed_1x1,
        gram_wide: false,
        ..Fusions::ALL
    }) {
        assert_eq!(on.launches.len(), off.launches.len());
        let mut staged = 0;
        for (a, b) in on.launches.iter().zip(&off.launches) {
            match (a.kernel, b.kernel) {
                (
                    Kernel::ConvMma(_, 8, MmaGather::ChannelsLast1x1),
                    Kernel::ConvMma(_, 8, MmaGather::ChannelsLast),
                ) => {}
                _ => {
                    assert_eq!(a.kernel, b.kernel);
                    assert_eq!((a.grid, a.block, a.shared), (b.grid, b.block, b.shared));
                    continue;
                }
            }
            staged += 1;
            let (c, d): (NnConv, NnConv) = (params(&on, a), params(&off, b));
            assert_eq!((c.kh, c.kw, c.sh, c.sw), (1, 1, 1, 1));
            assert_eq!((c.stages, d.stages), (2, 2), "{w}x{h}: stage {}", a.stage);
            assert_eq!((a.grid, a.block), (b.grid, b.block));
            assert_eq!(
                a.shared,
                conv_shared_bytes(MmaGather::ChannelsLast1x1, 8, &c)
            );
        }
        println!("hayao_class {w}x{h}: {staged} staged 1x1 launches");
        assert!(staged >= 4, "hayao_class {w}x{h}: {staged}");
        assert!(
            !off.launches
                .iter()
                .any(|l| matches!(l.kernel, Kernel::ConvMma(_, _, MmaGather::ChannelsLast1x1)))
        );
    }
}

/// The staged 1x1 kernel multiplies the same fragments in the same order as the general
/// gather's single tap: the same bits, on hayao_class at 1920x1080 and 960x544 (a photo).
#[test]
fn the_staged_1x1_keeps_the_bits() {
    need_gpu!();
    let model = hayao_class();
    let general = Fusions {
        fixed_1x1: false,
        ..Fusions::ALL
    };
    for (w, h) in [(1920, 1080), (960, 544)] {
        let input = photo_tensor(&model, "chelsea.png", w, h);
        let spec = model.specialise(input.shape[1], input.shape[2]).unwrap();
        let (a, b) = run_with_and_without(&spec, &input, general);
        println!("hayao_class {w}x{h}: {} values", a.data.len());
        assert_same_bits(&a, &b, &format!("hayao_class {w}x{h}: the staged 1x1"));
    }
}

/// An instance normalization that reads channels-last inputs (`Fusions::instance_cl`, no GPU
/// needed to plan): on hayao_class at 1920x1080 and 960x544 its application reads its
/// 256-channel input channels-last, the residual blocks before it stay channels-last, so no
/// eight-tile convolution gathers an NCHW input any more (five do at 1920x1080 with the switch
/// off), and the
/// arena does not grow.
#[test]
fn instance_normalizations_read_channels_last_inputs() {
    use gsttoonflow::cuda::neural::program::{MmaGather, NnNormApply};
    // (the wide Gram moments off: with them most of the 1x1 convolutions, and the eight-tile
    // NCHW gathers of those, are gone either way)
    for (w, h, on, off) in hayao_class_plans(|instance_cl| Fusions {
        instance_cl,
        gram_wide: false,
        ..Fusions::ALL
    }) {
        let planar_wide = |p: &gsttoonflow::cuda::neural::program::Program| {
            p.launches
                .iter()
                .filter(|l| matches!(l.kernel, Kernel::ConvMma(_, 8, MmaGather::Planar)))
                .count()
        };
        let apply = |p: &gsttoonflow::cuda::neural::program::Program| -> Vec<NnNormApply> {
            p.launches
                .iter()
                .filter(|l| l.kernel == Kernel::NormApply)
                .map(|l| params(p, l))
                .collect()
        };
        let (a_on, a_off) = (apply(&on), apply(&off));
        println!(
            "hayao_class {w}x{h}: eight-tile NCHW gathers {} -> {}, arena {} -> {} B, \
             instance normalization x_cl {:?} -> {:?}",
            planar_wide(&off),
            planar_wide(&on),
            off.arena.arena_bytes,
            on.arena.arena_bytes,
            a_off.iter().map(|p| p.x_cl).collect::<Vec<_>>(),
            a_on.iter().map(|p| p.x_cl).collect::<Vec<_>>(),
        );
        if w == 1920 {
            assert!(planar_wide(&off) >= 5, "{w}x{h}: {}", planar_wide(&off));
        }
        assert_eq!(planar_wide(&on), 0, "{w}x{h}");
        assert!(!a_on.is_empty() && a_on.iter().all(|p| p.x_cl == 256 && p.c == 256));
        assert!(a_off.iter().all(|p| p.x_cl == 0));
        assert!(on.arena.arena_bytes <= off.arena.arena_bytes);
    }
}

/// Channels-last instance normalization inputs change only the order of the statistics'
/// sums: on hayao_class at 480x272 both plans keep 40 dB against the CPU reference on a photo,
/// and at 1920x1080 the two GPU outputs stay within 50 dB of each other.
#[test]
fn channels_last_instance_inputs_keep_the_picture() {
    need_gpu!();
    let model = hayao_class();
    let nchw = Fusions {
        instance_cl: false,
        ..Fusions::ALL
    };
    for (w, h, reference) in [(480, 272, true), (1920, 1080, false)] {
        let input = photo_tensor(&model, "chelsea.png", w, h);
        let spec = model.specialise(input.shape[1], input.shape[2]).unwrap();
        let (a, b) = run_with_and_without(&spec, &input, nchw);
        let between = psnr(&a, &b);
        if reference {
            let cpu = spec.run(&input, None).unwrap();
            let (pa, pb) = (psnr(&cpu, &a), psnr(&cpu, &b));
            println!(
                "hayao_class {w}x{h}: {pa:.1} dB channels-last, {pb:.1} dB NCHW, {between:.1} dB between"
            );
            assert!(pa >= 40.0 && pb >= 40.0, "{w}x{h}: {pa:.1} / {pb:.1} dB");
        } else {
            println!("hayao_class {w}x{h}: {between:.1} dB between");
        }
        assert!(between >= 50.0, "{w}x{h}: {between:.1} dB");
    }
}

/// The shared-memory kernels of the eight-tile layers at about the smallest size that takes
/// them (for compute-sanitizer racecheck): hayao_class at 1024x256 takes the double-buffered
/// eight-tile 3x3, the staged 1x1 (with the wide Gram moments off, which take its launches
/// there) and the channels-last instance normalization; the second
/// switched off keeps the bits, the third 50 dB, and all of them 40 dB against the CPU
/// reference on a photo.
#[test]
fn eight_tile_kernels_at_a_small_size() {
    use gsttoonflow::cuda::neural::program::MmaGather;
    need_gpu!();
    let model = hayao_class();
    let input = photo_tensor(&model, "chelsea.png", 1024, 256);
    let spec = model.specialise(input.shape[1], input.shape[2]).unwrap();
    // (the wide Gram moments off: they take the statistics-only 1x1 layers, which are the staged
    // 1x1's launches here)
    let base = Fusions {
        gram_wide: false,
        ..Fusions::ALL
    };
    let all = gpu_with(&spec, true, false, true, base);
    let kernels: Vec<Kernel> = all.program().launches.iter().map(|l| l.kernel).collect();
    for k in [
        Kernel::ConvMma(true, 8, MmaGather::ChannelsLast3x3),
        Kernel::ConvMma(true, 8, MmaGather::ChannelsLast1x1),
        Kernel::NormApply,
    ] {
        assert!(
            kernels.contains(&k),
            "hayao_class 1024x256 does not launch {k:?}"
        );
    }
    // the eight-tile 3x3 double-buffered (the single-buffered one takes the same kernel, within
    // 48 KiB of shared memory; two tiles and two B stages take it past)
    assert!(all.program().launches.iter().any(|l| {
        l.kernel == Kernel::ConvMma(true, 8, MmaGather::ChannelsLast3x3) && l.shared > 48 * 1024
    }));
    let on = run_gpu(&mut { all }, &input);
    let cpu = spec.run(&input, None).unwrap();
    let p = psnr(&cpu, &on);
    println!("hayao_class 1024x256: {p:.1} dB against the CPU reference");
    assert!(p >= 40.0, "{p:.1} dB");
    for (off, same_bits) in [
        (
            Fusions {
                fixed_1x1: false,
                ..base
            },
            true,
        ),
        (
            Fusions {
                instance_cl: false,
                ..base
            },
            false,
        ),
    ] {
        let out = run_gpu(&mut gpu_with(&spec, true, false, true, off), &input);
        if same_bits {
            assert_same_bits(&on, &out, &format!("hayao_class 1024x256 {off:?}"));
        } else {
            let between = psnr(&on, &out);
            println!(
                "hayao_class 1024x256, instance normalizations over NCHW: {between:.1} dB between"
            );
            assert!(between >= 50.0, "{between:.1} dB");
        }
    }
}

/// An fp16 network input (`Fusions::half_input`) is what the stem's gather made of the fp32
/// one (both round to nearest even): the same output bits through the tensor path's upload
/// (tiny_16 and the real tiny, when here, at 1920x1088 and 640x368). The frame path's
/// conversion writing halves is checked against the CPU reference by neural_frame_cuda.
#[test]
fn an_fp16_input_keeps_the_bits() {
    need_gpu!();
    let fp32_input = Fusions {
        half_input: false,
        ..Fusions::ALL
    };
    fusion_keeps_the_bits_on_photos(fp32_input, "an fp16 input");
}

/// The residual-pair epilogue computes what the one-value-at-a-time epilogue does: the same
/// bits (tiny_16 and the real tiny, when here, at 1920x1088).
#[test]
fn residual_pairs_keep_the_bits() {
    need_gpu!();
    let mut models = vec![tiny_16()];
    models.extend(real_tiny());
    let single = Fusions {
        residual_pairs: false,
        ..Fusions::ALL
    };
    for model in &models {
        let input = photo_tensor(model, "chelsea.png", 1920, 1088);
        let spec = model.specialise(input.shape[1], input.shape[2]).unwrap();
        let (a, b) = run_with_and_without(&spec, &input, single);
        println!("{}: {} values", model.name(), a.data.len());
        assert_same_bits(
            &a,
            &b,
            &format!("{}: the residual-pair epilogue", model.name()),
        );
    }
}

/// The double-buffered staged Resize patch copies the same pixels and B fragments as the
/// single-buffered one, and the patch blends the taps as the gather through them does: the same
/// bits. At 960x544 hayao_class stages its eight-tile Resize convolutions' patches and, double-
/// buffered only, its four-tile one; the real tiny (when present) at 1920x1088 its four-tile
/// ones.
#[test]
fn the_double_buffered_resize_patch_keeps_the_bits() {
    use gsttoonflow::cuda::neural::program::MmaGather;
    need_gpu!();
    let mut models = vec![(hayao_class(), 960, 544)];
    models.extend(real_tiny().map(|m| (m, 1920, 1088)));
    for (model, w, h) in &models {
        let input = photo_tensor(model, "chelsea.png", *w, *h);
        let spec = model.specialise(input.shape[1], input.shape[2]).unwrap();
        let single = Fusions {
            pipelined_patch: false,
            ..Fusions::ALL
        };
        let mut piped = gpu_with(&spec, true, false, true, Fusions::ALL);
        let mut plain = gpu_with(&spec, true, false, true, single);
        // the staged Resize launches: (tiles, shared memory); a double-buffered block takes a
        // second patch and B stage
        let staged = |g: &NeuralGpu| -> Vec<(u8, u32)> {
            g.program()
                .launches
                .iter()
                .filter_map(|l| match l.kernel {
                    Kernel::ConvMma(_, nt, MmaGather::ChannelsLast3x3Resize) => {
                        Some((nt, l.shared))
                    }
                    _ => None,
                })
                .collect()
        };
        let (piped_staged, plain_staged) = (staged(&piped), staged(&plain));
        // single-buffered, only the eight-tile ones stage their patch
        assert!(plain_staged.iter().all(|&(nt, _)| nt == 8));
        let wide: Vec<u32> = piped_staged
            .iter()
            .filter(|&&(nt, _)| nt == 8)
            .map(|&(_, s)| s)
            .collect();
        assert_eq!(wide.len(), plain_staged.len());
        let double_buffered = wide
            .iter()
            .zip(&plain_staged)
            .filter(|(a, (_, b))| *a > b)
            .count();
        let narrow = piped_staged.len() - wide.len();
        if double_buffered + narrow == 0 {
            // the gate in NeuralGpu::new: fewer than three such blocks fit a multiprocessor
            println!(
                "skipped ({}): no double-buffered Resize patch (this GPU keeps them \
                 single-buffered)",
                model.name()
            );
            continue;
        }
        let a = run_gpu(&mut piped, &input);
        let b = run_gpu(&mut plain, &input);
        println!(
            "{}: {double_buffered} double-buffered eight-tile Resize patches, {narrow} at four \
             tiles, {} values",
            model.name(),
            a.data.len()
        );
        assert_same_bits(
            &a,
            &b,
            &format!("{}: the double-buffered Resize patch", model.name()),
        );
    }
}

/// Two 3x3 convolutions over a tensor around 1000 (a bias of 1000), weights that fp16 holds
/// exactly (k/256), NCHW in and out: where fp16 storage, or an fp32 input rounded to fp16 for
/// the tensor cores, loses ~2^-12 of every value, a split input (`Storage::split`) keeps 22
/// bits. (With weights fp16 does not hold, their rounding would dominate: the tensor cores
/// multiply fp16 weights, split or not.)
fn offset_convs() -> NeuralModel {
    let mut b = Builder::new(0x5b17);
    let mut rng = Rng::new(0x5b18);
    let mut exact = |b: &mut Builder, base: &str, dims: &[i64]| {
        let n: i64 = dims.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| (rng.uniform() * 64.0).round() / 256.0)
            .collect();
        b.floats(base, dims, &data)
    };
    let conv = |b: &mut Builder, x: &str, w: &str, bias: &str| {
        b.op(
            "Conv",
            &[x, w, bias],
            vec![
                attr_ints("kernel_shape", &[3, 3]),
                attr_ints("pads", &[1, 1, 1, 1]),
            ],
        )
    };
    let w1 = exact(&mut b, "w", &[16, 3, 3, 3]);
    let b1 = b.floats("b", &[16], &[1000.0; 16]);
    let a = conv(&mut b, "input", &w1, &b1);
    // the second convolution's border a constant Pad of a value fp16 does not hold (1000.3:
    // fp16 1000.5, low half -0.2), folded into its gather as the pad value
    let pads = b.ints("pads", &[8], &[0, 0, 1, 1, 0, 0, 1, 1]);
    let fill = b.floats("fill", &[], &[1000.3]);
    let padded = b.op("Pad", &[&a, &pads, &fill], vec![]);
    let w2 = exact(&mut b, "w", &[16, 16, 3, 3]);
    let b2 = exact(&mut b, "b", &[16]);
    let c = b.op(
        "Conv",
        &[&padded, &w2, &b2],
        vec![attr_ints("kernel_shape", &[3, 3])],
    );
    let w3 = exact(&mut b, "w", &[3, 16, 3, 3]);
    let b3 = exact(&mut b, "b", &[3]);
    let out = conv(&mut b, &c, &w3, &b3);
    let m = b.finish("input", &out, &[1, 3, -1, -1], "offset_convs");
    NeuralModel::from_bytes(&encode_model(&m), "offset_convs").unwrap()
}

/// fp32 storage throughout, the tensor cores on, every stage split (`split`) or none.
fn split_storage(spec: &Specialised, split: bool) -> Storage {
    Storage {
        half: vec![false; spec.stage_count()],
        tensor_cores: true,
        fusions: Fusions::from_env(),
        split: vec![split; spec.stage_count()],
        frame_input: false,
    }
}

/// The convolutions whose fp32 input is split in two run on the tensor cores (no GPU needed):
/// without the split an fp32 input keeps a convolution on CUDA cores.
#[test]
fn split_fp32_inputs_take_the_tensor_cores() {
    for (model, w, h) in generated().into_iter().chain([(offset_convs(), 64, 48)]) {
        let spec = model.specialise(h, w).unwrap();
        let split =
            gsttoonflow::cuda::neural::program::build(&spec, &split_storage(&spec, true), 0, 0)
                .unwrap();
        let plain =
            gsttoonflow::cuda::neural::program::build(&spec, &split_storage(&spec, false), 0, 0)
                .unwrap();
        assert_eq!(tensor_core_convs(&plain), 0, "{}", model.name());
        let modes: Vec<i32> = split
            .launches
            .iter()
            .filter(|l| matches!(l.kernel, Kernel::ConvMma(..)))
            .map(|l| params::<NnConv>(&split, l).x_f32)
            .collect();
        println!(
            "{}: split inputs on the tensor cores {modes:?}",
            model.name()
        );
        // (only a stage's output splits; the network input stays on CUDA cores in fp32)
        assert!(modes.len() >= 2, "{}", model.name());
        assert!(modes.iter().all(|&m| m == 2), "{}", model.name());
        assert!(split.launches.len() <= plain.launches.len());
    }
    // the offset model's second convolution folds its constant Pad of 1000.3: the border
    // reads the pad value's two halves
    let spec = offset_convs().specialise(48, 64).unwrap();
    let p = gsttoonflow::cuda::neural::program::build(&spec, &split_storage(&spec, true), 0, 0)
        .unwrap();
    assert!(p.launches.iter().any(|l| {
        matches!(l.kernel, Kernel::ConvMma(..)) && {
            let c = params::<NnConv>(&p, l);
            c.x_f32 == 2 && c.pad_mode == 0 && c.pad_t == 1 && c.pad_value == 1000.3
        }
    }));
}

/// A split fp32 input keeps 22 bits through the tensor cores: the offset model's output
/// against the CPU reference within 2e-6 of its range, where rounding the ~1000 inputs to
/// fp16 would be off by ~1e-4.
#[test]
fn split_fp32_inputs_keep_their_low_bits() {
    need_gpu!();
    let spec = offset_convs().specialise(48, 64).unwrap();
    let input = random_input(&spec, 21);
    let cpu = spec.run(&input, None).unwrap();
    let range = cpu.data.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for split in [true, false] {
        let storage = split_storage(&spec, split);
        let tc = gsttoonflow::cuda::neural::program::build(&spec, &storage, 0, 0).unwrap();
        let split_convs = tc
            .launches
            .iter()
            .filter(|l| {
                matches!(l.kernel, Kernel::ConvMma(..)) && params::<NnConv>(&tc, l).x_f32 == 2
            })
            .count();
        // the two convolutions over the ~1000 tensors, on the tensor cores split, or on CUDA
        // cores in fp32
        assert_eq!(split_convs, if split { 2 } else { 0 });
        assert_eq!(tensor_core_convs(&tc), split_convs);
        let mut g = NeuralGpu::new(0, &spec, &storage, 0, false).unwrap();
        let out = run_gpu(&mut g, &input);
        let rel = max_abs(&cpu, &out) / range;
        println!(
            "offset_convs split {split}: {split_convs} split tensor-core convolutions, max |diff| {rel:.2e} of the range {range:.0}"
        );
        assert!(rel <= 2e-6, "split {split}: {rel:.2e}");
    }
}

/// Calibration's figures of each stage output, reduced on the device (`run_calibration`,
/// `nn_range`), are the host readback's (`run_observed` + `OutputRange::of`): the same counts,
/// the same largest magnitude to the bit, sums of squares within 1e-9 (summed in another
/// order), and so the same plan; fp32 and fp16 storage (the kernel's two loads) on photos, and
/// the figures' time both ways at 1080p (hayao_class, the real tiny when present).
#[test]
fn calibration_ranges_on_the_device_match_the_host_readback() {
    need_gpu!();
    use gsttoonflow::neural::precision::{Calibrator, OutputRange};
    let mut cases: Vec<(NeuralModel, usize, usize, bool)> = [false, true]
        .into_iter()
        .flat_map(|half| {
            generated()
                .into_iter()
                .map(move |(m, w, h)| (m, w, h, half))
        })
        .collect();
    cases.push((hayao_class(), 1920, 1080, false));
    cases.extend(real_tiny().map(|m| (m, 1920, 1088, false)));
    for (model, w, h, half) in cases {
        let input = photo_tensor(&model, "chelsea.png", w, h);
        let spec = model.specialise(input.shape[1], input.shape[2]).unwrap();
        let mut g = gpu_with(&spec, half, false, half, Fusions::from_env());
        let mut out = Tensor::zeros(&input.shape);
        let (mut host, mut device) = (Vec::new(), Vec::new());
        let mut host_cal = Calibrator::new(&spec);
        let mut device_cal = Calibrator::new(&spec);
        let mut stats = Vec::new();
        let t0 = Instant::now();
        g.run_observed(
            &input,
            &mut out,
            &mut |stage, v| {
                host.push((stage, OutputRange::of(v)));
                host_cal.record_output_data(stage, v);
            },
            &mut |k, m, v| stats.push((k, m.to_vec(), v.to_vec())),
        )
        .unwrap();
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t0 = Instant::now();
        g.run_calibration(
            &input,
            &mut out,
            &mut |stage, r| {
                device.push((stage, *r));
                device_cal.record_output_range(stage, r);
            },
            &mut |_, _, _| {},
        )
        .unwrap();
        let device_ms = t0.elapsed().as_secs_f64() * 1e3;
        println!(
            "{} {w}x{h} {}: {} stage outputs, host readback {host_ms:.1} ms, device ranges {device_ms:.1} ms",
            model.name(),
            if half { "fp16" } else { "fp32" },
            host.len()
        );
        assert_eq!(host.len(), device.len());
        for ((s, a), (t, b)) in host.iter().zip(&device) {
            let what = format!(
                "{} stage {s} ({})",
                model.name(),
                if half { "fp16" } else { "fp32" }
            );
            assert_eq!(s, t, "{what}");
            assert_eq!((a.count, a.non_finite), (b.count, b.non_finite), "{what}");
            assert_eq!(
                a.absmax.to_bits(),
                b.absmax.to_bits(),
                "{what}: {a:?} {b:?}"
            );
            let rel = (a.sum_squares - b.sum_squares).abs() / a.sum_squares.max(f64::MIN_POSITIVE);
            assert!(rel <= 1e-9, "{what}: {a:?} {b:?}");
        }
        // (the statistics are the same downloads both ways)
        for (k, m, v) in &stats {
            host_cal.record_stats(*k, m, v);
            device_cal.record_stats(*k, m, v);
        }
        host_cal.frame_done();
        device_cal.frame_done();
        let (p, q) = (host_cal.finish(), device_cal.finish());
        for (a, b) in p.decisions.iter().zip(&q.decisions) {
            assert_eq!(
                (a.precision, a.reason),
                (b.precision, b.reason),
                "{}",
                q.ledger()
            );
        }
    }
}

/// Stages calibration would keep fp32 for their variance are stored in fp16 centered on the
/// calibration frame's channel means (`neural::center`): the centered network on the GPU
/// computes the CPU reference's function (fp32 storage within 1e-3; its calibrated storage at
/// 40 dB or better on another photo, no worse than keeping those stages fp32), with more fp16
/// stages and no more arena. Calibrated on the CPU (chelsea), checked on coffee.
#[test]
fn centered_stages_keep_the_function_in_fp16() {
    need_gpu!();
    use gsttoonflow::neural::precision::{
        Calibrator, Reason, StoragePrecision, calibrate, calibrate_with,
    };
    let mut centered_somewhere = false;
    let mut models: Vec<(NeuralModel, usize, usize)> = generated();
    models.push((hayao_class(), 256, 144));
    for (model, w, h) in &models {
        let calib = photo_tensor(model, "chelsea.png", *w, *h);
        let input = photo_tensor(model, "coffee.png", *w, *h);
        let spec = model.specialise(input.shape[1], input.shape[2]).unwrap();
        let plan = calibrate(&spec, std::slice::from_ref(&calib)).unwrap();
        let fp32_plan =
            calibrate_with(Calibrator::new(&spec).without_centering(), &spec, &[calib]).unwrap();
        let centered = plan
            .decisions
            .iter()
            .filter(|d| d.reason == Reason::Centered)
            .count();
        centered_somewhere |= centered > 0;
        let network = plan.network(&spec).unwrap();
        let cpu = spec.run(&input, None).unwrap();
        let out32 = run_gpu(&mut gpu(&network, false, false), &input);
        let d32 = max_abs(&cpu, &out32);
        assert!(
            d32 <= 1e-3,
            "{} centered, fp32 storage: {d32}",
            model.name()
        );
        let run = |plan: &gsttoonflow::neural::precision::PrecisionPlan| {
            let net = plan.network(&spec).unwrap();
            let mut g = NeuralGpu::new(0, &net, &Storage::from_plan(plan), 0, false).unwrap();
            let out = run_gpu(&mut g, &input);
            (
                psnr(&cpu, &out),
                g.program().arena.arena_bytes,
                g.program().launches.len(),
            )
        };
        let (p_centered, arena_centered, launches_centered) = run(&plan);
        let (p_fp32, arena_fp32, launches_fp32) = run(&fp32_plan);
        println!(
            "{} {}x{}: {centered} stages centered, fp16 stages {} (fp32 kept: {}); PSNR {p_centered:.1} dB \
             (fp32 kept {p_fp32:.1}), arena {arena_centered} B ({arena_fp32}), launches \
             {launches_centered} ({launches_fp32}); fp32 storage max abs {d32:.2e}",
            model.name(),
            input.shape[2],
            input.shape[1],
            plan.count(StoragePrecision::Fp16),
            fp32_plan.count(StoragePrecision::Fp16),
        );
        assert!(p_centered >= 40.0, "{}: {p_centered:.1} dB", model.name());
        assert!(
            p_centered + 1.0 >= p_fp32,
            "{}: {p_centered:.1} < {p_fp32:.1}",
            model.name()
        );
        assert!(arena_centered <= arena_fp32, "{}", model.name());
        // fp16 inputs open the fused paths (channels-last chains, Gram moments); the shift
        // itself adds no launch
        assert!(launches_centered <= launches_fp32, "{}", model.name());
        assert_eq!(
            plan.count(StoragePrecision::Fp16),
            fp32_plan.count(StoragePrecision::Fp16) + centered
        );
    }
    assert!(
        centered_somewhere,
        "no generated model has a stage to center"
    );
}

/// A plan does not depend on where its arena and static block lie: at base 0 for both (the
/// sizing build, these tests' `fp16_plan`) the statistics' static addresses once seemed to lie
/// under the output convolution's arena output, and hayao_class's last modulated normalization
/// stayed an elementwise launch there while the element (distinct bases) folded it into the
/// output convolution's gather. No GPU needed.
#[test]
fn plans_do_not_depend_on_their_bases() {
    let spec = hayao_class().specialise(1080, 1920).unwrap();
    let kernels = |arena: u64, statics: u64| -> Vec<(Kernel, (u32, u32, u32))> {
        fp16_plan_at(&spec, Fusions::ALL, arena, statics)
            .launches
            .iter()
            .map(|l| (l.kernel, l.grid))
            .collect()
    };
    let at_zero = kernels(0, 0);
    let apart = kernels(1 << 32, 1 << 40);
    assert_eq!(at_zero, apart, "the launches at bases (0, 0) and apart");
    // the last normalization's chain goes into the output convolution's gather
    let eltwise = at_zero
        .iter()
        .filter(|(k, _)| *k == Kernel::Eltwise)
        .count();
    let last = at_zero.last().unwrap().0;
    assert!(
        matches!(last, Kernel::ConvMma(..)),
        "the output convolution comes last: {last:?}"
    );
    assert!(
        at_zero[at_zero.len() - 2].0 != Kernel::Eltwise,
        "the last chain is folded ({eltwise} elementwise launches)"
    );
}
