//! The engine's face: a model loaded and checked once ([`NeuralModel`]), specialised for one
//! input size into lowered stages with a memory plan ([`Specialised`]), run by the CPU
//! reference.

use std::collections::HashMap;
use std::path::Path;

use super::NeuralError;
use super::frame::TensorLayout;
use super::graph::{Graph, MAX_WEIGHT_BYTES};
use super::lower::{self, Lowered, StageKind, StatsHook};
use super::onnx::decode_model;
use super::ops;
use super::shapes::{self, Shaped};
use super::tensor::{Tensor, Value};
use crate::memplan::{ALIGN, ArenaPlan, BufferRequest};

/// Size at which a model is probed at load (when its input does not fix the size): shapes are
/// inferred once there to check the graph and measure its downsampling.
const PROBE_SIZE: usize = 256;

/// Sees each stage output after its stage: `(stage index, value name, value)`; may change it.
pub type StageObserver<'a> = &'a mut dyn FnMut(usize, &str, &mut Value);

/// A checked model, ready to be specialised for a frame size.
#[derive(Debug, Clone)]
pub struct NeuralModel {
    name: String,
    graph: Graph,
    layout: TensorLayout,
    multiple: usize,
}

impl NeuralModel {
    /// Reads, decodes and checks the model at `path`; its name is the file name.
    pub fn load(path: &Path) -> Result<Self, NeuralError> {
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let meta = std::fs::metadata(path)
            .map_err(|e| NeuralError::Io(format!("{}: {e}", path.display())))?;
        if meta.is_dir() {
            return Err(NeuralError::Io(format!(
                "{} is a directory",
                path.display()
            )));
        }
        // a file this large cannot hold ≤ 1 GiB of weights plus its graph: refuse unread
        if meta.len() > MAX_WEIGHT_BYTES + (64 << 20) {
            return Err(NeuralError::Model(format!(
                "model '{name}' is a {} byte file; models with more than {MAX_WEIGHT_BYTES} \
                 bytes (1 GiB) of weights are refused",
                meta.len()
            )));
        }
        let bytes =
            std::fs::read(path).map_err(|e| NeuralError::Io(format!("{}: {e}", path.display())))?;
        Self::from_bytes(&bytes, &name)
    }

