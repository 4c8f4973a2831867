//! The fast CPU path: the stylize pipeline of docs/pipeline.md, as the CPU reference
//! (src/pipeline/cpu.rs) computes it, fast enough for live video on a laptop.
//!
//! Same stages, same order, same temporal ring and scene cuts as the reference; the differences
//! are how, not what:
//! - the row kernels (src/pipeline/fast_kernels.rs) compute 16 pixels at a time in SIMD
//!   registers (AVX2 where the CPU has it, chosen at run time) with a vectorisable `exp`/`tanh`
//!   a few ulp from the library's, instead of a library call per tap;
//! - chroma is held planar (u and v planes) so the joint (u, v) range weight vectorises;
//! - every pass runs over bands of rows on the persistent [`BandPool`];
//! - nothing is allocated per frame: planes, the ring and padded rows (on the stack) are all made
//!   once.
//!
//! tests/cpu_fast.rs holds it to the reference on the photos and on a moving clip with a scene
//! cut: within one code value on at least 99.9% of the pixels.

use parking_lot::Mutex;

use super::band_pool::BandPool;
use super::cpu::{
    ClassicStages, CpuPipeline, FrameReport, StageTimes, StreamPlanes, classic_pipeline_methods,
    run_stages,
};
use super::fast_kernels::{self as k, ComposeInputs, DogWeights, EdgeInputs, Isa, TemporalInputs};
use super::frame::{FrameGeometry, Nv12Frame, Nv12FrameMut};
use super::params::{MAX_HISTORY, ToonParams};

/// The fast CPU backend's per-stream state. Its features in the ring are planar: `uv` holds the
/// u plane, then the v plane.
#[derive(Debug)]
pub struct FastPipeline {
    s: StreamPlanes,
    isa: Isa,
    /// Pair weights of the vertical passes, one buffer per pool thread (made on the first
    /// frame, and again only if the radius or the number of threads grows).
    scratch: Vec<Mutex<Vec<f32>>>,
}

/// Runs `f` with a scratch buffer of at least `len` floats that no other band holds.
fn with_scratch(scratch: &[Mutex<Vec<f32>>], len: usize, f: impl FnOnce(&mut [f32])) {
    // There is a buffer per pool thread, so a free one is found; lock the first otherwise.
    let mut buffer = scratch
        .iter()
        .find_map(|m| m.try_lock())
        .unwrap_or_else(|| scratch[0].lock());
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    f(&mut buffer[..len]);
}

impl FastPipeline {
    /// Allocates every plane for `geometry` and a ring of `history` features; one thread per
    /// core (at most 16).
    pub fn new(geometry: FrameGeometry, history: usize) -> Self {
        FastPipeline {
            s: StreamPlanes::new(geometry, history),
            isa: Isa::detect(),
            scratch: Vec::new(),
        }
    }

    classic_pipeline_methods!();

    /// Runs the kernels built for the crate's baseline target only (tests compare the two).
    pub fn use_baseline_isa(&mut self) {
        self.isa = Isa::baseline();
    }

    /// The instruction set the kernels run with ("avx2" or "baseline").
    pub fn isa_name(&self) -> &'static str {
        self.isa.name()
    }
}

impl ClassicStages for FastPipeline {
    fn planes(&mut self) -> &mut StreamPlanes {
        &mut self.s
    }

    fn unpack_and_analyse(&mut self, input: &Nv12Frame) -> f32 {
        let (w, h, cw, ch) = self.s.dims();
        let (isa, pool) = (self.isa, &self.s.pool);
        pool.for_row_bands(&mut self.s.l, w, h, |first, rows, out| {
            for r in 0..rows {
                let src = &input.y[(first + r) * input.y_stride..][..w];
                k::unpack_luma(isa, src, &mut out[r * w..][..w]);
            }
        });
        let (u, v) = self.s.uv.split_at_mut(cw * ch);
        pool.for_row_bands2(u, v, cw, ch, |first, rows, u, v| {
            for r in 0..rows {
                let src = &input.uv[(first + r) * input.uv_stride..][..2 * cw];
                k::unpack_chroma(isa, src, &mut u[r * cw..][..cw], &mut v[r * cw..][..cw]);
            }
        });
        self.s.analyse(input)
    }

