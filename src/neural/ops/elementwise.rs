//! Elementwise operators: activations, unary math, and the binary arithmetic with numpy
//! broadcasting (f32, and i64 for shape arithmetic).
//!
//! Plain kernels for the engine: [`Activation`] (applied by the fused conv and normalize stages)
//! and [`broadcast_zip`] / [`broadcast_shape`].

use super::{Node, par_chunks_mut};
use crate::neural::NeuralError;
use crate::neural::tensor::{Tensor, Value};

/// An activation fused after a convolution or a normalization.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Activation {
    #[default]
    None,
    Relu,
    LeakyRelu(f32),
    Sigmoid,
    Tanh,
    /// Clip to `[min, max]`.
    Clip(f32, f32),
}

impl Activation {
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::None => x,
            Activation::Relu => relu(x),
            Activation::LeakyRelu(alpha) => leaky_relu(x, alpha),
            Activation::Sigmoid => sigmoid(x),
            Activation::Tanh => x.tanh(),
            Activation::Clip(lo, hi) => clip(x, lo, hi),
        }
    }

    /// Applies the activation in place (threaded for large slices).
    pub fn apply_slice(self, data: &mut [f32]) {
        if self == Activation::None {
            return;
        }
        par_chunks_mut(data, 1 << 14, 1 << 14, |_, chunk| {
            for v in chunk {
                *v = self.apply(*v);
            }
        });
    }
}

#[inline]
fn relu(x: f32) -> f32 {
    // NaN stays NaN, as in max(x, 0) of the spec's numpy reference.
    if x < 0.0 { 0.0 } else { x }
}

#[inline]
fn leaky_relu(x: f32, alpha: f32) -> f32 {
    if x < 0.0 { alpha * x } else { x }
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
fn clip(x: f32, lo: f32, hi: f32) -> f32 {
    // ONNX: min(max(x, lo), hi); with lo > hi every value becomes hi.
    let y = if x < lo { lo } else { x };
    if y > hi { hi } else { y }
}

/// Applies `f` to every element of `t` (threaded for large tensors).
pub fn map(t: &Tensor<f32>, f: impl Fn(f32) -> f32 + Sync) -> Tensor<f32> {
    let mut out = t.data.clone();
    par_chunks_mut(&mut out, 1 << 14, 1 << 14, |_, chunk| {
        for v in chunk {
            *v = f(*v);
        }
    });
    Tensor {
        shape: t.shape.clone(),
        data: out,
    }
}

pub(crate) fn run_unary(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let op = ctx.node.op_type.as_str();
    if let Value::Int(t) = ctx.any(0)? {
        // Shape arithmetic occasionally negates or takes absolute values of sizes.
        let f: fn(i64) -> i64 = match op {
            "Neg" => |v| v.wrapping_neg(),
            "Abs" => |v| v.wrapping_abs(),
            "Relu" => |v| v.max(0),
            "Identity" | "Floor" | "Ceil" => |v| v,
            _ => return Err(ctx.unsupported("int64 input")),
        };
        let data = t.data.iter().map(|&v| f(v)).collect();
        return Ok(vec![Value::Int(Tensor::new(t.shape.clone(), data))]);
    }
    let x = ctx.float(0)?;
    let y = match op {
        "Relu" => map(x, relu),
        "LeakyRelu" => {
            let alpha = ctx.attr_float("alpha", 0.01)?;
            map(x, move |v| leaky_relu(v, alpha))
        }
        "Sigmoid" => map(x, sigmoid),
        "Tanh" => map(x, f32::tanh),
        "Sqrt" => map(x, f32::sqrt),
        "Reciprocal" => map(x, |v| 1.0 / v),
        "Neg" => map(x, |v| -v),
        "Abs" => map(x, f32::abs),
        "Exp" => map(x, f32::exp),
        "Log" => map(x, f32::ln),
        "Floor" => map(x, f32::floor),
        "Ceil" => map(x, f32::ceil),
        _ => return Err(ctx.unsupported("operator not implemented")),
    };
    Ok(vec![Value::Float(y)])
}

/// Clip: bounds from the `min`/`max` attributes before opset 11, from optional scalar inputs 1
/// and 2 since.
pub(crate) fn run_clip(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let scalar = |i: usize, default: f32| -> Result<f32, NeuralError> {
        match ctx.opt_float(i)? {
            None => Ok(default),
            Some(t) if t.data.len() == 1 => Ok(t.data[0]),
            Some(t) => Err(ctx.graph_err(format!(
                "bound {i} must be a scalar, it has shape {:?}",
                t.shape
            ))),
        }
    };
    let (lo, hi) = if ctx.opset < 11 {
        (
            ctx.attr_float("min", f32::MIN)?,
            ctx.attr_float("max", f32::MAX)?,
        )
    } else {
        (scalar(1, f32::NEG_INFINITY)?, scalar(2, f32::INFINITY)?)
    };
    let x = ctx.float(0)?;
    Ok(vec![Value::Float(map(x, move |v| clip(v, lo, hi)))])
}

/// The numpy broadcast of two shapes, or `None` when they do not broadcast.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| {
        if i + s.len() >= r {
            s[i + s.len() - r]
        } else {
            1
        }
    };
    (0..r)
        .map(|i| {
            let (da, db) = (dim(a, i), dim(b, i));
            if da == db || db == 1 {
                Some(da)
            } else if da == 1 {
                Some(db)
            } else {
                None
            }
        })
        .collect()
}

