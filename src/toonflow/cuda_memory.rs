//! Zero-copy with NVIDIA's GStreamer elements (nvcodec): `memory:CUDAMemory` caps beside
//! system memory, the one CUDA context a pipeline shares (`gst.cuda.context`), CUDA buffer pools
//! and the mapping of GstCudaMemory frames for the CUDA pipeline.
//!
//! The negotiation rule is plain Rust ([`offered_kinds`]); the rest is thin glue over
//! `crate::cuda::gstcuda` (libgstcuda loaded at run time: without it nothing here is offered).

use std::sync::Arc;

use cudarc::driver::CudaContext;
use gst::prelude::*;
use gst_video::prelude::*;

use crate::cuda::gstcuda::{
    self, CAPS_FEATURE_MEMORY_CUDA_MEMORY, GstCudaContext, MappedCudaFrame,
};
use crate::cuda::{self, FrameSource, FrameTarget};
use crate::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut};

/// Where a pad's frames live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// `video/x-raw(memory:CUDAMemory)`: GstCudaMemory of the shared context.
    Cuda,
    /// `video/x-raw`: system memory.
    System,
}

impl MemoryKind {
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Cuda => "cuda",
            MemoryKind::System => "system",
        }
    }

    /// The kind of one caps structure's features: `None` for features toonflow does not take
    /// (GL memory, DMABuf, ...). ANY features count as CUDA (tried first by the caller).
    pub fn of_features(features: Option<&gst::CapsFeaturesRef>) -> Option<MemoryKind> {
        let Some(f) = features else {
            return Some(MemoryKind::System);
        };
        if f.is_any() || f.contains(CAPS_FEATURE_MEMORY_CUDA_MEMORY) {
            Some(MemoryKind::Cuda)
        } else if f.is_empty() || f.contains(gst::CAPS_FEATURE_MEMORY_SYSTEM_MEMORY) {
            Some(MemoryKind::System)
        } else {
            None
        }
    }

    /// The kind of fixed caps (the first structure's features).
    pub fn of_caps(caps: &gst::CapsRef) -> MemoryKind {
        Self::of_features(caps.features(0)).unwrap_or(MemoryKind::System)
    }

    fn features(self) -> gst::CapsFeatures {
        match self {
            MemoryKind::Cuda => gst::CapsFeatures::new([CAPS_FEATURE_MEMORY_CUDA_MEMORY]),
            MemoryKind::System => gst::CapsFeatures::new_empty(),
        }
    }
}

/// The negotiation rule: the memory kinds toonflow offers on one pad, best first, when the
/// other pad's caps carry `other` (in their order of preference).
///
/// - Without a usable GPU (or libgstcuda) only system memory is offered.
/// - Otherwise both: the other side's own preference first, so CUDA memory wins when both
///   neighbours take it (CUDA in → CUDA out preferred, and upstream is offered CUDA first
///   when downstream takes it), system memory stays the choice when upstream gives system
///   memory and downstream takes it, and the mixed cases (CUDA in / system out and the reverse)
///   remain possible where a neighbour takes only one kind.
pub fn offered_kinds(other: &[MemoryKind], cuda_usable: bool) -> Vec<MemoryKind> {
    if !cuda_usable {
        return vec![MemoryKind::System];
    }
    let mut offered: Vec<MemoryKind> = Vec::with_capacity(2);
    for &k in other.iter().chain(&[MemoryKind::Cuda, MemoryKind::System]) {
        if !offered.contains(&k) {
            offered.push(k);
        }
    }
    offered
}

/// BaseTransform::transform_caps: the same NV12 structures with the offered memory features
/// (see [`offered_kinds`]), intersected with `filter`.
pub fn transform_caps(
    caps: &gst::Caps,
    filter: Option<&gst::Caps>,
    cuda_usable: bool,
) -> gst::Caps {
    let mut other = Vec::new();
    let mut structures: Vec<gst::Structure> = Vec::new();
    if caps.is_any() {
        // (BaseTransform intersects peer caps with the pad template first, so rarely seen.)
        other.extend([MemoryKind::Cuda, MemoryKind::System]);
        structures.push(
            gst::Structure::builder("video/x-raw")
                .field("format", gst_video::VideoFormat::Nv12.to_str())
                .build(),
        );
    }
    for (s, f) in caps.iter_with_features() {
        if f.is_any() {
            other.extend([MemoryKind::Cuda, MemoryKind::System]);
        } else if let Some(k) = MemoryKind::of_features(Some(f)) {
            other.push(k);
        } else {
            continue;
        }
        if !structures.iter().any(|x| x == s) {
            structures.push(s.to_owned());
        }
    }
    let mut out = gst::Caps::new_empty();
    {
        let out = out.get_mut().expect("new caps are writable");
        for kind in offered_kinds(&other, cuda_usable) {
            for s in &structures {
                out.append_structure_full(s.clone(), Some(kind.features()));
            }
        }
    }
    match filter {
        Some(f) => f.intersect_with_mode(&out, gst::CapsIntersectMode::First),
        None => out,
    }
}

