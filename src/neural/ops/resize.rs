//! Resize (opset 10, 11–13 and 18+ forms) and Upsample: nearest (every `nearest_mode`) and
//! linear (N-linear over every resized axis), with the coordinate transformations
//! `half_pixel`, `pytorch_half_pixel`, `align_corners`, `asymmetric`, `tf_half_pixel_for_nn`;
//! output size from `sizes` or `scales`.
//!
//! Both modes are separable, so the resize runs one axis at a time: each output coordinate
//! along the axis reads at most two input coordinates with two weights. Plain kernel:
//! [`resize`].

use super::{Node, par_chunks_mut};
use crate::neural::NeuralError;
use crate::neural::tensor::{Tensor, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NearestMode {
    RoundPreferFloor,
    RoundPreferCeil,
    Floor,
    Ceil,
    /// Upsample and opset-10 Resize (as onnxruntime runs them): truncate when enlarging,
    /// ceil when shrinking.
    Legacy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeMode {
    Nearest(NearestMode),
    Linear,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CoordMode {
    HalfPixel,
    PytorchHalfPixel,
    AlignCorners,
    Asymmetric,
    TfHalfPixelForNn,
}

impl CoordMode {
    pub fn parse(s: &str) -> Option<CoordMode> {
        Some(match s {
            "half_pixel" => CoordMode::HalfPixel,
            "pytorch_half_pixel" => CoordMode::PytorchHalfPixel,
            "align_corners" => CoordMode::AlignCorners,
            "asymmetric" => CoordMode::Asymmetric,
            "tf_half_pixel_for_nn" => CoordMode::TfHalfPixelForNn,
            _ => return None,
        })
    }

    /// The input coordinate of output coordinate `x` (f32, as the spec's reference computes).
    fn source(self, x: usize, scale: f32, in_len: usize, out_len: usize) -> f32 {
        let x = x as f32;
        match self {
            CoordMode::HalfPixel => (x + 0.5) / scale - 0.5,
            CoordMode::PytorchHalfPixel if out_len > 1 => (x + 0.5) / scale - 0.5,
            CoordMode::PytorchHalfPixel => 0.0,
            CoordMode::AlignCorners if out_len == 1 => 0.0,
            CoordMode::AlignCorners => x * (in_len as f32 - 1.0) / (out_len as f32 - 1.0),
            CoordMode::Asymmetric => x / scale,
            CoordMode::TfHalfPixelForNn => (x + 0.5) / scale,
        }
    }
}

/// One output coordinate along an axis: `w0 · in[i0] + w1 · in[i1]` (`w1 = 0` reads one).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tap {
    i0: usize,
    i1: usize,
    w0: f32,
    w1: f32,
}

fn nearest_index(x: f32, mode: NearestMode, shrinking: bool) -> i64 {
    let f = x.floor();
    let v = match mode {
        NearestMode::RoundPreferFloor if x - f == 0.5 => f,
        NearestMode::RoundPreferCeil if x - f == 0.5 => f + 1.0,
        NearestMode::RoundPreferFloor | NearestMode::RoundPreferCeil => x.round(),
        NearestMode::Floor => f,
        NearestMode::Ceil => x.ceil(),
        NearestMode::Legacy if shrinking => x.ceil(),
        NearestMode::Legacy => x.trunc(),
    };
    v as i64
}

fn axis_taps(
    in_len: usize,
    out_len: usize,
    scale: f32,
    mode: ResizeMode,
    coord: CoordMode,
) -> Vec<Tap> {
    let last = in_len as i64 - 1;
    (0..out_len)
        .map(|x| {
            let src = coord.source(x, scale, in_len, out_len);
            match mode {
                ResizeMode::Nearest(nm) => {
                    let i = nearest_index(src, nm, scale < 1.0).clamp(0, last) as usize;
                    Tap {
                        i0: i,
                        i1: i,
                        w0: 1.0,
                        w1: 0.0,
                    }
                }
                ResizeMode::Linear => {
                    let s = src.clamp(0.0, last as f32);
                    let i0 = (s as i64).min(last) as usize;
                    let i1 = (i0 + 1).min(last as usize);
                    if i0 == i1 {
                        Tap {
                            i0,
                            i1,
                            w0: 1.0,
                            w1: 0.0,
                        }
                    } else {
                        let w1 = s - i0 as f32;
                        Tap {
                            i0,
                            i1,
                            w0: 1.0 - w1,
                            w1,
                        }
                    }
                }
            }
        })
        .collect()
}

/// Resizes `x` to `out_shape` with the per-axis `scales` used by the coordinate
/// transformation (for `sizes`, pass `out / in`). Axes with the same length and scale 1 are
/// left alone.
pub fn resize(
    x: &Tensor<f32>,
    out_shape: &[usize],
    scales: &[f32],
    mode: ResizeMode,
    coord: CoordMode,
) -> Result<Tensor<f32>, NeuralError> {
    let rank = x.rank();
    if out_shape.len() != rank || scales.len() != rank {
        return Err(NeuralError::Graph(format!(
            "resize: output shape {out_shape:?} / scales {scales:?} for rank {rank}"
        )));
    }
    if scales.iter().any(|&s| !(s > 0.0 && s.is_finite())) {
        return Err(NeuralError::Graph(format!(
            "resize: scales {scales:?} must be positive"
        )));
    }
    let mut cur = x.clone();
    for a in 0..rank {
        let (in_len, out_len) = (cur.shape[a], out_shape[a]);
        if in_len == out_len && scales[a] == 1.0 {
            continue;
        }
        if in_len == 0 && out_len > 0 {
            return Err(NeuralError::Graph(format!("resize: axis {a} is empty")));
        }
        let taps = axis_taps(in_len, out_len, scales[a], mode, coord);
        let inner: usize = cur.shape[a + 1..].iter().product();
        let mut shape = cur.shape.clone();
        shape[a] = out_len;
        let mut out = vec![0.0; shape.iter().product()];
        let src = &cur.data;
        par_chunks_mut(
            &mut out,
            out_len * inner,
            out_len * inner * 2,
            |o, block| {
                let base = o * in_len * inner;
                for (t, dst) in taps.iter().zip(block.chunks_mut(inner.max(1))) {
                    let r0 = &src[base + t.i0 * inner..][..inner];
                    if t.w1 == 0.0 {
                        dst.copy_from_slice(r0);
                    } else {
                        let r1 = &src[base + t.i1 * inner..][..inner];
                        for ((d, &v0), &v1) in dst.iter_mut().zip(r0).zip(r1) {
                            *d = t.w0 * v0 + t.w1 * v1;
                        }
                    }
                }
            },
        );
        cur = Tensor::new(shape, out);
    }
    Ok(cur)
}

pub(crate) fn run_resize(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let upsample = ctx.node.op_type == "Upsample";
    let legacy = upsample || ctx.opset < 11;
    let x = ctx.float(0)?;
    let rank = x.rank();

    let mode_name = ctx.attr_string("mode", "nearest")?;
    let nearest_name = ctx.attr_string("nearest_mode", "round_prefer_floor")?;
    let mode = match mode_name.as_str() {
        "nearest" if legacy => ResizeMode::Nearest(NearestMode::Legacy),
        "nearest" => ResizeMode::Nearest(match nearest_name.as_str() {
            "round_prefer_floor" => NearestMode::RoundPreferFloor,
            "round_prefer_ceil" => NearestMode::RoundPreferCeil,
            "floor" => NearestMode::Floor,
            "ceil" => NearestMode::Ceil,
            other => return Err(ctx.unsupported(format!("nearest_mode '{other}'"))),
        }),
        "linear" | "bilinear" => ResizeMode::Linear,
        other => return Err(ctx.unsupported(format!("mode '{other}'"))),
    };
    let coord = if legacy {
        CoordMode::Asymmetric
    } else {
        let name = ctx.attr_string("coordinate_transformation_mode", "half_pixel")?;
        CoordMode::parse(&name)
            .ok_or_else(|| ctx.unsupported(format!("coordinate_transformation_mode '{name}'")))?
    };
    if ctx.attr_int("antialias", 0)? != 0 {
        return Err(ctx.unsupported("antialias=1"));
    }
    if ctx.attr_int("exclude_outside", 0)? != 0 && mode_name == "cubic" {
        return Err(ctx.unsupported("exclude_outside=1"));
    }

    // Scales and sizes, as given (possibly over a subset of `axes`, opset 18).
    let (scales_in, sizes_in) = if upsample && ctx.opset < 9 {
        (ctx.attr_floats("scales")?, None)
    } else if legacy {
        (ctx.opt_floats(1)?, None)
    } else {
        (ctx.opt_floats(2)?, ctx.opt_ints(3)?)
    };
    let axes: Vec<usize> = match ctx.attr_ints("axes")? {
        Some(a) if !legacy => a
            .iter()
            .map(|&ax| ctx.axis(ax, rank))
            .collect::<Result<_, _>>()?,
        _ => (0..rank).collect(),
    };
    let mut scales = vec![1.0f32; rank];
    let mut out_shape = x.shape.clone();
    match (scales_in, sizes_in) {
        (Some(s), None) => {
            if s.len() != axes.len() {
                return Err(ctx.graph_err(format!("{} scales for {} axes", s.len(), axes.len())));
            }
            for (&ax, &sc) in axes.iter().zip(&s) {
                if !(sc > 0.0 && sc.is_finite()) {
                    return Err(ctx.graph_err(format!("scale {sc} must be positive")));
                }
                scales[ax] = sc;
                out_shape[ax] = (x.shape[ax] as f32 * sc).floor() as usize;
            }
        }
        (None, Some(sz)) => {
            if sz.len() != axes.len() || sz.iter().any(|&v| v < 0) {
                return Err(ctx.graph_err(format!("sizes {sz:?} for {} axes", axes.len())));
            }
            let policy = ctx.attr_string("keep_aspect_ratio_policy", "stretch")?;
            let ratio = |ax: usize, v: i64| v as f32 / x.shape[ax] as f32;
            let common = match policy.as_str() {
                "stretch" => None,
                "not_larger" => Some(
                    axes.iter()
                        .zip(&sz)
                        .map(|(&a, &v)| ratio(a, v))
                        .fold(f32::INFINITY, f32::min),
                ),
                "not_smaller" => Some(
                    axes.iter()
                        .zip(&sz)
                        .map(|(&a, &v)| ratio(a, v))
                        .fold(0.0, f32::max),
                ),
                other => return Err(ctx.unsupported(format!("keep_aspect_ratio_policy '{other}'"))),
            };
            for (&ax, &v) in axes.iter().zip(&sz) {
                if x.shape[ax] == 0 {
                    return Err(ctx.graph_err(format!("cannot resize the empty axis {ax}")));
                }
                match common {
                    None => {
                        out_shape[ax] = v as usize;
                        scales[ax] = ratio(ax, v);
                    }
                    Some(r) => {
                        scales[ax] = r;
                        out_shape[ax] = (x.shape[ax] as f32 * r).round() as usize;
                    }
                }
            }
        }
        (Some(_), Some(_)) => return Err(ctx.graph_err("both scales and sizes are given")),
        (None, None) => return Err(ctx.graph_err("neither scales nor sizes is given")),
    }
    let y =
        resize(x, &out_shape, &scales, mode, coord).map_err(|e| ctx.graph_err(e.to_string()))?;
    Ok(vec![Value::Float(y)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(v: &[f32]) -> Tensor<f32> {
        Tensor::new(vec![1, v.len()], v.to_vec())
    }

    #[test]
    fn linear_2x_with_each_coordinate_mode() {
        let x = row(&[0.0, 1.0, 2.0, 3.0]);
        let up = |c| {
            resize(&x, &[1, 8], &[1.0, 2.0], ResizeMode::Linear, c)
                .unwrap()
                .data
        };
        // asymmetric: x/2, the last sample held.
        assert_eq!(
            up(CoordMode::Asymmetric),
            vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0]
        );
        // half_pixel: (x+0.5)/2 − 0.5, clamped at both ends.
        assert_eq!(
            up(CoordMode::HalfPixel),
            vec![0.0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3.0]
        );
        // align_corners: x·3/7.
        let ac = up(CoordMode::AlignCorners);
        for (i, v) in ac.iter().enumerate() {
            assert!((v - i as f32 * 3.0 / 7.0).abs() < 1e-6);
        }
    }

    #[test]
    fn nearest_modes_round_as_specified() {
        // Source coordinates 0.5 and 1.5 (asymmetric, scale 2/3 from 3 to 2? use direct).
        assert_eq!(nearest_index(1.5, NearestMode::RoundPreferFloor, false), 1);
        assert_eq!(nearest_index(1.5, NearestMode::RoundPreferCeil, false), 2);
        assert_eq!(nearest_index(1.7, NearestMode::Floor, false), 1);
        assert_eq!(nearest_index(1.2, NearestMode::Ceil, false), 2);
        assert_eq!(nearest_index(1.2, NearestMode::Legacy, true), 2);
        assert_eq!(nearest_index(1.7, NearestMode::Legacy, false), 1);
        let x = row(&[1.0, 2.0, 3.0]);
        let y = resize(
            &x,
            &[1, 6],
            &[1.0, 2.0],
            ResizeMode::Nearest(NearestMode::Floor),
            CoordMode::Asymmetric,
        )
        .unwrap();
        assert_eq!(y.data, vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    }

    #[test]
    fn bilinear_is_the_product_of_the_axes() {
        let x = Tensor::new(vec![1, 1, 2, 2], vec![0.0, 1.0, 2.0, 3.0]);
        let y = resize(
            &x,
            &[1, 1, 3, 3],
            &[1.0, 1.0, 1.5, 1.5],
            ResizeMode::Linear,
            CoordMode::AlignCorners,
        )
        .unwrap();
        assert_eq!(y.data, vec![0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 2.5, 3.0]);
    }
}