    /// Decodes and checks a model held in memory.
    pub fn from_bytes(bytes: &[u8], name: &str) -> Result<Self, NeuralError> {
        let model = decode_model(bytes).map_err(|e| match e {
            NeuralError::Parse(m) => NeuralError::Parse(format!("{m} (model '{name}')")),
            other => other,
        })?;
        let graph = Graph::from_model(&model, name)?;
        let dims = &graph.input_dims;
        let three = |i: usize| dims.get(i) == Some(&Some(3));
        let layout = match dims.len() {
            4 if three(3) => TensorLayout::Nhwc,
            4 if three(1) => TensorLayout::Nchw,
            _ => {
                let shown: Vec<String> = dims
                    .iter()
                    .map(|d| d.map_or("?".to_string(), |v| v.to_string()))
                    .collect();
                return Err(NeuralError::Model(format!(
                    "model '{name}' takes '{}' of shape [{}]; the element feeds one 3-channel \
                     picture, NHWC [1, H, W, 3] or NCHW [1, 3, H, W]",
                    graph.input,
                    shown.join(", ")
                )));
            }
        };
        if dims[0].is_some_and(|n| n != 1) {
            return Err(NeuralError::Model(format!(
                "model '{name}' fixes its batch to {}; the element feeds one picture",
                dims[0].unwrap_or(0)
            )));
        }
        let mut model = NeuralModel {
            name: name.to_string(),
            graph,
            layout,
            multiple: 1,
        };
        let (h, w) = model.spatial_dims();
        let probe = model.shape_for(h.unwrap_or(PROBE_SIZE), w.unwrap_or(PROBE_SIZE));
        let shaped = shapes::infer(&model.graph, &probe)?;
        model.multiple = downsampling(&model.graph, &shaped);
        Ok(model)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// NHWC or NCHW, 3 channels (checked at load).
    pub fn input_layout(&self) -> TensorLayout {
        self.layout
    }

    /// The multiple the input's height and width must have: the product of the strides along
    /// the most downsampled path (16 for AnimeGANv3 tiny, 8 for the others).
    pub fn size_multiple(&self) -> usize {
        self.multiple
    }

    /// Bytes the weights declare (initializers and constants).
    pub fn weight_bytes(&self) -> u64 {
        self.graph.weight_bytes
    }

    /// The checked graph (for tools and tests).
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    fn spatial_dims(&self) -> (Option<usize>, Option<usize>) {
        let d = &self.graph.input_dims;
        match self.layout {
            TensorLayout::Nhwc => (d[1], d[2]),
            TensorLayout::Nchw => (d[2], d[3]),
        }
    }

    fn shape_for(&self, height: usize, width: usize) -> [usize; 4] {
        match self.layout {
            TensorLayout::Nhwc => [1, height, width, 3],
            TensorLayout::Nchw => [1, 3, height, width],
        }
    }

    /// Infers every shape for `height` × `width` (multiples of [`size_multiple`]
    /// (Self::size_multiple)), folds the shape subgraphs and lowers the graph into stages.
    pub fn specialise(&self, height: usize, width: usize) -> Result<Specialised, NeuralError> {
        let m = self.multiple;
        if height == 0 || width == 0 || !height.is_multiple_of(m) || !width.is_multiple_of(m) {
            return Err(NeuralError::Model(format!(
                "model '{}' runs on sizes that are multiples of {m}, not {width}x{height}",
                self.name
            )));
        }
        let input_shape = self.shape_for(height, width);
        let shaped = shapes::infer(&self.graph, &input_shape)?;
        let out = shaped.shape(&self.graph.output).unwrap_or(&[]);
        if out != input_shape {
            return Err(NeuralError::Model(format!(
                "model '{}' turns a {input_shape:?} picture into {out:?}; the element needs \
                 the output in the input's shape",
                self.name
            )));
        }
        let lowered = lower::lower(
            &shaped,
            &self.graph.input,
            &self.graph.output,
            self.graph.opset,
        )?;
        let last_use = last_uses(&lowered);
        Ok(Specialised {
            model: self.name.clone(),
            input_shape,
            lowered,
            shaped,
            last_use,
        })
    }
}

/// The most downsampled activation's factor: strides multiply along each path, upsampling
/// (Resize, Upsample, ConvTranspose) divides, measured on the probe's shapes.
fn downsampling(graph: &Graph, shaped: &Shaped) -> usize {
    let mut factor: HashMap<&str, f64> = HashMap::new();
    factor.insert(graph.input.as_str(), 1.0);
    let mut most = 1.0f64;
    for n in &shaped.nodes {
        let mut f = n
            .input
            .iter()
            .filter_map(|i| factor.get(i.as_str()))
            .fold(1.0f64, |a, &b| a.max(b));
        let spatial = |name: &str| {
            shaped
                .shape(name)
                .filter(|s| s.len() == 4)
                .map(|s| (s[2] * s[3]) as f64)
        };
        match n.op_type.as_str() {
            "Conv" | "ConvTranspose" => {
                let stride = n
                    .attr("strides")
                    .and_then(|a| a.ints.iter().copied().max())
                    .unwrap_or(1)
                    .max(1) as f64;
                if n.op_type == "Conv" {
                    f *= stride;
                } else {
                    f /= stride;
                }
            }
            "Resize" | "Upsample" => {
                if let (Some(a), Some(b)) = (spatial(&n.input[0]), spatial(&n.output[0]))
                    && b > 0.0
                {
                    f *= (a / b).sqrt();
                }
            }
            _ => {}
        }
        most = most.max(f);
        for o in &n.output {
            factor.insert(o.as_str(), f);
        }
    }
    (most.round() as usize).max(1)
}

/// For every value the stages read, the last stage that reads it (the output: the last stage).
fn last_uses(lowered: &Lowered) -> HashMap<String, usize> {
    let mut last: HashMap<String, usize> = HashMap::new();
    for (i, s) in lowered.stages.iter().enumerate() {
        for v in &s.inputs {
            last.insert(v.clone(), i);
        }
    }
    last.insert(
        lowered.output.clone(),
        lowered.stages.len().saturating_sub(1),
    );
    last
}

/// A model at one input size: lowered stages, a memory plan, and the CPU reference.
#[derive(Debug, Clone)]
pub struct Specialised {
    model: String,
    input_shape: [usize; 4],
    lowered: Lowered,
    shaped: Shaped,
    last_use: HashMap<String, usize>,
}

impl Specialised {
    /// The model's name (its file name).
    pub fn model_name(&self) -> &str {
        &self.model
    }

