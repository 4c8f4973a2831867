//! The CPU reference operators: exact ONNX semantics in f32 (i64 for shape arithmetic), direct
//! and readable, threaded across rows or channels where it pays.
//!
//! One entry point, [`run_node`], evaluates one ONNX node on concrete values: the graph's
//! constant folding and the stage executor both go through it. The operator families live in
//! their own files, and each also exposes plain f32 kernels the engine's fused stages call
//! directly on NCHW buffers ([`conv::conv2d`], [`norm::channel_stats`], [`norm::normalize`],
//! [`elementwise::Activation`], [`resize::resize_nchw`], [`pad::pad`]).

pub mod conv;
pub mod elementwise;
pub mod matmul;
pub mod norm;
pub mod pad;
pub mod resize;
pub mod shape;

use super::NeuralError;
use super::onnx::{AttributeProto, NodeProto, TensorProto, attribute_type};
use super::tensor::{Tensor, Value};

/// Operators `run_node` evaluates (the default ONNX domain).
pub const SUPPORTED_OPS: &[&str] = &[
    // conv.rs
    "Conv",
    "ConvTranspose",
    // pad.rs
    "Pad",
    // resize.rs
    "Resize",
    "Upsample",
    // elementwise.rs
    "Relu",
    "LeakyRelu",
    "PRelu",
    "Sigmoid",
    "Tanh",
    "Clip",
    "Sqrt",
    "Reciprocal",
    "Neg",
    "Abs",
    "Exp",
    "Log",
    "Floor",
    "Ceil",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Min",
    "Max",
    // norm.rs
    "GlobalAveragePool",
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",
    "ReduceMin",
    "InstanceNormalization",
    "BatchNormalization",
    "Softmax",
    // matmul.rs
    "MatMul",
    "Gemm",
    // shape.rs
    "Concat",
    "Transpose",
    "Reshape",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Identity",
    "Constant",
    "ConstantOfShape",
    "Cast",
    "Shape",
    "Gather",
    "Slice",
    "Expand",
];

/// Whether `op_type` (default domain) is implemented.
pub fn is_supported(op_type: &str) -> bool {
    SUPPORTED_OPS.contains(&op_type)
}

/// Evaluates `node` on `inputs` (one entry per `node.input`; `None` for an omitted optional
/// input, written as an empty name in the model), for the model's default-domain `opset`.
/// Returns one value per `node.output`.
pub fn run_node(
    node: &NodeProto,
    inputs: &[Option<&Value>],
    opset: i64,
) -> Result<Vec<Value>, NeuralError> {
    let ctx = Node {
        node,
        inputs,
        opset,
    };
    if !node.domain.is_empty() && node.domain != "ai.onnx" {
        return Err(ctx.unsupported(format!("domain '{}'", node.domain)));
    }
    let out = match node.op_type.as_str() {
        "Conv" => conv::run_conv(&ctx)?,
        "ConvTranspose" => conv::run_conv_transpose(&ctx)?,
        "Pad" => pad::run_pad(&ctx)?,
        "Resize" | "Upsample" => resize::run_resize(&ctx)?,
        "Relu" | "LeakyRelu" | "Sigmoid" | "Tanh" | "Sqrt" | "Reciprocal" | "Neg" | "Abs"
        | "Exp" | "Log" | "Floor" | "Ceil" => elementwise::run_unary(&ctx)?,
        "Clip" => elementwise::run_clip(&ctx)?,
        "PRelu" | "Add" | "Sub" | "Mul" | "Div" | "Pow" => elementwise::run_binary(&ctx)?,
        "Min" | "Max" => elementwise::run_variadic(&ctx)?,
        "GlobalAveragePool" => norm::run_global_average_pool(&ctx)?,
        "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" => norm::run_reduce(&ctx)?,
        "InstanceNormalization" => norm::run_instance_norm(&ctx)?,
        "BatchNormalization" => norm::run_batch_norm(&ctx)?,
        "Softmax" => norm::run_softmax(&ctx)?,
        "MatMul" => matmul::run_matmul(&ctx)?,
        "Gemm" => matmul::run_gemm(&ctx)?,
        "Concat" => shape::run_concat(&ctx)?,
        "Transpose" => shape::run_transpose(&ctx)?,
        "Reshape" => shape::run_reshape(&ctx)?,
        "Flatten" => shape::run_flatten(&ctx)?,
        "Squeeze" => shape::run_squeeze(&ctx)?,
        "Unsqueeze" => shape::run_unsqueeze(&ctx)?,
        "Identity" => vec![ctx.any(0)?.clone()],
        "Constant" => shape::run_constant(&ctx)?,
        "ConstantOfShape" => shape::run_constant_of_shape(&ctx)?,
        "Cast" => shape::run_cast(&ctx)?,
        "Shape" => shape::run_shape(&ctx)?,
        "Gather" => shape::run_gather(&ctx)?,
        "Slice" => shape::run_slice(&ctx)?,
        "Expand" => shape::run_expand(&ctx)?,
        _ => return Err(ctx.unsupported("operator not implemented")),
    };
    if out.len() < node.output.iter().filter(|o| !o.is_empty()).count() {
        return Err(ctx.unsupported(format!(
            "{} outputs requested, the operator computes {}",
            node.output.len(),
            out.len()
        )));
    }
    Ok(out)
}

