//! Centered storage: a convolution's or an elementwise chain's output whose channels' means
//! dwarf their deviations is stored as `x − c` (`c` per channel, the calibration frame's
//! means) so that fp16 keeps its variance.
//!
//! fp16 rounds a value to 11 bits of *its magnitude*: a channel of mean 0.45 and deviation
//! 0.016 keeps only ~6 bits of its variation, and the normalization after it magnifies that
//! noise 30 times. Calibration then kept such stages fp32 (twice the bytes, planar layout,
//! split tensor-core reads). Subtracting the channel's calibrated mean in the producing
//! convolution's bias costs nothing (a chain takes one more `Sub`), and every reader this
//! module accepts gets the same values as before, in real arithmetic:
//!
//! - a moments normalization of `x` (per-channel spatial mean and variance): the variance does
//!   not move; its mean becomes `m − c`, which a reader `Sub(x, m)` takes as it is (`(x − c) −
//!   (m − c)`); an elementwise chain that adds or subtracts the mean elsewhere gets an `Add` or
//!   `Sub` of `c` right after that node (the chain stays a line, as the GPU's chains are);
//! - `InstanceNormalization(x)`: per-channel statistics, shift-invariant;
//! - a convolution reading `x` (one group, no zero padding of its own, through a reflect or
//!   edge Pad or none): its bias takes `Σ_k W[o, i, k] · c_i` back.
//!
//! A stage with any other reader (a residual Add, a Resize, the network's output) is not
//! centerable. The rewrite is a graph transform ([`centered`]): the CPU reference and the GPU
//! program run the centered network as any other, and compute the same function.

use super::NeuralError;
use super::lower::{Lowered, StageKind};
use super::onnx::node;
use super::tensor::{Tensor, Value};

/// A normalization's mean reader that takes the centered mean as it is.
fn centered_sub(n: &super::onnx::NodeProto, x: &str, mean: &str) -> bool {
    n.op_type == "Sub" && n.input.len() == 2 && n.input[0] == x && n.input[1] == mean
}

fn conv_keeps_shifts(n: &super::onnx::NodeProto) -> bool {
    let zero_pads = n
        .attr("pads")
        .is_none_or(|a| a.ints.iter().all(|&p| p == 0));
    let auto_pad = n.attr("auto_pad").map_or(String::new(), |a| {
        String::from_utf8_lossy(&a.s).into_owned()
    });
    n.op_type == "Conv"
        && n.attr("group").is_none_or(|a| a.i <= 1)
        && zero_pads
        && matches!(auto_pad.as_str(), "" | "NOTSET" | "VALID")
}

/// A Conv of constant rank-4 weights and a constant bias or none (the rewrite changes its
/// bias).
fn constant_conv(l: &Lowered, n: &super::onnx::NodeProto) -> bool {
    let weights = n
        .input
        .get(1)
        .and_then(|w| float_const(l, w))
        .is_some_and(|w| w.shape.len() == 4);
    let bias = n
        .input
        .get(2)
        .filter(|b| !b.is_empty())
        .is_none_or(|b| float_const(l, b).is_some());
    weights && bias
}

/// A reflect or edge Pad of H and W only: every padded value is a value of its channel.
fn pad_keeps_shifts(l: &Lowered, n: &super::onnx::NodeProto) -> bool {
    let mode = n.attr("mode").map_or(String::new(), |a| {
        String::from_utf8_lossy(&a.s).into_owned()
    });
    let pads = match n.input.get(1).and_then(|p| l.consts.get(p)) {
        Some(Value::Int(t)) => Some(t.data.clone()),
        _ => n.attr("pads").map(|a| a.ints.clone()),
    };
    let spatial_only =
        pads.is_some_and(|p| p.len() == 8 && [0, 1, 4, 5].iter().all(|&k| p[k] == 0));
    n.op_type == "Pad"
        && matches!(mode.as_str(), "reflect" | "edge")
        && spatial_only
        && n.input.len() <= 3
}

