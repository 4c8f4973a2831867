//! Dense row-major tensors for the CPU reference: f32 activations and weights, i64 for the
//! shape subgraphs that are folded once the input size is known.

/// A dense row-major tensor. `data.len()` is always the product of `shape` (1 for a scalar,
/// whose shape is empty).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tensor<T = f32> {
    pub shape: Vec<usize>,
    pub data: Vec<T>,
}

impl<T: Clone + Default> Tensor<T> {
    /// A tensor of `shape` filled with `T::default()`.
    pub fn zeros(shape: &[usize]) -> Self {
        let n = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            data: vec![T::default(); n],
        }
    }

    /// Panics when `data.len()` does not match `shape` (a bug in the caller, not bad input).
    pub fn new(shape: Vec<usize>, data: Vec<T>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "tensor data does not match shape {shape:?}"
        );
        Tensor { shape, data }
    }

    pub fn scalar(v: T) -> Self {
        Tensor {
            shape: vec![],
            data: vec![v],
        }
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

/// A value flowing through the graph: activations and weights are f32, shape arithmetic is i64.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Float(Tensor<f32>),
    Int(Tensor<i64>),
}

impl Value {
    pub fn shape(&self) -> &[usize] {
        match self {
            Value::Float(t) => &t.shape,
            Value::Int(t) => &t.shape,
        }
    }
}
