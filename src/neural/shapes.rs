//! Shape inference for one concrete input size, and constant folding: every node whose inputs
//! are all known values (initializers, folded results, or the shape of an activation) is
//! evaluated once here by [`ops::run_node`], so the shape subgraphs (Shape → Gather/Slice →
//! Mul → Concat → Resize sizes) disappear before the network runs.

use std::collections::HashMap;

use super::NeuralError;
use super::graph::Graph;
use super::onnx::NodeProto;
use super::ops;
use super::ops::conv::{Conv2dParams, conv2d_output_size};
use super::ops::elementwise::broadcast_shape;
use super::tensor::{Tensor, Value};

/// Operators besides the elementwise unary ones (`lower::UNARY_OPS`) whose output has the
/// input's shape.
const OTHER_SAME_SHAPE_OPS: &[&str] = &[
    "Cast",
    "Softmax",
    "InstanceNormalization",
    "BatchNormalization",
];

/// Operators with numpy broadcasting over all inputs.
pub const BROADCAST_OPS: &[&str] = &["Add", "Sub", "Mul", "Div", "Pow", "PRelu", "Min", "Max"];

/// The graph at one input size: the shape of every activation, the value of every folded
/// tensor, and the nodes left to run.
#[derive(Debug, Clone)]
pub struct Shaped {
    pub shapes: HashMap<String, Vec<usize>>,
    pub consts: HashMap<String, Value>,
    /// Nodes that depend on the input, in topological order.
    pub nodes: Vec<NodeProto>,
    /// How many nodes were folded away.
    pub folded: usize,
}

impl Shaped {
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.shapes.get(name).map(|s| s.as_slice())
    }

    pub fn is_const(&self, name: &str) -> bool {
        self.consts.contains_key(name)
    }

    /// Elements of `name` (1 for a scalar).
    pub fn numel(&self, name: &str) -> usize {
        self.shapes.get(name).map_or(0, |s| s.iter().product())
    }
}

/// Infers every shape for `input_shape` and folds every input-independent node.
pub fn infer(graph: &Graph, input_shape: &[usize]) -> Result<Shaped, NeuralError> {
    if input_shape.len() != graph.input_dims.len() {
        return Err(NeuralError::Model(format!(
            "model '{}' takes a rank-{} input, the engine was given {input_shape:?}",
            graph.model,
            graph.input_dims.len()
        )));
    }
    for (i, (&given, declared)) in input_shape.iter().zip(&graph.input_dims).enumerate() {
        if let Some(d) = declared
            && *d != given
        {
            return Err(NeuralError::Model(format!(
                "model '{}' fixes dimension {i} of its input to {d}, the engine was given \
                 {input_shape:?}",
                graph.model
            )));
        }
    }
    let mut s = Shaped {
        shapes: HashMap::new(),
        consts: graph.initializers.clone(),
        nodes: Vec::new(),
        folded: 0,
    };
    for (name, v) in &s.consts {
        s.shapes.insert(name.clone(), v.shape().to_vec());
    }
    s.shapes.insert(graph.input.clone(), input_shape.to_vec());

    for node in &graph.nodes {
        let named = |e: NeuralError| name_error(e, node, &graph.model);
        let inputs: Vec<Option<&str>> = node
            .input
            .iter()
            .map(|i| (!i.is_empty()).then_some(i.as_str()))
            .collect();
        let all_const = inputs.iter().flatten().all(|i| s.consts.contains_key(*i));
        let outputs: Vec<Value> = if node.op_type == "Shape" {
            let x = s.shape(&node.input[0]).expect("sorted").to_vec();
            let r = x.len() as i64;
            let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let start = clamp(node.attr("start").map_or(0, |a| a.i));
            let end = clamp(node.attr("end").map_or(r, |a| a.i));
            let dims: Vec<i64> = x[start..end.max(start)].iter().map(|&d| d as i64).collect();
            vec![Value::Int(Tensor::new(vec![dims.len()], dims))]
        } else if all_const {
            let values: Vec<Option<&Value>> =
                inputs.iter().map(|i| i.map(|i| &s.consts[i])).collect();
            ops::run_node(node, &values, graph.opset).map_err(named)?
        } else {
            let shapes = infer_node(node, &s, graph.opset).map_err(named)?;
            for (o, sh) in node.output.iter().zip(shapes) {
                if !o.is_empty() {
                    s.shapes.insert(o.clone(), sh);
                }
            }
            s.nodes.push(node.clone());
            continue;
        };
        s.folded += 1;
        for (o, v) in node.output.iter().zip(outputs) {
            if !o.is_empty() {
                s.shapes.insert(o.clone(), v.shape().to_vec());
                s.consts.insert(o.clone(), v);
            }
        }
    }
    if !s.shapes.contains_key(&graph.output) {
        return Err(NeuralError::Graph(format!(
            "model '{}': the output '{}' has no shape",
            graph.model, graph.output
        )));
    }
    Ok(s)
}