/// `caps` with the structures of memory `first` moved to the front (order otherwise kept).
/// Neighbours such as cudaupload/cudadownload list system memory first in their caps, and
/// BaseTransform keeps the peer's order when it fixates; this puts toonflow's own preference
/// ([`offered_kinds`]) back in charge of the output.
pub fn prefer(caps: &gst::Caps, first: MemoryKind) -> gst::Caps {
    let mut front = gst::Caps::new_empty();
    let mut back = gst::Caps::new_empty();
    for (s, f) in caps.iter_with_features() {
        let target = if MemoryKind::of_features(Some(f)) == Some(first) {
            &mut front
        } else {
            &mut back
        };
        target
            .get_mut()
            .expect("new caps are writable")
            .append_structure_full(s.to_owned(), Some(f.to_owned()));
    }
    front.get_mut().expect("new caps are writable").append(back);
    front
}

/// The pad templates' caps: `structure` in CUDA memory, then in system memory.
pub fn template_caps(structure: gst::Structure) -> gst::Caps {
    let mut caps = gst::Caps::new_empty();
    {
        let caps = caps.get_mut().expect("new caps are writable");
        caps.append_structure_full(structure.clone(), Some(MemoryKind::Cuda.features()));
        caps.append_structure_full(structure, Some(MemoryKind::System.features()));
    }
    caps
}

/// The CUDA context an element shares with its pipeline: the GstCudaContext neighbours see and
/// the same context as cudarc sees it.
#[derive(Clone)]
pub struct SharedContext {
    pub gst: GstCudaContext,
    pub cuda: Arc<CudaContext>,
    /// True when it came from the pipeline (another element or the application), false when
    /// toonflow wrapped its own primary context.
    pub adopted: bool,
}

impl std::fmt::Debug for SharedContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} CUDA context {:?} of device {}",
            if self.adopted { "adopted" } else { "own" },
            self.gst.handle(),
            self.gst.device_id()
        )
    }
}

impl SharedContext {
    /// Uses the pipeline's context (same device, checked by the caller).
    pub fn adopt(gst: GstCudaContext) -> Result<SharedContext, String> {
        let device_id = gst.device_id() as usize;
        // SAFETY: the GstCudaContext is alive and is kept (in `self.gst`) as long as the
        // adopted cudarc context is used: the element drops its engine before this value.
        let cuda =
            unsafe { cuda::context::adopt(device_id, gst.handle()) }.map_err(|e| e.to_string())?;
        let adopted = !cuda.is_primary();
        Ok(SharedContext { gst, cuda, adopted })
    }

    /// Wraps the process's primary context of `device_id` for the pipeline.
    pub fn own(device_id: u32) -> Result<SharedContext, String> {
        gstcuda::api()?;
        let cuda = cuda::context::context(device_id as usize).map_err(|e| e.to_string())?;
        // SAFETY: the primary context is held by the process-wide map for the process's life.
        let gst = unsafe { GstCudaContext::wrap(cuda.cu_ctx(), cuda::context::device_of(&cuda))? };
        Ok(SharedContext {
            gst,
            cuda,
            adopted: false,
        })
    }
}

/// Whether CUDA memory can be offered at all before a context is chosen: libgstcuda and the
/// driver load (no context is created).
pub fn cuda_memory_possible() -> bool {
    gstcuda::api().is_ok() && cuda::context::libraries_present().is_ok()
}

/// Asks the neighbours (downstream first, then upstream, as nvcodec does) for a
/// `gst.cuda.context` of `device_id`.
pub fn query_neighbours(element: &gst::Element, device_id: u32) -> Option<GstCudaContext> {
    let pads = [element.src_pads(), element.sink_pads()];
    for pad in pads.iter().flatten() {
        let mut query = gst::query::Context::new(gstcuda::CONTEXT_TYPE);
        if pad.peer_query(&mut query)
            && let Some(context) = query.context_owned()
            && let Some(found) = GstCudaContext::from_context(element, &context, device_id)
        {
            return Some(found);
        }
    }
    None
}

