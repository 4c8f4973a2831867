//! Temporal stability of the neural stage: per-frame networks flicker because each frame's
//! normalization statistics move with its content and noise.
//!
//! - [`StatSmoother`] keeps every normalization stage's per-channel mean and variance over
//!   recent frames and replaces the frame's own statistics by their exponential average
//!   (`model-stat-smoothing`), called from the engine's statistics hook.
//! - [`OutputFilter`] is the classic temporal filter with its motion guard, applied to the
//!   network's RGB output at the network's content size (before upscaling and NV12 packing).
//! - [`SceneCutGate`] is the classic scene-cut detector (luma thumbnail) for neural mode.
//!
//! [`NeuralTemporal`] bundles the three with one `reset` for scene cuts, FLUSH, DISCONT and
//! caps changes. Nothing here allocates per frame once the first frame has been seen.

use super::frame::{ColorMatrix, ColorRange};
use crate::pipeline::analysis::{FrameStatistics, SceneCutDetector};
use crate::pipeline::params::{THUMB_H, THUMB_W};
use crate::pipeline::ring::TemporalRing;

/// Largest `model-stat-smoothing`: 0.99 averages over ~100 frames; 1 would freeze the
/// statistics forever.
pub const MAX_STAT_SMOOTHING: f32 = 0.99;

#[derive(Debug, Clone, Default)]
struct StageStatistics {
    mean: Vec<f32>,
    var: Vec<f32>,
    /// Holds a frame's statistics (false after a reset).
    primed: bool,
}

/// Smoothed normalization statistics, one entry per normalization stage.
///
/// With smoothing `a`, each stage's per-channel statistics become
/// `mean_t = a·mean_{t−1} + (1−a)·mean_frame` and `var_t = a·var_{t−1} + (1−a)·var_frame`.
/// The *variance* is averaged, not E[x²]: averaging E[x²] and subtracting the averaged mean²
/// gives the pooled variance of all recent frames, which adds the frame-to-frame spread of
/// the mean to the within-frame variance the network was trained with (a contrast loss that
/// grows with motion), and its difference of two large fp32 numbers loses precision; a convex
/// combination of variances stays ≥ 0 and keeps the trained meaning.
///
/// `a = 0` leaves the statistics untouched, bit for bit. The first frame after construction
/// or [`reset`](Self::reset) uses (and stores) its own statistics. Each stage is expected once
/// per frame.
#[derive(Debug, Clone)]
pub struct StatSmoother {
    smoothing: f32,
    stages: Vec<StageStatistics>,
}

impl StatSmoother {
    /// A smoother for `stages` normalization stages; each stage's buffers are allocated the
    /// first time it is seen (the engine's channel counts), then reused.
    pub fn new(stages: usize, smoothing: f32) -> Self {
        StatSmoother {
            smoothing: clamp_smoothing(smoothing),
            stages: vec![StageStatistics::default(); stages],
        }
    }

    /// A smoother with each stage's buffers preallocated for `channels[k]` channels.
    pub fn with_channels(channels: &[usize], smoothing: f32) -> Self {
        StatSmoother {
            smoothing: clamp_smoothing(smoothing),
            stages: channels
                .iter()
                .map(|&c| StageStatistics {
                    mean: vec![0.0; c],
                    var: vec![0.0; c],
                    primed: false,
                })
                .collect(),
        }
    }

    pub fn smoothing(&self) -> f32 {
        self.smoothing
    }

    /// Changes `a` (clamped to [0, MAX_STAT_SMOOTHING]) without dropping the history.
    pub fn set_smoothing(&mut self, smoothing: f32) {
        self.smoothing = clamp_smoothing(smoothing);
    }

    pub fn stage_count(&self) -> usize {
        self.stages.len()
    }

    /// Forgets every stage's history (scene cut, FLUSH, DISCONT, caps change).
    pub fn reset(&mut self) {
        for s in &mut self.stages {
            s.primed = false;
        }
    }