/// Why stage `i`'s output can or cannot be centered: `None` when it can.
pub fn refusal(l: &Lowered, i: usize) -> Option<&'static str> {
    let s = &l.stages[i];
    let [x] = s.outputs.as_slice() else {
        return Some("not one output");
    };
    let producer = match (s.kind, s.nodes.last()) {
        (StageKind::Conv, Some(n)) => n.op_type == "Conv" && constant_conv(l, n),
        // a chain ending in an activation runs its affine part and the activation in one
        // pass on the GPU; a shift after the activation would take that away
        (StageKind::Elementwise, Some(n)) => {
            n.output.first() == Some(x)
                && matches!(n.op_type.as_str(), "Add" | "Sub" | "Mul" | "Div")
        }
        _ => false,
    };
    if !producer {
        return Some(
            "not a convolution of constant weights without an activation after it, nor a \
             chain ending in a binary operator",
        );
    }
    if *x == l.output {
        return Some("the network's output");
    }
    if l.shapes.get(x).is_none_or(|sh| sh.len() != 4 || sh[0] != 1) {
        return Some("not one NCHW image");
    }
    if [format!("{x}.center"), format!("{x}.uncentered")]
        .iter()
        .any(|n| l.consts.contains_key(n) || l.shapes.contains_key(n))
    {
        return Some("already centered");
    }
    // the means of `x` (moments normalizations of it)
    let means: Vec<&String> = l
        .stages
        .iter()
        .filter_map(|r| r.stats.as_ref())
        .filter(|st| st.input == *x && st.instance.is_none())
        .filter_map(|st| st.mean.as_ref())
        .collect();
    for (j, r) in l.stages.iter().enumerate() {
        for (k, n) in r.nodes.iter().enumerate() {
            if !n.input.iter().any(|v| v == x) {
                continue;
            }
            let fine = match n.op_type.as_str() {
                "Sub" => means.iter().any(|m| centered_sub(n, x, m)),
                "InstanceNormalization" => n.input[0] == *x && n.input[1..].iter().all(|v| v != x),
                "Conv" => {
                    r.kind == StageKind::Conv
                        && k == 0
                        && n.input[0] == *x
                        && n.input[1..].iter().all(|v| v != x)
                        && conv_keeps_shifts(n)
                        && constant_conv(l, n)
                }
                "Pad" => {
                    r.kind == StageKind::Conv
                        && k == 0
                        && n.input[0] == *x
                        && pad_keeps_shifts(l, n)
                        && r.nodes.get(1).is_some_and(|c| {
                            c.input.first() == n.output.first()
                                && conv_keeps_shifts(c)
                                && constant_conv(l, c)
                        })
                }
                _ => false,
            };
            if !fine || j <= i {
                return Some("a reader that the shift would change");
            }
        }
    }
    // a mean read elsewhere must be added or subtracted in an elementwise chain, where `c`
    // can be added back
    for m in &means {
        if **m == l.output {
            return Some("a mean is the network's output");
        }
        for r in &l.stages {
            for n in &r.nodes {
                let reads = n.input.iter().filter(|v| v == m).count();
                if reads == 0 || centered_sub(n, x, m) {
                    continue;
                }
                if r.kind != StageKind::Elementwise
                    || reads != 1
                    || take_back(n, m).is_none()
                    || n.output.len() != 1
                {
                    return Some("a mean read other than added or subtracted in a chain");
                }
            }
        }
    }
    None
}

/// The node that restores a centered mean `m` after `n` read it: `Add` when `n` added it
/// (`a + m` or `m − a`: the result lacks `c`), `Sub` when `n` subtracted it (`a − m`).
fn take_back(n: &super::onnx::NodeProto, m: &str) -> Option<&'static str> {
    match (n.op_type.as_str(), n.input.iter().position(|v| v == m)) {
        ("Add", Some(_)) | ("Sub", Some(0)) => Some("Add"),
        ("Sub", Some(1)) => Some("Sub"),
        _ => None,
    }
}

/// Per stage: whether its output may be stored centered ([`refusal`] is `None`).
pub fn centerable(l: &Lowered) -> Vec<bool> {
    (0..l.stages.len())
        .map(|i| refusal(l, i).is_none())
        .collect()
}