    pub fn input_shape(&self) -> [usize; 4] {
        self.input_shape
    }

    pub fn stage_count(&self) -> usize {
        self.lowered.stages.len()
    }

    /// Channels of each normalize stage's statistics, in the order the stats hook sees them.
    pub fn normalize_channels(&self) -> Vec<usize> {
        self.lowered.normalize_channels.clone()
    }

    /// The lowered stages (for the GPU work, tools and tests).
    pub fn lowered(&self) -> &Lowered {
        &self.lowered
    }

    /// The same network with stage outputs stored centered (`centers[i] = Some(c)`: stage i's
    /// output minus `c` per channel, its readers taking `c` back; [`super::center`]). It
    /// computes the same function.
    pub fn centered(&self, centers: &[Option<Vec<f32>>]) -> Result<Specialised, NeuralError> {
        Ok(self.with_lowered(super::center::centered(&self.lowered, centers)?))
    }

    /// The same network with its stem computed a second time for its last reader
    /// ([`super::recompute`]), or `None` when it has no such stem. It computes the same
    /// function.
    pub fn recomputed_stem(&self) -> Option<Specialised> {
        Some(self.with_lowered(super::recompute::recomputed_stem(&self.lowered)?))
    }

    /// This network with its stages rewritten by a graph transform.
    fn with_lowered(&self, lowered: Lowered) -> Specialised {
        Specialised {
            model: self.model.clone(),
            input_shape: self.input_shape,
            last_use: last_uses(&lowered),
            lowered,
            shaped: self.shaped.clone(),
        }
    }

    /// Nodes left after folding, before lowering.
    pub fn unlowered_node_count(&self) -> usize {
        self.shaped.nodes.len()
    }

    /// "(H)x(W)" of the input.
    fn size_label(&self) -> String {
        let [_, a, b, c] = self.input_shape;
        if a == 3 {
            format!("{c}x{b}")
        } else {
            format!("{b}x{a}")
        }
    }

    fn stage_label(&self, i: usize) -> String {
        let s = &self.lowered.stages[i];
        format!("{i} {} {}", s.kind.label(), s.name)
    }