/// One node being evaluated: its proto, its inputs and the opset, with the attribute and input
/// accessors every operator uses. Errors name the node and the operator.
pub(crate) struct Node<'a> {
    pub node: &'a NodeProto,
    pub inputs: &'a [Option<&'a Value>],
    pub opset: i64,
}

impl Node<'_> {
    fn describe(&self, msg: &str) -> String {
        format!("{} node '{}': {}", self.node.op_type, self.node.name, msg)
    }

    /// A malformed node: bad attribute, wrong input count, shapes that do not fit.
    pub fn graph_err(&self, msg: impl AsRef<str>) -> NeuralError {
        NeuralError::Graph(self.describe(msg.as_ref()))
    }

    /// A valid node using a mode or type the engine does not implement.
    pub fn unsupported(&self, msg: impl AsRef<str>) -> NeuralError {
        NeuralError::Unsupported(self.describe(msg.as_ref()))
    }

    // ---- inputs ----

    /// Input `i`, or `None` when it is absent (omitted or past the end).
    pub fn opt(&self, i: usize) -> Option<&Value> {
        self.inputs.get(i).copied().flatten()
    }

    /// Input `i` of either type; an error when absent.
    pub fn any(&self, i: usize) -> Result<&Value, NeuralError> {
        self.opt(i)
            .ok_or_else(|| self.graph_err(format!("input {i} is missing")))
    }

    /// Input `i` as f32; an error when absent or i64.
    pub fn float(&self, i: usize) -> Result<&Tensor<f32>, NeuralError> {
        match self.any(i)? {
            Value::Float(t) => Ok(t),
            Value::Int(_) => Err(self.graph_err(format!("input {i} must be float, it is int64"))),
        }
    }

    /// Optional input `i` as f32.
    pub fn opt_float(&self, i: usize) -> Result<Option<&Tensor<f32>>, NeuralError> {
        match self.opt(i) {
            None => Ok(None),
            Some(_) => self.float(i).map(Some),
        }
    }

    /// Optional input `i` as a list of i64 (shape arithmetic: pads, axes, sizes, starts...).
    /// Empty tensors count as absent (ONNX writes "no sizes" as an empty tensor too).
    pub fn opt_ints(&self, i: usize) -> Result<Option<Vec<i64>>, NeuralError> {
        match self.opt(i) {
            None => Ok(None),
            Some(Value::Int(t)) if t.data.is_empty() => Ok(None),
            Some(Value::Int(t)) => Ok(Some(t.data.clone())),
            Some(Value::Float(_)) => {
                Err(self.graph_err(format!("input {i} must be an integer tensor, it is float")))
            }
        }
    }

    /// Optional input `i` as a list of f32 (scales), empty counting as absent.
    pub fn opt_floats(&self, i: usize) -> Result<Option<Vec<f32>>, NeuralError> {
        match self.opt(i) {
            None => Ok(None),
            Some(Value::Float(t)) if t.data.is_empty() => Ok(None),
            Some(Value::Float(t)) => Ok(Some(t.data.clone())),
            Some(Value::Int(_)) => {
                Err(self.graph_err(format!("input {i} must be a float tensor, it is int64")))
            }
        }
    }

    // ---- attributes ----

    pub fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.node.attribute.iter().find(|a| a.name == name)
    }

    /// Checks an attribute's declared type (0 = undeclared, as very old exporters write).
    fn typed(&self, name: &str, want: i32) -> Result<Option<&AttributeProto>, NeuralError> {
        match self.attr(name) {
            Some(a) if a.r#type != 0 && a.r#type != want => Err(self.graph_err(format!(
                "attribute '{name}' has type {}, expected {want}",
                a.r#type
            ))),
            other => Ok(other),
        }
    }

    pub fn attr_int(&self, name: &str, default: i64) -> Result<i64, NeuralError> {
        Ok(self
            .typed(name, attribute_type::INT)?
            .map_or(default, |a| a.i))
    }

    pub fn attr_float(&self, name: &str, default: f32) -> Result<f32, NeuralError> {
        Ok(self
            .typed(name, attribute_type::FLOAT)?
            .map_or(default, |a| a.f))
    }

    pub fn attr_ints(&self, name: &str) -> Result<Option<Vec<i64>>, NeuralError> {
        Ok(self
            .typed(name, attribute_type::INTS)?
            .map(|a| a.ints.clone()))
    }

    pub fn attr_floats(&self, name: &str) -> Result<Option<Vec<f32>>, NeuralError> {
        Ok(self
            .typed(name, attribute_type::FLOATS)?
            .map(|a| a.floats.clone()))
    }

    pub fn attr_string(&self, name: &str, default: &str) -> Result<String, NeuralError> {
        match self.typed(name, attribute_type::STRING)? {
            None => Ok(default.to_string()),
            Some(a) => String::from_utf8(a.s.clone())
                .map_err(|_| self.graph_err(format!("attribute '{name}' is not UTF-8"))),
        }
    }

    pub fn attr_tensor(&self, name: &str) -> Result<Option<&TensorProto>, NeuralError> {
        Ok(self
            .typed(name, attribute_type::TENSOR)?
            .and_then(|a| a.t.as_ref()))
    }

    /// Normalises a possibly negative axis against `rank`.
    pub fn axis(&self, axis: i64, rank: usize) -> Result<usize, NeuralError> {
        let r = rank as i64;
        if axis < -r || axis >= r {
            return Err(self.graph_err(format!("axis {axis} out of range for rank {rank}")));
        }
        Ok(if axis < 0 { axis + r } else { axis } as usize)
    }
}

