//! Conv and ConvTranspose, 2-D (1-D as a height of one), any kernel size, stride, dilation,
//! groups (depthwise included), bias and padding (explicit `pads` or `auto_pad`).
//!
//! Plain kernels for the engine's fused stages: [`conv2d`] / [`conv2d_into`] (NCHW, bias and
//! an [`Activation`] fused) and [`conv_transpose2d`]. The convolution is direct: each output
//! row accumulates `weight · input row` for every input channel and kernel tap, so the inner
//! loop is a contiguous axpy (for stride 1) that the compiler vectorises. Work is split across
//! threads by bands of output rows of each (image, output channel) plane.

use super::elementwise::Activation;
use super::{Node, par_chunks_mut, thread_count};
use crate::neural::NeuralError;
use crate::neural::tensor::{Tensor, Value};

/// The geometry of a 2-D convolution: `[height, width]` pairs, pads `[top, left, bottom,
/// right]` (ONNX's begin-then-end order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dParams {
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    pub pads: [usize; 4],
    pub groups: usize,
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Conv2dParams {
            stride: [1, 1],
            dilation: [1, 1],
            pads: [0; 4],
            groups: 1,
        }
    }
}

/// Extra geometry of a transposed convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConvTransposeExtra {
    /// Added at the bottom/right of the output (`output_padding`).
    pub output_padding: [usize; 2],
}

fn graph(msg: String) -> NeuralError {
    NeuralError::Graph(msg)
}

/// Output `[height, width]` of a convolution over `input_hw` with `kernel_hw`, or an error
/// when the padded input is smaller than the dilated kernel.
pub fn conv2d_output_size(
    input_hw: [usize; 2],
    kernel_hw: [usize; 2],
    p: &Conv2dParams,
) -> Result<[usize; 2], NeuralError> {
    let mut out = [0; 2];
    for a in 0..2 {
        let span = (kernel_hw[a] - 1) * p.dilation[a] + 1;
        let padded = input_hw[a] + p.pads[a] + p.pads[a + 2];
        if padded < span {
            return Err(graph(format!(
                "padded input {padded} is smaller than the dilated kernel {span}"
            )));
        }
        out[a] = (padded - span) / p.stride[a] + 1;
    }
    Ok(out)
}

fn check_params(p: &Conv2dParams) -> Result<(), NeuralError> {
    if p.stride.contains(&0) || p.dilation.contains(&0) || p.groups == 0 {
        return Err(graph(format!(
            "strides {:?}, dilations {:?} and group {} must be positive",
            p.stride, p.dilation, p.groups
        )));
    }
    Ok(())
}

/// Checks the shapes of a convolution; returns the output shape `[n, m, oh, ow]`.
fn conv2d_shape(
    in_shape: [usize; 4],
    w_shape: [usize; 4],
    bias: Option<&[f32]>,
    p: &Conv2dParams,
) -> Result<[usize; 4], NeuralError> {
    check_params(p)?;
    let [n, c, h, w] = in_shape;
    let [m, cg, kh, kw] = w_shape;
    if c % p.groups != 0 || m % p.groups != 0 || cg * p.groups != c {
        return Err(graph(format!(
            "input channels {c}, weight {w_shape:?} and group {} do not fit",
            p.groups
        )));
    }
    if kh == 0 || kw == 0 {
        return Err(graph("empty kernel".into()));
    }
    if let Some(b) = bias
        && b.len() != m
    {
        return Err(graph(format!(
            "bias has {} values for {m} outputs",
            b.len()
        )));
    }
    let [oh, ow] = conv2d_output_size([h, w], [kh, kw], p)?;
    Ok([n, m, oh, ow])
}

/// A 2-D convolution on an NCHW tensor with the bias and activation fused: `weight` is
/// `[m, c / groups, kh, kw]`, `bias` has `m` values. Returns `[n, m, oh, ow]`.
pub fn conv2d(
    input: &[f32],
    in_shape: [usize; 4],
    weight: &[f32],
    w_shape: [usize; 4],
    bias: Option<&[f32]>,
    p: &Conv2dParams,
    act: Activation,
) -> Result<Tensor<f32>, NeuralError> {
    let out_shape = conv2d_shape(in_shape, w_shape, bias, p)?;
    let mut out = vec![0.0; out_shape.iter().product()];
    conv2d_into(&mut out, input, in_shape, weight, w_shape, bias, p, act)?;
    Ok(Tensor::new(out_shape.to_vec(), out))
}