    /// Replaces stage `stage`'s per-channel statistics of this frame by their smoothed values.
    /// A stage index out of range or mean/var slices of different lengths are left untouched.
    /// A channel whose incoming mean or variance is not finite is left as it is and does not
    /// enter the history.
    pub fn apply(&mut self, stage: usize, mean: &mut [f32], var: &mut [f32]) {
        let a = self.smoothing;
        if a == 0.0 || mean.len() != var.len() {
            return;
        }
        let Some(s) = self.stages.get_mut(stage) else {
            return;
        };
        if !s.primed || s.mean.len() != mean.len() {
            s.mean.clear();
            s.mean.extend_from_slice(mean);
            s.var.clear();
            s.var.extend_from_slice(var);
            s.primed = true;
            return;
        }
        let b = 1.0 - a;
        for c in 0..mean.len() {
            if !mean[c].is_finite() || !var[c].is_finite() {
                continue;
            }
            s.mean[c] = a * s.mean[c] + b * mean[c];
            s.var[c] = a * s.var[c] + b * var[c];
            mean[c] = s.mean[c];
            var[c] = s.var[c];
        }
    }

    /// The statistics hook the engine calls for each normalization stage.
    pub fn hook(&mut self) -> impl FnMut(usize, &mut [f32], &mut [f32]) + '_ {
        move |stage, mean, var| self.apply(stage, mean, var)
    }
}

fn clamp_smoothing(a: f32) -> f32 {
    if a.is_nan() {
        0.0
    } else {
        a.clamp(0.0, MAX_STAT_SMOOTHING)
    }
}

/// The classic temporal output filter on the network's RGB output.
///
/// Works on three planes (R, G, B) of `width × height` in nominal range [0, 1], the layout
/// of [`FrameConverter::network_rgb_mut`](super::frame::FrameConverter::network_rgb_mut), so
/// it runs at the network's (possibly reduced) size and before the 8-bit packing. As in the
/// classic pipeline, the ring holds the *unfiltered* outputs of the last N frames, here as
/// 8-bit codes of [0, 1] (`ring_code`: the stream they become is 8-bit, and the device's ring
/// takes 3 bytes a pixel rather than 6 in fp16), and
///
/// `out = Σ_k w_k·f_k / Σ_k w_k`, `w_0 = 1`, `w_k = s^k·exp(−d_k²/(2σ²))`, `f_k = code_k / 255`
///
/// with s = `temporal-strength`, σ = `motion-sigma`. `d_k` is the distance between `f_k` and
/// the current pixel in the classic filter's units: 100/255 per 8-bit code of the stream's
/// Y, Cb and Cr (so 0–100 over full-range luma, and 0–85.9 over limited-range luma, exactly
/// what the classic filter measures on the same video). One weight serves all three channels
/// and uses the joint distance `d² = ΔY² + ΔCb² + ΔCr²`: for a grey change it is the classic
/// luma distance, and a change of colour at equal luma is caught as motion too. Where a pixel
/// moved by several σ its weights vanish and the current frame shows through: no ghost.
#[derive(Debug)]
pub struct OutputFilter {
    width: usize,
    height: usize,
    ring: TemporalRing<Vec<u8>>,
    /// The current frame's unfiltered codes, swapped into the ring after filtering.
    raw: Vec<u8>,
    history: usize,
    strength: f32,
    /// −1/(2σ²).
    motion_coeff: f32,
    kr: f32,
    kb: f32,
    /// Distance units per nominal unit of Y′ and of Pb/Pr.
    luma_units: f32,
    chroma_units: f32,
    threads: usize,
}

impl OutputFilter {
    /// Largest ring (the classic pipeline's `MAX_HISTORY`).
    pub const MAX_HISTORY: usize = crate::pipeline::params::MAX_HISTORY as usize;