    /// One bilateral iteration (x pass then y pass) over luma and chroma, in place.
    fn bilateral_iteration(&mut self, p: &ToonParams) {
        let (w, h, cw, ch) = self.s.dims();
        let (isa, pool) = (self.isa, &self.s.pool);
        let (lr, cr) = (p.luma_radius as usize, p.chroma_radius as usize);
        let coeff = p.range_coeff;

        let src = &self.s.l;
        pool.for_row_bands(&mut self.s.tmp_l, w, h, |first, rows, out| {
            k::bilateral_luma_x(isa, src, w, first, rows, out, &p.luma_spatial, lr, coeff);
        });
        let (su, sv) = self.s.uv.split_at(cw * ch);
        let (tu, tv) = self.s.tmp_uv.split_at_mut(cw * ch);
        pool.for_row_bands2(tu, tv, cw, ch, |first, rows, ou, ov| {
            k::bilateral_chroma_x(
                isa,
                su,
                sv,
                cw,
                first,
                rows,
                ou,
                ov,
                &p.chroma_spatial,
                cr,
                coeff,
            );
        });

        // Every band's scratch sized here, whichever band takes which buffer later: only a
        // frame that grows the radius (or the first) allocates.
        let need = k::vertical_scratch_len(w, lr).max(k::vertical_scratch_len(cw, cr));
        // One buffer per pool thread (set_threads may have changed their number).
        self.scratch
            .resize_with(self.s.pool.threads(), || Mutex::new(Vec::new()));
        for buffer in &self.scratch {
            let mut buffer = buffer.lock();
            if buffer.len() < need {
                buffer.resize(need, 0.0);
            }
        }
        let scratch = &self.scratch;
        let src = &self.s.tmp_l;
        pool.for_row_bands(&mut self.s.l, w, h, |first, rows, out| {
            with_scratch(scratch, k::vertical_scratch_len(w, lr), |s| {
                k::bilateral_luma_y(
                    isa,
                    src,
                    w,
                    h,
                    first,
                    rows,
                    out,
                    &p.luma_spatial,
                    lr,
                    coeff,
                    s,
                );
            });
        });
        let (su, sv) = self.s.tmp_uv.split_at(cw * ch);
        let (ou, ov) = self.s.uv.split_at_mut(cw * ch);
        pool.for_row_bands2(ou, ov, cw, ch, |first, rows, ou, ov| {
            with_scratch(scratch, k::vertical_scratch_len(cw, cr), |s| {
                k::bilateral_chroma_y(
                    isa,
                    su,
                    sv,
                    cw,
                    ch,
                    first,
                    rows,
                    ou,
                    ov,
                    &p.chroma_spatial,
                    cr,
                    coeff,
                    s,
                );
            });
        });
    }

    /// Filters the current features against the `used` most recent ring entries into tmp.
    fn temporal(&mut self, p: &ToonParams, used: usize) {
        let (w, h) = (self.s.geometry.width, self.s.geometry.height);
        let nc = self.s.geometry.chroma_pixels();
        let cw = self.s.geometry.chroma_width();
        let (isa, pool) = (self.isa, &self.s.pool);
        // The ring entries, newest first, in arrays on the stack (the ring holds at most
        // MAX_HISTORY entries that take part).
        let used = used.min(MAX_HISTORY as usize);
        let mut luma: [&[f32]; MAX_HISTORY as usize] = [&[]; MAX_HISTORY as usize];
        let mut chroma: [&[f32]; MAX_HISTORY as usize] = [&[]; MAX_HISTORY as usize];
        for i in 0..used {
            let f = self.s.ring.recent(i + 1).expect("ring entry in range");
            luma[i] = &f.l;
            chroma[i] = &f.uv;
        }
        let luma_inputs = TemporalInputs {
            history: &luma[..used],
            strength: p.temporal_strength,
            coeff: p.motion_coeff,
        };
        let cur = &self.s.l;
        pool.for_row_bands(&mut self.s.tmp_l, w, h, |first, rows, out| {
            k::temporal_luma(isa, cur, first * w, &mut out[..rows * w], &luma_inputs);
        });
        let chroma_inputs = TemporalInputs {
            history: &chroma[..used],
            ..luma_inputs
        };
        let (cu, cv) = self.s.uv.split_at(nc);
        let (ou, ov) = self.s.tmp_uv.split_at_mut(nc);
        pool.for_row_bands2(
            ou,
            ov,
            cw,
            self.s.geometry.chroma_height(),
            |first, rows, ou, ov| {
                let n = rows * cw;
                k::temporal_chroma(
                    isa,
                    cu,
                    cv,
                    first * cw,
                    nc,
                    &mut ou[..n],
                    &mut ov[..n],
                    &chroma_inputs,
                );
            },
        );
    }