    /// Every activation the stages exchange (the input, each stage's outputs), with its
    /// lifetime in stages, laid into one arena by the project's planner.
    pub fn plan(&self, bytes_per_element: u64) -> ArenaPlan {
        let last_stage = self.stage_count().saturating_sub(1) as u32;
        let bytes = |v: &str| -> u64 {
            self.lowered
                .shapes
                .get(v)
                .map_or(0, |s| s.iter().product::<usize>() as u64)
                * bytes_per_element
        };
        let last = |v: &str, first: u32| -> u32 {
            self.last_use
                .get(v)
                .map_or(first, |&l| (l as u32).max(first))
                .min(last_stage)
        };
        let mut requests = vec![BufferRequest {
            name: self.lowered.input.clone(),
            bytes: bytes(&self.lowered.input),
            first: 0,
            last: last(&self.lowered.input, 0),
            grow: None,
        }];
        for (i, s) in self.lowered.stages.iter().enumerate() {
            for o in &s.outputs {
                requests.push(BufferRequest {
                    name: o.clone(),
                    bytes: bytes(o),
                    first: i as u32,
                    last: last(o, i as u32),
                    grow: None,
                });
            }
        }
        let names = (0..self.stage_count())
            .map(|i| self.stage_label(i))
            .collect();
        let precision = match bytes_per_element {
            2 => "fp16".to_string(),
            4 => "fp32".to_string(),
            b => format!("{b} bytes per element"),
        };
        ArenaPlan::layout(
            &requests,
            names,
            format!("{} {} {precision}", self.model, self.size_label()),
        )
    }

    /// The per-stage memory ledger: each stage's output bytes and the live bytes while it runs
    /// (aligned as the arena places them), then the peak, where it occurs, and the arena.
    pub fn ledger(&self, bytes_per_element: u64) -> String {
        let plan = self.plan(bytes_per_element);
        let aligned = |b: u64| b.div_ceil(ALIGN) * ALIGN;
        let mut s = format!(
            "memory ledger of {} ({} stages):\n",
            plan.label,
            self.stage_count()
        );
        for (i, stage) in self.lowered.stages.iter().enumerate() {
            let i32_ = i as u32;
            let out: u64 = plan
                .buffers
                .iter()
                .filter(|b| b.first_stage == i32_ && stage.outputs.contains(&b.name))
                .map(|b| b.bytes)
                .sum();
            let live: u64 = plan
                .buffers
                .iter()
                .filter(|b| b.first_stage <= i32_ && i32_ <= b.last_stage)
                .map(|b| aligned(b.bytes))
                .sum();
            let shape = stage
                .outputs
                .first()
                .and_then(|o| self.lowered.shapes.get(o))
                .map_or(String::new(), |sh| format!("{sh:?}"));
            s.push_str(&format!(
                "  stage {i:>3} {:<11} out {out:>11} B  live {live:>11} B  {shape} {}\n",
                stage.kind.label(),
                stage.name
            ));
        }
        s.push_str(&format!(
            "  peak {} B live at stage {} ({}); arena {} B ({:.2} MiB)\n",
            plan.peak_live_bytes,
            plan.peak_stage,
            plan.stage_names
                .get(plan.peak_stage as usize)
                .map_or("?", |n| n.as_str()),
            plan.arena_bytes,
            crate::memplan::mib(plan.arena_bytes)
        ));
        s
    }

    fn check_input(&self, input: &Tensor<f32>) -> Result<(), NeuralError> {
        if input.shape != self.input_shape
            || input.data.len() != input.shape.iter().product::<usize>()
        {
            return Err(NeuralError::Model(format!(
                "model '{}' was specialised for {:?}, given {:?}",
                self.model, self.input_shape, input.shape
            )));
        }
        Ok(())
    }

    fn take_output(&self, mut values: HashMap<String, Value>) -> Result<Tensor<f32>, NeuralError> {
        let out = values
            .remove(&self.lowered.output)
            .or_else(|| self.lowered.consts.get(&self.lowered.output).cloned());
        match out {
            Some(Value::Float(t)) => Ok(t),
            _ => Err(NeuralError::Graph(format!(
                "model '{}' did not produce a float output",
                self.model
            ))),
        }
    }

    /// Runs the lowered stages on `input` (the model's layout and value range). `stats_hook`
    /// sees every normalize stage's per-channel mean and variance before they are used, and may
    /// change them (temporal smoothing).
    pub fn run(
        &self,
        input: &Tensor<f32>,
        stats_hook: Option<StatsHook<'_>>,
    ) -> Result<Tensor<f32>, NeuralError> {
        self.run_observed(input, stats_hook, None)
    }