    /// A filter for `width × height` planes with a ring of `capacity` frames, all allocated
    /// now. The history in use starts at `capacity` with the classic defaults (strength 0.6,
    /// motion-sigma 3).
    pub fn new(
        width: usize,
        height: usize,
        capacity: usize,
        matrix: ColorMatrix,
        range: ColorRange,
    ) -> Self {
        let capacity = capacity.min(Self::MAX_HISTORY);
        let n = 3 * width * height;
        let (kr, kb) = matrix.kr_kb();
        let (_, y_scale, c_scale) = range.code_scales();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(16);
        let mut filter = OutputFilter {
            width,
            height,
            ring: TemporalRing::new(capacity, || vec![0; n]),
            raw: if capacity > 0 { vec![0; n] } else { Vec::new() },
            history: capacity,
            strength: 0.0,
            motion_coeff: 0.0,
            kr,
            kb,
            luma_units: 100.0 * y_scale / 255.0,
            chroma_units: 100.0 * c_scale / 255.0,
            threads,
        };
        filter.set_params(capacity, 0.6, 3.0);
        filter
    }

    /// `temporal-history` (clamped to the ring's capacity; 0 = off), `temporal-strength`
    /// (clamped to [0, 1]) and `motion-sigma` (at least 0.01, as in the classic pipeline).
    pub fn set_params(&mut self, history: usize, strength: f32, motion_sigma: f32) {
        self.history = history.min(self.capacity());
        self.strength = strength.clamp(0.0, 1.0);
        let sigma = motion_sigma.max(0.01);
        self.motion_coeff = -1.0 / (2.0 * sigma * sigma);
    }

    /// Limits the worker threads (1 = the calling thread only).
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    pub fn capacity(&self) -> usize {
        self.ring.cursor().capacity()
    }

