//! Temporal stability of the neural stage on the CPU engine, with the project's Hayao-like
//! network (26-odd normalizations whose whole-frame statistics move with every frame's noise):
//! the per-stream state the element keeps ([`NeuralTemporal`]: statistics smoothing, the output
//! filter with its motion guard, the scene-cut gate), driven frame by frame as the element
//! drives it, on generated clips.
//!
//! - a static noisy clip: the frame-to-frame change of the output with the smoothing on is at
//!   most half of the bare network's;
//! - a bright square moving over a textured background: no ghost where it was (the smoothed
//!   output there follows the bare network's, unlike a filter without a motion guard);
//! - a scene cut: the first frame of the new scene is the bare network's output, bit for bit.
//!
//! The figures are printed (`--nocapture`).

#[path = "common/onnx_models.rs"]
mod onnx_models;

use gsttoonflow::neural::Tensor;
use gsttoonflow::neural::engine::{NeuralModel, Specialised};
use gsttoonflow::neural::frame::{ColorMatrix, ColorRange};
use gsttoonflow::neural::onnx::encode_model;
use gsttoonflow::neural::temporal::{NeuralTemporal, OutputFilter, SceneCutGate, StatSmoother};

const W: usize = 64;
const H: usize = 48;
const PLANE: usize = W * H;
/// The element's scene-cut-threshold default.
const SCENE_CUT_THRESHOLD: f32 = 12.0;
/// The stat smoothing these tests turn on (`model-stat-smoothing`; the element's default is 0).
const STAT_SMOOTHING: f32 = 0.8;

fn network() -> Specialised {
    let bytes = encode_model(&onnx_models::hayao_like());
    NeuralModel::from_bytes(&bytes, "hayao_like.onnx")
        .unwrap()
        .specialise(H, W)
        .unwrap()
}

/// Three planes (R, G, B) in [0, 1].
type Rgb = Vec<f32>;

struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// A still picture: `scene` 0 is warm gradients and a disc, 1 a cool checkered one.
fn scene(kind: u32) -> Rgb {
    let mut rgb = vec![0.0; 3 * PLANE];
    for y in 0..H {
        for x in 0..W {
            let (fx, fy) = (x as f32 / W as f32, y as f32 / H as f32);
            let p = y * W + x;
            let c = if kind == 0 {
                let disc = ((fx - 0.6).powi(2) + (fy - 0.5).powi(2)).sqrt() < 0.25;
                let d = if disc { 0.35 } else { 0.0 };
                [
                    0.3 + 0.5 * fx + d,
                    0.2 + 0.4 * fy,
                    0.15 + 0.2 * fx * fy + d * 0.5,
                ]
            } else {
                // darker and cooler: the luma the scene-cut gate reads moves by ~25 L units
                let check = ((x / 8 + y / 8) % 2) as f32;
                [0.05 + 0.1 * check, 0.05 + 0.15 * fy, 0.4 + 0.3 * check * fx]
            };
            for (k, v) in c.into_iter().enumerate() {
                rgb[k * PLANE + p] = v.clamp(0.0, 1.0);
            }
        }
    }
    rgb
}

fn with_noise(rgb: &Rgb, amplitude: f32, rng: &mut Rng) -> Rgb {
    rgb.iter()
        .map(|v| (v + amplitude * (2.0 * rng.uniform() - 1.0)).clamp(0.0, 1.0))
        .collect()
}

/// A dark textured background with a bright `size`² square whose left edge is at `left`.
fn square_at(left: usize, size: usize) -> Rgb {
    let mut rgb = vec![0.0; 3 * PLANE];
    for y in 0..H {
        for x in 0..W {
            let inside = (left..left + size).contains(&x) && (14..14 + size).contains(&y);
            let texture = 0.1 + 0.05 * ((x * 7 + y * 3) % 5) as f32 / 4.0;
            for k in 0..3 {
                rgb[k * PLANE + y * W + x] = if inside {
                    0.9 - 0.1 * k as f32
                } else {
                    texture
                };
            }
        }
    }
    rgb
}

/// Full-range BT.601 luma codes, what the scene-cut gate reads.
fn luma(rgb: &Rgb) -> Vec<u8> {
    (0..PLANE)
        .map(|p| {
            let y = 0.299 * rgb[p] + 0.587 * rgb[PLANE + p] + 0.114 * rgb[2 * PLANE + p];
            (y * 255.0).round().clamp(0.0, 255.0) as u8
        })
        .collect()
}

