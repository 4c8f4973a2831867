//! Layout and shape operators: Concat, Transpose, Reshape, Flatten, Squeeze, Unsqueeze,
//! Constant, ConstantOfShape, Cast, Shape, Gather, Slice, Expand. They work on both value
//! types (f32 activations and the i64 shape subgraphs that are folded once the input size is
//! known).
//!
//! Transpose, Slice and Expand are one strided copy ([`strided_copy`]): each output axis reads
//! the input with its own (possibly zero or negative) stride.

use super::elementwise::broadcast_shape;
use super::{Node, par_chunks_mut, strides, to_sizes};
use crate::neural::NeuralError;
use crate::neural::onnx::data_type;
use crate::neural::tensor::{Tensor, Value};

/// Applies a shape-generic expression to whichever tensor a value holds.
macro_rules! on_value {
    ($v:expr, $t:ident => $body:expr) => {
        match $v {
            Value::Float($t) => Value::Float($body),
            Value::Int($t) => Value::Int($body),
        }
    };
}

/// `out[i0, i1, ...] = src[base + Σ i_a · src_strides[a]]` for an output of `out_shape`.
/// The caller guarantees every index stays inside `src`.
pub fn strided_copy<T: Copy + Send + Sync + Default>(
    src: &[T],
    out_shape: &[usize],
    src_strides: &[isize],
    base: isize,
) -> Vec<T> {
    let total: usize = out_shape.iter().product();
    let mut out = vec![T::default(); total];
    let rank = out_shape.len();
    if total == 0 {
        return out;
    }
    if rank == 0 {
        out[0] = src[base as usize];
        return out;
    }
    let row = out_shape[rank - 1];
    let step = src_strides[rank - 1];
    par_chunks_mut(&mut out, row, row, |r, dst| {
        let mut off = base;
        let mut rem = r;
        for a in (0..rank - 1).rev() {
            off += (rem % out_shape[a]) as isize * src_strides[a];
            rem /= out_shape[a];
        }
        if step == 1 {
            dst.copy_from_slice(&src[off as usize..off as usize + row]);
        } else {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = src[(off + j as isize * step) as usize];
            }
        }
    });
    out
}

/// `t` reshaped (same data).
fn reshaped<T: Clone>(t: &Tensor<T>, shape: Vec<usize>) -> Tensor<T> {
    Tensor {
        shape,
        data: t.data.clone(),
    }
}