    /// Frames held in the ring.
    pub fn len(&self) -> usize {
        self.ring.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// Empties the ring (scene cut, FLUSH, DISCONT, caps change).
    pub fn reset(&mut self) {
        self.ring.clear();
    }

    /// Filters `rgb` (three planes of `width × height`) in place against the ring, then adds
    /// its unfiltered copy to the ring. Returns the number of ring entries used. With history
    /// 0 the frame is left untouched and not recorded. Planes of another size are refused
    /// and leave the ring as it was.
    pub fn apply(&mut self, rgb: &mut [f32]) -> Result<usize, String> {
        let plane = self.width * self.height;
        if rgb.len() != 3 * plane {
            return Err(format!(
                "the output filter holds {}x{} RGB planes ({} values), got {} values",
                self.width,
                self.height,
                3 * plane,
                rgb.len()
            ));
        }
        if self.history == 0 {
            return Ok(0);
        }
        let used = self.ring.len().min(self.history);
        for (code, &v) in self.raw.iter_mut().zip(rgb.iter()) {
            *code = ring_code(v);
        }
        if used > 0 {
            self.filter(rgb, used);
        }
        let raw = &mut self.raw;
        self.ring.push_with(|slot| std::mem::swap(slot, raw));
        Ok(used)
    }

    fn filter(&self, rgb: &mut [f32], used: usize) {
        let plane = self.width * self.height;
        let mut recent: [&[u8]; Self::MAX_HISTORY] = [&[]; Self::MAX_HISTORY];
        for (k, r) in recent.iter_mut().enumerate().take(used) {
            *r = self.ring.recent(k + 1).expect("ring entry");
        }
        let recent = &recent[..used];
        let (r, rest) = rgb.split_at_mut(plane);
        let (g, b) = rest.split_at_mut(plane);
        let threads = if plane >= 1 << 16 { self.threads } else { 1 };
        let per = plane.div_ceil(threads);
        std::thread::scope(|s| {
            let bands = r
                .chunks_mut(per)
                .zip(g.chunks_mut(per))
                .zip(b.chunks_mut(per))
                .enumerate();
            for (i, ((r, g), b)) in bands {
                let first = i * per;
                if threads == 1 {
                    self.filter_band(first, r, g, b, recent);
                } else {
                    s.spawn(move || self.filter_band(first, r, g, b, recent));
                }
            }
        });
    }

    /// Filters pixels `first..first + r.len()` of the three planes.
    fn filter_band(
        &self,
        first: usize,
        r: &mut [f32],
        g: &mut [f32],
        b: &mut [f32],
        recent: &[&[u8]],
    ) {
        let plane = self.width * self.height;
        let (kr, kb) = (self.kr, self.kb);
        let kg = 1.0 - kr - kb;
        // Pb = (B' − Y')/(2(1 − kb)), Pr = (R' − Y')/(2(1 − kr)), in distance units: one
        // coefficient each, so the loop multiplies (kernels/neural_frame.cu does the same)
        let lu = self.luma_units;
        let cb_units = self.chroma_units / (2.0 * (1.0 - kb));
        let cr_units = self.chroma_units / (2.0 * (1.0 - kr));
        for i in 0..r.len() {
            let p = first + i;
            let f0 = [r[i], g[i], b[i]];
            let mut acc = f0;
            let (mut wsum, mut sk) = (1.0f32, 1.0f32);
            for fk in recent {
                sk *= self.strength;
                let fk = [fk[p], fk[plane + p], fk[2 * plane + p]].map(ring_value);
                let d = [fk[0] - f0[0], fk[1] - f0[1], fk[2] - f0[2]];
                let dy = kr * d[0] + kg * d[1] + kb * d[2];
                let dl = lu * dy;
                let dcb = cb_units * (d[2] - dy);
                let dcr = cr_units * (d[0] - dy);
                let w = sk * (self.motion_coeff * (dl * dl + dcb * dcb + dcr * dcr)).exp();
                for c in 0..3 {
                    acc[c] += w * fk[c];
                }
                wsum += w;
            }
            let inv = 1.0 / wsum;
            r[i] = acc[0] * inv;
            g[i] = acc[1] * inv;
            b[i] = acc[2] * inv;
        }
    }
}

/// A ring entry's 8-bit code of a nominal value: [0, 1] in 255 steps, half away from zero
/// (`nf_ring_code` in kernels/neural_frame.cu).
pub fn ring_code(v: f32) -> u8 {
    (v.clamp(0.0, 1.0) * 255.0).round() as u8
}

/// The nominal value a ring entry's code stands for (the filter's `f_k`).
pub fn ring_value(code: u8) -> f32 {
    code as f32 / 255.0
}

/// Whether a frame starts a new scene, and its score (mean absolute thumbnail change, L units).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SceneCut {
    pub cut: bool,
    pub score: f32,
}

/// The classic scene-cut detector on the input frame's luma, for neural mode.
#[derive(Debug)]
pub struct SceneCutGate {
    width: usize,
    height: usize,
    statistics: FrameStatistics,
    detector: SceneCutDetector,
}

impl SceneCutGate {
    pub fn new(width: usize, height: usize) -> Self {
        SceneCutGate {
            width,
            height,
            statistics: FrameStatistics::new(width.min(THUMB_W), height.min(THUMB_H)),
            detector: SceneCutDetector::default(),
        }
    }

    /// Scores a frame's Y plane against the previous frame's; a cut is a score above
    /// `threshold` (`scene-cut-threshold`, as in the classic pipeline).
    pub fn observe(&mut self, y: &[u8], y_stride: usize, threshold: f32) -> SceneCut {
        self.statistics.gather(y, y_stride, self.width, self.height);
        let score = self
            .detector
            .score(self.statistics.thumbnail(self.width, self.height));
        SceneCut {
            cut: score > threshold,
            score,
        }
    }

    pub fn reset(&mut self) {
        self.detector.reset();
    }
}

