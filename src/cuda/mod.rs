//! CUDA backend (cudarc): context, kernel build, memory plan, graph cache.
//!
//! The element talks to this module only through [`probe`], [`CudaPipeline`] and
//! [`PinnedHostBuffer`]. Nothing here depends on GStreamer: what should be logged is returned
//! by [`CudaPipeline::take_events`].

mod backend;
pub mod context;
pub mod fault;
pub mod graph;
pub mod kernels;
pub mod plan;

pub use backend::{
    CudaPipeline, GRAPH_CACHE_SIZE, GRAPH_WARMUP_FRAMES, GraphKey, PinnedHostBuffer, PipelineEvent,
    is_page_locked,
};
pub use plan::MemoryPlan;

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
    /// Kernels of the frame (CUDA events around the graph launch or the eager launches).
    pub gpu_time_us: f64,
    /// Upload plus download (CUDA events).
    pub transfer_time_us: f64,
    pub launches: u32,
    pub graph_replayed: bool,
    pub arena_bytes: u64,
    pub peak_live_bytes: u64,
    pub device_free_bytes: u64,
    /// Wall time of `process` on the calling thread.
    pub host_time_us: f64,
    pub upload_time_us: f64,
    pub download_time_us: f64,
}

/// Checks, without any call that could panic, that libcuda and NVRTC load and that `device_id`
/// exists. Returns the device's name. Creates (once per process) the device's primary context.
pub fn probe(device_id: usize) -> Result<String, CudaError> {
    let ctx = context::context(device_id)?;
    let (name, (major, minor)) = context::describe(&ctx)?;
    Ok(format!("{name} (sm_{major}{minor})"))
}