fn float_const<'a>(l: &'a Lowered, name: &str) -> Option<&'a Tensor<f32>> {
    match l.consts.get(name) {
        Some(Value::Float(t)) => Some(t),
        _ => None,
    }
}

/// Adds `delta` (one value per output channel) to the bias of node `k` of stage `j` (a Conv),
/// giving the node a bias of its own under a new name.
fn add_to_bias(l: &mut Lowered, j: usize, k: usize, delta: &[f32]) -> Result<(), NeuralError> {
    let n = &l.stages[j].nodes[k];
    let old = n.input.get(2).filter(|b| !b.is_empty());
    let mut bias = match old {
        Some(b) => float_const(l, b)
            .map(|t| t.data.clone())
            .ok_or_else(|| NeuralError::Graph(format!("conv '{}': computed bias", n.name)))?,
        None => vec![0.0; delta.len()],
    };
    if bias.len() != delta.len() {
        return Err(NeuralError::Graph(format!(
            "conv '{}': {} bias values for {} channels",
            n.name,
            bias.len(),
            delta.len()
        )));
    }
    bias.iter_mut().zip(delta).for_each(|(b, d)| *b += d);
    // a reader of two centered tensors, or a centered reader, adjusts its bias again
    let name = (0..)
        .map(|k| format!("{}.centered_bias{k}", n.output[0]))
        .find(|name| !l.consts.contains_key(name))
        .expect("a free name");
    let c = bias.len();
    l.consts
        .insert(name.clone(), Value::Float(Tensor::new(vec![c], bias)));
    l.shapes.insert(name.clone(), vec![c]);
    let n = &mut l.stages[j].nodes[k];
    n.input.resize(3.max(n.input.len()), String::new());
    n.input[2] = name;
    Ok(())
}