/// [`conv2d`] writing into `out` (length n·m·oh·ow, any previous content overwritten): the
/// engine passes a slice of its arena.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_into(
    out: &mut [f32],
    input: &[f32],
    in_shape: [usize; 4],
    weight: &[f32],
    w_shape: [usize; 4],
    bias: Option<&[f32]>,
    p: &Conv2dParams,
    act: Activation,
) -> Result<(), NeuralError> {
    let [n, m, oh, ow] = conv2d_shape(in_shape, w_shape, bias, p)?;
    let [_, c, h, w] = in_shape;
    let [_, cg, kh, kw] = w_shape;
    if input.len() != n * c * h * w || weight.len() != m * cg * kh * kw {
        return Err(graph(format!(
            "buffer sizes {} / {} do not match shapes {in_shape:?} / {w_shape:?}",
            input.len(),
            weight.len()
        )));
    }
    if out.len() != n * m * oh * ow {
        return Err(graph(format!(
            "output buffer has {} values, the convolution makes {}",
            out.len(),
            n * m * oh * ow
        )));
    }
    if out.is_empty() {
        return Ok(());
    }
    let mg = m / p.groups;
    let [sh, sw] = p.stride;
    let [dh, dw] = p.dilation;
    let (pt, pl) = (p.pads[0] as isize, p.pads[1] as isize);

    // For each kernel column kx: the output columns whose input column is inside the image,
    // and the input column of the first of them.
    let col_ranges: Vec<(usize, usize, usize)> = (0..kw)
        .map(|kx| {
            let off = (kx * dw) as isize - pl; // ix = ox·sw + off
            let first = if off >= 0 {
                0
            } else {
                (-off as usize).div_ceil(sw)
            };
            let last = if (w as isize) - 1 - off < 0 {
                0
            } else {
                (((w as isize - 1 - off) as usize) / sw + 1).min(ow)
            };
            let first = first.min(last);
            (
                first,
                last,
                (first as isize * sw as isize + off).max(0) as usize,
            )
        })
        .collect();

    // Bands of rows: enough chunks for every thread, each band inside one plane.
    let planes = n * m;
    let bands_per_plane = (4 * thread_count()).div_ceil(planes).min(oh);
    let target_rows = oh.div_ceil(bands_per_plane.max(1));
    let band_rows = (1..=target_rows).rev().find(|d| oh % d == 0).unwrap_or(1);
    let bands = oh / band_rows;

    // With a column stride, each input row is split once into its `sw` column phases (phase
    // p holds columns p, p + sw, ...), so every kernel tap reads a contiguous run again.
    let phase_len = w.div_ceil(sw);
    let row_len = if sw == 1 { w } else { sw * phase_len };
    let mut phased = Vec::new();
    if sw > 1 {
        phased = vec![0.0f32; n * c * h * row_len];
        par_chunks_mut(&mut phased, row_len, row_len, |y, dst| {
            for (x, &v) in input[y * w..][..w].iter().enumerate() {
                dst[(x % sw) * phase_len + x / sw] = v;
            }
        });
    }
    let rows_src: &[f32] = if sw == 1 { input } else { &phased };

    par_chunks_mut(
        out,
        band_rows * ow,
        band_rows * ow * cg * kh * kw,
        |chunk, band| {
            let plane = chunk / bands;
            let oy0 = (chunk % bands) * band_rows;
            let (img, oc) = (plane / m, plane % m);
            let g = oc / mg;
            band.fill(0.0);
            for icg in 0..cg {
                let ic = g * cg + icg;
                let rows = &rows_src[(img * c + ic) * h * row_len..][..h * row_len];
                let w_taps = &weight[(oc * cg + icg) * kh * kw..][..kh * kw];
                for ky in 0..kh {
                    for r in 0..band_rows {
                        let iy = ((oy0 + r) * sh + ky * dh) as isize - pt;
                        if iy < 0 || iy >= h as isize {
                            continue;
                        }
                        let in_row = &rows[iy as usize * row_len..][..row_len];
                        let out_row = &mut band[r * ow..][..ow];
                        for (kx, &(x0, x1, ix0)) in col_ranges.iter().enumerate() {
                            let wv = w_taps[ky * kw + kx];
                            let start = (ix0 % sw) * phase_len + ix0 / sw;
                            let src = &in_row[start..start + (x1 - x0)];
                            for (o, &v) in out_row[x0..x1].iter_mut().zip(src) {
                                *o += wv * v;
                            }
                        }
                    }
                }
            }
            let b = bias.map_or(0.0, |b| b[oc]);
            for v in band.iter_mut() {
                *v = act.apply(*v + b);
            }
        },
    );
    Ok(())
}