/// The neural stage's temporal state for one stream: statistics, output ring, scene cuts.
#[derive(Debug)]
pub struct NeuralTemporal {
    pub smoother: StatSmoother,
    pub filter: OutputFilter,
    pub scene: SceneCutGate,
}

impl NeuralTemporal {
    /// Observes the input frame's luma before the network runs; on a scene cut empties the
    /// statistics and the output ring (the scene detector keeps this frame as its reference).
    pub fn begin_frame(&mut self, y: &[u8], y_stride: usize, threshold: f32) -> SceneCut {
        let cut = self.scene.observe(y, y_stride, threshold);
        if cut.cut {
            self.smoother.reset();
            self.filter.reset();
        }
        cut
    }

    /// FLUSH, DISCONT, caps change: everything forgotten.
    pub fn reset(&mut self) {
        self.smoother.reset();
        self.filter.reset();
        self.scene.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::cpu::temporal_luma;
    use crate::pipeline::params::{StageParams, ToonParams};

    /// xorshift64* with Box–Muller, fixed seeds.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 + 0.5) / (1 << 24) as f32
        }
        fn gaussian(&mut self) -> f32 {
            let (a, b) = (self.next(), self.next());
            (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
        }
    }

    #[test]
    fn smoothing_zero_is_the_identity_bit_for_bit() {
        let mut s = StatSmoother::new(3, 0.0);
        let mut rng = Rng(7);
        for _ in 0..5 {
            for k in 0..3 {
                let mut mean: Vec<f32> = (0..16).map(|_| rng.gaussian()).collect();
                let mut var: Vec<f32> = (0..16).map(|_| rng.next() * 1e-3).collect();
                mean[3] = f32::MIN_POSITIVE / 4.0; // subnormal
                let (m0, v0) = (mean.clone(), var.clone());
                (s.hook())(k, &mut mean, &mut var);
                assert_eq!(
                    mean.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    m0.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                assert_eq!(var, v0);
            }
        }
        assert_eq!(StatSmoother::new(1, -3.0).smoothing(), 0.0);
        assert_eq!(StatSmoother::new(1, f32::NAN).smoothing(), 0.0);
        assert_eq!(StatSmoother::new(1, 1.0).smoothing(), MAX_STAT_SMOOTHING);
    }

    /// Runs `frames` frames of a stationary sequence (per channel: mean μ_c + N(0, 0.05),
    /// variance ν_c·(1 + N(0, 0.1))) through the smoother; returns (last smoothed means,
    /// mean |Δ| frame to frame of the bare means, of the smoothed means).
    fn stationary(smoothing: f32, frames: usize) -> (Vec<f32>, f64, f64) {
        let channels = 32;
        let mut s = StatSmoother::new(2, smoothing);
        let mut rng = Rng(42);
        let (mut prev_bare, mut prev_out): (Option<Vec<f32>>, Option<Vec<f32>>) = (None, None);
        let (mut bare_change, mut out_change, mut n) = (0.0f64, 0.0f64, 0usize);
        let mut last = Vec::new();
        for t in 0..frames {
            let mut mean: Vec<f32> = (0..channels)
                .map(|c| c as f32 * 0.1 + 0.05 * rng.gaussian())
                .collect();
            let mut var: Vec<f32> = (0..channels)
                .map(|c| (1.0 + c as f32 * 0.01) * (1.0 + 0.1 * rng.gaussian()))
                .collect();
            let bare = mean.clone();
            s.apply(1, &mut mean, &mut var);
            assert!(var.iter().all(|&v| v > 0.0));
            if t >= 20 {
                let d = |a: &[f32], b: &[f32]| {
                    a.iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs() as f64)
                        .sum::<f64>()
                };
                bare_change += d(&bare, prev_bare.as_ref().unwrap());
                out_change += d(&mean, prev_out.as_ref().unwrap());
                n += channels;
            }
            prev_bare = Some(bare);
            prev_out = Some(mean.clone());
            last = mean;
        }
        (last, bare_change / n as f64, out_change / n as f64)
    }

