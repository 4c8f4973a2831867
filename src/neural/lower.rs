//! Lowering: the shaped graph (constants folded, shapes known) becomes a list of stages, the
//! unit the GPU work turns into kernels and the memory plan counts.
//!
//! Passes, in order:
//! 1. layout: a Transpose after a Pad is hoisted above it (the input's NHWC→NCHW transpose then
//!    meets the raw input and the Pad joins the convolution), and a Transpose followed by
//!    elementwise work and its inverse Transpose is cancelled (the per-channel operands are
//!    re-shaped instead), so activations stay NCHW between the input and the output;
//! 2. statistics: `m = GlobalAveragePool(x)` (or ReduceMean over the spatial axes), `d = x − m`,
//!    `v = GlobalAveragePool(d·d)` becomes one normalize stage computing `m` and `v` in fp32
//!    (f64 accumulation) without materialising `d·d`; InstanceNormalization becomes one
//!    normalize stage (statistics + affine + a following activation). The stats hook sees the
//!    statistics of every normalize stage, in order;
//! 3. Pad (single reader) + Conv (bias included) + activation (single reader) → one conv stage;
//! 4. chains of elementwise operators whose intermediates have a single reader → one stage;
//! 5. every other node → a generic stage calling [`ops::run_node`].

use std::collections::{HashMap, HashSet};

use super::NeuralError;
use super::onnx::{NodeProto, int64_tensor, node};
use super::ops;
use super::shapes::{BROADCAST_OPS, Shaped};
use super::tensor::{Tensor, Value};

/// The stats hook: `(normalize index, mean per channel, variance per channel)`, may change them.
pub type StatsHook<'a> = &'a mut dyn FnMut(usize, &mut [f32], &mut [f32]);

/// Elementwise unary operators (fusable into chains and movable across layout transposes).
pub const UNARY_OPS: &[&str] = &[
    "Relu",
    "LeakyRelu",
    "Sigmoid",
    "Tanh",
    "Sqrt",
    "Reciprocal",
    "Neg",
    "Abs",
    "Exp",
    "Log",
    "Floor",
    "Ceil",
    "Clip",
    "Identity",
];

/// The fused statistics node `fuse_moments` writes: input x, outputs (mean, variance).
pub const MOMENTS: &str = "Moments";
pub const TOONFLOW_DOMAIN: &str = "toonflow";

/// Activations a conv or normalize stage absorbs.
pub const ACTIVATION_OPS: &[&str] = &["Relu", "LeakyRelu", "Sigmoid", "Tanh", "Clip"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageKind {
    /// [Pad] + Conv (+ bias) [+ activation].
    Conv,
    /// Per-channel statistics in fp32 (and, for InstanceNormalization, their application).
    Normalize,
    /// A fused chain of elementwise operators.
    Elementwise,
    /// One operator through [`ops::run_node`].
    Op,
}

impl StageKind {
    pub fn label(self) -> &'static str {
        match self {
            StageKind::Conv => "conv",
            StageKind::Normalize => "normalize",
            StageKind::Elementwise => "elementwise",
            StageKind::Op => "op",
        }
    }
}

/// What a normalize stage computes.
#[derive(Debug, Clone, PartialEq)]
pub struct Statistics {
    /// The activation reduced (NCHW).
    pub input: String,
    /// Index among the model's normalize stages (the stats hook's first argument).
    pub index: usize,
    /// Moments pattern: the values receiving mean and variance (`[N, C, 1, 1]`).
    pub mean: Option<String>,
    pub var: Option<String>,
    /// InstanceNormalization: (node, activation) applied with the statistics.
    pub instance: Option<(NodeProto, Option<NodeProto>)>,
}

#[derive(Debug, Clone)]
pub struct Stage {
    pub kind: StageKind,
    /// A readable name: the first node's name.
    pub name: String,
    /// Nodes run in order (empty for a moments-only normalize stage).
    pub nodes: Vec<NodeProto>,
    pub stats: Option<Statistics>,
    /// Activations read from earlier stages (or the input).
    pub inputs: Vec<String>,
    /// Activations written for later stages (or the output).
    pub outputs: Vec<String>,
}