/// A 2-D transposed convolution on NCHW: `weight` is `[c, m / groups, kh, kw]`, `bias` has
/// `m` values; the output is `[n, m, oh, ow]` with `oh = sh·(h−1) + output_padding +
/// (kh−1)·dh + 1 − pad_top − pad_bottom` (and the same for the width).
#[allow(clippy::too_many_arguments)]
pub fn conv_transpose2d(
    input: &[f32],
    in_shape: [usize; 4],
    weight: &[f32],
    w_shape: [usize; 4],
    bias: Option<&[f32]>,
    p: &Conv2dParams,
    extra: &ConvTransposeExtra,
    act: Activation,
) -> Result<Tensor<f32>, NeuralError> {
    check_params(p)?;
    let [n, c, h, w] = in_shape;
    let [wc, mg, kh, kw] = w_shape;
    if wc != c || c % p.groups != 0 || kh == 0 || kw == 0 {
        return Err(graph(format!(
            "input channels {c}, weight {w_shape:?} and group {} do not fit",
            p.groups
        )));
    }
    let m = mg * p.groups;
    if let Some(b) = bias
        && b.len() != m
    {
        return Err(graph(format!(
            "bias has {} values for {m} outputs",
            b.len()
        )));
    }
    if input.len() != n * c * h * w || weight.len() != c * mg * kh * kw {
        return Err(graph(format!(
            "buffer sizes {} / {} do not match shapes {in_shape:?} / {w_shape:?}",
            input.len(),
            weight.len()
        )));
    }
    let mut out_hw = [0; 2];
    for a in 0..2 {
        let full = p.stride[a] * ([h, w][a].max(1) - 1)
            + extra.output_padding[a]
            + ([kh, kw][a] - 1) * p.dilation[a]
            + 1;
        let cut = p.pads[a] + p.pads[a + 2];
        if [h, w][a] == 0 || full <= cut {
            return Err(graph(format!(
                "pads {:?} leave no output from input {in_shape:?}",
                p.pads
            )));
        }
        out_hw[a] = full - cut;
    }
    let [oh, ow] = out_hw;
    let cg = c / p.groups;
    let [sh, sw] = p.stride;
    let [dh, dw] = p.dilation;
    let (pt, pl) = (p.pads[0] as isize, p.pads[1] as isize);
    let mut out = vec![0.0; n * m * oh * ow];
    par_chunks_mut(&mut out, oh * ow, h * w * cg * kh * kw, |plane, dst| {
        let (img, oc) = (plane / m, plane % m);
        let (g, ocg) = (oc / mg, oc % mg);
        for icg in 0..cg {
            let ic = g * cg + icg;
            let in_plane = &input[(img * c + ic) * h * w..][..h * w];
            let w_taps = &weight[(ic * mg + ocg) * kh * kw..][..kh * kw];
            for ky in 0..kh {
                for iy in 0..h {
                    let oy = (iy * sh + ky * dh) as isize - pt;
                    if oy < 0 || oy >= oh as isize {
                        continue;
                    }
                    let out_row = &mut dst[oy as usize * ow..][..ow];
                    let in_row = &in_plane[iy * w..][..w];
                    for kx in 0..kw {
                        let wv = w_taps[ky * kw + kx];
                        for (ix, &v) in in_row.iter().enumerate() {
                            let ox = (ix * sw + kx * dw) as isize - pl;
                            if ox >= 0 && ox < ow as isize {
                                out_row[ox as usize] += wv * v;
                            }
                        }
                    }
                }
            }
        }
        let b = bias.map_or(0.0, |b| b[oc]);
        for v in dst.iter_mut() {
            *v = act.apply(*v + b);
        }
    });
    Ok(Tensor::new(vec![n, m, oh, ow], out))
}

