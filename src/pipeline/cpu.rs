//! The CPU reference: every stage of the stylize pipeline in plain f32 Rust.
//!
//! This is the oracle the CUDA kernels are tested against, so each stage is written as the
//! formula reads (docs/pipeline.md, which gives every formula and the defaults) and evaluates
//! its terms in the order the kernels do. Rows are split into bands over a pool of worker
//! threads made with the pipeline ([`BandPool`]); after [`CpuPipeline::new`], processing a frame
//! allocates nothing and starts no thread.

use std::time::{Duration, Instant};

use super::analysis::{FrameStatistics, SceneCutDetector, apply_levels};
use super::band_pool::BandPool;
use super::frame::{FrameGeometry, Nv12Frame, Nv12FrameMut};
use super::params::ToonParams;
use super::ring::TemporalRing;

/// Luma 0–255 code to the L scale (0–100).
#[inline]
pub fn luma_to_l(y: u8) -> f32 {
    100.0 * y as f32 / 255.0
}

/// Chroma 0–255 code to the signed chroma scale.
#[inline]
pub fn chroma_to_c(c: u8) -> f32 {
    (c as f32 - 128.0) / 255.0
}

/// Soft quantization (Winnemöller et al. 2006): `q` is the bin boundary nearest to `l`, and
/// `q + (Δq/2)·tanh(φ_q·(l − q))` sends flat areas to the `levels` bin centres with a smooth
/// step between them. (Putting `q` at the bin centre instead would make `levels + 1` plateaus at
/// the boundaries; the paper's form gives exactly `levels`, see docs/pipeline.md.)
#[inline]
pub fn quantize(l: f32, levels: i32, sharpness: f32) -> f32 {
    let dq = 100.0 / levels as f32;
    let q = dq * (l / dq + 0.5).floor();
    q + (dq * 0.5) * (sharpness * (l - q)).tanh()
}

/// DoG response to the blended edge factor E' in [0, 1] (1 = no line).
#[inline]
pub fn edge_factor(g1: f32, g2: f32, p: &ToonParams) -> f32 {
    let h = g1 - p.edge_tau * g2;
    let e = if h > 0.0 {
        1.0
    } else {
        (1.0 + (p.edge_sharpness * h).tanh()).clamp(0.0, 1.0)
    };
    1.0 - p.edge_strength * (1.0 - e)
}

/// Final 8-bit luma from quantized L and the edge factor.
#[inline]
pub fn pack_luma(lq: f32, e: f32) -> u8 {
    (255.0 * lq * e / 100.0).round().clamp(0.0, 255.0) as u8
}

/// Final 8-bit chroma from filtered chroma, saturation and the block's edge factor.
#[inline]
pub fn pack_chroma(c: f32, saturation: f32, e_half: f32) -> u8 {
    (128.0 + 255.0 * saturation * c * e_half)
        .round()
        .clamp(0.0, 255.0) as u8
}

#[inline]
fn clamp_index(i: isize, n: usize) -> usize {
    i.clamp(0, n as isize - 1) as usize
}

/// The features of one frame: smoothed luma and interleaved (u, v) chroma.
#[derive(Debug, Clone)]
pub struct Feature {
    pub l: Vec<f32>,
    pub uv: Vec<f32>,
}

/// What a processed frame reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FrameReport {
    pub scene_cut: bool,
    pub scene_score: f32,
    /// Entries of the ring that took part in this frame's temporal filter.
    pub history_used: usize,
}

/// How long each stage of a frame took (both CPU paths report it; the benchmark prints it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    /// Unpack to working planes, statistics and the scene-cut score.
    pub unpack_analysis: Duration,
    /// Bilateral iterations up to the edge iteration (the features).
    pub smoothing_to_edges: Duration,
    /// Temporal filter and the ring update.
    pub temporal: Duration,
    /// DoG and the edge factor.
    pub edges: Duration,
    /// The remaining bilateral iterations.
    pub smoothing_after_edges: Duration,
    /// Auto-levels, quantization, compose and pack.
    pub compose: Duration,
}

impl StageTimes {
    /// Stage names, in the order of [`StageTimes::as_array`].
    pub const NAMES: [&'static str; 6] = [
        "unpack+analysis",
        "smoothing to edges",
        "temporal",
        "edges (DoG)",
        "smoothing after edges",
        "compose+pack",
    ];

