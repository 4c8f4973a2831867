//! Reductions and normalizations: GlobalAveragePool, ReduceMean/Sum/Max/Min,
//! InstanceNormalization, BatchNormalization (inference) and Softmax.
//!
//! Statistics accumulate in f64 (the network's normalizations reduce over whole frames, where
//! an f32 running sum loses digits). Plain kernels for the engine's normalize stage and the
//! stats hook: [`channel_stats`] and [`normalize`].

use super::elementwise::Activation;
use super::{Node, par_chunks_mut, strides};
use crate::neural::NeuralError;
use crate::neural::tensor::{Tensor, Value};

/// Mean and (population) variance of each of the `data.len() / spatial` planes of `spatial`
/// values (NCHW: one plane per image and channel). Two passes in f64, threaded over planes.
pub fn channel_stats(data: &[f32], spatial: usize) -> (Vec<f32>, Vec<f32>) {
    let planes = data.len().checked_div(spatial).unwrap_or(0);
    let mut stats = vec![(0.0f32, 0.0f32); planes];
    par_chunks_mut(&mut stats, 1, spatial, |p, s| {
        let plane = &data[p * spatial..][..spatial];
        let mean = plane.iter().map(|&v| v as f64).sum::<f64>() / spatial as f64;
        let var = plane
            .iter()
            .map(|&v| {
                let d = v as f64 - mean;
                d * d
            })
            .sum::<f64>()
            / spatial as f64;
        s[0] = (mean as f32, var as f32);
    });
    stats.into_iter().unzip()
}

/// Normalizes each plane in place: `y = (x − mean[p]) / sqrt(var[p] + eps) · scale[c] +
/// bias[c]`, then `act`, where plane `p` is channel `c = p % channels` (NCHW) and `scale` /
/// `bias` default to 1 / 0. `mean` and `var` have one entry per plane.
#[allow(clippy::too_many_arguments)]
pub fn normalize(
    data: &mut [f32],
    spatial: usize,
    channels: usize,
    mean: &[f32],
    var: &[f32],
    eps: f32,
    scale: Option<&[f32]>,
    bias: Option<&[f32]>,
    act: Activation,
) -> Result<(), NeuralError> {
    let planes = data.len().checked_div(spatial).unwrap_or(0);
    if spatial == 0
        || channels == 0
        || planes * spatial != data.len()
        || !planes.is_multiple_of(channels)
        || mean.len() != planes
        || var.len() != planes
        || scale.is_some_and(|s| s.len() != channels)
        || bias.is_some_and(|b| b.len() != channels)
    {
        return Err(NeuralError::Graph(format!(
            "normalize: {} values in planes of {spatial}, {channels} channels, {} means, {} \
             variances, {:?} scales, {:?} biases do not fit",
            data.len(),
            mean.len(),
            var.len(),
            scale.map(<[f32]>::len),
            bias.map(<[f32]>::len)
        )));
    }
    par_chunks_mut(data, spatial, spatial, |p, plane| {
        let c = p % channels;
        let k = (scale.map_or(1.0, |s| s[c] as f64) / (var[p] as f64 + eps as f64).sqrt()) as f32;
        let (m, b) = (mean[p], bias.map_or(0.0, |b| b[c]));
        for v in plane {
            *v = act.apply((*v - m) * k + b);
        }
    });
    Ok(())
}

/// `[N, C, d1, d2, ...]` → `(N·C, d1·d2·...)`, refusing ranks below 2 (3 for the instance and
/// pool operators that need a spatial axis).
fn planes(ctx: &Node, x: &Tensor<f32>, min_rank: usize) -> Result<(usize, usize), NeuralError> {
    if x.rank() < min_rank {
        return Err(ctx.graph_err(format!(
            "input of rank {} (at least {min_rank} needed)",
            x.rank()
        )));
    }
    Ok((x.shape[0] * x.shape[1], x.shape[2..].iter().product()))
}

pub(crate) fn run_global_average_pool(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.float(0)?;
    let (_, spatial) = planes(ctx, x, 3)?;
    let (mean, _) = channel_stats(&x.data, spatial);
    let mut shape = x.shape[..2].to_vec();
    shape.resize(x.rank(), 1);
    Ok(vec![Value::Float(Tensor::new(shape, mean))])
}

