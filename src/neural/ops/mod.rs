//! The CPU reference operators: exact ONNX semantics in f32 (i64 for shape arithmetic), direct
//! and readable, threaded across rows or channels where it pays.
//!
//! One entry point, [`run_node`], evaluates one ONNX node on concrete values: the graph's
//! constant folding and the stage executor both go through it.

use super::NeuralError;
use super::onnx::NodeProto;
use super::tensor::Value;

/// Operators `run_node` evaluates (the default ONNX domain).
pub const SUPPORTED_OPS: &[&str] = &[];

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
    let _ = (inputs, opset);
    Err(NeuralError::Unsupported(format!(
        "operator {} (node '{}')",
        node.op_type, node.name
    )))
}