    pub fn as_array(&self) -> [Duration; 6] {
        [
            self.unpack_analysis,
            self.smoothing_to_edges,
            self.temporal,
            self.edges,
            self.smoothing_after_edges,
            self.compose,
        ]
    }

    pub fn total(&self) -> Duration {
        self.as_array().iter().sum()
    }
}

/// What both CPU paths keep per stream: working planes, the temporal ring, the scene detector,
/// the worker pool and the last frame's stage times. The features in the ring are whatever
/// layout the path keeps its chroma in (the reference interleaved, the fast path planar).
#[derive(Debug)]
pub(crate) struct StreamPlanes {
    pub geometry: FrameGeometry,
    pub pool: BandPool,
    pub l: Vec<f32>,
    pub uv: Vec<f32>,
    pub tmp_l: Vec<f32>,
    pub tmp_uv: Vec<f32>,
    pub dog1: Vec<f32>,
    pub dog2: Vec<f32>,
    pub edge: Vec<f32>,
    pub ring: TemporalRing<Feature>,
    pub statistics: FrameStatistics,
    pub detector: SceneCutDetector,
    pub times: StageTimes,
}

impl StreamPlanes {
    /// Allocates every plane for `geometry` and a ring of `history` features; one thread per
    /// core (at most 16).
    pub fn new(geometry: FrameGeometry, history: usize) -> Self {
        let n = geometry.luma_pixels();
        let nc = geometry.chroma_pixels() * 2;
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(16);
        let p = ToonParams::new(
            &Default::default(),
            geometry.width as u32,
            geometry.height as u32,
        );
        StreamPlanes {
            geometry,
            pool: BandPool::new(threads),
            l: vec![0.0; n],
            uv: vec![0.0; nc],
            tmp_l: vec![0.0; n],
            tmp_uv: vec![0.0; nc],
            dog1: vec![0.0; n],
            dog2: vec![0.0; n],
            edge: vec![0.0; n],
            ring: TemporalRing::new(history, || Feature {
                l: vec![0.0; n],
                uv: vec![0.0; nc],
            }),
            statistics: FrameStatistics::new(p.thumb_w as usize, p.thumb_h as usize),
            detector: SceneCutDetector::with_capacity((p.thumb_w * p.thumb_h) as usize),
            times: StageTimes::default(),
        }
    }

    pub fn history_capacity(&self) -> usize {
        self.ring.cursor().capacity()
    }

    /// Luma width and height, chroma width and height.
    pub fn dims(&self) -> (usize, usize, usize, usize) {
        let g = self.geometry;
        (g.width, g.height, g.chroma_width(), g.chroma_height())
    }

    /// Empties the temporal ring and forgets the previous thumbnail (flush, discont, caps).
    pub fn reset(&mut self) {
        self.ring.clear();
        self.detector.reset();
    }

    /// The frame's statistics from its luma; returns the scene-cut score against the last frame.
    pub fn analyse(&mut self, input: &Nv12Frame) -> f32 {
        let (w, h) = (self.geometry.width, self.geometry.height);
        self.statistics.gather(input.y, input.y_stride, w, h);
        self.detector.score_statistics(&self.statistics, w, h)
    }

    /// The raw features join the ring; the filtered ones (in the tmp planes) become current.
    pub fn remember_features(&mut self) {
        let (l, uv) = (&self.l, &self.uv);
        self.ring.push_with(|slot| {
            slot.l.copy_from_slice(l);
            slot.uv.copy_from_slice(uv);
        });
        std::mem::swap(&mut self.l, &mut self.tmp_l);
        std::mem::swap(&mut self.uv, &mut self.tmp_uv);
    }
}