pub(crate) fn run_instance_norm(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let (x, scale, bias) = (ctx.float(0)?, ctx.float(1)?, ctx.float(2)?);
    let (_, spatial) = planes(ctx, x, 3)?;
    let eps = ctx.attr_float("epsilon", 1e-5)?;
    let c = x.shape[1];
    if scale.len() != c || bias.len() != c {
        return Err(ctx.graph_err(format!(
            "scale {:?} and bias {:?} for {c} channels",
            scale.shape, bias.shape
        )));
    }
    let mut y = x.clone();
    if spatial == 0 {
        return Ok(vec![Value::Float(y)]);
    }
    let (mean, var) = channel_stats(&x.data, spatial);
    normalize(
        &mut y.data,
        spatial,
        c,
        &mean,
        &var,
        eps,
        Some(&scale.data),
        Some(&bias.data),
        Activation::None,
    )
    .map_err(|e| ctx.graph_err(e.to_string()))?;
    Ok(vec![Value::Float(y)])
}

pub(crate) fn run_batch_norm(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    if ctx.attr_int("training_mode", 0)? != 0 {
        return Err(ctx.unsupported("training_mode=1 (inference only)"));
    }
    if ctx.node.output.iter().skip(1).any(|o| !o.is_empty()) {
        return Err(ctx.unsupported("running statistics outputs (inference only)"));
    }
    if ctx.opset < 9 && ctx.attr_int("spatial", 1)? == 0 {
        return Err(ctx.unsupported("spatial=0"));
    }
    let x = ctx.float(0)?;
    let [scale, bias, mean, var] = [1, 2, 3, 4].map(|i| ctx.float(i));
    let (scale, bias, mean, var) = (scale?, bias?, mean?, var?);
    let eps = ctx.attr_float("epsilon", 1e-5)?;
    let (planes_count, spatial) = planes(ctx, x, 2)?;
    let c = x.shape[1];
    if [scale, bias, mean, var].iter().any(|t| t.len() != c) {
        return Err(ctx.graph_err(format!("per-channel inputs must have {c} values")));
    }
    let mut y = x.clone();
    if spatial == 0 {
        return Ok(vec![Value::Float(y)]);
    }
    // One (mean, var) per plane: the channel's running statistics.
    let plane_mean: Vec<f32> = (0..planes_count).map(|p| mean.data[p % c]).collect();
    let plane_var: Vec<f32> = (0..planes_count).map(|p| var.data[p % c]).collect();
    normalize(
        &mut y.data,
        spatial,
        c,
        &plane_mean,
        &plane_var,
        eps,
        Some(&scale.data),
        Some(&bias.data),
        Activation::None,
    )
    .map_err(|e| ctx.graph_err(e.to_string()))?;
    Ok(vec![Value::Float(y)])
}

/// ReduceMean, ReduceSum, ReduceMax, ReduceMin over any set of axes. The axes come from the
/// `axes` attribute, or from input 1 (ReduceSum since opset 13, the others since 18).
pub(crate) fn run_reduce(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let op = ctx.node.op_type.as_str();
    let x = ctx.float(0)?;
    let axes_from_input = ctx.opset >= 18 || (op == "ReduceSum" && ctx.opset >= 13);
    let axes = if axes_from_input {
        ctx.opt_ints(1)?
    } else {
        ctx.attr_ints("axes")?
    };
    let keepdims = ctx.attr_int("keepdims", 1)? != 0;
    let noop = ctx.attr_int("noop_with_empty_axes", 0)? != 0;
    let rank = x.rank();
    let mut reduced = vec![false; rank];
    match axes {
        Some(a) if !a.is_empty() => {
            for &ax in &a {
                reduced[ctx.axis(ax, rank)?] = true;
            }
        }
        _ if noop => return Ok(vec![Value::Float(x.clone())]),
        _ => reduced.iter_mut().for_each(|r| *r = true),
    }
    let out_full: Vec<usize> = (0..rank)
        .map(|i| if reduced[i] { 1 } else { x.shape[i] })
        .collect();
    let out_strides = strides(&out_full);
    let count: usize = (0..rank)
        .filter(|&i| reduced[i])
        .map(|i| x.shape[i])
        .product();
    let n_out: usize = out_full.iter().product();
    let (init, combine): (f64, fn(f64, f64) -> f64) = match op {
        "ReduceMean" | "ReduceSum" => (0.0, |a, v| a + v),
        "ReduceMax" => (f64::NEG_INFINITY, f64::max),
        "ReduceMin" => (f64::INFINITY, f64::min),
        _ => return Err(ctx.unsupported("operator not implemented")),
    };
    let mut acc = vec![init; n_out];
    // Walk the input in order with an odometer over its index, tracking the output offset.
    let mut idx = vec![0usize; rank];
    let mut off = 0usize;
    for &v in &x.data {
        acc[off] = combine(acc[off], v as f64);
        for ax in (0..rank).rev() {
            idx[ax] += 1;
            if !reduced[ax] {
                off += out_strides[ax];
            }
            if idx[ax] < x.shape[ax] {
                break;
            }
            if !reduced[ax] {
                off -= out_strides[ax] * x.shape[ax];
            }
            idx[ax] = 0;
        }
    }
    if op == "ReduceMean" {
        acc.iter_mut().for_each(|a| *a /= count as f64);
    }
    let shape = if keepdims {
        out_full
    } else {
        (0..rank)
            .filter(|&i| !reduced[i])
            .map(|i| x.shape[i])
            .collect()
    };
    let data = acc.into_iter().map(|a| a as f32).collect();
    Ok(vec![Value::Float(Tensor::new(shape, data))])
}