// ---- threading ----

/// Worker threads for the CPU reference: the machine's available parallelism.
pub fn thread_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Below this many scalar operations a job runs on the calling thread: spawning costs more.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// Calls `f(index, chunk)` for every `chunk_len`-sized chunk of `data` (the last may be
/// shorter), spreading contiguous runs of chunks over [`thread_count`] scoped threads when the
/// job (`work_per_chunk` operations per chunk) is big enough to pay for them.
pub fn par_chunks_mut<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    work_per_chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if data.is_empty() {
        return;
    }
    let chunk_len = chunk_len.max(1);
    let chunks = data.len().div_ceil(chunk_len);
    let threads = thread_count().min(chunks);
    if threads <= 1 || chunks.saturating_mul(work_per_chunk) < PARALLEL_MIN_WORK {
        for (i, c) in data.chunks_mut(chunk_len).enumerate() {
            f(i, c);
        }
        return;
    }
    let per_thread = chunks.div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        for (t, run) in data.chunks_mut(per_thread * chunk_len).enumerate() {
            s.spawn(move || {
                for (i, c) in run.chunks_mut(chunk_len).enumerate() {
                    f(t * per_thread + i, c);
                }
            });
        }
    });
}

/// Row-major strides of `shape`.
pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Converts ONNX dims (i64) to sizes, refusing negatives.
pub(crate) fn to_sizes(ctx: &Node, dims: &[i64]) -> Result<Vec<usize>, NeuralError> {
    dims.iter()
        .map(|&d| usize::try_from(d).map_err(|_| ctx.graph_err(format!("negative dimension {d}"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn par_chunks_visits_every_chunk_once_with_its_index() {
        for len in [0usize, 1, 7, 100_000] {
            let mut data = vec![0usize; len];
            par_chunks_mut(&mut data, 10, 1000, |i, c| {
                for v in c.iter_mut() {
                    *v += i + 1;
                }
            });
            for (k, v) in data.iter().enumerate() {
                assert_eq!(*v, k / 10 + 1);
            }
        }
    }

    #[test]
    fn unknown_operator_is_unsupported_and_named() {
        let node = NodeProto {
            op_type: "Frobnicate".into(),
            name: "n1".into(),
            ..Default::default()
        };
        let err = run_node(&node, &[], 13).unwrap_err();
        match err {
            NeuralError::Unsupported(m) => {
                assert!(m.contains("Frobnicate") && m.contains("n1"), "{m}")
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(strides(&[]), Vec::<usize>::new());
    }
}