/// The public methods both CPU paths (a struct with a `s: StreamPlanes` field and
/// [`ClassicStages`]) offer, written once.
macro_rules! classic_pipeline_methods {
    () => {
        pub fn geometry(&self) -> FrameGeometry {
            self.s.geometry
        }

        pub fn history_capacity(&self) -> usize {
            self.s.history_capacity()
        }

        /// Sets the number of threads a frame runs on (1 = the calling thread alone); replaces
        /// the worker pool, so call it at setup, not per frame.
        pub fn set_threads(&mut self, threads: usize) {
            if threads.max(1) != self.s.pool.threads() {
                self.s.pool = BandPool::new(threads);
            }
        }

        pub fn threads(&self) -> usize {
            self.s.pool.threads()
        }

        /// How long each stage of the last frame took.
        pub fn last_stage_times(&self) -> StageTimes {
            self.s.times
        }

        /// Empties the temporal ring and forgets the previous thumbnail (flush, discont, caps).
        pub fn reset(&mut self) {
            self.s.reset();
        }

        /// Stylizes `input` into `output`. Both must have this pipeline's geometry.
        pub fn process(
            &mut self,
            p: &ToonParams,
            input: &Nv12Frame,
            output: &mut Nv12FrameMut,
        ) -> FrameReport {
            run_stages(self, p, input, output)
        }
    };
}
pub(crate) use classic_pipeline_methods;

/// The stages one CPU path provides; [`run_stages`] runs them in the pipeline's order, so the
/// reference and the fast path share the order, the ring, the scene cuts and the timing, and
/// differ only in their arithmetic.
pub(crate) trait ClassicStages {
    fn planes(&mut self) -> &mut StreamPlanes;
    /// Stage 1: the frame into the working planes, statistics through
    /// [`StreamPlanes::analyse`]; returns the scene-cut score.
    fn unpack_and_analyse(&mut self, input: &Nv12Frame) -> f32;
    /// One bilateral iteration (x pass then y pass) over luma and chroma, in place.
    fn bilateral_iteration(&mut self, p: &ToonParams);
    /// Filters the current features against the `used` most recent ring entries into tmp planes.
    fn temporal(&mut self, p: &ToonParams, used: usize);
    /// DoG of the filtered luma into the edge factor.
    fn edges(&mut self, p: &ToonParams);
    /// Quantize, compose with the edges and pack NV12.
    fn compose(&mut self, p: &ToonParams, levels: Option<(f32, f32)>, output: &mut Nv12FrameMut);
}

/// Stylizes `input` into `output` with `stages`. Both frames must have the pipeline's geometry.
pub(crate) fn run_stages(
    stages: &mut impl ClassicStages,
    p: &ToonParams,
    input: &Nv12Frame,
    output: &mut Nv12FrameMut,
) -> FrameReport {
    let geometry = stages.planes().geometry;
    assert_eq!(
        input.geometry, geometry,
        "input geometry differs from the pipeline's"
    );
    assert_eq!(
        output.geometry, geometry,
        "output geometry differs from the pipeline's"
    );
    let t0 = Instant::now();

    // 1. Unpack and analysis.
    let scene_score = stages.unpack_and_analyse(input);
    let scene_cut = scene_score > p.scene_cut_threshold;
    let t1 = Instant::now();

    // 2. Edge-preserving smoothing up to the edge iteration: these are the frame's features.
    let edge_iteration = p.edge_iteration.clamp(0, p.bilateral_iterations.max(0));
    for _ in 0..edge_iteration {
        stages.bilateral_iteration(p);
    }
    let t2 = Instant::now();

    // 3. Temporal filter of the features against the ring; the raw features join the ring.
    // Everything after this point (edges, further smoothing, quantization) works on the
    // filtered features, so neither the lines nor the bands flicker.
    if scene_cut {
        stages.planes().ring.clear();
    }
    let history_used = stages.planes().ring.len().min(p.history.max(0) as usize);
    stages.temporal(p, history_used);
    stages.planes().remember_features();
    let t3 = Instant::now();

    // 4. DoG edges of the filtered features, then the remaining smoothing iterations.
    stages.edges(p);
    let t4 = Instant::now();
    for _ in edge_iteration..p.bilateral_iterations.max(0) {
        stages.bilateral_iteration(p);
    }
    let t5 = Instant::now();

    // 5–6. Auto-levels, quantize, compose, pack.
    let levels = if p.auto_levels != 0 {
        stages.planes().statistics.levels()
    } else {
        None
    };
    stages.compose(p, levels, output);
    let t6 = Instant::now();
    stages.planes().times = StageTimes {
        unpack_analysis: t1 - t0,
        smoothing_to_edges: t2 - t1,
        temporal: t3 - t2,
        edges: t4 - t3,
        smoothing_after_edges: t5 - t4,
        compose: t6 - t5,
    };
    FrameReport {
        scene_cut,
        scene_score,
        history_used,
    }
}