pub(crate) fn run_concat(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let first = ctx.any(0)?;
    let rank = first.shape().len();
    let axis = match ctx.attr("axis") {
        Some(_) => ctx.attr_int("axis", 0)?,
        None if ctx.opset < 4 => 1,
        None => return Err(ctx.graph_err("the 'axis' attribute is missing")),
    };
    let axis = ctx.axis(axis, rank)?;
    let parts: Vec<&Value> = (0..ctx.inputs.len())
        .map(|i| ctx.any(i))
        .collect::<Result<_, _>>()?;
    let mut shape = first.shape().to_vec();
    shape[axis] = 0;
    for p in &parts {
        let s = p.shape();
        if s.len() != rank || (0..rank).any(|a| a != axis && s[a] != shape[a]) {
            return Err(ctx.graph_err(format!(
                "input shapes {:?} do not concatenate on axis {axis}",
                parts.iter().map(|p| p.shape().to_vec()).collect::<Vec<_>>()
            )));
        }
        shape[axis] += s[axis];
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    fn cat<T: Copy>(
        parts: &[&Tensor<T>],
        outer: usize,
        inner: usize,
        axis: usize,
        total: usize,
    ) -> Vec<T> {
        let mut out = Vec::with_capacity(total);
        for o in 0..outer {
            for p in parts {
                let block = p.shape[axis] * inner;
                out.extend_from_slice(&p.data[o * block..][..block]);
            }
        }
        out
    }
    let total = shape.iter().product();
    let out = match first {
        Value::Float(_) => {
            let ts: Vec<&Tensor<f32>> = parts
                .iter()
                .map(|p| match p {
                    Value::Float(t) => Ok(t),
                    _ => Err(ctx.graph_err("inputs of different types")),
                })
                .collect::<Result<_, _>>()?;
            Value::Float(Tensor::new(shape, cat(&ts, outer, inner, axis, total)))
        }
        Value::Int(_) => {
            let ts: Vec<&Tensor<i64>> = parts
                .iter()
                .map(|p| match p {
                    Value::Int(t) => Ok(t),
                    _ => Err(ctx.graph_err("inputs of different types")),
                })
                .collect::<Result<_, _>>()?;
            Value::Int(Tensor::new(shape, cat(&ts, outer, inner, axis, total)))
        }
    };
    Ok(vec![out])
}

/// Transposes `t` by `perm` (output axis a is input axis `perm[a]`).
pub fn transpose<T: Copy + Send + Sync + Default>(t: &Tensor<T>, perm: &[usize]) -> Tensor<T> {
    let in_strides = strides(&t.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| t.shape[p]).collect();
    let st: Vec<isize> = perm.iter().map(|&p| in_strides[p] as isize).collect();
    let data = strided_copy(&t.data, &shape, &st, 0);
    Tensor::new(shape, data)
}

pub(crate) fn run_transpose(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.any(0)?;
    let rank = x.shape().len();
    let perm: Vec<usize> = match ctx.attr_ints("perm")? {
        None => (0..rank).rev().collect(),
        Some(p) => p
            .iter()
            .map(|&a| ctx.axis(a, rank))
            .collect::<Result<_, _>>()?,
    };
    let mut seen = vec![false; rank];
    if perm.len() != rank || perm.iter().any(|&p| std::mem::replace(&mut seen[p], true)) {
        return Err(ctx.graph_err(format!("perm {perm:?} is not a permutation of {rank} axes")));
    }
    Ok(vec![on_value!(x, t => transpose(t, &perm))])
}

pub(crate) fn run_reshape(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.any(0)?;
    let target = if ctx.opset < 5 {
        ctx.attr_ints("shape")?
    } else {
        match ctx.opt(1) {
            Some(Value::Int(t)) => Some(t.data.clone()),
            Some(Value::Float(_)) => return Err(ctx.graph_err("the shape input must be int64")),
            None => None,
        }
    }
    .ok_or_else(|| ctx.graph_err("no target shape"))?;
    let allow_zero = ctx.attr_int("allowzero", 0)? != 0;
    let in_shape = x.shape();
    let total: usize = in_shape.iter().product();
    let mut shape = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &d) in target.iter().enumerate() {
        match d {
            0 if !allow_zero => shape.push(*in_shape.get(i).ok_or_else(|| {
                ctx.graph_err(format!(
                    "0 at position {i} copies a dimension {in_shape:?} lacks"
                ))
            })?),
            -1 if infer.is_none() => {
                infer = Some(i);
                shape.push(1);
            }
            d if d >= 0 => shape.push(d as usize),
            _ => return Err(ctx.graph_err(format!("bad target shape {target:?}"))),
        }
    }
    let known: usize = shape.iter().product();
    if let Some(i) = infer {
        if known == 0 || !total.is_multiple_of(known) {
            return Err(ctx.graph_err(format!(
                "cannot infer -1 reshaping {in_shape:?} to {target:?}"
            )));
        }
        shape[i] = total / known;
    }
    if shape.iter().product::<usize>() != total {
        return Err(ctx.graph_err(format!("cannot reshape {in_shape:?} to {target:?}")));
    }
    Ok(vec![on_value!(x, t => reshaped(t, shape))])
}

pub(crate) fn run_flatten(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.any(0)?;
    let rank = x.shape().len();
    let axis = ctx.attr_int("axis", 1)?;
    let axis = if axis == rank as i64 {
        rank
    } else {
        ctx.axis(axis, rank)?
    };
    let outer: usize = x.shape()[..axis].iter().product();
    let inner: usize = x.shape()[axis..].iter().product();
    Ok(vec![on_value!(x, t => reshaped(t, vec![outer, inner]))])
}