    #[test]
    fn smoothing_converges_and_steadies_a_noisy_sequence() {
        for a in [0.5f32, 0.8, 0.95] {
            let (last, bare, smoothed) = stationary(a, 400);
            let err = last
                .iter()
                .enumerate()
                .map(|(c, m)| (m - c as f32 * 0.1).abs())
                .sum::<f32>()
                / last.len() as f32;
            // Stationary EMA: std of the estimate is 0.05·sqrt((1−a)/(1+a)); the change per
            // frame is (1−a)/sqrt(1+a) of the bare change.
            let expected = (1.0 - a as f64) / (1.0 + a as f64).sqrt();
            println!(
                "stat smoothing {a}: mean |Δ| per frame {smoothed:.5} vs bare {bare:.5} \
                 (ratio {:.3}, theory {expected:.3}), mean error {err:.4}",
                smoothed / bare
            );
            assert!(smoothed <= 0.5 * bare, "{smoothed} vs {bare}");
            assert!((smoothed / bare - expected).abs() < 0.05);
            assert!(
                err < 0.05 * 1.2 * ((1.0 - a) / (1.0 + a)).sqrt() + 1e-3,
                "{err}"
            );
        }
    }

    #[test]
    fn first_frame_and_frames_after_reset_use_their_own_statistics() {
        let mut s = StatSmoother::with_channels(&[2], 0.9);
        let (mut m, mut v) = ([1.0, 2.0], [3.0, 4.0]);
        s.apply(0, &mut m, &mut v);
        assert_eq!((m, v), ([1.0, 2.0], [3.0, 4.0]));
        let (mut m, mut v) = ([11.0, 2.0], [3.0, 14.0]);
        s.apply(0, &mut m, &mut v);
        assert!(
            (m[0] - 2.0).abs() < 1e-6 && (v[1] - 5.0).abs() < 1e-6,
            "{m:?} {v:?}"
        );
        s.reset();
        let (mut m, mut v) = ([-5.0, 0.5], [0.25, 9.0]);
        s.apply(0, &mut m, &mut v);
        assert_eq!((m, v), ([-5.0, 0.5], [0.25, 9.0]));
    }

    #[test]
    fn bad_stage_calls_are_left_alone() {
        let mut s = StatSmoother::new(1, 0.5);
        let (mut m, mut v) = ([1.0, 2.0], [1.0, 1.0]);
        s.apply(0, &mut m, &mut v);
        // Out of range stage, mismatched lengths: untouched.
        let (mut m2, mut v2) = ([9.0, 9.0], [9.0, 9.0]);
        s.apply(5, &mut m2, &mut v2);
        assert_eq!((m2, v2), ([9.0, 9.0], [9.0, 9.0]));
        let (mut m3, mut v3) = ([9.0, 9.0], [9.0]);
        s.apply(0, &mut m3, &mut v3);
        assert_eq!(m3, [9.0, 9.0]);
        // A NaN channel passes through without poisoning the history.
        let (mut m4, mut v4) = ([f32::NAN, 3.0], [1.0, 1.0]);
        s.apply(0, &mut m4, &mut v4);
        assert!(m4[0].is_nan());
        assert_eq!(m4[1], 2.5);
        let (mut m5, mut v5) = ([1.0, 2.5], [1.0, 1.0]);
        s.apply(0, &mut m5, &mut v5);
        assert_eq!(m5, [1.0, 2.5]);
    }

    fn planes(w: usize, h: usize, f: impl Fn(usize, usize, usize) -> f32) -> Vec<f32> {
        (0..3)
            .flat_map(|c| (0..h).flat_map(move |y| (0..w).map(move |x| (c, x, y))))
            .map(|(c, x, y)| f(c, x, y))
            .collect()
    }