    /// DoG edges of the current luma plane into `self.s.edge` (the blended factor E').
    fn edges(&mut self, p: &ToonParams) {
        let (w, h) = (self.s.geometry.width, self.s.geometry.height);
        let (isa, pool) = (self.isa, &self.s.pool);
        let dog = DogWeights::new(p);
        let src = &self.s.l;
        pool.for_row_bands2(
            &mut self.s.dog1,
            &mut self.s.dog2,
            w,
            h,
            |first, rows, a, b| {
                k::dog_x(isa, src, w, first, rows, a, b, &dog);
            },
        );
        let inputs = EdgeInputs {
            dog: &dog,
            tau: p.edge_tau,
            sharpness: p.edge_sharpness,
            strength: p.edge_strength,
        };
        let (d1, d2) = (&self.s.dog1, &self.s.dog2);
        pool.for_row_bands(&mut self.s.edge, w, h, |first, rows, out| {
            k::dog_y_edges(isa, d1, d2, w, h, first, rows, out, &inputs);
        });
    }

    /// Quantize, compose with the edges and pack NV12.
    fn compose(&mut self, p: &ToonParams, levels: Option<(f32, f32)>, output: &mut Nv12FrameMut) {
        let (w, h, cw, ch) = self.s.dims();
        let (isa, pool) = (self.isa, &self.s.pool);
        let inputs = ComposeInputs {
            levels,
            levels_count: p.levels,
            level_sharpness: p.level_sharpness,
            saturation: p.saturation,
        };
        let (fl, edge) = (&self.s.l, &self.s.edge);
        let y_stride = output.y_stride;
        pool.for_row_bands(output.y, y_stride, h, |first, rows, out| {
            for r in 0..rows {
                let y = first + r;
                k::compose_luma(
                    isa,
                    &fl[y * w..][..w],
                    &edge[y * w..][..w],
                    &mut out[r * y_stride..][..w],
                    &inputs,
                );
            }
        });
        let (u, v) = self.s.uv.split_at(cw * ch);
        let uv_stride = output.uv_stride;
        pool.for_row_bands(output.uv, uv_stride, ch, |first, rows, out| {
            for r in 0..rows {
                let cy = first + r;
                let (y0, y1) = (2 * cy, (2 * cy + 1).min(h - 1));
                k::compose_chroma(
                    isa,
                    &u[cy * cw..][..cw],
                    &v[cy * cw..][..cw],
                    &edge[y0 * w..][..w],
                    &edge[y1 * w..][..w],
                    &mut out[r * uv_stride..][..2 * cw],
                    &inputs,
                );
            }
        });
    }
}

/// `$e` on whichever pipeline a [`CpuClassic`] holds, bound to `$p`.
macro_rules! either {
    ($self:expr, $p:ident => $e:expr) => {
        match $self {
            CpuClassic::Fast($p) => $e,
            CpuClassic::Reference($p) => $e,
        }
    };
}

/// The classic pipeline on the CPU: the fast path, or the exact reference (the oracle).
#[derive(Debug)]
pub enum CpuClassic {
    Fast(Box<FastPipeline>),
    Reference(Box<CpuPipeline>),
}

impl CpuClassic {
    /// The fast path, or the reference when `reference` is set.
    pub fn new(geometry: FrameGeometry, history: usize, reference: bool) -> CpuClassic {
        if reference {
            CpuClassic::Reference(Box::new(CpuPipeline::new(geometry, history)))
        } else {
            CpuClassic::Fast(Box::new(FastPipeline::new(geometry, history)))
        }
    }

    pub fn is_reference(&self) -> bool {
        matches!(self, CpuClassic::Reference(_))
    }

    pub fn geometry(&self) -> FrameGeometry {
        either!(self, p => p.geometry())
    }

    pub fn history_capacity(&self) -> usize {
        either!(self, p => p.history_capacity())
    }

    pub fn reset(&mut self) {
        either!(self, p => p.reset())
    }