/// Axes from the attribute (before `input_since`) or from input 1.
fn axes_list(ctx: &Node, input_since: i64) -> Result<Option<Vec<i64>>, NeuralError> {
    if ctx.opset >= input_since {
        ctx.opt_ints(1)
    } else {
        ctx.attr_ints("axes")
    }
}

pub(crate) fn run_squeeze(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.any(0)?;
    let s = x.shape();
    let rank = s.len();
    let drop: Vec<bool> = match axes_list(ctx, 13)? {
        None => s.iter().map(|&d| d == 1).collect(),
        Some(axes) => {
            let mut drop = vec![false; rank];
            for &a in &axes {
                let a = ctx.axis(a, rank)?;
                if s[a] != 1 {
                    return Err(ctx.graph_err(format!("axis {a} of {s:?} is not 1")));
                }
                drop[a] = true;
            }
            drop
        }
    };
    let shape = (0..rank).filter(|&a| !drop[a]).map(|a| s[a]).collect();
    Ok(vec![on_value!(x, t => reshaped(t, shape))])
}

pub(crate) fn run_unsqueeze(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.any(0)?;
    let axes = axes_list(ctx, 13)?.ok_or_else(|| ctx.graph_err("no axes"))?;
    let out_rank = x.shape().len() + axes.len();
    let mut added = vec![false; out_rank];
    for &a in &axes {
        let a = ctx.axis(a, out_rank)?;
        if std::mem::replace(&mut added[a], true) {
            return Err(ctx.graph_err(format!("axis {a} repeated in {axes:?}")));
        }
    }
    let mut dims = x.shape().iter();
    let shape = added
        .iter()
        .map(|&new| if new { 1 } else { *dims.next().unwrap_or(&1) })
        .collect();
    Ok(vec![on_value!(x, t => reshaped(t, shape))])
}

pub(crate) fn run_constant(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    if let Some(t) = ctx.attr_tensor("value")? {
        return Ok(vec![
            t.to_value().map_err(|e| ctx.graph_err(e.to_string()))?,
        ]);
    }
    if ctx.attr("value_float").is_some() {
        return Ok(vec![Value::Float(Tensor::scalar(
            ctx.attr_float("value_float", 0.0)?,
        ))]);
    }
    if let Some(v) = ctx.attr_floats("value_floats")? {
        return Ok(vec![Value::Float(Tensor::new(vec![v.len()], v))]);
    }
    if ctx.attr("value_int").is_some() {
        return Ok(vec![Value::Int(Tensor::scalar(
            ctx.attr_int("value_int", 0)?,
        ))]);
    }
    if let Some(v) = ctx.attr_ints("value_ints")? {
        return Ok(vec![Value::Int(Tensor::new(vec![v.len()], v))]);
    }
    Err(ctx.unsupported("no value, value_float(s) or value_int(s) attribute"))
}

pub(crate) fn run_constant_of_shape(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let dims = ctx.opt_ints(0)?.unwrap_or_default();
    let shape = to_sizes(ctx, &dims)?;
    let n: usize = shape.iter().product();
    let value = match ctx.attr_tensor("value")? {
        None => Value::Float(Tensor::scalar(0.0)),
        Some(t) => t.to_value().map_err(|e| ctx.graph_err(e.to_string()))?,
    };
    Ok(vec![match value {
        Value::Float(v) if v.len() == 1 => Value::Float(Tensor::new(shape, vec![v.data[0]; n])),
        Value::Int(v) if v.len() == 1 => Value::Int(Tensor::new(shape, vec![v.data[0]; n])),
        _ => return Err(ctx.graph_err("value must hold one element")),
    }])
}

/// Wraps an integer to the range of an ONNX integer type (i64 stores all of them).
fn wrap_int(v: i64, to: i32) -> i64 {
    match to {
        data_type::INT8 => v as i8 as i64,
        data_type::UINT8 => v as u8 as i64,
        4 => v as u16 as i64, // UINT16
        5 => v as i16 as i64, // INT16
        data_type::INT32 => v as i32 as i64,
        12 => v as u32 as i64, // UINT32
        data_type::BOOL => (v != 0) as i64,
        _ => v,
    }
}

