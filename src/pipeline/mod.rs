//! Backend-neutral pipeline: stage parameters, frame geometry, the temporal ring, the scene-cut
//! detector, the CPU reference and the fast CPU path. Nothing here depends on GStreamer or CUDA.

pub mod analysis;
pub mod band_pool;
pub mod cpu;
pub mod fast;
pub mod fast_kernels;
pub mod frame;
pub mod params;
pub mod ring;
pub mod stats;

pub use frame::{FrameGeometry, Nv12Frame, Nv12FrameMut};
pub use params::{Precision, Shape, StageParams, ToonParams};