    pub fn process(
        &mut self,
        p: &ToonParams,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> FrameReport {
        either!(self, c => c.process(p, input, output))
    }

    pub fn last_stage_times(&self) -> StageTimes {
        either!(self, p => p.last_stage_times())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::StageParams;

    /// A synthetic NV12 frame with edges, gradients and texture, shifted by `t`.
    fn frame(w: usize, h: usize, t: usize) -> Vec<u8> {
        let mut data = vec![0u8; w * h * 3 / 2];
        for y in 0..h {
            for x in 0..w {
                let xs = x + 3 * t;
                let v = if (xs / 17 + y / 13).is_multiple_of(3) {
                    200
                } else {
                    40
                };
                data[y * w + x] = (v + (xs * 7 + y * 3) % 23) as u8;
            }
        }
        for i in 0..w * h / 2 {
            data[w * h + i] = (100 + (i * 13 + t) % 57) as u8;
        }
        data
    }

    fn run_both(w: usize, h: usize, s: &StageParams, frames: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        let g = FrameGeometry::new(w, h).unwrap();
        let p = ToonParams::new(s, w as u32, h as u32);
        let mut fast = FastPipeline::new(g, p.history as usize);
        let mut reference = CpuPipeline::new(g, p.history as usize);
        (0..frames)
            .map(|t| {
                let input = frame(w, h, t);
                let input = Nv12Frame::packed(g, &input).unwrap();
                let (mut a, mut b) = (vec![0u8; g.nv12_bytes()], vec![0u8; g.nv12_bytes()]);
                let ra = fast.process(&p, &input, &mut Nv12FrameMut::packed(g, &mut a).unwrap());
                let rb =
                    reference.process(&p, &input, &mut Nv12FrameMut::packed(g, &mut b).unwrap());
                assert_eq!(ra, rb, "frame {t}: reports differ");
                (a, b)
            })
            .collect()
    }

    fn worst_and_share_off(a: &[u8], b: &[u8]) -> (u8, f64) {
        let worst = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).max().unwrap();
        let off = a.iter().zip(b).filter(|(x, y)| x.abs_diff(**y) > 1).count();
        (worst, off as f64 / a.len() as f64)
    }

    #[test]
    fn matches_the_reference_on_small_and_narrow_frames() {
        // Narrower than a chunk (scalar tails), a chroma row narrower than a chunk, and a size
        // with a partial last chunk, over a few frames so the ring takes part.
        for (w, h) in [(2, 2), (10, 6), (30, 40), (98, 66)] {
            for (i, (a, b)) in run_both(w, h, &StageParams::default(), 3)
                .iter()
                .enumerate()
            {
                let (worst, off) = worst_and_share_off(a, b);
                assert!(
                    worst <= 2 && off < 0.002,
                    "{w}x{h} frame {i}: worst {worst}, {off} off by more than 1"
                );
            }
        }
    }

    #[test]
    fn matches_the_reference_with_other_settings() {
        let s = StageParams {
            bilateral_iterations: 4,
            edge_iterations: 2,
            spatial_sigma: 5.0,
            range_sigma: 9.0,
            edge_sigma: 2.0,
            levels: 5,
            auto_levels: true,
            temporal_history: 7,
            ..Default::default()
        };
        for (i, (a, b)) in run_both(130, 74, &s, 4).iter().enumerate() {
            let (worst, off) = worst_and_share_off(a, b);
            assert!(
                worst <= 2 && off < 0.002,
                "frame {i}: worst {worst}, {off} off by more than 1"
            );
        }
    }

    #[test]
    fn baseline_and_detected_isa_give_the_same_frames() {
        let (w, h) = (66, 40);
        let g = FrameGeometry::new(w, h).unwrap();
        let p = ToonParams::new(&StageParams::default(), w as u32, h as u32);
        let mut a = FastPipeline::new(g, 4);
        let mut b = FastPipeline::new(g, 4);
        b.use_baseline_isa();
        for t in 0..3 {
            let input = frame(w, h, t);
            let input = Nv12Frame::packed(g, &input).unwrap();
            let (mut oa, mut ob) = (vec![0u8; g.nv12_bytes()], vec![0u8; g.nv12_bytes()]);
            a.process(&p, &input, &mut Nv12FrameMut::packed(g, &mut oa).unwrap());
            b.process(&p, &input, &mut Nv12FrameMut::packed(g, &mut ob).unwrap());
            assert_eq!(oa, ob, "frame {t}");
        }
    }
}