/// `f(a, b)` elementwise with numpy broadcasting, or `None` when the shapes do not broadcast.
///
/// Consecutive axes that broadcast the same way are merged, so the inner loop runs over the
/// longest contiguous stretch (a whole image for a per-channel bias, everything for equal
/// shapes) with each operand either advancing or held.
pub fn broadcast_zip<A, B, O>(
    a: &Tensor<A>,
    b: &Tensor<B>,
    f: impl Fn(A, B) -> O + Sync,
) -> Option<Tensor<O>>
where
    A: Copy + Sync,
    B: Copy + Sync,
    O: Copy + Send + Default,
{
    let out_shape = broadcast_shape(&a.shape, &b.shape)?;
    let r = out_shape.len();
    let pad = |s: &[usize]| {
        let mut p = vec![1; r - s.len()];
        p.extend_from_slice(s);
        p
    };
    let (sa, sb) = (pad(&a.shape), pad(&b.shape));
    // Merged axes: (length, a advances, b advances).
    let mut axes: Vec<(usize, bool, bool)> = Vec::new();
    for i in 0..r {
        if out_shape[i] == 1 {
            continue;
        }
        let (fa, fb) = (sa[i] != 1, sb[i] != 1);
        match axes.last_mut() {
            Some(last) if last.1 == fa && last.2 == fb => last.0 *= out_shape[i],
            _ => axes.push((out_shape[i], fa, fb)),
        }
    }
    let total: usize = out_shape.iter().product();
    let mut out = vec![O::default(); total];
    if total == 0 {
        return Some(Tensor::new(out_shape, out));
    }
    // Strides of each merged axis in a and b (0 when held).
    let mut stride_a = vec![0; axes.len()];
    let mut stride_b = vec![0; axes.len()];
    let (mut ka, mut kb) = (1, 1);
    for (i, &(len, fa, fb)) in axes.iter().enumerate().rev() {
        if fa {
            stride_a[i] = ka;
            ka *= len;
        }
        if fb {
            stride_b[i] = kb;
            kb *= len;
        }
    }
    let (inner, ia, ib) = axes
        .last()
        .map_or((1, false, false), |&(l, fa, fb)| (l, fa, fb));
    let outer = axes.len().saturating_sub(1);
    let (ad, bd) = (&a.data, &b.data);
    let f = &f;
    par_chunks_mut(&mut out, inner, inner, |row, dst| {
        // Offsets of this row's start in a and b.
        let (mut oa, mut ob, mut rem) = (0, 0, row);
        for i in (0..outer).rev() {
            let c = rem % axes[i].0;
            rem /= axes[i].0;
            oa += c * stride_a[i];
            ob += c * stride_b[i];
        }
        let n = dst.len();
        match (ia, ib) {
            (true, true) => {
                for ((o, &x), &y) in dst.iter_mut().zip(&ad[oa..oa + n]).zip(&bd[ob..ob + n]) {
                    *o = f(x, y);
                }
            }
            (true, false) => {
                let y = bd[ob];
                for (o, &x) in dst.iter_mut().zip(&ad[oa..oa + n]) {
                    *o = f(x, y);
                }
            }
            (false, true) => {
                let x = ad[oa];
                for (o, &y) in dst.iter_mut().zip(&bd[ob..ob + n]) {
                    *o = f(x, y);
                }
            }
            (false, false) => dst.fill(f(ad[oa], bd[ob])),
        }
    });
    Some(Tensor::new(out_shape, out))
}