/// Softmax over `len` values spaced `inner` apart, for each of the `data.len() / (len·inner)`
/// outer blocks, in place. Threaded over outer blocks.
pub fn softmax_in_place(data: &mut [f32], len: usize, inner: usize) {
    let block = len * inner;
    if block == 0 {
        return;
    }
    par_chunks_mut(data, block, block * 4, |_, b| {
        for i in 0..inner {
            let max = (0..len)
                .map(|k| b[k * inner + i])
                .fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f64;
            for k in 0..len {
                let e = (b[k * inner + i] - max).exp();
                b[k * inner + i] = e;
                sum += e as f64;
            }
            let inv = (1.0 / sum) as f32;
            for k in 0..len {
                b[k * inner + i] *= inv;
            }
        }
    });
}

/// Softmax: before opset 13 the input is flattened to 2-D at `axis` (default 1) and each row
/// normalised; since 13 it normalises along the single `axis` (default −1).
pub(crate) fn run_softmax(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.float(0)?;
    let rank = x.rank();
    let legacy = ctx.opset < 13;
    let axis = ctx.attr_int("axis", if legacy { 1 } else { -1 })?;
    let mut y = x.clone();
    if rank == 0 {
        y.data.iter_mut().for_each(|v| *v = 1.0);
        return Ok(vec![Value::Float(y)]);
    }
    let axis = ctx.axis(axis, rank)?;
    let (len, inner) = if legacy {
        (x.shape[axis..].iter().product(), 1)
    } else {
        (x.shape[axis], x.shape[axis + 1..].iter().product())
    };
    softmax_in_place(&mut y.data, len, inner);
    Ok(vec![Value::Float(y)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_stats_are_exact_on_a_known_plane() {
        // Plane 0: 1..=4 (mean 2.5, var 1.25); plane 1: constant 7.
        let data = [1.0, 2.0, 3.0, 4.0, 7.0, 7.0, 7.0, 7.0];
        let (m, v) = channel_stats(&data, 4);
        assert_eq!(m, vec![2.5, 7.0]);
        assert_eq!(v, vec![1.25, 0.0]);
    }

    #[test]
    fn channel_stats_keep_digits_on_large_offset_planes() {
        // 1000 + small noise over a 512x512 plane: an f32 running sum would drift.
        let n = 512 * 512;
        let data: Vec<f32> = (0..n)
            .map(|i| 1000.0 + ((i % 7) as f32 - 3.0) * 0.01)
            .collect();
        let (m, v) = channel_stats(&data, n);
        let exact_mean =
            1000.0 + (0..n).map(|i| ((i % 7) as f64 - 3.0) * 0.01).sum::<f64>() / n as f64;
        assert!((m[0] as f64 - exact_mean).abs() < 1e-4);
        assert!((v[0] - 0.0004).abs() < 1e-5, "{}", v[0]);
    }

    #[test]
    fn normalize_gives_zero_mean_unit_variance_then_affine() {
        let mut data: Vec<f32> = (0..32).map(|i| (i * i) as f32 * 0.1).collect();
        let (m, v) = channel_stats(&data, 16);
        normalize(
            &mut data,
            16,
            2,
            &m,
            &v,
            0.0,
            Some(&[2.0, 1.0]),
            Some(&[0.5, -1.0]),
            Activation::None,
        )
        .unwrap();
        let (m2, v2) = channel_stats(&data, 16);
        assert!(
            (m2[0] - 0.5).abs() < 1e-5 && (m2[1] + 1.0).abs() < 1e-5,
            "{m2:?}"
        );
        assert!(
            (v2[0] - 4.0).abs() < 1e-4 && (v2[1] - 1.0).abs() < 1e-4,
            "{v2:?}"
        );
        assert!(normalize(&mut data, 16, 3, &m, &v, 0.0, None, None, Activation::None).is_err());
    }

    #[test]
    fn softmax_rows_sum_to_one_and_keep_order() {
        let mut d = vec![1.0, 2.0, 3.0, 1000.0, 1000.0, -1000.0];
        softmax_in_place(&mut d, 3, 1);
        assert!((d[..3].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(d[0] < d[1] && d[1] < d[2]);
        assert!((d[3] - 0.5).abs() < 1e-6 && d[5] == 0.0);
    }
}
