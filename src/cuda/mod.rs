//! CUDA backend (cudarc): context, kernel build, memory plan, graph cache.
//!
//! The element talks to this module only through [`probe`], [`CudaPipeline`] and
//! [`PinnedHostBuffer`]. Nothing here but `gstcuda` depends on GStreamer: what should be logged is returned
//! by [`CudaPipeline::take_events`].
//!
//! Files: `abi` (blocks and constants shared with the kernels), `context` (one context per
//! device), `alloc` (device allocations), `kernels` (NVRTC build), `ptx_cache` (NVRTC's PTX
//! kept on disk across processes), `plan` (the classic pipeline's memory plan), `graph` (graph
//! cache and capture), `launch` (a frame's launches), `copy` (host↔device copies), `pinned`
//! (page-locked host memory), `staging` (pageable uploads copied in bands by a few threads),
//! `hostreg` (foreign host memory registered with the driver while it lives), `overlap` (the
//! overlap path's slot bookkeeping), `neural_frame` and `neural_overlap` (the network's frame
//! path on the device, and its overlap path), `pipeline` ([`CudaPipeline`]), `error` ([`CudaError`]),
//! `gstcuda` (libgstcuda-1.0 loaded at run time: GstCudaContext, GstCudaMemory, its pool; the
//! one GStreamer-aware file here).

pub mod abi;
mod alloc;
pub mod context;
mod copy;
mod error;
pub mod fault;
pub mod graph;
pub mod gstcuda;
pub mod hostreg;
pub mod kernels;
mod launch;
pub mod neural;
pub mod neural_frame;
pub mod neural_overlap;
pub mod overlap;
mod pinned;
mod pipeline;
pub mod plan;
pub mod ptx_cache;
pub mod staging;

pub use error::{CudaError, MemoryShortfall};
pub use graph::GraphKey;
pub use pinned::{PinnedHostBuffer, is_page_locked};
pub use pipeline::{
    CudaPipeline, DeviceNv12, FrameSource, FrameTarget, GRAPH_CACHE_SIZE, GRAPH_WARMUP_FRAMES,
    PipelineEvent, Submitted,
};
pub use plan::MemoryPlan;

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
    /// Bytes of the frame that crossed PCIe host→device (0 when it came in device memory).
    pub upload_bytes: u64,
    /// Bytes of the frame that crossed PCIe device→host (0 when it left in device memory).
    pub download_bytes: u64,
    /// Device-to-device copies between GstCudaMemory frames and the arena (CUDA events).
    pub device_copy_time_us: f64,
}

/// Checks, without any call that could panic, that libcuda and NVRTC load and that `device_id`
/// exists. Returns the device's name. Creates (once per process) the device's primary context.
pub fn probe(device_id: usize) -> Result<String, CudaError> {
    probe_context(&context::context(device_id)?)
}

/// [`probe`] for a context the pipeline shares (see [`context::adopt`]).
pub fn probe_context(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> Result<String, CudaError> {
    let (name, (major, minor)) = context::describe(ctx)?;
    Ok(format!("{name} (sm_{major}{minor})"))
}
