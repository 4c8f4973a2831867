//! The checked graph: one activation input, its initializers decoded, nodes in topological
//! order, every operator known. Everything the lowering assumes is verified here, so later
//! passes can index without checking.

use std::collections::{HashMap, HashSet};

use super::NeuralError;
use super::onnx::{Dim, ModelProto, NodeProto, attribute_type};
use super::ops;
use super::tensor::Value;

/// Models whose weights declare more than this many bytes are refused before any is decoded.
pub const MAX_WEIGHT_BYTES: u64 = 1 << 30;

/// A model's graph, checked.
#[derive(Debug, Clone)]
pub struct Graph {
    /// The model's name (the file name, or what the caller passed).
    pub model: String,
    /// The default domain's opset.
    pub opset: i64,
    /// The one activation input: name and declared dims (`None` = symbolic).
    pub input: String,
    pub input_dims: Vec<Option<usize>>,
    /// The one output.
    pub output: String,
    /// Initializers and `Constant` node values, decoded.
    pub initializers: HashMap<String, Value>,
    /// Nodes in topological order (`Constant` nodes excluded: their values are initializers).
    pub nodes: Vec<NodeProto>,
    /// Bytes the weights declare (dims × element size).
    pub weight_bytes: u64,
}

impl Graph {
    /// Checks `model` and decodes its weights. The weight size is summed from the tensors'
    /// headers first, so an oversized model is refused before anything is allocated.
    pub fn from_model(model: &ModelProto, name: &str) -> Result<Graph, NeuralError> {
        let g = &model.graph;
        let opset = model.default_opset().ok_or_else(|| {
            NeuralError::Graph(format!(
                "model '{name}' imports no opset of the default ONNX domain"
            ))
        })?;

        // weights: sum the declared sizes before decoding
        let mut weight_bytes = 0u64;
        let constant_tensors = g
            .node
            .iter()
            .filter(|n| n.op_type == "Constant")
            .filter_map(|n| {
                n.attribute
                    .iter()
                    .find(|a| a.name == "value" && a.r#type == attribute_type::TENSOR)
                    .and_then(|a| a.t.as_ref())
            });
        for t in g.initializer.iter().chain(constant_tensors) {
            let bytes = t.declared_bytes().map_err(|e| in_model(e, name))?;
            weight_bytes = weight_bytes.saturating_add(bytes);
        }
        if weight_bytes > MAX_WEIGHT_BYTES {
            return Err(NeuralError::Model(format!(
                "model '{name}' declares {weight_bytes} bytes of weights, more than the limit \
                 of {MAX_WEIGHT_BYTES} bytes (1 GiB); refused before loading them"
            )));
        }

        let mut initializers = HashMap::new();
        for t in &g.initializer {
            let v = t.to_value().map_err(|e| in_model(e, name))?;
            initializers.insert(t.name.clone(), v);
        }

        // operators
        for n in &g.node {
            let domain_ok = n.domain.is_empty() || n.domain == "ai.onnx";
            if !domain_ok || !ops::is_supported(&n.op_type) {
                let op = if domain_ok {
                    n.op_type.clone()
                } else {
                    format!("{}.{}", n.domain, n.op_type)
                };
                return Err(NeuralError::Unsupported(format!(
                    "operator '{op}' (node '{}') in model '{name}' is not implemented; the \
                     engine implements {}",
                    n.name,
                    ops::SUPPORTED_OPS.join(", ")
                )));
            }
        }

        // Constant nodes become initializers (their outputs are values from the start)
        let mut nodes = Vec::with_capacity(g.node.len());
        for n in &g.node {
            if n.op_type == "Constant" {
                let out = ops::run_node(n, &[], opset).map_err(|e| in_model(e, name))?;
                for (o, v) in n.output.iter().zip(out) {
                    initializers.insert(o.clone(), v);
                }
            } else {
                nodes.push(n.clone());
            }
        }

        // the activation input: graph inputs that are not initializers
        let inputs: Vec<_> = g
            .input
            .iter()
            .filter(|i| !initializers.contains_key(&i.name))
            .collect();
        let [input] = inputs.as_slice() else {
            return Err(NeuralError::Model(format!(
                "model '{name}' has {} activation inputs ({}); the element feeds exactly one \
                 picture",
                inputs.len(),
                inputs
                    .iter()
                    .map(|i| i.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        let input_dims = match &input.shape {
            Some(dims) => dims
                .iter()
                .map(|d| match d {
                    Dim::Value(v) if *v > 0 => Some(*v as usize),
                    _ => None,
                })
                .collect(),
            None => vec![None; 4],
        };
        let [output] = g.output.as_slice() else {
            return Err(NeuralError::Model(format!(
                "model '{name}' has {} outputs; the element reads exactly one picture",
                g.output.len()
            )));
        };

        let nodes = topological_order(nodes, &input.name, &initializers, name)?;
        let produced: HashSet<&str> = nodes
            .iter()
            .flat_map(|n| n.output.iter().map(|s| s.as_str()))
            .chain(std::iter::once(input.name.as_str()))
            .collect();
        if !produced.contains(output.name.as_str()) && !initializers.contains_key(&output.name) {
            return Err(NeuralError::Graph(format!(
                "model '{name}': no node produces the output '{}'",
                output.name
            )));
        }

        Ok(Graph {
            model: name.to_string(),
            opset,
            input: input.name.clone(),
            input_dims,
            output: output.name.clone(),
            initializers,
            nodes,
            weight_bytes,
        })
    }

    /// Nodes that read `value`.
    pub fn consumers(&self, value: &str) -> Vec<usize> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.input.iter().any(|i| i == value))
            .map(|(i, _)| i)
            .collect()
    }
}

fn in_model(e: NeuralError, model: &str) -> NeuralError {
    let add = |m: String| format!("{m} (model '{model}')");
    e.with_context(add)
}

/// Kahn's algorithm, stable (nodes already in order stay in order). A node input that nothing
/// provides, or a cycle, is a [`NeuralError::Graph`] naming the node and the model.
fn topological_order(
    nodes: Vec<NodeProto>,
    input: &str,
    initializers: &HashMap<String, Value>,
    model: &str,
) -> Result<Vec<NodeProto>, NeuralError> {
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            if producer.insert(o, i).is_some() || o == input || initializers.contains_key(o) {
                return Err(NeuralError::Graph(format!(
                    "node '{}' ({}) in model '{model}' writes '{o}', which is already defined",
                    n.name, n.op_type
                )));
            }
        }
    }
    let mut waiting = vec![0usize; nodes.len()];
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        for name in n.input.iter().filter(|s| !s.is_empty()) {
            if let Some(&p) = producer.get(name.as_str()) {
                waiting[i] += 1;
                readers[p].push(i);
            } else if name != input && !initializers.contains_key(name) {
                return Err(NeuralError::Graph(format!(
                    "node '{}' ({}) in model '{model}' reads '{name}', which no node, \
                     initializer or input provides",
                    n.name, n.op_type
                )));
            }
        }
    }
    let mut ready: std::collections::BTreeSet<usize> =
        (0..nodes.len()).filter(|&i| waiting[i] == 0).collect();
    let mut order = Vec::with_capacity(nodes.len());
    while let Some(i) = ready.pop_first() {
        order.push(i);
        for &r in &readers[i] {
            waiting[r] -= 1;
            if waiting[r] == 0 {
                ready.insert(r);
            }
        }
    }
    if order.len() < nodes.len() {
        let stuck: Vec<String> = (0..nodes.len())
            .filter(|&i| waiting[i] > 0)
            .take(6)
            .map(|i| format!("'{}' ({})", nodes[i].name, nodes[i].op_type))
            .collect();
        return Err(NeuralError::Graph(format!(
            "model '{model}' has a cycle through nodes {}",
            stuck.join(", ")
        )));
    }
    let mut slots: Vec<Option<NodeProto>> = nodes.into_iter().map(Some).collect();
    Ok(order
        .into_iter()
        .map(|i| slots[i].take().expect("each node once"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::neural::onnx::*;

    fn graph(nodes: Vec<NodeProto>, inits: Vec<TensorProto>) -> ModelProto {
        model(
            GraphProto {
                name: "g".into(),
                node: nodes,
                initializer: inits,
                input: vec![value_info("x", data_type::FLOAT, &[1, 3, -1, -1])],
                output: vec![value_info("y", data_type::FLOAT, &[1, 3, -1, -1])],
                ..Default::default()
            },
            13,
        )
    }

    #[test]
    fn nodes_are_sorted() {
        let m = graph(
            vec![
                node("Relu", &["a"], &["y"], vec![]),
                node("Add", &["x", "b"], &["a"], vec![]),
            ],
            vec![float_tensor("b", &[1], &[1.0])],
        );
        let g = Graph::from_model(&m, "m").unwrap();
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Add", "Relu"]);
        assert_eq!(g.weight_bytes, 4);
        assert_eq!(g.input_dims, vec![Some(1), Some(3), None, None]);
    }

    #[test]
    fn cycles_missing_values_and_unknown_ops_are_named() {
        let m = graph(
            vec![
                node("Add", &["x", "b"], &["a"], vec![]),
                node("Relu", &["a"], &["y"], vec![]),
            ],
            vec![],
        );
        let e = Graph::from_model(&m, "cute").unwrap_err().to_string();
        assert!(
            e.contains("'b'") && e.contains("Add_a") && e.contains("cute"),
            "{e}"
        );

        let m = graph(
            vec![
                node("Add", &["x", "c"], &["a"], vec![]),
                node("Relu", &["a"], &["c"], vec![]),
                node("Relu", &["a"], &["y"], vec![]),
            ],
            vec![],
        );
        let e = Graph::from_model(&m, "cute").unwrap_err();
        assert!(
            matches!(e, NeuralError::Graph(ref m) if m.contains("cycle")),
            "{e}"
        );

        let m = graph(vec![node("Frobnicate", &["x"], &["y"], vec![])], vec![]);
        let e = Graph::from_model(&m, "cute").unwrap_err();
        assert!(
            matches!(e, NeuralError::Unsupported(ref m) if m.contains("'Frobnicate'") && m.contains("Frobnicate_y") && m.contains("'cute'")),
            "{e}"
        );
    }

    #[test]
    fn oversized_weights_are_refused_before_decoding() {
        // declares 4 GB of floats with no data: refused by the header sum, not by decoding
        let big = TensorProto {
            name: "w".into(),
            dims: vec![1 << 20, 1 << 10],
            data_type: data_type::FLOAT,
            ..Default::default()
        };
        let m = graph(vec![node("Add", &["x", "w"], &["y"], vec![])], vec![big]);
        let e = Graph::from_model(&m, "big").unwrap_err();
        assert!(
            matches!(e, NeuralError::Model(ref m) if m.contains("4294967296") && m.contains("1 GiB")),
            "{e}"
        );
    }
}