fn float_binary(op: &str) -> Option<fn(f32, f32) -> f32> {
    Some(match op {
        "Add" => |x, y| x + y,
        "Sub" => |x, y| x - y,
        "Mul" => |x, y| x * y,
        "Div" => |x, y| x / y,
        "Pow" => f32::powf,
        "PRelu" => |x, slope| if x < 0.0 { slope * x } else { x },
        "Min" => |x: f32, y: f32| if x.is_nan() || x < y { x } else { y },
        "Max" => |x: f32, y: f32| if x.is_nan() || x > y { x } else { y },
        _ => return None,
    })
}

fn int_binary(op: &str) -> Option<fn(i64, i64) -> Option<i64>> {
    Some(match op {
        "Add" => |x: i64, y| x.checked_add(y),
        "Sub" => |x: i64, y| x.checked_sub(y),
        "Mul" => |x: i64, y| x.checked_mul(y),
        // Integer division truncates toward zero (C semantics, as onnxruntime does).
        "Div" => |x: i64, y| x.checked_div(y),
        "Pow" => |x: i64, y| u32::try_from(y).ok().and_then(|e| x.checked_pow(e)),
        "Min" => |x: i64, y| Some(x.min(y)),
        "Max" => |x: i64, y| Some(x.max(y)),
        _ => return None,
    })
}

/// One binary operation on two values, broadcasting.
fn binary(ctx: &Node, a: &Value, b: &Value) -> Result<Value, NeuralError> {
    let op = ctx.node.op_type.as_str();
    let no_broadcast = |sa: &[usize], sb: &[usize]| {
        ctx.graph_err(format!("shapes {sa:?} and {sb:?} do not broadcast"))
    };
    match (a, b) {
        (Value::Float(x), Value::Float(y)) => {
            let f = float_binary(op).ok_or_else(|| ctx.unsupported("float inputs"))?;
            let out = broadcast_zip(x, y, f).ok_or_else(|| no_broadcast(&x.shape, &y.shape))?;
            Ok(Value::Float(out))
        }
        // Pow accepts an integer exponent on a float base (opset 12+).
        (Value::Float(x), Value::Int(y)) if op == "Pow" => {
            let out = broadcast_zip(x, y, |v, e| v.powf(e as f32))
                .ok_or_else(|| no_broadcast(&x.shape, &y.shape))?;
            Ok(Value::Float(out))
        }
        (Value::Int(x), Value::Int(y)) => {
            let f = int_binary(op).ok_or_else(|| ctx.unsupported("int64 inputs"))?;
            let out = broadcast_zip(x, y, f).ok_or_else(|| no_broadcast(&x.shape, &y.shape))?;
            let data: Option<Vec<i64>> = out.data.into_iter().collect();
            let data =
                data.ok_or_else(|| ctx.graph_err("int64 arithmetic overflows or divides by zero"))?;
            Ok(Value::Int(Tensor::new(out.shape, data)))
        }
        _ => Err(ctx.graph_err("inputs of different types (float and int64)")),
    }
}

/// Add, Sub, Mul, Div, Pow and PRelu.
pub(crate) fn run_binary(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let (a, b) = (ctx.any(0)?, ctx.any(1)?);
    let out = binary(ctx, a, b)?;
    if ctx.node.op_type == "PRelu" && out.shape() != a.shape() {
        return Err(ctx.graph_err(format!(
            "slope of shape {:?} does not broadcast to the input's {:?}",
            b.shape(),
            a.shape()
        )));
    }
    Ok(vec![out])
}