pub(crate) fn run_cast(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let to = ctx.attr_int("to", 0)? as i32;
    let x = ctx.any(0)?;
    let to_float = matches!(to, data_type::FLOAT | data_type::DOUBLE);
    let to_int = matches!(
        to,
        data_type::INT8
            | data_type::UINT8
            | 4
            | 5
            | data_type::INT32
            | data_type::INT64
            | 12
            | 13
            | data_type::BOOL
    );
    let out = match x {
        Value::Float(t) if to_float => Value::Float(t.clone()),
        Value::Int(t) if to_float => Value::Float(Tensor::new(
            t.shape.clone(),
            t.data.iter().map(|&v| v as f32).collect(),
        )),
        Value::Float(t) if to == data_type::BOOL => Value::Int(Tensor::new(
            t.shape.clone(),
            t.data.iter().map(|&v| (v != 0.0) as i64).collect(),
        )),
        // Float to integer truncates toward zero (C semantics; out of range saturates).
        Value::Float(t) if to_int => Value::Int(Tensor::new(
            t.shape.clone(),
            t.data
                .iter()
                .map(|&v| wrap_int(v.trunc() as i64, to))
                .collect(),
        )),
        Value::Int(t) if to_int => Value::Int(Tensor::new(
            t.shape.clone(),
            t.data.iter().map(|&v| wrap_int(v, to)).collect(),
        )),
        _ => return Err(ctx.unsupported(format!("cast to data type {to}"))),
    };
    Ok(vec![out])
}

pub(crate) fn run_shape(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let s = ctx.any(0)?.shape();
    let r = s.len() as i64;
    let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = clamp(ctx.attr_int("start", 0)?);
    let end = clamp(ctx.attr_int("end", r)?);
    let dims: Vec<i64> = s[start..end.max(start)].iter().map(|&d| d as i64).collect();
    Ok(vec![Value::Int(Tensor::new(vec![dims.len()], dims))])
}

pub(crate) fn run_gather(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.any(0)?;
    let indices = match ctx.any(1)? {
        Value::Int(t) => t,
        Value::Float(_) => return Err(ctx.graph_err("indices must be integers")),
    };
    let s = x.shape();
    if s.is_empty() {
        return Err(ctx.graph_err("cannot gather from a scalar"));
    }
    let axis = ctx.axis(ctx.attr_int("axis", 0)?, s.len())?;
    let n = s[axis] as i64;
    let idx: Vec<usize> = indices
        .data
        .iter()
        .map(|&i| {
            let j = if i < 0 { i + n } else { i };
            if (0..n).contains(&j) {
                Ok(j as usize)
            } else {
                Err(ctx.graph_err(format!("index {i} out of range for axis of length {n}")))
            }
        })
        .collect::<Result<_, _>>()?;
    let outer: usize = s[..axis].iter().product();
    let inner: usize = s[axis + 1..].iter().product();
    let mut shape = s[..axis].to_vec();
    shape.extend_from_slice(&indices.shape);
    shape.extend_from_slice(&s[axis + 1..]);
    fn take<T: Copy>(d: &[T], idx: &[usize], outer: usize, len: usize, inner: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(outer * idx.len() * inner);
        for o in 0..outer {
            for &i in idx {
                out.extend_from_slice(&d[(o * len + i) * inner..][..inner]);
            }
        }
        out
    }
    let len = s[axis];
    Ok(vec![
        on_value!(x, t => Tensor::new(shape, take(&t.data, &idx, outer, len, inner))),
    ])
}

