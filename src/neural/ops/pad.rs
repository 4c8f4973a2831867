//! Pad: constant, reflect, edge and wrap, any rank, asymmetric and negative (cropping) pads,
//! the pads from the `pads` attribute (opset < 11) or from input 1 (with the constant value in
//! input 2 and, since opset 18, the axes in input 3).
//!
//! Plain kernel: [`pad`].

use super::{Node, par_chunks_mut, strides};
use crate::neural::NeuralError;
use crate::neural::tensor::{Tensor, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PadMode {
    Constant,
    /// Mirror without repeating the edge (numpy `reflect`): index −1 → 1.
    Reflect,
    /// Repeat the edge value.
    Edge,
    /// Periodic (numpy `wrap`).
    Wrap,
}

impl PadMode {
    pub fn parse(s: &str) -> Option<PadMode> {
        Some(match s {
            "constant" => PadMode::Constant,
            "reflect" => PadMode::Reflect,
            "edge" => PadMode::Edge,
            "wrap" => PadMode::Wrap,
            _ => return None,
        })
    }
}

/// The source index along one axis of length `n` for padded coordinate `i` (already shifted
/// by the begin pad), or `None` for the constant fill.
pub fn source_index(i: i64, n: usize, mode: PadMode) -> Option<usize> {
    let n = n as i64;
    if (0..n).contains(&i) {
        return Some(i as usize);
    }
    Some(match mode {
        PadMode::Constant => return None,
        PadMode::Edge => i.clamp(0, n - 1),
        PadMode::Wrap => i.rem_euclid(n),
        PadMode::Reflect if n == 1 => 0,
        // Reflection folds back and forth with period 2(n − 1) when the pad is longer than
        // the axis.
        PadMode::Reflect => {
            let period = 2 * (n - 1);
            let m = i.rem_euclid(period);
            if m >= n { period - m } else { m }
        }
    } as usize)
}

/// Pads (or, with negative values, crops) `x` by `begins[a]` / `ends[a]` along each axis.
pub fn pad<T: Copy + Default + Send + Sync>(
    x: &Tensor<T>,
    begins: &[i64],
    ends: &[i64],
    mode: PadMode,
    value: T,
) -> Result<Tensor<T>, NeuralError> {
    let rank = x.rank();
    if begins.len() != rank || ends.len() != rank {
        return Err(NeuralError::Graph(format!(
            "pad: {} / {} pads for rank {rank}",
            begins.len(),
            ends.len()
        )));
    }
    let mut out_shape = Vec::with_capacity(rank);
    let mut maps: Vec<Vec<Option<usize>>> = Vec::with_capacity(rank);
    for a in 0..rank {
        let n = x.shape[a];
        let len = n as i64 + begins[a] + ends[a];
        if len < 0 {
            return Err(NeuralError::Graph(format!(
                "pad: pads {}/{} crop more than the axis {a} of length {n}",
                begins[a], ends[a]
            )));
        }
        if n == 0 && len > 0 && mode != PadMode::Constant {
            return Err(NeuralError::Graph(format!(
                "pad: cannot {mode:?}-pad the empty axis {a}"
            )));
        }
        out_shape.push(len as usize);
        maps.push(
            (0..len)
                .map(|o| source_index(o - begins[a], n, mode))
                .collect(),
        );
    }
    let total: usize = out_shape.iter().product();
    if rank == 0 {
        return Ok(x.clone());
    }
    let mut out = vec![value; total];
    if total == 0 {
        return Ok(Tensor::new(out_shape, out));
    }
    let in_strides = strides(&x.shape);
    let row = out_shape[rank - 1];
    let last = &maps[rank - 1];
    par_chunks_mut(&mut out, row, row, |r, dst| {
        // This row's outer coordinates, from the last outer axis back.
        let mut base = 0;
        let mut rem = r;
        for a in (0..rank - 1).rev() {
            let o = rem % out_shape[a];
            rem /= out_shape[a];
            match maps[a][o] {
                Some(s) => base += s * in_strides[a],
                None => return, // a constant-filled row, already `value`
            }
        }
        for (d, m) in dst.iter_mut().zip(last) {
            if let Some(s) = m {
                *d = x.data[base + s];
            }
        }
    });
    Ok(Tensor::new(out_shape, out))
}

pub(crate) fn run_pad(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let mode_name = ctx.attr_string("mode", "constant")?;
    let mode =
        PadMode::parse(&mode_name).ok_or_else(|| ctx.unsupported(format!("mode '{mode_name}'")))?;
    let x = ctx.any(0)?;
    let rank = x.shape().len();
    let (pads, axes) = if ctx.opset < 11 {
        let pads = ctx
            .attr_ints("pads")?
            .ok_or_else(|| ctx.graph_err("the 'pads' attribute is missing"))?;
        (pads, None)
    } else {
        let pads = ctx
            .opt_ints(1)?
            .ok_or_else(|| ctx.graph_err("the pads input is missing"))?;
        (pads, ctx.opt_ints(3)?)
    };
    // Pads are [begin of each axis..., end of each axis...] over `axes` (default: all).
    let axes: Vec<usize> = match axes {
        None => (0..rank).collect(),
        Some(a) => a
            .iter()
            .map(|&ax| ctx.axis(ax, rank))
            .collect::<Result<_, _>>()?,
    };
    if pads.len() != 2 * axes.len() {
        return Err(ctx.graph_err(format!(
            "{} pads for {} axes of a rank-{rank} input",
            pads.len(),
            axes.len()
        )));
    }
    let mut begins = vec![0i64; rank];
    let mut ends = vec![0i64; rank];
    for (k, &ax) in axes.iter().enumerate() {
        begins[ax] = pads[k];
        ends[ax] = pads[k + axes.len()];
    }
    let wrap = |e: NeuralError| ctx.graph_err(e.to_string());
    let out = match x {
        Value::Float(t) => {
            let value = if ctx.opset < 11 {
                ctx.attr_float("value", 0.0)?
            } else {
                match ctx.opt_float(2)? {
                    None => 0.0,
                    Some(v) if v.data.len() == 1 => v.data[0],
                    Some(v) => {
                        return Err(ctx.graph_err(format!(
                            "constant_value must be a scalar, shape {:?}",
                            v.shape
                        )));
                    }
                }
            };
            Value::Float(pad(t, &begins, &ends, mode, value).map_err(wrap)?)
        }
        Value::Int(t) => {
            let value = ctx
                .opt_ints(2)?
                .and_then(|v| v.first().copied())
                .unwrap_or(0);
            Value::Int(pad(t, &begins, &ends, mode, value).map_err(wrap)?)
        }
    };
    Ok(vec![out])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_on_a_row_match_numpy() {
        let x = Tensor::new(vec![1, 4], vec![1.0f32, 2.0, 3.0, 4.0]);
        let row = |mode, b, e| pad(&x, &[0, b], &[0, e], mode, 9.0).unwrap().data;
        assert_eq!(
            row(PadMode::Constant, 2, 1),
            vec![9.0, 9.0, 1.0, 2.0, 3.0, 4.0, 9.0]
        );
        assert_eq!(
            row(PadMode::Reflect, 2, 1),
            vec![3.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0]
        );
        assert_eq!(
            row(PadMode::Edge, 2, 1),
            vec![1.0, 1.0, 1.0, 2.0, 3.0, 4.0, 4.0]
        );
        assert_eq!(
            row(PadMode::Wrap, 2, 1),
            vec![3.0, 4.0, 1.0, 2.0, 3.0, 4.0, 1.0]
        );
        // numpy.pad([1,2,3,4], (5, 0), 'reflect') folds back: [2,3,4,3,2,1,2,3,4].
        assert_eq!(
            row(PadMode::Reflect, 5, 0),
            vec![2.0, 3.0, 4.0, 3.0, 2.0, 1.0, 2.0, 3.0, 4.0]
        );
        // Negative pads crop.
        assert_eq!(row(PadMode::Constant, -1, -2), vec![2.0]);
    }

    #[test]
    fn two_d_asymmetric_reflect_and_constant_rows() {
        let x = Tensor::new(vec![2, 3], vec![1, 2, 3, 4, 5, 6i64]);
        let y = pad(&x, &[1, 1], &[0, 0], PadMode::Reflect, 0).unwrap();
        assert_eq!(y.shape, vec![3, 4]);
        assert_eq!(y.data, vec![5, 4, 5, 6, 2, 1, 2, 3, 5, 4, 5, 6]);
        let y = pad(&x, &[1, 0], &[0, 1], PadMode::Constant, -1).unwrap();
        assert_eq!(y.data, vec![-1, -1, -1, -1, 1, 2, 3, -1, 4, 5, 6, -1]);
    }

    #[test]
    fn bad_pads_are_errors() {
        let x = Tensor::new(vec![2], vec![1.0f32, 2.0]);
        assert!(pad(&x, &[-3], &[0], PadMode::Constant, 0.0).is_err());
        assert!(pad(&x, &[1, 1], &[0], PadMode::Constant, 0.0).is_err());
        let e = Tensor::new(vec![0], Vec::<f32>::new());
        assert!(pad(&e, &[1], &[0], PadMode::Reflect, 0.0).is_err());
    }
}