// ---- the ONNX nodes ----

/// The attributes shared by Conv and ConvTranspose, resolved for a 2-D (or 1-D lifted to
/// 2-D) convolution.
struct ConvAttrs {
    params: Conv2dParams,
    kernel: [usize; 2],
    auto_pad: String,
}

/// Lifts 1-D lists to the 2-D form (height 1 in front).
fn lift(v: &[i64], spatial: usize, fill: i64) -> Vec<i64> {
    if spatial == 1 {
        let mut l = vec![fill];
        l.extend_from_slice(v);
        l
    } else {
        v.to_vec()
    }
}

fn read_conv_attrs(
    ctx: &Node,
    spatial: usize,
    w_kernel: [usize; 2],
) -> Result<ConvAttrs, NeuralError> {
    let list = |name: &str, default: i64| -> Result<Vec<i64>, NeuralError> {
        let v = ctx
            .attr_ints(name)?
            .unwrap_or_else(|| vec![default; spatial]);
        if v.len() != spatial {
            return Err(ctx.graph_err(format!(
                "'{name}' has {} values for {spatial} spatial axes",
                v.len()
            )));
        }
        if v.iter().any(|&x| x < 1) {
            return Err(ctx.graph_err(format!("'{name}' must be positive: {v:?}")));
        }
        Ok(lift(&v, spatial, 1))
    };
    let stride = list("strides", 1)?;
    let dilation = list("dilations", 1)?;
    let pads = ctx
        .attr_ints("pads")?
        .unwrap_or_else(|| vec![0; 2 * spatial]);
    if pads.len() != 2 * spatial || pads.iter().any(|&x| x < 0) {
        return Err(ctx.graph_err(format!(
            "'pads' must be {} non-negative values: {pads:?}",
            2 * spatial
        )));
    }
    let pads = if spatial == 1 {
        vec![0, pads[0], 0, pads[1]]
    } else {
        pads
    };
    if let Some(k) = ctx.attr_ints("kernel_shape")? {
        let k = lift(&k, spatial, 1);
        if k.len() != 2 || k[0] as usize != w_kernel[0] || k[1] as usize != w_kernel[1] {
            return Err(ctx.graph_err(format!(
                "kernel_shape {k:?} does not match the weight's {w_kernel:?}"
            )));
        }
    }
    let groups = ctx.attr_int("group", 1)?;
    if groups < 1 {
        return Err(ctx.graph_err(format!("group {groups} must be positive")));
    }
    let auto_pad = ctx.attr_string("auto_pad", "NOTSET")?;
    Ok(ConvAttrs {
        params: Conv2dParams {
            stride: [stride[0] as usize, stride[1] as usize],
            dilation: [dilation[0] as usize, dilation[1] as usize],
            pads: [
                pads[0] as usize,
                pads[1] as usize,
                pads[2] as usize,
                pads[3] as usize,
            ],
            groups: groups as usize,
        },
        kernel: w_kernel,
        auto_pad,
    })
}

/// The input as NCHW (a 1-D NCW input gets a height of one) and the weight's 4-D shape.
fn as_2d(
    ctx: &Node,
    x: &Tensor<f32>,
    w: &Tensor<f32>,
) -> Result<(usize, [usize; 4], [usize; 4]), NeuralError> {
    let spatial = x.rank().saturating_sub(2);
    if !(1..=2).contains(&spatial) || w.rank() != x.rank() {
        return Err(ctx.unsupported(format!(
            "input of rank {} with weight of rank {} (1-D and 2-D convolutions only)",
            x.rank(),
            w.rank()
        )));
    }
    let lift4 = |s: &[usize]| {
        if spatial == 1 {
            [s[0], s[1], 1, s[2]]
        } else {
            [s[0], s[1], s[2], s[3]]
        }
    };
    Ok((spatial, lift4(&x.shape), lift4(&w.shape)))
}