/// The lowered network at one input size.
#[derive(Debug, Clone)]
pub struct Lowered {
    pub stages: Vec<Stage>,
    pub shapes: HashMap<String, Vec<usize>>,
    pub consts: HashMap<String, Value>,
    pub input: String,
    pub output: String,
    pub opset: i64,
    /// Channels of each normalize stage's statistics, by normalize index.
    pub normalize_channels: Vec<usize>,
}

impl Lowered {
    /// The stage that writes `value`, if one does.
    pub fn stage_writing(&self, value: &str) -> Option<usize> {
        self.stages
            .iter()
            .position(|s| s.outputs.iter().any(|o| o == value))
    }
}

/// Lowers the shaped graph into stages.
pub fn lower(
    shaped: &Shaped,
    input: &str,
    output: &str,
    opset: i64,
) -> Result<Lowered, NeuralError> {
    let mut g = Work {
        nodes: shaped.nodes.clone(),
        shapes: shaped.shapes.clone(),
        consts: shaped.consts.clone(),
        output: output.to_string(),
        fresh: 0,
    };
    g.hoist_transposes_over_pads();
    g.cancel_transposes();
    g.collapse_reshapes();
    g.fuse_moments();
    g.remove_dead();
    let stages = g.group()?;
    let mut normalize_channels = Vec::new();
    for s in &stages {
        if let Some(st) = &s.stats {
            debug_assert_eq!(st.index, normalize_channels.len());
            normalize_channels.push(g.shapes[&st.input].get(1).copied().unwrap_or(1));
        }
    }
    Ok(Lowered {
        stages,
        shapes: g.shapes,
        consts: g.consts,
        input: input.to_string(),
        output: output.to_string(),
        opset,
        normalize_channels,
    })
}

struct Work {
    nodes: Vec<NodeProto>,
    shapes: HashMap<String, Vec<usize>>,
    consts: HashMap<String, Value>,
    output: String,
    fresh: usize,
}

fn perm_of(n: &NodeProto, rank: usize) -> Vec<usize> {
    match n.attr("perm") {
        Some(a) => a.ints.iter().map(|&p| p as usize).collect(),
        None => (0..rank).rev().collect(),
    }
}