/// A configured GstCudaBufferPool of `ctx` for `caps`; returns it and its buffer size.
pub fn cuda_pool(
    ctx: &GstCudaContext,
    caps: &gst::Caps,
    min: u32,
    max: u32,
) -> Result<(gst::BufferPool, u32), String> {
    let info = gst_video::VideoInfo::from_caps(caps).map_err(|e| e.to_string())?;
    let pool = ctx.buffer_pool()?;
    let mut config = pool.config();
    config.set_params(Some(caps), info.size() as u32, min, max);
    config.add_option(gst_video::BUFFER_POOL_OPTION_VIDEO_META);
    pool.set_config(config)
        .map_err(|e| format!("the CUDA buffer pool refused its configuration: {e}"))?;
    // The pool sizes its pitched allocations itself.
    let size = pool.config().params().map_or(info.size() as u32, |p| p.1);
    Ok((pool, size))
}

/// Maps `buffer` for the device when its memory is GstCudaMemory of `ctx` (else `None`: the
/// caller maps it as system memory, and GstCudaMemory of another context downloads itself).
///
/// # Safety
/// `buffer` outlives the mapping and is writable when `write` is true.
pub unsafe fn map_device(
    buffer: *mut gst::ffi::GstBuffer,
    memory: &gst::MemoryRef,
    info: &gst_video::VideoInfo,
    ctx: &SharedContext,
    write: bool,
) -> Result<Option<MappedCudaFrame>, String> {
    if gstcuda::memory_context(memory) != Some(ctx.gst.handle()) {
        return Ok(None);
    }
    // SAFETY: the caller's guarantees.
    unsafe { MappedCudaFrame::map(buffer, info, write) }.map(Some)
}

/// What the element decided about CUDA memory at NULL→READY: whether it has looked yet, and
/// the context it shares with the pipeline (none: CUDA memory is not offered).
#[derive(Debug, Default)]
pub struct CudaShare {
    pub decided: bool,
    pub shared: Option<SharedContext>,
}

/// Runs `f` on `inbuf` and `outbuf` as NV12 frames of `info`: device planes where the pad's
/// memory is GstCudaMemory of the shared context, host planes otherwise (system memory, or
/// CUDA memory of another context, which GstCudaMemory downloads or uploads itself).
#[allow(clippy::too_many_arguments)]
pub fn with_frames<R>(
    inbuf: &gst::Buffer,
    outbuf: &mut gst::BufferRef,
    info: &gst_video::VideoInfo,
    geometry: FrameGeometry,
    shared: &SharedContext,
    kinds: [MemoryKind; 2],
    f: impl FnOnce(FrameSource, FrameTarget) -> R,
) -> Result<R, gst::ErrorMessage> {
    let failed = |e: String| gst::error_msg!(gst::StreamError::Failed, ("{}", e));
    let in_memory = (inbuf.n_memory() > 0).then(|| inbuf.peek_memory(0));
    let in_device = match in_memory {
        // SAFETY: `inbuf` is alive for this call and mapped for reading only.
        Some(mem) if kinds[0] == MemoryKind::Cuda => unsafe {
            map_device(inbuf.as_ptr() as *mut _, mem, info, shared, false).map_err(failed)?
        },
        _ => None,
    };
    let out_device = if kinds[1] == MemoryKind::Cuda && outbuf.n_memory() > 0 {
        let mem = outbuf.peek_memory(0) as *const gst::MemoryRef;
        // SAFETY: `outbuf` is writable (BaseTransform's output) and alive for this call; `mem`
        // is its first memory, read before the buffer is mapped.
        unsafe { map_device(outbuf.as_mut_ptr(), &*mem, info, shared, true).map_err(failed)? }
    } else {
        None
    };
    match in_device {
        Some(input) => with_output(outbuf, out_device, info, geometry, |target| {
            f(FrameSource::Device(input.planes), target)
        }),
        None => {
            let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(inbuf.as_ref(), info)
                .map_err(|_| {
                    gst::error_msg!(
                        gst::StreamError::Format,
                        (
                            "Input buffer does not hold a {}x{} NV12 frame",
                            geometry.width,
                            geometry.height
                        )
                    )
                })?;
            let bad =
                |e: String| gst::error_msg!(gst::StreamError::Format, ("Bad input frame: {}", e));
            let input = Nv12Frame::new(
                geometry,
                frame.plane_data(0).map_err(|e| bad(e.to_string()))?,
                frame.plane_stride()[0] as usize,
                frame.plane_data(1).map_err(|e| bad(e.to_string()))?,
                frame.plane_stride()[1] as usize,
            )
            .map_err(bad)?;
            with_output(outbuf, out_device, info, geometry, |target| {
                f(FrameSource::Host(&input), target)
            })
        }
    }
}