/// Planes in [0, 1] → the network's NHWC input in [-1, 1], and back.
fn to_input(rgb: &Rgb) -> Tensor<f32> {
    let mut data = vec![0.0; 3 * PLANE];
    for p in 0..PLANE {
        for k in 0..3 {
            data[3 * p + k] = 2.0 * rgb[k * PLANE + p] - 1.0;
        }
    }
    Tensor::new(vec![1, H, W, 3], data)
}

fn from_output(t: &Tensor<f32>) -> Rgb {
    let mut rgb = vec![0.0; 3 * PLANE];
    for p in 0..PLANE {
        for k in 0..3 {
            rgb[k * PLANE + p] = (t.data[3 * p + k] + 1.0) / 2.0;
        }
    }
    rgb
}

fn bare(net: &Specialised, rgb: &Rgb) -> Rgb {
    from_output(&net.run(&to_input(rgb), None).unwrap())
}

/// What the element keeps per stream, with the statistics smoothing and the output filter
/// (history 4, strength 0.6 and motion-sigma 3: the element's defaults) switchable.
fn temporal(
    net: &Specialised,
    smoothing: f32,
    history: usize,
    motion_sigma: f32,
) -> NeuralTemporal {
    let mut filter = OutputFilter::new(W, H, 4, ColorMatrix::Bt601, ColorRange::Full);
    filter.set_params(history, 0.6, motion_sigma);
    NeuralTemporal {
        smoother: StatSmoother::with_channels(&net.normalize_channels(), smoothing),
        filter,
        scene: SceneCutGate::new(W, H),
    }
}

/// One frame through the element's order: scene-cut gate (reset on a cut), the network with
/// the statistics hook, the output filter. Returns the output and whether it was a cut.
fn step(net: &Specialised, state: &mut NeuralTemporal, rgb: &Rgb) -> (Rgb, bool) {
    let cut = state.begin_frame(&luma(rgb), W, SCENE_CUT_THRESHOLD);
    let mut hook = state.smoother.hook();
    let out = net.run(&to_input(rgb), Some(&mut hook)).unwrap();
    let mut out = from_output(&out);
    state.filter.apply(&mut out).unwrap();
    (out, cut.cut)
}

fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Mean frame-to-frame change over the frames after the first `settle`.
fn flicker(outputs: &[Rgb], settle: usize) -> f32 {
    let changes: Vec<f32> = outputs
        .windows(2)
        .skip(settle)
        .map(|w| mean_abs_diff(&w[0], &w[1]))
        .collect();
    changes.iter().sum::<f32>() / changes.len() as f32
}

#[test]
fn smoothing_halves_the_flicker_of_a_static_noisy_clip() {
    let net = network();
    let still = scene(0);
    let mut rng = Rng(0x5eed_1234_abcd);
    // ±6 codes of 8-bit noise on every channel, a new draw every frame
    let clip: Vec<Rgb> = (0..12)
        .map(|_| with_noise(&still, 6.0 / 255.0, &mut rng))
        .collect();
    let bare_out: Vec<Rgb> = clip.iter().map(|f| bare(&net, f)).collect();
    let run = |smoothing: f32, history: usize| -> Vec<Rgb> {
        let mut state = temporal(&net, smoothing, history, 3.0);
        clip.iter()
            .map(|f| {
                let (out, cut) = step(&net, &mut state, f);
                assert!(!cut, "noise alone must not look like a scene cut");
                out
            })
            .collect()
    };
    let stats_only = run(STAT_SMOOTHING, 0);
    let filter_only = run(0.0, 4);
    let both = run(STAT_SMOOTHING, 4);
    // after the ring has filled (history 4)
    let settle = 4;
    let f_bare = flicker(&bare_out, settle);
    let f_stats = flicker(&stats_only, settle);
    let f_filter = flicker(&filter_only, settle);
    let f_both = flicker(&both, settle);
    let input_flicker = flicker(&clip, settle);
    println!(
        "static noisy clip ({W}x{H}, hayao_like, 12 frames, ±6 codes): mean |frame-to-frame \
         change| input {input_flicker:.5}; output bare {f_bare:.5}, stat smoothing {STAT_SMOOTHING} \
         {f_stats:.5} ({:.2}x), output filter {f_filter:.5} ({:.2}x), both {f_both:.5} ({:.2}x)",
        f_stats / f_bare,
        f_filter / f_bare,
        f_both / f_bare
    );
    assert!(f_bare > 0.0);
    assert!(
        f_both <= 0.5 * f_bare,
        "smoothing on: {f_both}, bare: {f_bare} (must be at most half)"
    );
    // the smoothing keeps the picture: it does not drift from what the network makes of it
    let drift = mean_abs_diff(&both[11], &bare(&net, &still));
    let bare_noise = mean_abs_diff(&bare_out[11], &bare(&net, &still));
    println!(
        "  last frame vs the network on the clean still: smoothed {drift:.5}, bare {bare_noise:.5}"
    );
    assert!(drift <= bare_noise, "{drift} > {bare_noise}");
}