/// The CPU backend's per-stream state: working planes, the temporal ring, the scene detector.
#[derive(Debug)]
pub struct CpuPipeline {
    s: StreamPlanes,
}

impl CpuPipeline {
    /// Allocates every plane for `geometry` and a ring of `history` features.
    pub fn new(geometry: FrameGeometry, history: usize) -> Self {
        CpuPipeline {
            s: StreamPlanes::new(geometry, history),
        }
    }

    classic_pipeline_methods!();
}

impl ClassicStages for CpuPipeline {
    fn planes(&mut self) -> &mut StreamPlanes {
        &mut self.s
    }

    fn unpack_and_analyse(&mut self, input: &Nv12Frame) -> f32 {
        let (w, h, cw, ch) = self.s.dims();
        let pool = &self.s.pool;
        pool.for_row_bands(&mut self.s.l, w, h, |first, rows, out| {
            for r in 0..rows {
                let src = &input.y[(first + r) * input.y_stride..][..w];
                for (o, &v) in out[r * w..][..w].iter_mut().zip(src) {
                    *o = luma_to_l(v);
                }
            }
        });
        pool.for_row_bands(&mut self.s.uv, 2 * cw, ch, |first, rows, out| {
            for r in 0..rows {
                let src = &input.uv[(first + r) * input.uv_stride..][..2 * cw];
                for (o, &v) in out[r * 2 * cw..][..2 * cw].iter_mut().zip(src) {
                    *o = chroma_to_c(v);
                }
            }
        });
        self.s.analyse(input)
    }

    /// One bilateral iteration (x pass then y pass) over luma and chroma, in place.
    fn bilateral_iteration(&mut self, p: &ToonParams) {
        let (w, h, cw, ch) = self.s.dims();
        let pool = &self.s.pool;
        let (lr, cr) = (p.luma_radius as isize, p.chroma_radius as isize);
        // x passes: plane -> tmp
        let src = &self.s.l;
        pool.for_row_bands(&mut self.s.tmp_l, w, h, |first, rows, out| {
            for r in 0..rows {
                let row = &src[(first + r) * w..][..w];
                for (x, o) in out[r * w..][..w].iter_mut().enumerate() {
                    *o = bilateral_luma(p, row[x], lr, |j| row[clamp_index(x as isize + j, w)]);
                }
            }
        });
        let src = &self.s.uv;
        pool.for_row_bands(&mut self.s.tmp_uv, 2 * cw, ch, |first, rows, out| {
            for r in 0..rows {
                let row = &src[(first + r) * 2 * cw..][..2 * cw];
                for x in 0..cw {
                    let at = |j: isize| {
                        let xx = clamp_index(x as isize + j, cw);
                        (row[2 * xx], row[2 * xx + 1])
                    };
                    let (u, v) = bilateral_chroma(p, at(0), cr, at);
                    out[r * 2 * cw + 2 * x] = u;
                    out[r * 2 * cw + 2 * x + 1] = v;
                }
            }
        });
        // y passes: tmp -> plane
        let src = &self.s.tmp_l;
        pool.for_row_bands(&mut self.s.l, w, h, |first, rows, out| {
            for r in 0..rows {
                let y = first + r;
                for (x, o) in out[r * w..][..w].iter_mut().enumerate() {
                    let at = |j: isize| src[clamp_index(y as isize + j, h) * w + x];
                    *o = bilateral_luma(p, at(0), lr, at);
                }
            }
        });
        let src = &self.s.tmp_uv;
        pool.for_row_bands(&mut self.s.uv, 2 * cw, ch, |first, rows, out| {
            for r in 0..rows {
                let y = first + r;
                for x in 0..cw {
                    let at = |j: isize| {
                        let i = clamp_index(y as isize + j, ch) * 2 * cw + 2 * x;
                        (src[i], src[i + 1])
                    };
                    let (u, v) = bilateral_chroma(p, at(0), cr, at);
                    out[r * 2 * cw + 2 * x] = u;
                    out[r * 2 * cw + 2 * x + 1] = v;
                }
            }
        });
    }