/// Min and Max over any number of inputs.
pub(crate) fn run_variadic(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let mut acc = ctx.any(0)?.clone();
    for i in 1..ctx.inputs.len() {
        acc = binary(ctx, &acc, ctx.any(i)?)?;
    }
    Ok(vec![acc])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], data: &[f32]) -> Tensor<f32> {
        Tensor::new(shape.to_vec(), data.to_vec())
    }

    /// Broadcasting by brute force over output indices.
    fn reference(a: &Tensor<f32>, b: &Tensor<f32>, f: fn(f32, f32) -> f32) -> Tensor<f32> {
        let shape = broadcast_shape(&a.shape, &b.shape).unwrap();
        let r = shape.len();
        let n: usize = shape.iter().product();
        let index = |s: &[usize], idx: &[usize]| {
            let off = r - s.len();
            let mut k = 0;
            for (i, &d) in s.iter().enumerate() {
                k = k * d + if d == 1 { 0 } else { idx[i + off] };
            }
            k
        };
        let mut data = Vec::with_capacity(n);
        for flat in 0..n {
            let mut idx = vec![0; r];
            let mut rem = flat;
            for i in (0..r).rev() {
                idx[i] = rem % shape[i];
                rem /= shape[i];
            }
            data.push(f(
                a.data[index(&a.shape, &idx)],
                b.data[index(&b.shape, &idx)],
            ));
        }
        Tensor::new(shape, data)
    }

    fn ramp(shape: &[usize]) -> Tensor<f32> {
        let n: usize = shape.iter().product();
        t(
            shape,
            &(0..n).map(|i| i as f32 * 0.5 - 3.0).collect::<Vec<_>>(),
        )
    }

    #[test]
    fn broadcasting_matches_brute_force() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[2, 3, 4, 5], &[2, 3, 4, 5]),
            (&[2, 3, 4, 5], &[1, 3, 1, 1]),
            (&[2, 3, 4, 5], &[5]),
            (&[2, 3, 4, 5], &[]),
            (&[3, 1, 5], &[2, 1, 4, 1]),
            (&[1], &[4, 3]),
            (&[2, 1, 4, 1], &[1, 3, 1, 5]),
            (&[1, 64, 128, 128], &[1, 64, 1, 1]),
        ];
        for (sa, sb) in cases {
            let (a, b) = (ramp(sa), ramp(sb));
            let f: fn(f32, f32) -> f32 = |x, y| x * 3.0 - y;
            let got = broadcast_zip(&a, &b, f).unwrap();
            assert_eq!(got, reference(&a, &b, f), "{sa:?} {sb:?}");
            let got = broadcast_zip(&b, &a, f).unwrap();
            assert_eq!(got, reference(&b, &a, f), "{sb:?} {sa:?}");
        }
        assert!(broadcast_zip(&ramp(&[2, 3]), &ramp(&[4]), |x, y| x + y).is_none());
    }

    #[test]
    fn activations_follow_the_spec() {
        assert_eq!(Activation::LeakyRelu(0.2).apply(-2.0), -0.4);
        assert_eq!(Activation::LeakyRelu(0.2).apply(3.0), 3.0);
        assert_eq!(Activation::Relu.apply(-1.0), 0.0);
        assert_eq!(Activation::Clip(-1.0, 1.0).apply(5.0), 1.0);
        assert_eq!(Activation::Clip(2.0, 1.0).apply(0.0), 1.0);
        assert!((Activation::Sigmoid.apply(0.0) - 0.5).abs() < 1e-7);
        assert_eq!(Activation::Sigmoid.apply(-200.0), 0.0);
        let mut v = vec![-1.0f32; 100_000];
        Activation::LeakyRelu(0.5).apply_slice(&mut v);
        assert!(v.iter().all(|&x| x == -0.5));
    }

    #[test]
    fn integer_arithmetic_truncates_and_refuses_division_by_zero() {
        let f = int_binary("Div").unwrap();
        assert_eq!(f(-7, 2), Some(-3));
        assert_eq!(f(7, 0), None);
        assert_eq!(int_binary("Mul").unwrap()(i64::MAX, 2), None);
    }
}