fn with_output<R>(
    outbuf: &mut gst::BufferRef,
    device: Option<MappedCudaFrame>,
    info: &gst_video::VideoInfo,
    geometry: FrameGeometry,
    f: impl FnOnce(FrameTarget) -> R,
) -> Result<R, gst::ErrorMessage> {
    if let Some(output) = device {
        return Ok(f(FrameTarget::Device(output.planes)));
    }
    let mut frame = gst_video::VideoFrameRef::from_buffer_ref_writable(outbuf, info)
        .map_err(|_| gst::error_msg!(gst::CoreError::Failed, ("Cannot map the output buffer")))?;
    let strides = [
        frame.plane_stride()[0] as usize,
        frame.plane_stride()[1] as usize,
    ];
    let [y, uv, ..] = frame.planes_data_mut();
    let mut output = Nv12FrameMut::new(geometry, y, strides[0], uv, strides[1])
        .map_err(|e| gst::error_msg!(gst::CoreError::Failed, ("Bad output frame: {}", e)))?;
    Ok(f(FrameTarget::Host(&mut output)))
}

#[cfg(test)]
mod tests {
    use super::MemoryKind::{Cuda, System};
    use super::*;

    #[test]
    fn without_a_gpu_only_system_memory_is_offered() {
        assert_eq!(offered_kinds(&[Cuda], false), vec![System]);
        assert_eq!(offered_kinds(&[Cuda, System], false), vec![System]);
        assert_eq!(offered_kinds(&[], false), vec![System]);
    }

    #[test]
    fn cuda_wins_when_the_other_side_prefers_it() {
        assert_eq!(offered_kinds(&[Cuda], true), vec![Cuda, System]);
        assert_eq!(offered_kinds(&[Cuda, System], true), vec![Cuda, System]);
        // ANY (a sink that takes everything) reads as [Cuda, System].
        assert_eq!(offered_kinds(&[], true), vec![Cuda, System]);
    }

    #[test]
    fn transform_caps_adds_the_other_memory_after_the_given_one() {
        gst::init().unwrap();
        let system: gst::Caps = "video/x-raw,format=NV12,width=64,height=48"
            .parse()
            .unwrap();
        let out = transform_caps(&system, None, true);
        let kinds: Vec<_> = out
            .iter_with_features()
            .map(|(_, f)| MemoryKind::of_features(Some(f)).unwrap())
            .collect();
        assert_eq!(kinds, vec![System, Cuda]);
        assert_eq!(out.structure(1).unwrap().get::<i32>("width").unwrap(), 64);
        let cuda: gst::Caps = "video/x-raw(memory:CUDAMemory),format=NV12,width=64,height=48"
            .parse()
            .unwrap();
        assert_eq!(
            MemoryKind::of_caps(&transform_caps(&cuda, None, true)),
            Cuda
        );
        let without = transform_caps(&cuda, None, false);
        assert_eq!(without.size(), 1);
        assert_eq!(MemoryKind::of_caps(&without), System);
        // GL memory is not ours: nothing comes of it.
        let gl: gst::Caps = "video/x-raw(memory:GLMemory),format=NV12".parse().unwrap();
        assert!(transform_caps(&gl, None, true).is_empty());
        // A filter keeps its own order.
        let filter: gst::Caps = "video/x-raw(memory:CUDAMemory);video/x-raw"
            .parse()
            .unwrap();
        let filtered = transform_caps(&system, Some(&filter), true);
        assert_eq!(MemoryKind::of_caps(&filtered), Cuda);
    }

    #[test]
    fn prefer_moves_one_memory_to_the_front() {
        gst::init().unwrap();
        let caps: gst::Caps =
            "video/x-raw,width=8;video/x-raw(memory:CUDAMemory),width=8;video/x-raw,width=16"
                .parse()
                .unwrap();
        let p = prefer(&caps, Cuda);
        assert_eq!(MemoryKind::of_caps(&p), Cuda);
        assert_eq!(p.size(), 3);
        assert_eq!(p.structure(1).unwrap().get::<i32>("width").unwrap(), 8);
        assert_eq!(p.structure(2).unwrap().get::<i32>("width").unwrap(), 16);
        assert_eq!(MemoryKind::of_caps(&prefer(&p, System)), System);
    }

    #[test]
    fn system_memory_stays_first_when_the_other_side_gives_system_memory() {
        assert_eq!(offered_kinds(&[System], true), vec![System, Cuda]);
        assert_eq!(offered_kinds(&[System, Cuda], true), vec![System, Cuda]);
    }
}