/// Resolves `auto_pad` for Conv into explicit pads.
fn conv_auto_pads(ctx: &Node, a: &mut ConvAttrs, in_hw: [usize; 2]) -> Result<(), NeuralError> {
    match a.auto_pad.as_str() {
        "NOTSET" => {}
        "VALID" => a.params.pads = [0; 4],
        mode @ ("SAME_UPPER" | "SAME_LOWER") => {
            for (ax, &len) in in_hw.iter().enumerate() {
                let s = a.params.stride[ax];
                let out = len.div_ceil(s);
                let span = (a.kernel[ax] - 1) * a.params.dilation[ax] + 1;
                let total = ((out.max(1) - 1) * s + span).saturating_sub(len);
                let small = total / 2;
                let (begin, end) = if mode == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                };
                a.params.pads[ax] = begin;
                a.params.pads[ax + 2] = end;
            }
        }
        other => return Err(ctx.unsupported(format!("auto_pad '{other}'"))),
    }
    Ok(())
}

fn unlift(spatial: usize, t: Tensor<f32>) -> Tensor<f32> {
    if spatial == 1 {
        let s = &t.shape;
        Tensor {
            shape: vec![s[0], s[1], s[3]],
            data: t.data,
        }
    } else {
        t
    }
}

fn node_err(ctx: &Node, e: NeuralError) -> NeuralError {
    match e {
        NeuralError::Graph(m) => ctx.graph_err(m),
        other => other,
    }
}

pub(crate) fn run_conv(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let (x, w) = (ctx.float(0)?, ctx.float(1)?);
    let bias = ctx.opt_float(2)?;
    let (spatial, in_shape, w_shape) = as_2d(ctx, x, w)?;
    let mut a = read_conv_attrs(ctx, spatial, [w_shape[2], w_shape[3]])?;
    conv_auto_pads(ctx, &mut a, [in_shape[2], in_shape[3]])?;
    let y = conv2d(
        &x.data,
        in_shape,
        &w.data,
        w_shape,
        bias.map(|b| b.data.as_slice()),
        &a.params,
        Activation::None,
    )
    .map_err(|e| node_err(ctx, e))?;
    Ok(vec![Value::Float(unlift(spatial, y))])
}