/// The network with each stage `i` of `centers[i] = Some(c)` storing its output minus `c`
/// (one value per channel) and its readers taking `c` back, as the module says. Every
/// centered stage must be [`centerable`].
pub fn centered(l: &Lowered, centers: &[Option<Vec<f32>>]) -> Result<Lowered, NeuralError> {
    let mut out = l.clone();
    for (i, c) in centers.iter().enumerate() {
        let Some(c) = c else { continue };
        if i >= l.stages.len() {
            break;
        }
        if let Some(why) = refusal(l, i) {
            return Err(NeuralError::Graph(format!(
                "stage {i} '{}' cannot be stored centered: {why}",
                l.stages[i].name
            )));
        }
        let x = l.stages[i].outputs[0].clone();
        let channels = l.shapes[&x][1];
        if c.len() != channels {
            return Err(NeuralError::Graph(format!(
                "stage {i} '{}': {} centers for {channels} channels",
                l.stages[i].name,
                c.len()
            )));
        }
        // the producer subtracts c: a convolution in its bias, a chain in one more node
        let last = out.stages[i].nodes.len() - 1;
        if out.stages[i].kind == StageKind::Conv {
            let minus: Vec<f32> = c.iter().map(|v| -v).collect();
            add_to_bias(&mut out, i, last, &minus)?;
        } else {
            let (center, partial) = (format!("{x}.center"), format!("{x}.uncentered"));
            let shape = vec![1, channels, 1, 1];
            out.consts.insert(
                center.clone(),
                Value::Float(Tensor::new(shape.clone(), c.clone())),
            );
            out.shapes.insert(center.clone(), shape);
            out.shapes.insert(partial.clone(), l.shapes[&x].clone());
            let stage = &mut out.stages[i];
            stage.nodes[last].output[0] = partial.clone();
            stage
                .nodes
                .push(node("Sub", &[&partial, &center], &[&x], vec![]));
        }
        // convolutions reading x take W·c back into their bias
        for j in i + 1..out.stages.len() {
            let stage = &out.stages[j];
            let reads_x = stage.kind == StageKind::Conv
                && stage
                    .nodes
                    .first()
                    .is_some_and(|n| n.input.first() == Some(&x));
            if !reads_x {
                continue;
            }
            let k = out.stages[j]
                .nodes
                .iter()
                .position(|n| n.op_type == "Conv")
                .unwrap_or(0);
            let w = float_const(&out, &out.stages[j].nodes[k].input[1])
                .cloned()
                .ok_or_else(|| NeuralError::Graph(format!("stage {j}: computed weights")))?;
            let [o, ci, kh, kw] = w.shape[..] else {
                return Err(NeuralError::Graph(format!("stage {j}: weights of rank 4")));
            };
            if ci != channels {
                return Err(NeuralError::Graph(format!(
                    "stage {j}: {ci} input channels, {channels} centers"
                )));
            }
            let taps = kh * kw;
            let back: Vec<f32> = (0..o)
                .map(|oc| {
                    let sum: f64 = (0..ci)
                        .map(|ic| {
                            let row = &w.data[(oc * ci + ic) * taps..][..taps];
                            f64::from(c[ic]) * row.iter().map(|&v| f64::from(v)).sum::<f64>()
                        })
                        .sum();
                    sum as f32
                })
                .collect();
            add_to_bias(&mut out, j, k, &back)?;
        }
        // a chain node adding or subtracting a mean of x is followed by c's correction
        let means: Vec<String> = out
            .stages
            .iter()
            .filter_map(|r| r.stats.as_ref())
            .filter(|st| st.input == x && st.instance.is_none())
            .filter_map(|st| st.mean.clone())
            .collect();
        for m in &means {
            let center = format!("{m}.center");
            if out.consts.contains_key(&center) {
                return Err(NeuralError::Graph(format!("'{m}' is already centered")));
            }
            let shape = out
                .shapes
                .get(m)
                .cloned()
                .unwrap_or(vec![1, channels, 1, 1]);
            for j in 0..out.stages.len() {
                let mut k = 0;
                while k < out.stages[j].nodes.len() {
                    let n = &out.stages[j].nodes[k];
                    let op = match take_back(n, m) {
                        Some(op) if !centered_sub(n, &x, m) => op,
                        _ => {
                            k += 1;
                            continue;
                        }
                    };
                    out.consts.insert(
                        center.clone(),
                        Value::Float(Tensor::new(shape.clone(), c.clone())),
                    );
                    out.shapes.insert(center.clone(), shape.clone());
                    // the node writes a new name, the correction writes the old one
                    let result = n.output[0].clone();
                    let partial = format!("{result}.centered");
                    let result_shape = out.shapes.get(&result).cloned();
                    if let Some(sh) = result_shape {
                        out.shapes.insert(partial.clone(), sh);
                    }
                    let stage = &mut out.stages[j];
                    stage.nodes[k].output[0] = partial.clone();
                    stage
                        .nodes
                        .insert(k + 1, node(op, &[&partial, &center], &[&result], vec![]));
                    k += 2;
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::neural::engine::{Specialised, nchw_test_model, test_noise as noise};
    use crate::neural::onnx::*;
    use crate::neural::tensor::Tensor;

    fn weights(name: &str, dims: &[i64], seed: u64, scale: f32) -> TensorProto {
        let n: i64 = dims.iter().product();
        float_tensor(name, dims, &noise(n as usize, seed, scale))
    }

    /// AnimeGANv3's self-modulated normalization of `a` (a 3x3 conv of the reflect-padded
    /// input, no bias): `(a − m_a)/s_a · s_b ⊕ m_b` with b a 1x1 conv of a and ⊕ per
    /// `mean_op` ("Add": `+ m_b`, "Sub": `− m_b`, "RSub": `m_b − ·`), then a leaky Relu; plus,
    /// when `extra` names one, a second reader of `a` added to the result: "Pad" a
    /// reflect-padded 3x3 conv, "Edge" an edge-padded one, "Dilated" a reflect-padded 3x3 conv
    /// of dilation 2, "ConstPad" a zero-padded one, "Group" a two-group one, "Instance" an
    /// InstanceNormalization, "Add" `a` itself (a residual).
    fn modulated(mean_op: &str, extra: Option<&str>) -> Specialised {
        let pads = |name: &str, p: i64| int64_tensor(name, &[8], &[0, 0, p, p, 0, 0, p, p]);
        let inits = vec![
            weights("wa", &[4, 3, 3, 3], 1, 0.5),
            weights("wb", &[4, 4, 1, 1], 2, 0.5),
            weights("wc", &[4, 4, 3, 3], 3, 0.3),
            weights("wg", &[4, 2, 3, 3], 5, 0.3),
            weights("wo", &[3, 4, 1, 1], 4, 0.5),
            weights("in_scale", &[4], 6, 1.0),
            weights("in_bias", &[4], 7, 1.0),
            float_tensor("eps", &[1], &[1e-5]),
            float_tensor("ba", &[4], &[0.4, -0.3, 0.2, 0.6]),
            pads("pads_in", 1),
            pads("pads_1", 1),
            pads("pads_2", 2),
        ];
        let moments = |x: &str, nodes: &mut Vec<NodeProto>| {
            let (m, d, sq, v, ve, s) = (
                format!("{x}_m"),
                format!("{x}_d"),
                format!("{x}_sq"),
                format!("{x}_v"),
                format!("{x}_ve"),
                format!("{x}_s"),
            );
            nodes.push(node("GlobalAveragePool", &[x], &[&m], vec![]));
            nodes.push(node("Sub", &[x, &m], &[&d], vec![]));
            nodes.push(node("Mul", &[&d, &d], &[&sq], vec![]));
            nodes.push(node("GlobalAveragePool", &[&sq], &[&v], vec![]));
            nodes.push(node("Add", &[&v, "eps"], &[&ve], vec![]));
            nodes.push(node("Sqrt", &[&ve], &[&s], vec![]));
        };
        let k = |n: i64| vec![attr_ints("kernel_shape", &[n, n])];
        let mode = |m: &str| vec![attr_string("mode", m)];
        let mut nodes = vec![
            node("Pad", &["input", "pads_in"], &["p"], mode("reflect")),
            node("Conv", &["p", "wa", "ba"], &["a"], k(3)),
            node("Conv", &["a", "wb"], &["b"], k(1)),
        ];
        moments("a", &mut nodes);
        moments("b", &mut nodes);
        nodes.push(node("Div", &["a_d", "a_s"], &["n"], vec![]));
        nodes.push(node("Mul", &["n", "b_s"], &["ns"], vec![]));
        nodes.push(match mean_op {
            "Add" => node("Add", &["ns", "b_m"], &["nm"], vec![]),
            "Sub" => node("Sub", &["ns", "b_m"], &["nm"], vec![]),
            _ => node("Sub", &["b_m", "ns"], &["nm"], vec![]),
        });
        nodes.push(node(
            "LeakyRelu",
            &["nm"],
            &["y"],
            vec![attr_float("alpha", 0.2)],
        ));
        let second = match extra {
            Some("Pad") | Some("Edge") | Some("ConstPad") => {
                let m = match extra {
                    Some("Pad") => "reflect",
                    Some("Edge") => "edge",
                    _ => "constant",
                };
                nodes.push(node("Pad", &["a", "pads_1"], &["ap"], mode(m)));
                nodes.push(node("Conv", &["ap", "wc"], &["c"], k(3)));
                Some("c")
            }
            Some("Dilated") => {
                nodes.push(node("Pad", &["a", "pads_2"], &["ap"], mode("reflect")));
                let mut attrs = k(3);
                attrs.push(attr_ints("dilations", &[2, 2]));
                nodes.push(node("Conv", &["ap", "wc"], &["c"], attrs));
                Some("c")
            }
            Some("Group") => {
                nodes.push(node("Pad", &["a", "pads_1"], &["ap"], mode("reflect")));
                let mut attrs = k(3);
                attrs.push(attr_int("group", 2));
                nodes.push(node("Conv", &["ap", "wg"], &["c"], attrs));
                Some("c")
            }
            Some("Instance") => {
                nodes.push(node(
                    "InstanceNormalization",
                    &["a", "in_scale", "in_bias"],
                    &["c"],
                    vec![attr_float("epsilon", 1e-5)],
                ));
                Some("c")
            }
            Some("Add") => Some("a"),
            _ => None,
        };
        let last = match second {
            Some(c) => {
                nodes.push(node("Add", &["y", c], &["yc"], vec![]));
                "yc"
            }
            None => "y",
        };
        nodes.push(node("Conv", &[last, "wo"], &["output"], k(1)));
        nchw_test_model("center_test", nodes, inits, "output")
            .specialise(12, 16)
            .unwrap()
    }

    /// The stage of the chain that reads b's mean.
    fn chain_reading_b_m(l: &Lowered) -> usize {
        l.stages
            .iter()
            .position(|st| {
                st.kind == StageKind::Elementwise
                    && st.nodes.iter().any(|n| n.input.iter().any(|v| v == "b_m"))
            })
            .unwrap()
    }

    fn stage_writing(spec: &Specialised, value: &str) -> usize {
        spec.lowered()
            .stage_writing(value)
            .unwrap_or_else(|| panic!("no stage writes {value}"))
    }

    fn input(h: usize, w: usize) -> Tensor<f32> {
        Tensor::new(vec![1, 3, h, w], noise(3 * h * w, 9, 1.0))
    }

    fn max_diff(a: &Tensor<f32>, b: &Tensor<f32>) -> f32 {
        a.data
            .iter()
            .zip(&b.data)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max)
    }

    #[test]
    fn a_centered_network_computes_the_same_function() {
        let x = input(12, 16);
        for mean_op in ["Add", "Sub", "RSub"] {
            for extra in ["Pad", "Edge", "Dilated", "Instance"] {
                let what = format!("{mean_op} {extra}");
                let spec = modulated(mean_op, Some(extra));
                let l = spec.lowered();
                let (a, b) = (stage_writing(&spec, "a"), stage_writing(&spec, "b"));
                let chain = chain_reading_b_m(l);
                // the chain ends in the Add of the second reader's result: a binary operator
                for s in [a, b, chain] {
                    assert_eq!(refusal(l, s), None, "{what}: stage {s}");
                }
                // shifts far larger than the values: anything the rewrite missed shows
                let mut centers = vec![None; spec.stage_count()];
                centers[a] = Some(vec![40.0, -25.0, 13.0, 70.0]);
                centers[b] = Some(vec![-60.0, 33.0, 8.0, -17.0]);
                centers[chain] = Some(vec![5.0, -3.0, 2.0, 9.0]);
                let c = spec.centered(&centers).unwrap();
                let (want, got) = (spec.run(&x, None).unwrap(), c.run(&x, None).unwrap());
                let diff = max_diff(&want, &got);
                assert!(diff < 1e-4, "{what}: max difference {diff}");
                assert!(want.data.iter().any(|v| v.abs() > 0.1));
                // each centered stage alone too
                for s in [a, b, chain] {
                    let mut one = vec![None; spec.stage_count()];
                    one[s] = centers[s].clone();
                    let got = spec.centered(&one).unwrap().run(&x, None).unwrap();
                    let diff = max_diff(&want, &got);
                    assert!(diff < 1e-4, "{what}, stage {s} alone: {diff}");
                }

                // the chain: b's mean is followed by its correction (Sub after a subtracted
                // mean, Add after an added one or after `m − ·`), and the chain's own Sub
                let (old, new) = (&l.stages[chain], &c.lowered().stages[chain]);
                let at = new
                    .nodes
                    .iter()
                    .position(|n| n.input.iter().any(|v| v == "b_m"))
                    .unwrap();
                let fix = &new.nodes[at + 1];
                assert_eq!(fix.input[1], "b_m.center", "{what}");
                assert_eq!(fix.op_type, if mean_op == "Sub" { "Sub" } else { "Add" });
                assert_eq!(new.nodes.len(), old.nodes.len() + 2, "{what}");
                let end = new.nodes.last().unwrap();
                assert_eq!((end.op_type.as_str(), &end.output), ("Sub", &old.outputs));
                // the convolutions reading a (b; c unless an InstanceNormalization reads it),
                // and a itself, have a bias of their own now
                let cl = c.lowered();
                let bias_of = |s: usize| {
                    let n = cl.stages[s]
                        .nodes
                        .iter()
                        .find(|n| n.op_type == "Conv")
                        .unwrap();
                    n.input.get(2).cloned().unwrap_or_default()
                };
                let mut convs = vec![a, b];
                if extra != "Instance" {
                    convs.push(stage_writing(&spec, "c"));
                }
                for s in convs {
                    assert!(bias_of(s).contains(".centered_bias"), "{what}: stage {s}");
                }
            }
        }

        // the stored values are the shifted ones: a's mean over all channels moves by the
        // mean center, (40 - 25 + 13 + 70) / 4
        let spec = modulated("Add", Some("Pad"));
        let a = stage_writing(&spec, "a");
        let mut centers = vec![None; spec.stage_count()];
        centers[a] = Some(vec![40.0, -25.0, 13.0, 70.0]);
        let c = spec.centered(&centers).unwrap();
        let mean_of_a = |net: &Specialised| {
            let mut mean = 0.0f32;
            let mut observe = |stage: usize, _: &str, v: &mut Value| {
                if stage == a
                    && let Value::Float(t) = v
                {
                    mean = t.data.iter().sum::<f32>() / t.data.len() as f32;
                }
            };
            net.run_observed(&x, None, Some(&mut observe)).unwrap();
            mean
        };
        let (plain, shifted) = (mean_of_a(&spec), mean_of_a(&c));
        assert!((plain - shifted - 24.5).abs() < 1e-3, "{plain} {shifted}");
        // centering a convolution again composes in its bias; a chain's or a mean's center
        // is not taken twice
        let twice = c.centered(&centers).unwrap().run(&x, None).unwrap();
        assert!(max_diff(&spec.run(&x, None).unwrap(), &twice) < 1e-4);
        let (b, chain) = (stage_writing(&spec, "b"), chain_reading_b_m(spec.lowered()));
        let mut again = vec![None; spec.stage_count()];
        again[b] = Some(vec![1.0; 4]);
        let c = spec.centered(&again).unwrap();
        assert!(c.centered(&again).is_err());
        let mut again = vec![None; spec.stage_count()];
        again[chain] = Some(vec![1.0; 4]);
        let c = spec.centered(&again).unwrap();
        assert_eq!(refusal(c.lowered(), chain), Some("already centered"));
    }

    #[test]
    fn readers_that_a_shift_would_change_refuse_centering() {
        // a zero-padded convolution (the border would not shift), a grouped one, a residual
        for extra in ["ConstPad", "Group", "Add"] {
            let spec = modulated("Add", Some(extra));
            let a = stage_writing(&spec, "a");
            assert_eq!(
                refusal(spec.lowered(), a),
                Some("a reader that the shift would change"),
                "{extra}"
            );
            let mut centers = vec![None; spec.stage_count()];
            centers[a] = Some(vec![1.0; 4]);
            let e = spec.centered(&centers).unwrap_err().to_string();
            assert!(e.contains("cannot be stored centered"), "{e}");
            // b is still free to be centered
            assert_eq!(refusal(spec.lowered(), stage_writing(&spec, "b")), None);
        }
        let spec = modulated("Add", None);
        let l = spec.lowered();
        // a chain ending in its activation, and the network's output
        let chain = chain_reading_b_m(l);
        assert_eq!(l.stages[chain].nodes.last().unwrap().op_type, "LeakyRelu");
        assert!(
            refusal(l, chain)
                .unwrap()
                .contains("chain ending in a binary operator")
        );
        assert_eq!(
            refusal(l, stage_writing(&spec, "output")),
            Some("the network's output")
        );
        // centers of the wrong length are an error
        let mut centers = vec![None; spec.stage_count()];
        centers[stage_writing(&spec, "a")] = Some(vec![1.0; 3]);
        assert!(spec.centered(&centers).is_err());
    }
}