#[test]
fn no_ghost_behind_a_moving_edge() {
    let net = network();
    let size = 16;
    let lefts: Vec<usize> = (0..7).map(|t| 4 + 6 * t).collect();
    let clip: Vec<Rgb> = lefts.iter().map(|&l| square_at(l, size)).collect();
    let bare_out: Vec<Rgb> = clip.iter().map(|f| bare(&net, f)).collect();
    let run = |smoothing: f32, history: usize, motion_sigma: f32| -> Vec<Rgb> {
        let mut state = temporal(&net, smoothing, history, motion_sigma);
        clip.iter()
            .map(|f| {
                let (out, cut) = step(&net, &mut state, f);
                assert!(!cut, "a moving square is not a scene cut");
                out
            })
            .collect()
    };
    // A ghost is the old frame showing through where the square was at t−1 and is not at t:
    // there, fit smoothed_t ≈ bare_t + α·(bare_{t−1} − bare_t) (least squares, over the
    // region's pixels and channels). α = 0: no trace of the old position; α = 1: the old
    // frame. (The smoothed statistics also change the picture a little everywhere; that part
    // is not aligned with the old content and does not enter α.)
    let ghost = |outputs: &[Rgb]| -> f32 {
        let mut worst = 0.0f32;
        for t in 1..clip.len() {
            let (mut along, mut norm) = (0.0f64, 0.0f64);
            for y in 14..14 + size {
                for x in lefts[t - 1]..lefts[t] {
                    for k in 0..3 {
                        let p = k * PLANE + y * W + x;
                        let old = f64::from(bare_out[t - 1][p] - bare_out[t][p]);
                        along += f64::from(outputs[t][p] - bare_out[t][p]) * old;
                        norm += old * old;
                    }
                }
            }
            worst = worst.max((along / norm) as f32);
        }
        worst
    };
    let guarded = ghost(&run(STAT_SMOOTHING, 4, 3.0));
    let unguarded = ghost(&run(STAT_SMOOTHING, 4, 1000.0));
    let stats_only = ghost(&run(STAT_SMOOTHING, 0, 3.0));
    let filter_only = ghost(&run(0.0, 4, 3.0));
    println!("  stat smoothing alone {stats_only:.3}, output filter alone {filter_only:.3}");
    println!(
        "moving edge (16 px square, 6 px a frame): worst ghost behind the edge (share α of the \
         old frame showing through): {guarded:.3} with the motion guard (motion-sigma 3), {unguarded:.3} \
         without (motion-sigma 1000)"
    );
    assert!(guarded <= 0.05, "ghost {guarded}");
    assert!(
        unguarded >= 0.3 && unguarded >= 3.0 * guarded,
        "the measure must see a ghost where there is one: {unguarded}"
    );
}

#[test]
fn a_scene_cut_resets_statistics_and_output_history() {
    let net = network();
    let mut rng = Rng(0xc0ff_ee00_1234);
    let (a, b) = (scene(0), scene(1));
    let clip: Vec<Rgb> = (0..9)
        .map(|t| with_noise(if t < 6 { &a } else { &b }, 6.0 / 255.0, &mut rng))
        .collect();
    let mut state = temporal(&net, STAT_SMOOTHING, 4, 3.0);
    // the same state without the gate's reset: what the cut protects against
    let mut blind = temporal(&net, STAT_SMOOTHING, 4, 3.0);
    let mut cuts = Vec::new();
    for (t, frame) in clip.iter().enumerate() {
        let (out, cut) = step(&net, &mut state, frame);
        let mut hook = blind.smoother.hook();
        let mut blind_out = from_output(&net.run(&to_input(frame), Some(&mut hook)).unwrap());
        blind.filter.apply(&mut blind_out).unwrap();
        if cut {
            cuts.push(t);
        }
        if t == 6 {
            let own = bare(&net, frame);
            let reset = max_abs_diff(&out, &own);
            let stale = mean_abs_diff(&blind_out, &own);
            println!(
                "scene cut at frame 6: max |output − bare network| {reset:e} with the reset; \
                 mean {stale:.4} without it (statistics and ring of the old scene)"
            );
            assert_eq!(
                reset, 0.0,
                "the first frame of a scene is the network's own output"
            );
            assert!(
                stale > 0.01,
                "without the reset the old scene leaks in: {stale}"
            );
        }
    }
    assert_eq!(cuts, vec![6], "exactly the scene change is a cut");
}
