//! Recomputed stems: a large activation computed from the network's input alone (the stem
//! convolution of a U-Net, whose output is also its last skip connection) is computed a
//! second time right before its last reader instead of being kept alive across the whole
//! network.
//!
//! AnimeGANv3's generators keep the stem's full-resolution output (32 channels in the
//! Hayao-class layout, 10.7 times the 3-channel input) from the first stage to the last
//! up-sampling block. Holding the input instead (its stem is a single 7x7 convolution over 3
//! channels, about 2% of the network's arithmetic) frees that tensor for the whole middle of
//! the network. The rewrite is a graph transform ([`recomputed_stem`]): the CPU reference and
//! the GPU program run it as any other network, and it computes the same function; whether it
//! pays is the caller's decision (the GPU program keeps it where its arena shrinks).

use std::collections::HashMap;

use super::lower::{Lowered, Stage, StageKind};

/// The suffix of a recomputed value's name.
const RECOMPUTED: &str = ".recomputed";

/// Most stages of a stem (e.g. a layout Transpose, then [Pad] Conv [activation]).
const MAX_STEM_STAGES: usize = 3;

/// The stages reading each value, in order.
fn readers(l: &Lowered) -> HashMap<&str, Vec<usize>> {
    let mut r: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, s) in l.stages.iter().enumerate() {
        for v in &s.inputs {
            let list = r.entry(v.as_str()).or_default();
            if list.last() != Some(&i) {
                list.push(i);
            }
        }
    }
    r
}

/// Where the copy of the stem goes: before `reader`, and before the stages that only feed it
/// and that a GPU program runs as one launch with it (a Resize or layout op right before a
/// convolution, a convolution right before the elementwise Add that takes its output), so
/// that the copy does not stand between them.
fn insertion_point(l: &Lowered, readers: &HashMap<&str, Vec<usize>>, reader: usize) -> usize {
    let mut p = reader;
    while p > 0 {
        let (prev, next) = (&l.stages[p - 1], &l.stages[p]);
        let [out] = prev.outputs.as_slice() else {
            break;
        };
        let feeds_only_next = readers.get(out.as_str()).map(Vec::as_slice) == Some(&[p][..]);
        let fused = matches!(
            (prev.kind, next.kind),
            (StageKind::Op, StageKind::Conv) | (StageKind::Conv, StageKind::Elementwise)
        );
        if !feeds_only_next || !fused || *out == l.output {
            break;
        }
        p -= 1;
    }
    p
}

