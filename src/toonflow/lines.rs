//! `model-edges`: the classic pipeline's difference-of-Gaussians lines drawn over a finished
//! NV12 picture (the network's output). Same Gaussians, same line ramp and the same
//! composition as the classic compose step: luma is multiplied by the edge factor E', chroma
//! pulled towards grey by the smallest E' of its 2x2 block.

use crate::pipeline::cpu::{edge_factor, luma_to_l};
use crate::pipeline::{FrameGeometry, Nv12FrameMut, ToonParams};

/// Working planes for one frame size, allocated once.
#[derive(Debug)]
pub struct LineOverlay {
    geometry: FrameGeometry,
    l: Vec<f32>,
    g1: Vec<f32>,
    g2: Vec<f32>,
    edge: Vec<f32>,
}

impl LineOverlay {
    pub fn new(geometry: FrameGeometry) -> Self {
        let n = geometry.luma_pixels();
        LineOverlay {
            geometry,
            l: vec![0.0; n],
            g1: vec![0.0; n],
            g2: vec![0.0; n],
            edge: vec![0.0; n],
        }
    }

    /// Draws the lines into `frame` (this overlay's geometry) with the edge-* parameters of
    /// `p`.
    pub fn apply(&mut self, p: &ToonParams, frame: &mut Nv12FrameMut) {
        let (w, h) = (self.geometry.width, self.geometry.height);
        assert_eq!(frame.geometry, self.geometry, "overlay geometry");
        let radius = p.edge_radius.max(0) as isize;
        let clamp = |i: isize, n: usize| i.clamp(0, n as isize - 1) as usize;
        for r in 0..h {
            for (x, o) in self.l[r * w..][..w].iter_mut().enumerate() {
                *o = luma_to_l(frame.y[r * frame.y_stride + x]);
            }
        }
        // Separable: x pass of both Gaussians, then the y pass and the line ramp.
        let gauss = |at: &dyn Fn(isize) -> f32| {
            let (mut s1, mut n1, mut s2, mut n2) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
            for j in -radius..=radius {
                let v = at(j);
                let (a, b) = (
                    p.edge_gauss1[j.unsigned_abs()],
                    p.edge_gauss2[j.unsigned_abs()],
                );
                s1 += a * v;
                n1 += a;
                s2 += b * v;
                n2 += b;
            }
            (s1 / n1, s2 / n2)
        };
        for r in 0..h {
            let row = &self.l[r * w..][..w];
            for x in 0..w {
                let (a, b) = gauss(&|j| row[clamp(x as isize + j, w)]);
                self.g1[r * w + x] = a;
                self.g2[r * w + x] = b;
            }
        }
        for r in 0..h {
            for x in 0..w {
                let (a, _) = gauss(&|j| self.g1[clamp(r as isize + j, h) * w + x]);
                let (_, b) = gauss(&|j| self.g2[clamp(r as isize + j, h) * w + x]);
                self.edge[r * w + x] = edge_factor(a, b, p);
            }
        }
        for r in 0..h {
            for x in 0..w {
                let y = &mut frame.y[r * frame.y_stride + x];
                *y = (*y as f32 * self.edge[r * w + x]).round().clamp(0.0, 255.0) as u8;
            }
        }
        let (cw, ch) = (self.geometry.chroma_width(), self.geometry.chroma_height());
        for cy in 0..ch {
            for cx in 0..cw {
                let (x0, y0) = (2 * cx, 2 * cy);
                let (x1, y1) = ((x0 + 1).min(w - 1), (y0 + 1).min(h - 1));
                let e = self.edge[y0 * w + x0]
                    .min(self.edge[y0 * w + x1])
                    .min(self.edge[y1 * w + x0])
                    .min(self.edge[y1 * w + x1]);
                for k in 0..2 {
                    let c = &mut frame.uv[cy * frame.uv_stride + 2 * cx + k];
                    *c = (128.0 + (*c as f32 - 128.0) * e).round().clamp(0.0, 255.0) as u8;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::StageParams;

    #[test]
    fn a_step_gets_a_dark_line_and_flat_areas_are_untouched() {
        let g = FrameGeometry::new(64, 32).unwrap();
        let p = ToonParams::new(&StageParams::default(), 64, 32);
        let mut y: Vec<u8> = (0..64 * 32)
            .map(|i| if i % 64 < 32 { 60 } else { 200 })
            .collect();
        let mut uv = vec![90u8; 64 * 16];
        let before = y.clone();
        let mut overlay = LineOverlay::new(g);
        overlay.apply(
            &p,
            &mut Nv12FrameMut::new(g, &mut y, 64, &mut uv, 64).unwrap(),
        );
        // Far from the step: unchanged.
        for r in 0..32 {
            assert_eq!(y[r * 64 + 5], before[r * 64 + 5]);
            assert_eq!(y[r * 64 + 60], before[r * 64 + 60]);
        }
        // At the step, on the dark side: darker than it was.
        let darkest = (26..38).map(|x| y[10 * 64 + x]).min().unwrap();
        assert!(darkest < 40, "{:?}", &y[10 * 64 + 24..10 * 64 + 40]);
        // Chroma next to the line moves towards grey, chroma far away stays.
        assert!(uv[5 * 64 + 2 * 15] > 90);
        assert_eq!(uv[5 * 64 + 2 * 2], 90);
    }

    #[test]
    fn strength_zero_draws_nothing() {
        let g = FrameGeometry::new(32, 16).unwrap();
        let stage = StageParams {
            edge_strength: 0.0,
            ..StageParams::default()
        };
        let p = ToonParams::new(&stage, 32, 16);
        let mut y: Vec<u8> = (0..32 * 16).map(|i| (i * 7 % 256) as u8).collect();
        let mut uv: Vec<u8> = (0..32 * 8).map(|i| (i * 5 % 256) as u8).collect();
        let (y0, uv0) = (y.clone(), uv.clone());
        LineOverlay::new(g).apply(
            &p,
            &mut Nv12FrameMut::new(g, &mut y, 32, &mut uv, 32).unwrap(),
        );
        assert_eq!((y, uv), (y0, uv0));
    }
}