impl Work {
    fn readers(&self, value: &str) -> Vec<usize> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.input.iter().any(|i| i == value))
            .map(|(i, _)| i)
            .collect()
    }

    fn producer(&self, value: &str) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.output.iter().any(|o| o == value))
    }

    fn is_const(&self, v: &str) -> bool {
        self.consts.contains_key(v)
    }

    fn fresh_name(&mut self, base: &str) -> String {
        self.fresh += 1;
        format!("{base}__toonflow{}", self.fresh)
    }

    /// `Transpose(Pad(x))` → `Pad(Transpose(x))` with the pads permuted, when the Pad has no
    /// other reader and constant pads.
    fn hoist_transposes_over_pads(&mut self) {
        let mut i = 0;
        while i < self.nodes.len() {
            let t = self.nodes[i].clone();
            if t.op_type != "Transpose" {
                i += 1;
                continue;
            }
            let Some(p) = self.producer(&t.input[0]) else {
                i += 1;
                continue;
            };
            let pad = self.nodes[p].clone();
            let pads = match pad.input.get(1).and_then(|n| self.consts.get(n)) {
                Some(Value::Int(t)) => t.data.clone(),
                _ => Vec::new(),
            };
            let x = pad.input[0].clone();
            let rank = self.shapes[&x].len();
            if pad.op_type != "Pad"
                || self.readers(&pad.output[0]).len() != 1
                || pad.output[0] == self.output
                || pads.len() != 2 * rank
                || pad.input.len() > 3
            {
                i += 1;
                continue;
            }
            let perm = perm_of(&t, rank);
            let t_out = t.output[0].clone();
            let moved = self.fresh_name(&t_out);
            let pads_name = self.fresh_name(&pad.input[1]);
            let new_pads: Vec<i64> = (0..2 * rank)
                .map(|k| pads[perm[k % rank] + (k / rank) * rank])
                .collect();
            self.consts.insert(
                pads_name.clone(),
                Value::Int(Tensor::new(vec![2 * rank], new_pads)),
            );
            let x_shape = &self.shapes[&x];
            let moved_shape: Vec<usize> = perm.iter().map(|&k| x_shape[k]).collect();
            self.shapes.insert(moved.clone(), moved_shape);
            let mut transpose = t.clone();
            transpose.input[0] = x;
            transpose.output[0] = moved.clone();
            let mut new_pad = pad.clone();
            new_pad.input[0] = moved;
            new_pad.input[1] = pads_name;
            new_pad.output[0] = t_out;
            // the Pad comes first in the order: put the transpose there and the pad after it
            self.nodes[p] = transpose;
            self.nodes[i] = new_pad;
            i += 1;
        }
    }

    /// Cancels `Transpose(p) → elementwise chain → Transpose(p⁻¹)` (each intermediate read once).
    fn cancel_transposes(&mut self) {
        let mut changed = true;
        while changed {
            changed = false;
            for t in 0..self.nodes.len() {
                if self.nodes[t].op_type == "Transpose" && self.try_cancel(t) {
                    changed = true;
                    break;
                }
            }
        }
    }

    fn try_cancel(&mut self, t: usize) -> bool {
        let x = self.nodes[t].input[0].clone();
        let rank = self.shapes[&x].len();
        let p = perm_of(&self.nodes[t], rank);
        let mut cur = self.nodes[t].output[0].clone();
        let mut chain: Vec<usize> = Vec::new();
        let end = loop {
            let readers = self.readers(&cur);
            if readers.len() != 1 || cur == self.output {
                return false;
            }
            let n = &self.nodes[readers[0]];
            let op = n.op_type.as_str();
            if op == "Transpose" {
                let q = perm_of(n, rank);
                // Transpose(Transpose(x, p), q)[i] = x[p[q[i]]]
                if (0..rank).all(|i| p[q[i]] == i) {
                    break readers[0];
                }
                return false;
            }
            let out_shape = &self.shapes[&n.output[0]];
            if out_shape != &self.shapes[&cur] {
                return false;
            }
            let fits = UNARY_OPS.contains(&op)
                || (BROADCAST_OPS.contains(&op)
                    && n.input
                        .iter()
                        .filter(|i| **i != cur)
                        .all(|o| self.per_channel_axis(o, rank).is_some()));
            let reads_once = n.input.iter().filter(|i| **i == cur).count() == 1;
            if !fits || (!reads_once && !UNARY_OPS.contains(&op)) {
                return false;
            }
            chain.push(readers[0]);
            cur = n.output[0].clone();
        };
        if chain.is_empty() && self.nodes[end].output[0] == self.output {
            return false;
        }
        // rewrite: the chain runs on x directly; operands are re-shaped into x's layout
        let t_out = self.nodes[t].output[0].clone();
        let end_out = self.nodes[end].output[0].clone();
        let mut inserted: Vec<(usize, NodeProto)> = Vec::new();
        for (k, &c) in chain.iter().enumerate() {
            let prev = if k == 0 {
                t_out.clone()
            } else {
                self.nodes[chain[k - 1]].output[0].clone()
            };
            let inputs = self.nodes[c].input.clone();
            for (j, name) in inputs.iter().enumerate() {
                if *name == prev {
                    self.nodes[c].input[j] = if k == 0 { x.clone() } else { prev.clone() };
                    continue;
                }
                let axis = self.per_channel_axis(name, rank).expect("checked");
                // in the transposed layout the operand varies along `axis`; in x's layout
                // along p[axis]
                let mut shape = vec![1usize; rank];
                let len = self.shapes[name].iter().product::<usize>();
                if let Some(a) = axis {
                    shape[p[a]] = len;
                }
                let new_name = self.fresh_name(name);
                if let Some(v) = self.consts.get(name) {
                    let v = match v {
                        Value::Float(t) => Value::Float(Tensor::new(shape.clone(), t.data.clone())),
                        Value::Int(t) => Value::Int(Tensor::new(shape.clone(), t.data.clone())),
                    };
                    self.consts.insert(new_name.clone(), v);
                } else {
                    let shape_name = self.fresh_name("shape");
                    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
                    self.consts.insert(
                        shape_name.clone(),
                        int64_tensor("", &[rank as i64], &dims)
                            .to_value()
                            .expect("valid"),
                    );
                    self.shapes.insert(shape_name.clone(), vec![rank]);
                    let mut r = node("Reshape", &[name, &shape_name], &[&new_name], vec![]);
                    r.name = format!("{}/to_nchw", self.nodes[c].name);
                    inserted.push((c, r));
                }
                self.shapes.insert(new_name.clone(), shape);
                self.nodes[c].input[j] = new_name;
            }
            let out = self.nodes[c].output[0].clone();
            let inv: Vec<usize> = {
                // shape in x's layout: s'[p[i]] = s[i]
                let s = &self.shapes[&out];
                let mut v = vec![0; rank];
                for i in 0..rank {
                    v[p[i]] = s[i];
                }
                v
            };
            self.shapes.insert(out, inv);
        }
        if let Some(&last) = chain.last() {
            // the chain's last value takes the name the inverse transpose gave it
            let old = self.nodes[last].output[0].clone();
            self.shapes.remove(&old);
            self.nodes[last].output[0] = end_out;
        } else {
            for n in self.nodes.iter_mut() {
                for i in n.input.iter_mut() {
                    if *i == end_out {
                        *i = x.clone();
                    }
                }
            }
        }
        // insert the reshapes before their readers, drop the two transposes
        let mut drop: HashSet<usize> = HashSet::from([t, end]);
        let mut nodes = Vec::with_capacity(self.nodes.len() + inserted.len());
        for (i, n) in std::mem::take(&mut self.nodes).into_iter().enumerate() {
            for (_, r) in inserted.iter().filter(|(c, _)| *c == i) {
                nodes.push(r.clone());
            }
            if !drop.remove(&i) {
                nodes.push(n);
            }
        }
        self.nodes = nodes;
        true
    }

    /// `Reshape(Reshape(x))` → `Reshape(x)` (the inner one read once), and a Reshape to the
    /// shape it already has disappears (the transpose cancelling leaves such pairs on the
    /// normalizations' per-channel operands).
    fn collapse_reshapes(&mut self) {
        for r in 0..self.nodes.len() {
            if self.nodes[r].op_type != "Reshape" {
                continue;
            }
            if let Some(q) = self.producer(&self.nodes[r].input[0])
                && self.nodes[q].op_type == "Reshape"
                && self.readers(&self.nodes[q].output[0]).len() == 1
                && self.nodes[q].output[0] != self.output
            {
                self.nodes[r].input[0] = self.nodes[q].input[0].clone();
            }
        }
        let mut drop = HashSet::new();
        for r in 0..self.nodes.len() {
            let n = &self.nodes[r];
            if n.op_type != "Reshape" || n.output[0] == self.output {
                continue;
            }
            let (x, y) = (n.input[0].clone(), n.output[0].clone());
            if self.shapes.get(&x) == self.shapes.get(&y) {
                for m in self.nodes.iter_mut() {
                    for i in m.input.iter_mut().filter(|i| **i == y) {
                        *i = x.clone();
                    }
                }
                drop.insert(r);
            }
        }
        let mut k = 0;
        self.nodes.retain(|_| {
            k += 1;
            !drop.contains(&(k - 1))
        });
    }

    /// `Some(None)` for a scalar-like operand (one element), `Some(Some(axis))` for one that
    /// varies along a single axis of a rank-`rank` activation, `None` otherwise.
    fn per_channel_axis(&self, name: &str, rank: usize) -> Option<Option<usize>> {
        let s = self.shapes.get(name)?;
        if s.len() > rank {
            return None;
        }
        let offset = rank - s.len();
        let varying: Vec<usize> = (0..s.len()).filter(|&i| s[i] != 1).collect();
        match varying.as_slice() {
            [] => Some(None),
            [a] => Some(Some(a + offset)),
            _ => None,
        }
    }

    /// Drops nodes whose outputs nothing reads (after the rewrites).
    fn remove_dead(&mut self) {
        loop {
            let read: HashSet<&str> = self
                .nodes
                .iter()
                .flat_map(|n| n.input.iter().map(|s| s.as_str()))
                .chain(std::iter::once(self.output.as_str()))
                .collect();
            let live: Vec<bool> = self
                .nodes
                .iter()
                .map(|n| n.output.iter().any(|o| read.contains(o.as_str())))
                .collect();
            if live.iter().all(|&l| l) {
                return;
            }
            let mut k = 0;
            self.nodes.retain(|_| {
                k += 1;
                live[k - 1]
            });
        }
    }

    /// `m = mean(x)`, `d = x − m`, `v = mean(d·d)` → one Moments node (x → m, v) where `m`
    /// was; the squares are never materialised, and `d` survives only if something else reads
    /// it (the normalization's apply chain).
    fn fuse_moments(&mut self) {
        let mut found: Vec<(usize, usize, usize)> = Vec::new();
        for m in 0..self.nodes.len() {
            if !self.is_spatial_mean(&self.nodes[m]) {
                continue;
            }
            let x = &self.nodes[m].input[0];
            let mean = &self.nodes[m].output[0];
            let hit = self.readers(mean).into_iter().find_map(|d| {
                let sub = &self.nodes[d];
                if sub.op_type != "Sub" || sub.input[0] != *x || sub.input[1] != *mean {
                    return None;
                }
                let diff = &sub.output[0];
                self.readers(diff).into_iter().find_map(|sq| {
                    let sqn = &self.nodes[sq];
                    let squares =
                        (sqn.op_type == "Mul" && sqn.input[0] == *diff && sqn.input[1] == *diff)
                            || (sqn.op_type == "Pow"
                                && sqn.input[0] == *diff
                                && matches!(self.consts.get(&sqn.input[1]),
                                        Some(Value::Float(t)) if t.data == [2.0]));
                    let sq_out = &sqn.output[0];
                    if !squares || self.readers(sq_out).len() != 1 || *sq_out == self.output {
                        return None;
                    }
                    let v = self.readers(sq_out)[0];
                    self.is_spatial_mean(&self.nodes[v]).then_some((sq, v))
                })
            });
            if let Some((sq, v)) = hit
                && self.nodes[v].output[0] != self.output
            {
                found.push((m, sq, v));
            }
        }
        let mut drop: HashSet<usize> = HashSet::new();
        for &(m, sq, v) in &found {
            let mut moments = node(
                MOMENTS,
                &[&self.nodes[m].input[0]],
                &[&self.nodes[m].output[0], &self.nodes[v].output[0]],
                vec![],
            );
            moments.domain = TOONFLOW_DOMAIN.into();
            moments.name = self.nodes[m].name.clone();
            self.nodes[m] = moments;
            drop.insert(sq);
            drop.insert(v);
        }
        let mut k = 0;
        self.nodes.retain(|_| {
            k += 1;
            !drop.contains(&(k - 1))
        });
    }

    fn is_spatial_mean(&self, n: &NodeProto) -> bool {
        let rank = self.shapes.get(&n.input[0]).map_or(0, |s| s.len());
        match n.op_type.as_str() {
            "GlobalAveragePool" => rank == 4,
            "ReduceMean" => {
                let axes = n.attr("axes").map(|a| a.ints.clone()).or_else(|| {
                    match n.input.get(1).and_then(|i| self.consts.get(i)) {
                        Some(Value::Int(t)) => Some(t.data.clone()),
                        _ => None,
                    }
                });
                let mut axes: Vec<i64> = axes
                    .unwrap_or_default()
                    .iter()
                    .map(|&a| if a < 0 { a + 4 } else { a })
                    .collect();
                axes.sort_unstable();
                rank == 4 && axes == [2, 3] && n.attr("keepdims").is_none_or(|a| a.i != 0)
            }
            _ => false,
        }
    }

    /// Groups nodes into stages (in execution order).
    fn group(&mut self) -> Result<Vec<Stage>, NeuralError> {
        let n = self.nodes.len();
        // group id per node; the stage runs where its last node is
        let mut group: Vec<Option<usize>> = vec![None; n];
        let mut groups: Vec<(StageKind, Vec<usize>, Option<Statistics>)> = Vec::new();
        let single_reader = |w: &Work, v: &str| w.readers(v).len() == 1 && v != w.output;

        // 2. moments (fused by `fuse_moments`) → normalize (statistics) stages
        for (m, node) in self.nodes.iter().enumerate() {
            if node.op_type != MOMENTS || node.domain != TOONFLOW_DOMAIN {
                continue;
            }
            let stats = Statistics {
                input: node.input[0].clone(),
                index: 0, // numbered in execution order below
                mean: Some(node.output[0].clone()),
                var: Some(node.output[1].clone()),
                instance: None,
            };
            group[m] = Some(groups.len());
            groups.push((StageKind::Normalize, vec![m], Some(stats)));
        }
        // InstanceNormalization (+ activation)
        for i in 0..n {
            if group[i].is_some() || self.nodes[i].op_type != "InstanceNormalization" {
                continue;
            }
            let out = self.nodes[i].output[0].clone();
            let mut members = vec![i];
            let mut act = None;
            if single_reader(self, &out) {
                let r = self.readers(&out)[0];
                if ACTIVATION_OPS.contains(&self.nodes[r].op_type.as_str())
                    && group[r].is_none()
                    && activation(Some(&self.nodes[r])).is_ok()
                {
                    members.push(r);
                    act = Some(self.nodes[r].clone());
                }
            }
            let stats = Statistics {
                input: self.nodes[i].input[0].clone(),
                index: 0,
                mean: None,
                var: None,
                instance: Some((self.nodes[i].clone(), act)),
            };
            let id = groups.len();
            for &k in &members {
                group[k] = Some(id);
            }
            groups.push((StageKind::Normalize, members, Some(stats)));
        }
        // 3. [Pad] + Conv + [activation]
        for c in 0..n {
            if group[c].is_some() || self.nodes[c].op_type != "Conv" {
                continue;
            }
            let mut members = Vec::new();
            if let Some(p) = self.producer(&self.nodes[c].input[0])
                && self.nodes[p].op_type == "Pad"
                && group[p].is_none()
                && single_reader(self, &self.nodes[p].output[0])
                && self.nodes[p]
                    .input
                    .iter()
                    .skip(1)
                    .all(|i| i.is_empty() || self.is_const(i))
            {
                members.push(p);
            }
            members.push(c);
            let out = &self.nodes[c].output[0];
            if single_reader(self, out) {
                let r = self.readers(out)[0];
                if ACTIVATION_OPS.contains(&self.nodes[r].op_type.as_str()) && group[r].is_none() {
                    members.push(r);
                }
            }
            let id = groups.len();
            for &k in &members {
                group[k] = Some(id);
            }
            groups.push((StageKind::Conv, members, None));
        }
        // 4. elementwise chains
        let elementwise = |op: &str| UNARY_OPS.contains(&op) || BROADCAST_OPS.contains(&op);
        for s in 0..n {
            if group[s].is_some() || !elementwise(&self.nodes[s].op_type) {
                continue;
            }
            let mut members = vec![s];
            let mut cur = s;
            loop {
                let out = &self.nodes[cur].output[0];
                if !single_reader(self, out) {
                    break;
                }
                let r = self.readers(out)[0];
                if group[r].is_some()
                    || !elementwise(&self.nodes[r].op_type)
                    || self.shapes.get(&self.nodes[r].output[0]) != self.shapes.get(out)
                {
                    break;
                }
                members.push(r);
                cur = r;
            }
            let id = groups.len();
            for &k in &members {
                group[k] = Some(id);
            }
            groups.push((StageKind::Elementwise, members, None));
        }
        // 5. the rest
        for (i, g) in group.iter_mut().enumerate() {
            if g.is_none() {
                *g = Some(groups.len());
                groups.push((StageKind::Op, vec![i], None));
            }
        }

        // order stages by their last node; a stage's inputs all come from earlier nodes
        let mut order: Vec<usize> = (0..groups.len()).collect();
        order.sort_by_key(|&g| groups[g].1.iter().copied().max().unwrap_or(0));
        let produced_by_stage: HashMap<String, usize> = order
            .iter()
            .enumerate()
            .flat_map(|(pos, &g)| {
                groups[g]
                    .1
                    .iter()
                    .flat_map(|&k| self.nodes[k].output.clone())
                    .map(move |o| (o, pos))
            })
            .collect();
        let mut stages = Vec::with_capacity(order.len());
        let mut normalize_index = 0;
        for (pos, &g) in order.iter().enumerate() {
            let (kind, members, stats) = &groups[g];
            let mut members = members.clone();
            members.sort_unstable();
            let internal: HashSet<&str> = members
                .iter()
                .flat_map(|&k| self.nodes[k].output.iter().map(|s| s.as_str()))
                .collect();
            let mut inputs: Vec<String> = Vec::new();
            for &k in &members {
                for i in &self.nodes[k].input {
                    if !i.is_empty()
                        && !internal.contains(i.as_str())
                        && !self.is_const(i)
                        && !inputs.contains(i)
                    {
                        if let Some(&src) = produced_by_stage.get(i)
                            && src >= pos
                        {
                            return Err(NeuralError::Graph(format!(
                                "lowering ordered '{i}' after its reader (a bug)"
                            )));
                        }
                        inputs.push(i.clone());
                    }
                }
            }
            let mut outputs: Vec<String> = Vec::new();
            for &k in &members {
                for o in &self.nodes[k].output {
                    let read_outside = self.readers(o).iter().any(|r| !members.contains(r));
                    if !o.is_empty() && (read_outside || *o == self.output) {
                        outputs.push(o.clone());
                    }
                }
            }
            let mut stats = stats.clone();
            if let Some(st) = stats.as_mut() {
                st.index = normalize_index;
                normalize_index += 1;
                if let Some(x) = st.instance.as_ref().map(|(n, _)| n.input[0].clone())
                    && !inputs.contains(&x)
                {
                    inputs.push(x);
                }
                if !inputs.contains(&st.input) {
                    inputs.push(st.input.clone());
                }
            }
            let nodes: Vec<NodeProto> = if stats.as_ref().is_some_and(|s| s.instance.is_none()) {
                Vec::new() // the moments are computed by the stage itself
            } else {
                members.iter().map(|&k| self.nodes[k].clone()).collect()
            };
            let first = members.first().map(|&k| &self.nodes[k]);
            stages.push(Stage {
                kind: *kind,
                name: first.map_or(String::new(), |f| {
                    if f.name.is_empty() {
                        f.output[0].clone()
                    } else {
                        f.name.clone()
                    }
                }),
                nodes,
                stats,
                inputs,
                outputs,
            });
        }
        Ok(stages)
    }
}