    #[test]
    fn ring_codes_round_half_away_and_clamp() {
        assert_eq!(ring_code(0.0), 0);
        assert_eq!(ring_code(1.0), 255);
        assert_eq!(ring_code(0.5), 128, "127.5 rounds up");
        assert_eq!(ring_code(100.4 / 255.0), 100);
        assert_eq!(ring_code(-0.2), 0);
        assert_eq!(ring_code(1.3), 255);
        assert_eq!(ring_code(f32::NAN), 0);
        // every code survives the trip through its value
        for c in 0..=255u8 {
            assert_eq!(ring_code(ring_value(c)), c);
        }
    }

    #[test]
    fn history_zero_is_the_identity() {
        let mut f = OutputFilter::new(8, 4, 4, ColorMatrix::Bt709, ColorRange::Limited);
        f.set_params(0, 0.9, 50.0);
        for t in 0..5 {
            let frame = planes(8, 4, |c, x, y| (c + x + y + t) as f32 / 20.0);
            let mut out = frame.clone();
            assert_eq!(f.apply(&mut out), Ok(0));
            assert_eq!(out, frame);
        }
        assert!(f.is_empty());
        let mut off = OutputFilter::new(8, 4, 0, ColorMatrix::Bt709, ColorRange::Limited);
        let frame = planes(8, 4, |c, x, _| (c * x) as f32 / 30.0);
        let mut out = frame.clone();
        assert_eq!(off.apply(&mut out), Ok(0));
        assert_eq!(out, frame);
    }

    #[test]
    fn grey_pixels_follow_the_classic_luma_formula() {
        // Full range: grey level v is L = 100·v, the classic filter's units exactly.
        let params = StageParams {
            temporal_strength: 0.7,
            motion_sigma: 4.0,
            ..Default::default()
        };
        let p = ToonParams::new(&params, 2, 2);
        let mut f = OutputFilter::new(1, 1, 4, ColorMatrix::Bt601, ColorRange::Full);
        f.set_params(4, 0.7, 4.0);
        let levels = [0.50f32, 0.52, 0.47, 0.55, 0.51, 0.60];
        for (t, &v) in levels.iter().enumerate() {
            let mut px = [v, v, v];
            let used = f.apply(&mut px).unwrap();
            assert_eq!(used, t.min(4));
            // the ring holds the earlier levels as 8-bit codes
            let history = levels[..t]
                .iter()
                .rev()
                .take(4)
                .map(|&h| 100.0 * ring_value(ring_code(h)));
            let want = temporal_luma(&p, 100.0 * v, history) / 100.0;
            for c in px {
                assert!((c - want).abs() < 1e-5, "frame {t}: {c} vs {want}");
            }
        }
    }

    #[test]
    fn limited_range_distance_is_in_code_units() {
        // A grey step of 10/219 nominal is 10 codes of limited-range luma = 3.92 L units.
        // (from a grey the ring holds exactly: code 128)
        let mut f = OutputFilter::new(1, 1, 1, ColorMatrix::Bt709, ColorRange::Limited);
        f.set_params(1, 1.0, 3.0);
        let grey = ring_value(128);
        f.apply(&mut [grey; 3]).unwrap();
        let step = 10.0 / 219.0;
        let mut px = [grey + step; 3];
        f.apply(&mut px).unwrap();
        let d = 100.0 * 10.0 / 255.0;
        let w = (-d * d / 18.0f32).exp();
        let want = (grey + step + w * grey) / (1.0 + w);
        assert!((px[0] - want).abs() < 1e-6, "{} vs {want}", px[0]);
    }