    /// DoG edges of the current luma plane into `self.s.edge` (the blended factor E').
    fn edges(&mut self, p: &ToonParams) {
        let (w, h) = (self.s.geometry.width, self.s.geometry.height);
        let pool = &self.s.pool;
        let er = p.edge_radius as isize;
        let src = &self.s.l;
        // x pass of both Gaussians; dog1 and dog2 are written together through one band split.
        pool.for_row_bands2(
            &mut self.s.dog1,
            &mut self.s.dog2,
            w,
            h,
            |first, rows, a, b| {
                for r in 0..rows {
                    let row = &src[(first + r) * w..][..w];
                    for x in 0..w {
                        let (g1, g2) = gauss_pair(p, er, |j| row[clamp_index(x as isize + j, w)]);
                        a[r * w + x] = g1;
                        b[r * w + x] = g2;
                    }
                }
            },
        );
        let (d1, d2) = (&self.s.dog1, &self.s.dog2);
        pool.for_row_bands(&mut self.s.edge, w, h, |first, rows, out| {
            for r in 0..rows {
                let y = first + r;
                for (x, o) in out[r * w..][..w].iter_mut().enumerate() {
                    let (g1, _) = gauss_pair(p, er, |j| d1[clamp_index(y as isize + j, h) * w + x]);
                    let (_, g2) = gauss_pair(p, er, |j| d2[clamp_index(y as isize + j, h) * w + x]);
                    *o = edge_factor(g1, g2, p);
                }
            }
        });
    }

    /// Filters the current features against the `used` most recent ring entries into tmp planes.
    fn temporal(&mut self, p: &ToonParams, used: usize) {
        let (w, h, cw, ch) = self.s.dims();
        let pool = &self.s.pool;
        // The `used` most recent ring entries, newest first, looked up per pixel (no list is
        // built, so nothing allocates).
        let ring = &self.s.ring;
        let recent = move || (1..=used).filter_map(move |k| ring.recent(k));
        let cur = &self.s.l;
        pool.for_row_bands(&mut self.s.tmp_l, w, h, |first, rows, out| {
            for (i, o) in out[..rows * w].iter_mut().enumerate() {
                let idx = first * w + i;
                *o = temporal_luma(p, cur[idx], recent().map(|f| f.l[idx]));
            }
        });
        let cur = &self.s.uv;
        pool.for_row_bands(&mut self.s.tmp_uv, 2 * cw, ch, |first, rows, out| {
            for i in 0..rows * cw {
                let idx = 2 * (first * cw + i);
                let (u, v) = temporal_chroma(
                    p,
                    (cur[idx], cur[idx + 1]),
                    recent().map(|f| (f.uv[idx], f.uv[idx + 1])),
                );
                out[2 * i] = u;
                out[2 * i + 1] = v;
            }
        });
    }

    /// Quantize, compose with the edges and pack NV12.
    fn compose(&mut self, p: &ToonParams, levels: Option<(f32, f32)>, output: &mut Nv12FrameMut) {
        let (w, h, cw, ch) = self.s.dims();
        let pool = &self.s.pool;
        let (fl, edge) = (&self.s.l, &self.s.edge);
        let y_stride = output.y_stride;
        pool.for_row_bands(output.y, y_stride, h, |first, rows, out| {
            for r in 0..rows {
                for x in 0..w {
                    let idx = (first + r) * w + x;
                    let mut l = fl[idx];
                    if let Some((black, white)) = levels {
                        l = apply_levels(l, black, white);
                    }
                    let lq = quantize(l, p.levels, p.level_sharpness);
                    out[r * y_stride + x] = pack_luma(lq, edge[idx]);
                }
            }
        });
        let fuv = &self.s.uv;
        let uv_stride = output.uv_stride;
        pool.for_row_bands(output.uv, uv_stride, ch, |first, rows, out| {
            for r in 0..rows {
                let cy = first + r;
                for cx in 0..cw {
                    let e = edge_half(edge, w, h, cx, cy);
                    let i = 2 * (cy * cw + cx);
                    out[r * uv_stride + 2 * cx] = pack_chroma(fuv[i], p.saturation, e);
                    out[r * uv_stride + 2 * cx + 1] = pack_chroma(fuv[i + 1], p.saturation, e);
                }
            }
        });
    }
}