/// `l` with its stem computed a second time for its last reader, or `None` when it has no
/// such stem: the first stages (at most [`MAX_STEM_STAGES`]) read only the network's input
/// and each other, have no statistics, and end in a convolution whose output is read by a
/// stage after the stem's other readers, at least two stages later. That reader (and what
/// the GPU runs together with it, [`insertion_point`]) then reads the copy, named with
/// [`RECOMPUTED`] appended, and the original dies at its earlier readers.
pub fn recomputed_stem(l: &Lowered) -> Option<Lowered> {
    let readers = readers(l);
    // the stem: a prefix of stages reading the input and each other only
    let mut produced: Vec<&str> = vec![l.input.as_str()];
    let mut stem_end = None;
    for (i, s) in l.stages.iter().enumerate().take(MAX_STEM_STAGES) {
        let from_stem = s.inputs.iter().all(|v| produced.contains(&v.as_str()));
        if !from_stem || s.stats.is_some() || !matches!(s.kind, StageKind::Op | StageKind::Conv) {
            break;
        }
        produced.extend(s.outputs.iter().map(String::as_str));
        if s.kind == StageKind::Conv {
            stem_end = Some(i);
            break;
        }
    }
    let end = stem_end?;
    let [value] = l.stages[end].outputs.as_slice() else {
        return None;
    };
    if *value == l.output {
        return None;
    }
    // the stem's other values are read inside the stem only
    for s in &l.stages[..end] {
        for o in &s.outputs {
            if readers.get(o.as_str())?.iter().any(|&r| r > end) {
                return None;
            }
        }
    }
    let value_readers = readers.get(value.as_str())?;
    let (&last, earlier) = value_readers.split_last()?;
    let &before_last = earlier.last()?;
    let at = insertion_point(l, &readers, last);
    if at < before_last + 2 {
        return None;
    }
    // the copy: every value the stem writes, inside its stages too, renamed
    let rename = |v: &str| format!("{v}{RECOMPUTED}");
    let mut written: Vec<String> = Vec::new();
    for s in &l.stages[..=end] {
        for n in &s.nodes {
            written.extend(n.output.iter().cloned());
        }
        written.extend(s.outputs.iter().cloned());
    }
    let renamed = |v: &String| {
        if written.contains(v) {
            rename(v)
        } else {
            v.clone()
        }
    };
    let copy: Vec<Stage> = l.stages[..=end]
        .iter()
        .map(|s| {
            let mut c = s.clone();
            c.name = rename(&s.name);
            for n in c.nodes.iter_mut() {
                n.name = rename(&n.name);
                n.input = n.input.iter().map(renamed).collect();
                n.output = n.output.iter().map(renamed).collect();
            }
            c.inputs = c.inputs.iter().map(renamed).collect();
            c.outputs = c.outputs.iter().map(renamed).collect();
            c
        })
        .collect();
    let mut out = l.clone();
    for v in &written {
        if let Some(shape) = l.shapes.get(v) {
            out.shapes.insert(rename(v), shape.clone());
        }
    }
    // the last reader takes the copy
    let copied = rename(value);
    let reader = &mut out.stages[last];
    for v in reader.inputs.iter_mut().filter(|v| *v == value) {
        *v = copied.clone();
    }
    for n in reader.nodes.iter_mut() {
        for v in n.input.iter_mut().filter(|v| *v == value) {
            *v = copied.clone();
        }
    }
    out.stages.splice(at..at, copy);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::neural::Tensor;
    use crate::neural::engine::{NeuralModel, Specialised, nchw_test_model, test_noise};
    use crate::neural::onnx::{
        NodeProto, TensorProto, attr_float, attr_ints, attr_string, float_tensor, node,
    };

    /// Builds a model from nodes in order; a convolution brings its weights and bias (noise).
    struct Net {
        nodes: Vec<NodeProto>,
        inits: Vec<TensorProto>,
    }

    impl Net {
        fn new() -> Self {
            Net {
                nodes: Vec::new(),
                inits: vec![float_tensor("scales", &[4], &[1.0, 1.0, 2.0, 2.0])],
            }
        }

        /// A `k`x`k` convolution `cin → cout` (`stride`, zero pads `k / 2`).
        fn conv(
            &mut self,
            x: &str,
            out: &str,
            (cin, cout, k, stride): (usize, usize, usize, usize),
        ) {
            let (wn, bn) = (format!("{out}_w"), format!("{out}_b"));
            let p = (k / 2) as i64;
            let scale = 1.0 / (cin * k * k) as f32;
            let (n, seed) = (cout * cin * k * k, self.nodes.len() as u64 + 1);
            let dims = [cout as i64, cin as i64, k as i64, k as i64];
            self.inits
                .push(float_tensor(&wn, &dims, &test_noise(n, seed, scale)));
            self.inits.push(float_tensor(
                &bn,
                &[cout as i64],
                &test_noise(cout, seed + 99, 0.1),
            ));
            self.nodes.push(node(
                "Conv",
                &[x, &wn, &bn],
                &[out],
                vec![
                    attr_ints("kernel_shape", &[k as i64, k as i64]),
                    attr_ints("strides", &[stride as i64, stride as i64]),
                    attr_ints("pads", &[p, p, p, p]),
                ],
            ));
        }

        fn op(&mut self, n: NodeProto) {
            self.nodes.push(n);
        }

        fn relu(&mut self, x: &str, y: &str) {
            self.op(node(
                "LeakyRelu",
                &[x],
                &[y],
                vec![attr_float("alpha", 0.2)],
            ));
        }

        fn model(self, name: &str) -> NeuralModel {
            nchw_test_model(name, self.nodes, self.inits, "output")
        }
    }

    /// A small U-Net of the AnimeGANv3 kind: a stem, a stride-2 block, a 1x1 block, an
    /// upsampling block (nearest Resize, 3x3) and the skip Add of the stem's output, a head.
    fn unet() -> Specialised {
        let mut n = Net::new();
        n.conv("input", "stem_c", (3, 8, 3, 1));
        n.relu("stem_c", "stem");
        n.conv("stem", "down_c", (8, 8, 3, 2));
        n.relu("down_c", "down");
        n.conv("down", "mid_c", (8, 8, 1, 1));
        n.relu("mid_c", "mid");
        n.op(node(
            "Resize",
            &["mid", "", "scales"],
            &["up"],
            vec![attr_string("mode", "nearest")],
        ));
        n.conv("up", "up_c", (8, 8, 3, 1));
        n.op(node("Add", &["up_c", "stem"], &["sum"], vec![]));
        n.conv("sum", "head_c", (8, 3, 1, 1));
        n.op(node("Tanh", &["head_c"], &["output"], vec![]));
        n.model("unet").specialise(16, 24).unwrap()
    }

    fn input(shape: [usize; 4], seed: u64) -> Tensor<f32> {
        Tensor::new(
            shape.to_vec(),
            test_noise(shape.iter().product(), seed, 1.0),
        )
    }

    #[test]
    fn the_recomputed_stem_computes_the_same_function() {
        let spec = unet();
        let r = spec
            .recomputed_stem()
            .expect("the U-Net's stem is recomputed");
        assert_eq!(r.stage_count(), spec.stage_count() + 1);
        for seed in [1, 2] {
            let x = input(spec.input_shape(), seed);
            let a = spec.run(&x, None).unwrap();
            let b = r.run(&x, None).unwrap();
            assert_eq!(a.shape, b.shape);
            assert!(
                a.data
                    .iter()
                    .zip(&b.data)
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "recomputing the stem changed the output"
            );
        }
    }

    #[test]
    fn the_stem_output_dies_at_its_first_reader() {
        let spec = unet();
        let l = spec.lowered();
        let r = recomputed_stem(l).unwrap();
        let readers = readers(&r);
        let copy = format!("stem{RECOMPUTED}");
        // the original is read only by the stride-2 block, the copy only by the last block,
        // and the copy is made from the network's input
        assert_eq!(readers["stem"], vec![1]);
        let made = r.stage_writing(&copy).unwrap();
        assert_eq!(r.stages[made].inputs, vec![r.input.clone()]);
        assert_eq!(r.stages[made].kind, StageKind::Conv);
        let late = &readers[copy.as_str()];
        assert_eq!(late.len(), 1, "{late:?}");
        // after the 1x1 block, before the Resize, its convolution and the Add, which stay
        // together (a GPU program runs them as one launch)
        assert_eq!(r.stage_writing("mid"), Some(made - 1));
        assert_eq!(r.stages[made + 1].kind, StageKind::Op);
        assert_eq!(r.stages[made + 2].kind, StageKind::Conv);
        assert_eq!(late[0], made + 3);
    }

    #[test]
    fn a_network_without_a_late_stem_reader_is_left_alone() {
        // the stem's output read by the next stage only
        let mut n = Net::new();
        n.conv("input", "stem_c", (3, 8, 3, 1));
        n.op(node("Relu", &["stem_c"], &["stem"], vec![]));
        n.conv("stem", "head_c", (8, 3, 3, 1));
        n.op(node("Tanh", &["head_c"], &["output"], vec![]));
        let spec = n.model("chain").specialise(8, 8).unwrap();
        assert!(recomputed_stem(spec.lowered()).is_none());
        assert!(spec.recomputed_stem().is_none());
    }
}