pub(crate) fn run_slice(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.any(0)?;
    let s = x.shape().to_vec();
    let rank = s.len();
    let (starts, ends, axes, steps) = if ctx.opset < 10 {
        (
            ctx.attr_ints("starts")?,
            ctx.attr_ints("ends")?,
            ctx.attr_ints("axes")?,
            None,
        )
    } else {
        (
            ctx.opt_ints(1)?,
            ctx.opt_ints(2)?,
            ctx.opt_ints(3)?,
            ctx.opt_ints(4)?,
        )
    };
    let starts = starts.ok_or_else(|| ctx.graph_err("no starts"))?;
    let ends = ends.ok_or_else(|| ctx.graph_err("no ends"))?;
    let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return Err(ctx.graph_err("starts, ends, axes and steps differ in length"));
    }
    let in_strides = strides(&s);
    let mut out_shape = s.clone();
    let mut st: Vec<isize> = in_strides.iter().map(|&v| v as isize).collect();
    let mut base = 0isize;
    let mut seen = vec![false; rank];
    for k in 0..starts.len() {
        let a = ctx.axis(axes[k], rank)?;
        if std::mem::replace(&mut seen[a], true) {
            return Err(ctx.graph_err(format!("axis {a} repeated")));
        }
        let d = s[a] as i64;
        let step = steps[k];
        if step == 0 {
            return Err(ctx.graph_err("step 0"));
        }
        let norm = |v: i64| if v < 0 { v.saturating_add(d) } else { v };
        let (start, end) = if step > 0 {
            (norm(starts[k]).clamp(0, d), norm(ends[k]).clamp(0, d))
        } else {
            (
                norm(starts[k]).clamp(0, d - 1),
                norm(ends[k]).clamp(-1, d - 1),
            )
        };
        let len = if step > 0 {
            if end > start {
                (end - start + step - 1) / step
            } else {
                0
            }
        } else if start > end {
            (start - end + (-step) - 1) / (-step)
        } else {
            0
        };
        out_shape[a] = len as usize;
        if len > 0 {
            base += start as isize * in_strides[a] as isize;
        }
        st[a] = step as isize * in_strides[a] as isize;
    }
    Ok(vec![on_value!(x, t => {
        let data = strided_copy(&t.data, &out_shape, &st, base);
        Tensor::new(out_shape.clone(), data)
    })])
}

pub(crate) fn run_expand(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let x = ctx.any(0)?;
    let target = ctx.opt_ints(1)?.unwrap_or_default();
    let target = to_sizes(ctx, &target)?;
    let shape = broadcast_shape(x.shape(), &target)
        .ok_or_else(|| ctx.graph_err(format!("{:?} does not expand to {target:?}", x.shape())))?;
    let s = x.shape();
    let pad = shape.len() - s.len();
    let in_strides = strides(s);
    let st: Vec<isize> = (0..shape.len())
        .map(|a| {
            if a < pad || s[a - pad] == 1 {
                0
            } else {
                in_strides[a - pad] as isize
            }
        })
        .collect();
    Ok(vec![on_value!(x, t => {
        let data = strided_copy(&t.data, &shape, &st, 0);
        Tensor::new(shape.clone(), data)
    })])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_nhwc_to_nchw() {
        // [1, 2, 2, 3] NHWC, value = 100·h + 10·w + c.
        let data: Vec<f32> = (0..12)
            .map(|i| (100 * (i / 6) + 10 * ((i / 3) % 2) + i % 3) as f32)
            .collect();
        let x = Tensor::new(vec![1, 2, 2, 3], data);
        let y = transpose(&x, &[0, 3, 1, 2]);
        assert_eq!(y.shape, vec![1, 3, 2, 2]);
        assert_eq!(&y.data[..4], &[0.0, 10.0, 100.0, 110.0]);
        assert_eq!(&y.data[8..], &[2.0, 12.0, 102.0, 112.0]);
        assert_eq!(transpose(&y, &[0, 2, 3, 1]), x);
    }

    #[test]
    fn strided_copy_reverses_with_negative_strides() {
        let src = [0, 1, 2, 3, 4, 5i64];
        assert_eq!(strided_copy(&src, &[3], &[-2], 5), vec![5, 3, 1]);
        assert_eq!(
            strided_copy(&src, &[2, 3], &[0, 1], 0),
            vec![0, 1, 2, 0, 1, 2]
        );
    }
}
