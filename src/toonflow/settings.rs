//! The element's settings (properties) and the enums they use.

use gst::glib;

use crate::neural::frame::ValueRange;
use crate::pipeline::{Precision, StageParams};

#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstToonflowBackend")]
pub enum BackendChoice {
    #[default]
    #[enum_value(
        name = "Auto: CUDA where a driver and device exist, else the fast CPU path",
        nick = "auto"
    )]
    Auto = 0,
    #[enum_value(
        name = "CPU: the fast CPU path (SIMD row kernels on every core)",
        nick = "cpu"
    )]
    Cpu = 1,
    #[enum_value(
        name = "CUDA: NVIDIA GPU through the CUDA driver (fails without one)",
        nick = "cuda"
    )]
    Cuda = 2,
    #[enum_value(
        name = "CPU reference: the exact f32 oracle the other backends are tested against (slow)",
        nick = "cpu-reference"
    )]
    CpuReference = 3,
}

#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstToonflowPrecision")]
pub enum PrecisionChoice {
    #[default]
    #[enum_value(
        name = "fp16: half-precision storage, fp32 math (CUDA only)",
        nick = "fp16"
    )]
    Fp16 = 0,
    #[enum_value(name = "fp32: single-precision storage and math", nick = "fp32")]
    Fp32 = 1,
}

impl From<PrecisionChoice> for Precision {
    fn from(p: PrecisionChoice) -> Precision {
        match p {
            PrecisionChoice::Fp16 => Precision::Fp16,
            PrecisionChoice::Fp32 => Precision::Fp32,
        }
    }
}

/// `model-range`: the value range of the network's RGB input and output.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstToonflowModelRange")]
pub enum ModelRange {
    #[default]
    #[enum_value(name = "-1..1 (AnimeGANv3: tanh output)", nick = "-1..1")]
    MinusOneToOne = 0,
    #[enum_value(name = "0..1", nick = "0..1")]
    ZeroToOne = 1,
    #[enum_value(name = "0..255", nick = "0..255")]
    ZeroTo255 = 2,
}

impl From<ModelRange> for ValueRange {
    fn from(r: ModelRange) -> ValueRange {
        match r {
            ModelRange::MinusOneToOne => ValueRange::MinusOneToOne,
            ModelRange::ZeroToOne => ValueRange::ZeroToOne,
            ModelRange::ZeroTo255 => ValueRange::ZeroTo255,
        }
    }
}

pub const DEFAULT_DEVICE_ID: u32 = 0;
pub const DEFAULT_CUDA_GRAPH: bool = true;
/// `overlap`: a frame's upload overlaps the previous frame's kernels and download (issue 12).
/// On: on the H200 it raises a single instance's frame rate by 35–72% at 1080p, and with the
/// push thread polling it adds 19–29 µs per frame (p50) for a source paced below the element's
/// capacity (docs/benchmark.md).
pub const DEFAULT_OVERLAP: bool = true;
pub const DEFAULT_MAX_DEVICE_MEMORY: u64 = 0;
pub const DEFAULT_STATS_INTERVAL: u32 = 0;
pub const DEFAULT_MODEL_SCALE: f64 = 1.0;
/// 0: the multiple the model's strides need.
pub const DEFAULT_MODEL_SIZE_MULTIPLE: u32 = 0;
/// 0: each frame's own normalization statistics, as the network was trained.
pub const DEFAULT_MODEL_STAT_SMOOTHING: f64 = 0.0;
pub const DEFAULT_MODEL_EDGES: bool = false;
pub const DEFAULT_MODEL_LOW_MEMORY: bool = false;

/// The neural stage's settings (`model` and `model-*`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSettings {
    /// Path to the ONNX file; empty = the classic pipeline.
    pub path: String,
    pub range: ModelRange,
    pub scale: f64,
    pub size_multiple: u32,
    pub stat_smoothing: f64,
    pub edges: bool,
    /// `model-low-memory`: the stem computed again from the NV12 frame wherever that shrinks
    /// the network's activations by a tenth, at some speed (read at start).
    pub low_memory: bool,
}

impl Default for ModelSettings {
    fn default() -> Self {
        ModelSettings {
            path: String::new(),
            range: ModelRange::default(),
            scale: DEFAULT_MODEL_SCALE,
            size_multiple: DEFAULT_MODEL_SIZE_MULTIPLE,
            stat_smoothing: DEFAULT_MODEL_STAT_SMOOTHING,
            edges: DEFAULT_MODEL_EDGES,
            low_memory: DEFAULT_MODEL_LOW_MEMORY,
        }
    }
}

/// Everything the user can set. Shape-changing values take effect at the next frame by
/// rebuilding the backend's per-stream state; the others by updating the parameter block.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub backend: BackendChoice,
    pub device_id: u32,
    pub precision: PrecisionChoice,
    pub stage: StageParams,
    pub cuda_graph: bool,
    pub overlap: bool,
    pub max_device_memory: u64,
    pub stats_interval: u32,
    pub model: ModelSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            backend: BackendChoice::default(),
            device_id: DEFAULT_DEVICE_ID,
            precision: PrecisionChoice::default(),
            stage: StageParams::default(),
            cuda_graph: DEFAULT_CUDA_GRAPH,
            overlap: DEFAULT_OVERLAP,
            max_device_memory: DEFAULT_MAX_DEVICE_MEMORY,
            stats_interval: DEFAULT_STATS_INTERVAL,
            model: ModelSettings::default(),
        }
    }
}