    /// [`run`](Self::run), and `observer` sees every stage output right after its stage ran
    /// (stage index, value name, value) and may change its values, not its shape, before later
    /// stages read it (calibration records ranges; precision emulation rounds to fp16).
    pub fn run_observed(
        &self,
        input: &Tensor<f32>,
        stats_hook: Option<StatsHook<'_>>,
        mut observer: Option<StageObserver<'_>>,
    ) -> Result<Tensor<f32>, NeuralError> {
        self.check_input(input)?;
        let mut hook = stats_hook;
        let mut values: HashMap<String, Value> = HashMap::new();
        values.insert(self.lowered.input.clone(), Value::Float(input.clone()));
        for (i, stage) in self.lowered.stages.iter().enumerate() {
            lower::run_stage(stage, &self.lowered, &mut values, &mut hook)
                .map_err(|e| in_stage(e, &self.model, i, stage.kind, &stage.name))?;
            for o in &stage.outputs {
                let expected = self.lowered.shapes.get(o);
                let got = values.get(o).map(|v| v.shape());
                if expected.map(|s| s.as_slice()) != got {
                    return Err(NeuralError::Graph(format!(
                        "model '{}' stage {i} ({}) produced '{o}' of shape {got:?}, inference \
                         said {expected:?}",
                        self.model, stage.name
                    )));
                }
                if let (Some(observe), Some(v)) = (observer.as_mut(), values.get_mut(o)) {
                    observe(i, o, v);
                }
            }
            // free what no later stage reads
            values.retain(|k, _| {
                *k == self.lowered.output || self.last_use.get(k).is_some_and(|&l| l > i)
            });
        }
        self.take_output(values)
    }

    /// Runs the folded graph node by node through [`ops::run_node`], without lowering: the
    /// reference the lowered stages are tested against.
    pub fn run_unlowered(&self, input: &Tensor<f32>) -> Result<Tensor<f32>, NeuralError> {
        self.check_input(input)?;
        let mut values: HashMap<String, Value> = HashMap::new();
        values.insert(self.lowered.input.clone(), Value::Float(input.clone()));
        for node in &self.shaped.nodes {
            let inputs: Vec<Option<&Value>> = node
                .input
                .iter()
                .map(|i| {
                    if i.is_empty() {
                        None
                    } else {
                        values.get(i).or_else(|| self.shaped.consts.get(i))
                    }
                })
                .collect();
            let out = ops::run_node(node, &inputs, self.lowered.opset)?;
            for (name, v) in node.output.iter().zip(out) {
                values.insert(name.clone(), v);
            }
        }
        self.take_output(values)
    }
}

fn in_stage(e: NeuralError, model: &str, i: usize, kind: StageKind, name: &str) -> NeuralError {
    let add = |m: String| format!("{m} (model '{model}', stage {i} {} '{name}')", kind.label());
    e.with_context(add)
}

/// `n` values from a fixed xorshift, in [-scale, scale), for the neural modules' unit tests.
#[cfg(test)]
pub(crate) fn test_noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A model of `nodes` and `inits` from an NCHW RGB input named "input" to `output` (opset
/// 15), for the neural modules' unit tests.
#[cfg(test)]
pub(crate) fn nchw_test_model(
    name: &str,
    nodes: Vec<super::onnx::NodeProto>,
    inits: Vec<super::onnx::TensorProto>,
    output: &str,
) -> NeuralModel {
    use super::onnx::{GraphProto, data_type, encode_model, model, value_info};
    let g = GraphProto {
        name: name.into(),
        node: nodes,
        initializer: inits,
        input: vec![value_info("input", data_type::FLOAT, &[1, 3, -1, -1])],
        output: vec![value_info(output, data_type::FLOAT, &[1, 3, -1, -1])],
        ..Default::default()
    };
    NeuralModel::from_bytes(&encode_model(&model(g, 15)), name).unwrap()
}