/// Runs one stage: reads its inputs from `values` (and `consts`), writes its outputs there.
pub fn run_stage(
    stage: &Stage,
    lowered: &Lowered,
    values: &mut HashMap<String, Value>,
    hook: &mut Option<StatsHook<'_>>,
) -> Result<(), NeuralError> {
    if let Some(st) = &stage.stats {
        let x = match values.get(&st.input) {
            Some(Value::Float(t)) => t,
            _ => {
                return Err(NeuralError::Graph(format!(
                    "normalize stage '{}' reads '{}', which is not a float activation",
                    stage.name, st.input
                )));
            }
        };
        if x.rank() < 3 {
            return Err(NeuralError::Graph(format!(
                "normalize stage '{}' needs a spatial axis, '{}' is {:?}",
                stage.name, st.input, x.shape
            )));
        }
        let (n, c) = (x.shape[0], x.shape[1]);
        let spatial: usize = x.shape[2..].iter().product();
        let (mut mean, mut var) = ops::norm::channel_stats(&x.data, spatial);
        if let Some(h) = hook.as_mut() {
            h(st.index, &mut mean, &mut var);
        }
        if let Some((inst, act)) = &st.instance {
            let get = |i: usize| match inst.input.get(i).and_then(|k| lowered.consts.get(k)) {
                Some(Value::Float(t)) => Ok(t.data.clone()),
                _ => Err(NeuralError::Unsupported(format!(
                    "InstanceNormalization '{}' with computed scale or bias",
                    inst.name
                ))),
            };
            let (scale, bias) = (get(1)?, get(2)?);
            let eps = inst.attr("epsilon").map_or(1e-5, |a| a.f);
            let act = activation(act.as_ref())?;
            let mut y = x.clone();
            ops::norm::normalize(
                &mut y.data,
                spatial,
                c,
                &mean,
                &var,
                eps,
                Some(&scale),
                Some(&bias),
                act,
            )?;
            let out = stage.outputs.first().cloned().unwrap_or_default();
            values.insert(out, Value::Float(y));
        } else {
            let mut shape = vec![n, c];
            shape.extend(std::iter::repeat_n(1, x.rank() - 2));
            for (name, data) in [(&st.mean, mean), (&st.var, var)] {
                if let Some(name) = name.as_ref().filter(|m| stage.outputs.contains(m)) {
                    values.insert(name.clone(), Value::Float(Tensor::new(shape.clone(), data)));
                }
            }
        }
        return Ok(());
    }
    let mut local: HashMap<&str, Value> = HashMap::new();
    for node in &stage.nodes {
        let inputs: Vec<Option<&Value>> = node
            .input
            .iter()
            .map(|i| {
                if i.is_empty() {
                    None
                } else {
                    local
                        .get(i.as_str())
                        .or_else(|| values.get(i))
                        .or_else(|| lowered.consts.get(i))
                }
            })
            .collect();
        if let Some(k) = node
            .input
            .iter()
            .zip(&inputs)
            .position(|(name, v)| !name.is_empty() && v.is_none())
        {
            return Err(NeuralError::Graph(format!(
                "stage '{}': '{}' is not available (a lowering bug)",
                stage.name, node.input[k]
            )));
        }
        let out = ops::run_node(node, &inputs, lowered.opset)?;
        for (name, v) in node.output.iter().zip(out) {
            if !name.is_empty() {
                local.insert(name.as_str(), v);
            }
        }
    }
    for o in &stage.outputs {
        let v = local.remove(o.as_str()).ok_or_else(|| {
            NeuralError::Graph(format!("stage '{}' did not produce '{o}'", stage.name))
        })?;
        values.insert(o.clone(), v);
    }
    Ok(())
}

/// The activation a fused stage applies.
pub fn activation(node: Option<&NodeProto>) -> Result<ops::elementwise::Activation, NeuralError> {
    use ops::elementwise::Activation;
    let Some(n) = node else {
        return Ok(Activation::None);
    };
    Ok(match n.op_type.as_str() {
        "Relu" => Activation::Relu,
        "LeakyRelu" => Activation::LeakyRelu(n.attr("alpha").map_or(0.01, |a| a.f)),
        "Sigmoid" => Activation::Sigmoid,
        "Tanh" => Activation::Tanh,
        "Clip" if n.input.len() <= 1 => Activation::Clip(
            n.attr("min").map_or(f32::NEG_INFINITY, |a| a.f),
            n.attr("max").map_or(f32::INFINITY, |a| a.f),
        ),
        _ => {
            return Err(NeuralError::Unsupported(format!(
                "activation {} fused after normalization",
                n.op_type
            )));
        }
    })
}
