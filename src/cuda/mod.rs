//! CUDA backend (cudarc): context, kernel build, memory plan, graph cache.
//!
//! The element talks to this module only through [`probe`] and [`CudaPipeline`].

use crate::pipeline::cpu::FrameReport;
use crate::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, Shape, ToonParams};

/// Why the CUDA backend cannot run or failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// libcuda, NVRTC or a device is missing: the element may fall back to the CPU.
    Unavailable(String),
    /// The memory plan is larger than `max-device-memory` or than the device has free.
    OutOfMemory(String),
    /// Anything else the driver or NVRTC reported.
    Failed(String),
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaError::Unavailable(m) => write!(f, "CUDA unavailable: {m}"),
            CudaError::OutOfMemory(m) => write!(f, "device memory: {m}"),
            CudaError::Failed(m) => write!(f, "CUDA error: {m}"),
        }
    }
}

impl std::error::Error for CudaError {}

/// Per-frame figures of the GPU path.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuFrameStats {
    pub gpu_time_us: f64,
    pub transfer_time_us: f64,
    pub launches: u32,
    pub graph_replayed: bool,
    pub arena_bytes: u64,
    pub peak_live_bytes: u64,
    pub device_free_bytes: u64,
}

/// Checks, without any call that could panic, that libcuda and NVRTC load and that `device_id`
/// exists. Returns the device's name.
pub fn probe(_device_id: usize) -> Result<String, CudaError> {
    Err(CudaError::Unavailable(
        "the CUDA backend is not built yet".into(),
    ))
}

/// One element instance's GPU state: stream, arena, graph cache and temporal ring.
pub struct CudaPipeline {
    _private: (),
}

impl CudaPipeline {
    pub fn new(
        _device_id: usize,
        _geometry: FrameGeometry,
        _shape: Shape,
        _max_device_memory: u64,
        _use_graph: bool,
    ) -> Result<Self, CudaError> {
        Err(CudaError::Unavailable(
            "the CUDA backend is not built yet".into(),
        ))
    }

    pub fn process(
        &mut self,
        _params: &ToonParams,
        _input: &Nv12Frame,
        _output: &mut Nv12FrameMut,
    ) -> Result<FrameReport, CudaError> {
        Err(CudaError::Failed("not built".into()))
    }

    /// Empties the temporal ring and the scene detector's memory.
    pub fn reset(&mut self) {}

    pub fn last_frame_stats(&self) -> GpuFrameStats {
        GpuFrameStats::default()
    }
}