    #[test]
    fn a_moving_edge_leaves_no_ghost_and_reset_empties_the_ring() {
        let (w, h) = (64, 8);
        let mut f = OutputFilter::new(w, h, 4, ColorMatrix::Bt709, ColorRange::Limited);
        f.set_params(4, 0.9, 3.0);
        // levels the ring holds exactly, so a static pixel keeps its value
        let exact = |v: f32| ring_value(ring_code(v));
        for t in 0..8 {
            let edge = 8 + 6 * t;
            let frame = planes(w, h, |c, x, _| {
                exact(if x < edge { 0.8 - 0.1 * c as f32 } else { 0.1 })
            });
            let mut out = frame.clone();
            f.apply(&mut out).unwrap();
            for (i, (&o, &v)) in out.iter().zip(&frame).enumerate() {
                let x = i % w;
                if x < edge - 6 || x >= edge {
                    assert!((o - v).abs() < 1e-6, "static pixel {x}");
                } else {
                    // Swept by the edge since the last frame: 70 L units away, weight e^-272.
                    assert!(
                        (o - v).abs() < 1e-6,
                        "ghost at x {x}, frame {t}: {o} vs {v}"
                    );
                }
            }
        }
        assert_eq!(f.len(), 4);
        f.reset();
        assert!(f.is_empty());
        let mut px = planes(w, h, |_, _, _| 0.3);
        assert_eq!(f.apply(&mut px), Ok(0));
        assert!(px.iter().all(|&v| v == 0.3));
        assert_eq!(f.len(), 1);
        assert!(f.apply(&mut px[1..]).is_err());
        assert_eq!(f.len(), 1, "a refused frame is not recorded");
    }

    #[test]
    fn threaded_and_single_threaded_filters_agree() {
        let (w, h) = (320, 240);
        let mut rng = Rng(3);
        let frames: Vec<Vec<f32>> = (0..5)
            .map(|_| {
                let noise: Vec<f32> = (0..3 * w * h).map(|_| 0.01 * rng.gaussian()).collect();
                let base = planes(w, h, |c, x, y| ((x + 2 * y + c) % 50) as f32 / 60.0);
                base.iter().zip(&noise).map(|(b, n)| b + n).collect()
            })
            .collect();
        let mut outs = Vec::new();
        for threads in [1, 4] {
            let mut f = OutputFilter::new(w, h, 4, ColorMatrix::Bt601, ColorRange::Full);
            f.set_threads(threads);
            let mut last = Vec::new();
            for frame in &frames {
                last = frame.clone();
                f.apply(&mut last).unwrap();
            }
            outs.push(last);
        }
        assert_eq!(outs[0], outs[1]);
        assert_ne!(outs[0], frames[4], "the filter did something");
    }

    #[test]
    fn scene_cuts_reset_statistics_and_ring() {
        let (w, h) = (64, 36);
        let dark = vec![30u8; w * h];
        let bright: Vec<u8> = (0..w * h).map(|i| 150 + (i % 7) as u8).collect();
        let mut t = NeuralTemporal {
            smoother: StatSmoother::new(1, 0.9),
            filter: OutputFilter::new(4, 4, 2, ColorMatrix::Bt709, ColorRange::Limited),
            scene: SceneCutGate::new(w, h),
        };
        let threshold = 12.0;
        assert!(!t.begin_frame(&dark, w, threshold).cut);
        t.smoother.apply(0, &mut [1.0], &mut [1.0]);
        t.filter.apply(&mut [0.1; 48]).unwrap();
        assert!(!t.begin_frame(&dark, w, threshold).cut);
        t.filter.apply(&mut [0.1; 48]).unwrap();
        assert_eq!(t.filter.len(), 2);
        let cut = t.begin_frame(&bright, w, threshold);
        assert!(cut.cut && cut.score > 40.0, "{cut:?}");
        assert!(t.filter.is_empty());
        let (mut m, mut v) = ([5.0], [2.0]);
        t.smoother.apply(0, &mut m, &mut v);
        assert_eq!(
            (m, v),
            ([5.0], [2.0]),
            "first frame of the new scene uses its own stats"
        );
        assert!(!t.begin_frame(&bright, w, threshold).cut);
        t.reset();
        assert_eq!(t.begin_frame(&dark, w, threshold).score, 0.0);
    }
}
