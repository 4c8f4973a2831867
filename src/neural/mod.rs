//! The neural stage: a style network loaded from an ONNX file, checked, lowered into stages,
//! planned into one arena and run by the CPU reference (the oracle of the GPU kernels).
//!
//! Plain Rust, no GStreamer and no CUDA: the element and the tests drive it through
//! [`engine`].

pub mod center;
pub mod engine;
pub mod frame;
pub mod graph;
pub mod lower;
pub mod onnx;
pub mod ops;
pub mod precision;
pub mod recompute;
pub mod shapes;
pub mod temporal;
pub mod tensor;

pub use tensor::{Tensor, Value};

/// Everything that can go wrong between an ONNX file and a planned network. The messages name
/// the model, the node and the operator, so the element can post them on the bus as they are.
#[derive(Debug, Clone, PartialEq)]
pub enum NeuralError {
    /// The file could not be read.
    Io(String),
    /// The protobuf is truncated or corrupt.
    Parse(String),
    /// The graph is malformed: a cycle, a missing input or initializer, a bad attribute.
    Graph(String),
    /// An operator (or an attribute value of one) the engine does not implement.
    Unsupported(String),
    /// The model does not fit the element: not 3 channels, too many weights, too large a plan.
    Model(String),
}

impl std::fmt::Display for NeuralError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NeuralError::Io(m) => write!(f, "cannot read the model: {m}"),
            NeuralError::Parse(m) => write!(f, "the model is not a valid ONNX file: {m}"),
            NeuralError::Graph(m) => write!(f, "the model's graph is invalid: {m}"),
            NeuralError::Unsupported(m) => write!(f, "unsupported in the model: {m}"),
            NeuralError::Model(m) => write!(f, "the model cannot be used: {m}"),
        }
    }
}

impl NeuralError {
    /// The same error with its message rewritten by `add` (to name the model, node or stage
    /// it came from).
    pub fn with_context(self, add: impl FnOnce(String) -> String) -> NeuralError {
        match self {
            NeuralError::Io(m) => NeuralError::Io(add(m)),
            NeuralError::Parse(m) => NeuralError::Parse(add(m)),
            NeuralError::Graph(m) => NeuralError::Graph(add(m)),
            NeuralError::Unsupported(m) => NeuralError::Unsupported(add(m)),
            NeuralError::Model(m) => NeuralError::Model(add(m)),
        }
    }
}

impl std::error::Error for NeuralError {}