pub(crate) fn run_conv_transpose(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let (x, w) = (ctx.float(0)?, ctx.float(1)?);
    let bias = ctx.opt_float(2)?;
    let (spatial, in_shape, w_shape) = as_2d(ctx, x, w)?;
    let mut a = read_conv_attrs(ctx, spatial, [w_shape[2], w_shape[3]])?;
    let out_pad = ctx.attr_ints("output_padding")?.unwrap_or(vec![0; spatial]);
    if out_pad.len() != spatial || out_pad.iter().any(|&v| v < 0) {
        return Err(ctx.graph_err(format!("bad output_padding {out_pad:?}")));
    }
    let out_pad = lift(&out_pad, spatial, 0);
    let mut extra = ConvTransposeExtra {
        output_padding: [out_pad[0] as usize, out_pad[1] as usize],
    };
    // An explicit output_shape (spatial, or with N and C in front) or SAME auto_pad decides
    // the pads: total = stride·(in−1) + output_padding + span − out.
    let mut out_shape = ctx.attr_ints("output_shape")?;
    if let Some(s) = &out_shape {
        let s = if s.len() == spatial + 2 {
            s[2..].to_vec()
        } else {
            s.clone()
        };
        if s.len() != spatial || s.iter().any(|&v| v < 1) {
            return Err(ctx.graph_err(format!("bad output_shape {s:?}")));
        }
        out_shape = Some(lift(&s, spatial, 1));
    }
    let in_hw = [in_shape[2], in_shape[3]];
    match a.auto_pad.as_str() {
        "NOTSET" | "VALID" | "SAME_UPPER" | "SAME_LOWER" => {}
        other => return Err(ctx.unsupported(format!("auto_pad '{other}'"))),
    }
    if a.auto_pad == "VALID" {
        a.params.pads = [0; 4];
    }
    if out_shape.is_none() && a.auto_pad.starts_with("SAME") {
        out_shape = Some(vec![
            (in_hw[0] * a.params.stride[0]) as i64,
            (in_hw[1] * a.params.stride[1]) as i64,
        ]);
    }
    // As onnxruntime does: a negative total (output_shape beyond the full output) pads
    // nothing and extends the end like output_padding.
    if let Some(s) = out_shape {
        for ax in 0..2 {
            let full = a.params.stride[ax] * (in_hw[ax].max(1) - 1)
                + extra.output_padding[ax]
                + (a.kernel[ax] - 1) * a.params.dilation[ax]
                + 1;
            let total = full as i64 - s[ax];
            let (begin, end) = if total < 0 {
                extra.output_padding[ax] += (-total) as usize;
                (0, 0)
            } else if a.auto_pad == "SAME_UPPER" {
                (total as usize / 2, total as usize - total as usize / 2)
            } else {
                (total as usize - total as usize / 2, total as usize / 2)
            };
            a.params.pads[ax] = begin;
            a.params.pads[ax + 2] = end;
        }
    }
    let y = conv_transpose2d(
        &x.data,
        in_shape,
        &w.data,
        w_shape,
        bias.map(|b| b.data.as_slice()),
        &a.params,
        &extra,
        Activation::None,
    )
    .map_err(|e| node_err(ctx, e))?;
    Ok(vec![Value::Float(unlift(spatial, y))])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The convolution written as its definition, one output value at a time.
    fn naive_conv(
        x: &[f32],
        [n, c, h, w]: [usize; 4],
        wt: &[f32],
        [m, cg, kh, kw]: [usize; 4],
        bias: Option<&[f32]>,
        p: &Conv2dParams,
    ) -> Tensor<f32> {
        let [oh, ow] = conv2d_output_size([h, w], [kh, kw], p).unwrap();
        let mg = m / p.groups;
        let mut out = vec![0.0; n * m * oh * ow];
        for img in 0..n {
            for oc in 0..m {
                let g = oc / mg;
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = bias.map_or(0.0, |b| b[oc]) as f64;
                        for icg in 0..cg {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let iy = (oy * p.stride[0] + ky * p.dilation[0]) as isize
                                        - p.pads[0] as isize;
                                    let ix = (ox * p.stride[1] + kx * p.dilation[1]) as isize
                                        - p.pads[1] as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                        continue;
                                    }
                                    let ic = g * cg + icg;
                                    acc += (x[((img * c + ic) * h + iy as usize) * w + ix as usize]
                                        * wt[((oc * cg + icg) * kh + ky) * kw + kx])
                                        as f64;
                                }
                            }
                        }
                        out[((img * m + oc) * oh + oy) * ow + ox] = acc as f32;
                    }
                }
            }
        }
        Tensor::new(vec![n, m, oh, ow], out)
    }

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn conv2d_matches_the_definition() {
        let cases = [
            ([1, 3, 9, 11], [4, 3, 3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
            ([2, 4, 10, 7], [6, 2, 3, 2], [2, 1], [1, 2], [1, 0, 0, 2], 2),
            ([1, 6, 8, 8], [6, 1, 3, 3], [2, 2], [1, 1], [1, 1, 0, 0], 6),
            (
                [1, 3, 12, 12],
                [2, 3, 7, 7],
                [1, 1],
                [1, 1],
                [3, 3, 3, 3],
                1,
            ),
            ([1, 5, 6, 6], [3, 5, 1, 1], [1, 1], [1, 1], [0; 4], 1),
            ([1, 2, 5, 5], [2, 2, 3, 3], [3, 3], [2, 2], [2, 2, 2, 2], 1),
            ([1, 1, 3, 3], [1, 1, 5, 5], [1, 1], [1, 1], [1, 1, 1, 1], 1),
        ];
        for (k, (xs, ws, stride, dilation, pads, groups)) in cases.into_iter().enumerate() {
            let x = pseudo_random(xs.iter().product(), 1 + k as u32);
            let w = pseudo_random(ws.iter().product(), 100 + k as u32);
            let b = pseudo_random(ws[0], 200 + k as u32);
            let p = Conv2dParams {
                stride,
                dilation,
                pads,
                groups,
            };
            let want = naive_conv(&x, xs, &w, ws, Some(&b), &p);
            let got = conv2d(&x, xs, &w, ws, Some(&b), &p, Activation::None).unwrap();
            assert_eq!(got.shape, want.shape, "case {k}");
            let worst = got
                .data
                .iter()
                .zip(&want.data)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(worst < 1e-5, "case {k}: {worst}");
        }
    }

    #[test]
    fn conv2d_fuses_the_activation() {
        let x = pseudo_random(2 * 8 * 8, 3);
        let w = pseudo_random(4 * 2 * 9, 4);
        let p = Conv2dParams {
            pads: [1; 4],
            ..Default::default()
        };
        let plain = conv2d(
            &x,
            [1, 2, 8, 8],
            &w,
            [4, 2, 3, 3],
            None,
            &p,
            Activation::None,
        )
        .unwrap();
        let fused = conv2d(
            &x,
            [1, 2, 8, 8],
            &w,
            [4, 2, 3, 3],
            None,
            &p,
            Activation::LeakyRelu(0.2),
        )
        .unwrap();
        for (a, b) in plain.data.iter().zip(&fused.data) {
            assert_eq!(Activation::LeakyRelu(0.2).apply(*a), *b);
        }
    }

    #[test]
    fn conv_transpose_is_the_adjoint_of_conv() {
        // <conv(x), y> = <x, conv_transpose(y)> for the same weights (groups 1 and 2).
        for (groups, stride, pads) in [(1, [2, 2], [1, 1, 0, 0]), (2, [2, 1], [0, 1, 1, 0])] {
            let (c, m) = (4, 6);
            let xs = [1, c, 9, 8];
            let ws = [m, c / groups, 3, 3];
            let p = Conv2dParams {
                stride,
                pads,
                groups,
                ..Default::default()
            };
            let x = pseudo_random(xs.iter().product(), 7);
            let w = pseudo_random(ws.iter().product(), 8);
            let cx = conv2d(&x, xs, &w, ws, None, &p, Activation::None).unwrap();
            let y = pseudo_random(cx.len(), 9);
            // The transposed convolution's weight [in = m, out/group = c/g, kh, kw] has the
            // same layout as the convolution's [m, c/g, kh, kw].
            let wt = w.clone();
            // Output padding brings the transposed output back to the input's size.
            let [oh, ow] = [cx.shape[2], cx.shape[3]];
            let extra = ConvTransposeExtra {
                output_padding: [
                    9 + p.pads[0] + p.pads[2] - ((oh - 1) * stride[0] + 3),
                    8 + p.pads[1] + p.pads[3] - ((ow - 1) * stride[1] + 3),
                ],
            };
            let ty = conv_transpose2d(
                &y,
                [1, m, oh, ow],
                &wt,
                [m, c / groups, 3, 3],
                None,
                &Conv2dParams { groups, ..p },
                &extra,
                Activation::None,
            )
            .unwrap();
            assert_eq!(ty.shape, xs.to_vec());
            let lhs: f64 = cx.data.iter().zip(&y).map(|(a, b)| (a * b) as f64).sum();
            let rhs: f64 = x.iter().zip(&ty.data).map(|(a, b)| (a * b) as f64).sum();
            assert!((lhs - rhs).abs() < 1e-3, "{lhs} vs {rhs}");
        }
    }

    #[test]
    fn bad_shapes_are_errors_not_panics() {
        let p = Conv2dParams::default();
        assert!(
            conv2d(
                &[0.0; 12],
                [1, 3, 2, 2],
                &[0.0; 9],
                [1, 1, 3, 3],
                None,
                &p,
                Activation::None
            )
            .is_err()
        );
        assert!(
            conv2d(
                &[0.0; 4],
                [1, 1, 2, 2],
                &[0.0; 9],
                [1, 1, 3, 3],
                None,
                &p,
                Activation::None
            )
            .is_err()
        );
        let p0 = Conv2dParams {
            stride: [0, 1],
            ..p
        };
        assert!(
            conv2d(
                &[0.0; 9],
                [1, 1, 3, 3],
                &[0.0; 1],
                [1, 1, 1, 1],
                None,
                &p0,
                Activation::None
            )
            .is_err()
        );
    }
}