/// Minimum of E' over the 2x2 luma block of chroma sample (cx, cy).
#[inline]
fn edge_half(edge: &[f32], w: usize, h: usize, cx: usize, cy: usize) -> f32 {
    let (x0, y0) = (2 * cx, 2 * cy);
    let (x1, y1) = ((x0 + 1).min(w - 1), (y0 + 1).min(h - 1));
    edge[y0 * w + x0]
        .min(edge[y0 * w + x1])
        .min(edge[y1 * w + x0])
        .min(edge[y1 * w + x1])
}

/// One bilateral tap sum over luma: `at(j)` is the neighbour at offset j (replicated borders).
#[inline]
fn bilateral_luma(p: &ToonParams, c: f32, radius: isize, at: impl Fn(isize) -> f32) -> f32 {
    let (mut acc, mut wsum) = (0.0f32, 0.0f32);
    for j in -radius..=radius {
        let n = at(j);
        let d = n - c;
        let wgt = p.luma_spatial[j.unsigned_abs()] * (p.range_coeff * d * d).exp();
        acc += wgt * n;
        wsum += wgt;
    }
    acc / wsum
}

/// One bilateral tap sum over (u, v), range distance taken jointly in L units.
#[inline]
fn bilateral_chroma(
    p: &ToonParams,
    c: (f32, f32),
    radius: isize,
    at: impl Fn(isize) -> (f32, f32),
) -> (f32, f32) {
    let (mut acc_u, mut acc_v, mut wsum) = (0.0f32, 0.0f32, 0.0f32);
    for j in -radius..=radius {
        let (u, v) = at(j);
        let du = 100.0 * (u - c.0);
        let dv = 100.0 * (v - c.1);
        let wgt = p.chroma_spatial[j.unsigned_abs()] * (p.range_coeff * (du * du + dv * dv)).exp();
        acc_u += wgt * u;
        acc_v += wgt * v;
        wsum += wgt;
    }
    (acc_u / wsum, acc_v / wsum)
}

/// Both DoG Gaussians over the same taps, each normalised by its own weight sum.
#[inline]
fn gauss_pair(p: &ToonParams, radius: isize, at: impl Fn(isize) -> f32) -> (f32, f32) {
    let (mut s1, mut n1, mut s2, mut n2) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
    for j in -radius..=radius {
        let v = at(j);
        let a = p.edge_gauss1[j.unsigned_abs()];
        let b = p.edge_gauss2[j.unsigned_abs()];
        s1 += a * v;
        n1 += a;
        s2 += b * v;
        n2 += b;
    }
    (s1 / n1, s2 / n2)
}

/// Temporal filter of one luma value against its history, newest first.
#[inline]
pub fn temporal_luma(p: &ToonParams, f0: f32, history: impl Iterator<Item = f32>) -> f32 {
    let (mut acc, mut wsum, mut sk) = (f0, 1.0f32, 1.0f32);
    for fk in history {
        sk *= p.temporal_strength;
        let d = fk - f0;
        let w = sk * (p.motion_coeff * d * d).exp();
        acc += w * fk;
        wsum += w;
    }
    acc / wsum
}

/// Temporal filter of one (u, v) sample, the motion guard on the joint chroma distance.
#[inline]
pub fn temporal_chroma(
    p: &ToonParams,
    c0: (f32, f32),
    history: impl Iterator<Item = (f32, f32)>,
) -> (f32, f32) {
    let (mut acc_u, mut acc_v, mut wsum, mut sk) = (c0.0, c0.1, 1.0f32, 1.0f32);
    for (u, v) in history {
        sk *= p.temporal_strength;
        let du = 100.0 * (u - c0.0);
        let dv = 100.0 * (v - c0.1);
        let w = sk * (p.motion_coeff * (du * du + dv * dv)).exp();
        acc_u += w * u;
        acc_v += w * v;
        wsum += w;
    }
    (acc_u / wsum, acc_v / wsum)
}