fn name_error(e: NeuralError, node: &NodeProto, model: &str) -> NeuralError {
    let add = |m: String| {
        if m.contains(&node.name) {
            format!("{m} (model '{model}')")
        } else {
            format!(
                "{m} (node '{}' {}, model '{model}')",
                node.name, node.op_type
            )
        }
    };
    e.with_context(add)
}

fn ints(v: Option<&Value>) -> Option<Vec<i64>> {
    match v {
        Some(Value::Int(t)) => Some(t.data.clone()),
        _ => None,
    }
}

fn floats(v: Option<&Value>) -> Option<Vec<f32>> {
    match v {
        Some(Value::Float(t)) => Some(t.data.clone()),
        _ => None,
    }
}

fn bad(msg: String) -> NeuralError {
    NeuralError::Graph(msg)
}

/// Output shapes of a node that depends on the input. The common activation operators have
/// rules here; the rest are evaluated on zero-filled inputs of the right shapes (cheap: they
/// are the rare, small ones), which gives exactly the shapes [`ops::run_node`] produces.
fn infer_node(node: &NodeProto, s: &Shaped, opset: i64) -> Result<Vec<Vec<usize>>, NeuralError> {
    let shape = |i: usize| -> Result<&[usize], NeuralError> {
        node.input
            .get(i)
            .filter(|n| !n.is_empty())
            .and_then(|n| s.shape(n))
            .ok_or_else(|| bad(format!("input {i} is missing")))
    };
    let konst = |i: usize| {
        node.input
            .get(i)
            .filter(|n| !n.is_empty())
            .and_then(|n| s.consts.get(n))
    };
    let attr_ints = |name: &str| node.attr(name).map(|a| a.ints.clone());
    let attr_int = |name: &str, d: i64| node.attr(name).map_or(d, |a| a.i);
    let op = node.op_type.as_str();
    let one = |sh: Vec<usize>| Ok(vec![sh]);

    if super::lower::UNARY_OPS.contains(&op) || OTHER_SAME_SHAPE_OPS.contains(&op) {
        return one(shape(0)?.to_vec());
    }
    if BROADCAST_OPS.contains(&op) {
        let mut out = shape(0)?.to_vec();
        for i in 1..node.input.len() {
            out = broadcast_shape(&out, shape(i)?).ok_or_else(|| {
                bad(format!(
                    "shapes {out:?} and {:?} do not broadcast",
                    shape(i).unwrap_or(&[])
                ))
            })?;
        }
        return one(out);
    }
    match op {
        "Conv" => {
            let x = shape(0)?;
            let w = shape(1)?;
            if x.len() != 4 || w.len() != 4 {
                return Err(NeuralError::Unsupported(format!(
                    "Conv on rank {} (the engine runs 2-D convolutions)",
                    x.len()
                )));
            }
            let stride = attr_ints("strides").unwrap_or(vec![1, 1]);
            let dilation = attr_ints("dilations").unwrap_or(vec![1, 1]);
            let kernel = [w[2], w[3]];
            let auto = node.attr("auto_pad").map_or(String::new(), |a| {
                String::from_utf8_lossy(&a.s).into_owned()
            });
            let oh_ow = match auto.as_str() {
                "SAME_UPPER" | "SAME_LOWER" => [
                    x[2].div_ceil(stride[0].max(1) as usize),
                    x[3].div_ceil(stride[1].max(1) as usize),
                ],
                _ => {
                    let pads = if auto == "VALID" {
                        vec![0; 4]
                    } else {
                        attr_ints("pads").unwrap_or(vec![0; 4])
                    };
                    let u = |v: &[i64], i: usize| v.get(i).copied().unwrap_or(1).max(0) as usize;
                    let p = Conv2dParams {
                        stride: [u(&stride, 0).max(1), u(&stride, 1).max(1)],
                        dilation: [u(&dilation, 0).max(1), u(&dilation, 1).max(1)],
                        pads: [u(&pads, 0), u(&pads, 1), u(&pads, 2), u(&pads, 3)],
                        groups: 1,
                    };
                    conv2d_output_size([x[2], x[3]], kernel, &p)?
                }
            };
            one(vec![x[0], w[0], oh_ow[0], oh_ow[1]])
        }
        "Pad" => {
            let x = shape(0)?;
            let pads = if opset >= 11 {
                ints(konst(1)).ok_or_else(|| {
                    NeuralError::Unsupported("Pad whose pads depend on the input".into())
                })?
            } else {
                attr_ints("pads").unwrap_or_default()
            };
            let r = x.len();
            let axes: Vec<usize> = match ints(konst(3)) {
                Some(a) => a
                    .iter()
                    .map(|&v| (if v < 0 { v + r as i64 } else { v }) as usize)
                    .collect(),
                None => (0..r).collect(),
            };
            if pads.len() != 2 * axes.len() {
                return Err(bad(format!("{} pads for rank {r}", pads.len())));
            }
            let mut out = x.to_vec();
            for (k, &a) in axes.iter().enumerate() {
                let d = out[a] as i64 + pads[k] + pads[k + axes.len()];
                if d < 0 {
                    return Err(bad("pads crop more than the tensor".into()));
                }
                out[a] = d as usize;
            }
            one(out)
        }
        "Resize" | "Upsample" => {
            let x = shape(0)?;
            let (scales_at, sizes_at) = match (op, opset) {
                ("Upsample", _) | ("Resize", 10) => (1, usize::MAX),
                _ => (2, 3),
            };
            if let Some(sizes) = ints(konst(sizes_at)).filter(|v| !v.is_empty()) {
                if sizes.len() != x.len() {
                    return Err(bad(format!("{} sizes for rank {}", sizes.len(), x.len())));
                }
                return one(sizes.iter().map(|&v| v.max(0) as usize).collect());
            }
            let scales = floats(konst(scales_at))
                .filter(|v| !v.is_empty())
                .or_else(|| node.attr("scales").map(|a| a.floats.clone()))
                .ok_or_else(|| {
                    NeuralError::Unsupported(
                        "Resize whose sizes or scales depend on the input values".into(),
                    )
                })?;
            if scales.len() != x.len() {
                return Err(bad(format!("{} scales for rank {}", scales.len(), x.len())));
            }
            one(x
                .iter()
                .zip(&scales)
                .map(|(&d, &f)| (d as f32 * f).floor() as usize)
                .collect())
        }
        "GlobalAveragePool" => {
            let x = shape(0)?;
            let mut out = x.to_vec();
            out.iter_mut().skip(2).for_each(|d| *d = 1);
            one(out)
        }
        "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" => {
            let x = shape(0)?;
            let r = x.len() as i64;
            let axes = if opset >= 18 || (op == "ReduceSum" && opset >= 13) {
                ints(konst(1))
            } else {
                attr_ints("axes")
            };
            let keep = attr_int("keepdims", 1) != 0;
            let axes: Vec<usize> = match axes.filter(|a| !a.is_empty()) {
                Some(a) => a
                    .iter()
                    .map(|&v| (if v < 0 { v + r } else { v }) as usize)
                    .collect(),
                None if attr_int("noop_with_empty_axes", 0) != 0 => return one(x.to_vec()),
                None => (0..x.len()).collect(),
            };
            let mut out = Vec::new();
            for (i, &d) in x.iter().enumerate() {
                if axes.contains(&i) {
                    if keep {
                        out.push(1);
                    }
                } else {
                    out.push(d);
                }
            }
            one(out)
        }
        "Transpose" => {
            let x = shape(0)?;
            let perm = attr_ints("perm").unwrap_or_else(|| (0..x.len() as i64).rev().collect());
            if perm.len() != x.len() || perm.iter().any(|&p| p < 0 || p as usize >= x.len()) {
                return Err(bad(format!("perm {perm:?} for rank {}", x.len())));
            }
            one(perm.iter().map(|&p| x[p as usize]).collect())
        }
        "Concat" => {
            let first = shape(0)?.to_vec();
            let r = first.len() as i64;
            let axis = attr_int("axis", 0);
            let axis = (if axis < 0 { axis + r } else { axis }) as usize;
            if axis >= first.len() {
                return Err(bad(format!("axis {axis} for rank {r}")));
            }
            let mut out = first;
            for i in 1..node.input.len() {
                out[axis] += shape(i)?.get(axis).copied().unwrap_or(0);
            }
            one(out)
        }
        _ => {
            // evaluate on zeros: exact shapes from the operator itself
            let zeros: Vec<Option<Value>> = (0..node.input.len())
                .map(|i| match konst(i) {
                    Some(_) => Ok(None),
                    None if node.input[i].is_empty() => Ok(None),
                    None => shape(i).map(|sh| Some(Value::Float(Tensor::zeros(sh)))),
                })
                .collect::<Result<_, _>>()?;
            let values: Vec<Option<&Value>> = (0..node.input.len())
                .map(|i| konst(i).or(zeros[i].as_ref()))
                .collect();
            let out = ops::run_node(node, &values, opset)?;
            Ok(out.iter().map(|v| v.shape().to_vec()).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::neural::onnx::*;

    /// NHWC input, reflect pad, transpose, stride-2 conv, and a Resize whose sizes come from a
    /// Shape → Gather → Mul → Concat subgraph.
    fn model_with_shape_subgraph() -> ModelProto {
        let nodes = vec![
            node(
                "Pad",
                &["x", "pads"],
                &["p"],
                vec![attr_string("mode", "reflect")],
            ),
            node(
                "Transpose",
                &["p"],
                &["t"],
                vec![attr_ints("perm", &[0, 3, 1, 2])],
            ),
            node(
                "Conv",
                &["t", "w"],
                &["c"],
                vec![
                    attr_ints("strides", &[2, 2]),
                    attr_ints("kernel_shape", &[3, 3]),
                ],
            ),
            node("Shape", &["c"], &["s"], vec![]),
            node(
                "Gather",
                &["s", "hw_idx"],
                &["hw"],
                vec![attr_int("axis", 0)],
            ),
            node("Mul", &["hw", "two"], &["hw2"], vec![]),
            node("Slice", &["s", "zero", "two"], &["nc"], vec![]),
            node(
                "Concat",
                &["nc", "hw2"],
                &["sizes"],
                vec![attr_int("axis", 0)],
            ),
            node(
                "Resize",
                &["c", "", "", "sizes"],
                &["y"],
                vec![attr_string("mode", "linear")],
            ),
        ];
        model(
            GraphProto {
                name: "g".into(),
                node: nodes,
                initializer: vec![
                    int64_tensor("pads", &[8], &[0, 1, 1, 0, 0, 0, 0, 0]),
                    float_tensor("w", &[4, 3, 3, 3], &[0.1; 108]),
                    int64_tensor("hw_idx", &[2], &[2, 3]),
                    int64_tensor("two", &[1], &[2]),
                    int64_tensor("zero", &[1], &[0]),
                ],
                input: vec![value_info("x", data_type::FLOAT, &[1, -1, -1, 3])],
                output: vec![value_info("y", data_type::FLOAT, &[1, 4, -1, -1])],
                ..Default::default()
            },
            13,
        )
    }

    #[test]
    fn shape_subgraphs_fold_and_shapes_follow_the_size() {
        let g = Graph::from_model(&model_with_shape_subgraph(), "m").unwrap();
        let s = infer(&g, &[1, 16, 24, 3]).unwrap();
        assert_eq!(s.shape("p"), Some(&[1, 17, 25, 3][..]));
        assert_eq!(s.shape("t"), Some(&[1, 3, 17, 25][..]));
        assert_eq!(s.shape("c"), Some(&[1, 4, 8, 12][..]));
        assert_eq!(s.shape("y"), Some(&[1, 4, 16, 24][..]));
        assert_eq!(
            s.consts.get("sizes"),
            Some(&Value::Int(Tensor::new(vec![4], vec![1, 4, 16, 24])))
        );
        // Shape, Gather, Mul, Slice, Concat folded; Pad, Transpose, Conv, Resize left
        assert_eq!(s.folded, 5);
        let left: Vec<&str> = s.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(left, ["Pad", "Transpose", "Conv", "Resize"]);
    }

    #[test]
    fn a_fixed_input_dimension_is_enforced() {
        let g = Graph::from_model(&model_with_shape_subgraph(), "m").unwrap();
        let e = infer(&g, &[1, 16, 24, 4]).unwrap_err().to_string();
        assert!(e.contains("dimension 3"), "{e}");
    }
}
