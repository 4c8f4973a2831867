//! [`CudaPipeline`]: one element instance's stream, arena, graph cache and temporal ring.

use super::fault::{Fault, injected};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DriverError, LaunchConfig, PushKernelArg, result,
};

use super::context::{context, describe, failed, guard, memory_info};
use super::graph::{Decision, GraphCache, OwnedGraph};
use super::kernels::{Kernels, kernels};
use super::plan::{CONTROL_OFFSET, FRAME_BLOCK_BYTES, MemoryPlan, STATS_BYTES, names};
use super::{CudaError, GpuFrameStats};
use crate::pipeline::cpu::FrameReport;
use crate::pipeline::params::{MAX_HISTORY, MAX_ITERATIONS, THUMB_H, THUMB_W};
use crate::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, Shape, ToonParams};

/// Frames a new shape runs eagerly before it is captured.
pub const GRAPH_WARMUP_FRAMES: u32 = 2;
/// Graphs kept per pipeline.
pub const GRAPH_CACHE_SIZE: usize = 4;

/// What the pipeline wants logged (the element drains these with [`CudaPipeline::take_events`]).
#[derive(Debug, Clone, PartialEq)]
pub enum PipelineEvent {
    /// A memory plan was made (multi-line text) and the arena allocated or reused.
    Plan { text: String, arena_allocated: bool },
    /// NVRTC compiled the kernels (ms = 0 when a per-process cache hit).
    KernelsReady {
        arch: String,
        precision: String,
        compile_ms: f64,
    },
    /// A shape was captured into a CUDA graph.
    GraphCaptured {
        key: String,
        capture_us: f64,
        launches: u32,
    },
    /// Capture failed: the shape runs eagerly from now on (a warning, not an error).
    GraphCaptureFailed { key: String, reason: String },
    /// The least recently used graph was dropped.
    GraphEvicted { key: String },
}

/// Page-locked host memory (cuMemHostAlloc, flags 0: cached, so the CPU reads it fast too).
/// Freed on drop. Copies from and to it run at PCIe speed and asynchronously.
pub struct PinnedHostBuffer {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain host memory; the pointer is owned and freed once.
unsafe impl Send for PinnedHostBuffer {}
unsafe impl Sync for PinnedHostBuffer {}

impl PinnedHostBuffer {
    /// `len` bytes of page-locked memory registered with `device_id`'s context, zeroed.
    pub fn new(device_id: usize, len: usize) -> Result<Self, CudaError> {
        let ctx = context(device_id)?;
        guard("cuMemHostAlloc", || {
            ctx.bind_to_thread()
                .map_err(failed("binding the context"))?;
            let ptr = unsafe { result::malloc_host(len.max(1), 0) }.map_err(|e| {
                CudaError::OutOfMemory(format!(
                    "cannot allocate {len} bytes of page-locked host memory: {e}"
                ))
            })? as *mut u8;
            unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
            Ok(PinnedHostBuffer { ptr, len, ctx })
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl std::ops::Deref for PinnedHostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PinnedHostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = unsafe { result::free_host(self.ptr as _) };
    }
}

impl std::fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedHostBuffer({} bytes)", self.len)
    }
}

/// True when `ptr` lies in page-locked memory known to CUDA (cuMemHostAlloc / registered).
pub fn is_page_locked(ptr: *const u8) -> bool {
    if super::context::libraries_present().is_err() {
        return false;
    }
    let addr = ptr as usize;
    std::panic::catch_unwind(move || unsafe {
        let mut flags = 0u32;
        sys::cuMemHostGetFlags(&mut flags, addr as *mut _) == sys::CUresult::CUDA_SUCCESS
    })
    .unwrap_or(false)
}

/// The one device allocation of a pipeline.
struct Arena {
    ptr: CUdeviceptr,
    bytes: u64,
    ctx: Arc<CudaContext>,
}

impl Drop for Arena {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// `TfFrame` of the kernels, read back each frame.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct FrameBlock {
    scene_cut: i32,
    scene_score: f32,
    history_used: i32,
    push_slot: i32,
    levels_valid: i32,
    black: f32,
    white: f32,
    pad: i32,
    recent_slot: [i32; MAX_HISTORY as usize],
}

const HOST_PARAMS: usize = 0;
const HOST_CONTROL: usize = CONTROL_OFFSET as usize;
const HOST_FRAME: usize = 1024;
const HOST_BYTES: usize = HOST_FRAME + FRAME_BLOCK_BYTES as usize;

/// What a captured graph depends on: the shape, and the bilateral iteration after which the
/// temporal filter and the edges run (it fixes the order of the launches).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub shape: Shape,
    pub edge_iteration: u32,
}

impl GraphKey {
    fn iterations(&self) -> u32 {
        self.shape.bilateral_iterations.min(MAX_ITERATIONS)
    }
    fn has_ring(&self) -> bool {
        self.shape.temporal_history.min(MAX_HISTORY) > 0
    }
    /// The DoG x pass needs its own launch when no bilateral x pass follows the edge iteration.
    fn edge_at_end(&self) -> bool {
        self.edge_iteration == self.iterations()
    }
    /// Kernel launches of a frame: unpack, analyze, 2 per iteration, the temporal filter when
    /// there is a ring, the stand-alone DoG x pass when needed, final.
    pub fn launches(&self) -> u32 {
        3 + 2 * self.iterations() + self.has_ring() as u32 + self.edge_at_end() as u32
    }
}

impl std::fmt::Display for GraphKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shape;
        write!(
            f,
            "{}x{} {:?} iterations {} history {} auto-levels {} edge-iteration {}",
            s.width,
            s.height,
            s.precision,
            s.bilateral_iterations,
            s.temporal_history,
            s.auto_levels,
            self.edge_iteration
        )
    }
}

/// Device addresses of the planned buffers.
#[derive(Debug, Clone, Copy)]
struct Ptrs {
    params: u64,
    control: u64,
    state: u64,
    frame: u64,
    thumb: u64,
    hist: u64,
    nv12_in: u64,
    feat_l: u64,
    feat_uv: u64,
    tmp_l: u64,
    tmp_uv: u64,
    dog1: u64,
    dog2: u64,
    ring: u64,
    nv12_out: u64,
}

impl Ptrs {
    fn new(plan: &MemoryPlan, base: u64) -> Self {
        let at = |n: &str| plan.offset(n).map_or(0, |o| base + o);
        let stats = at(names::STATS);
        Ptrs {
            params: at(names::PARAMS),
            control: at(names::PARAMS) + CONTROL_OFFSET,
            state: at(names::STATE),
            frame: at(names::FRAME),
            thumb: stats,
            hist: stats + 4 * (THUMB_W * THUMB_H) as u64,
            nv12_in: at(names::NV12_IN),
            feat_l: at(names::FEAT_L),
            feat_uv: at(names::FEAT_UV),
            tmp_l: at(names::TMP_L),
            tmp_uv: at(names::TMP_UV),
            dog1: at(names::DOG1),
            dog2: at(names::DOG2),
            ring: at(names::RING),
            nv12_out: at(names::NV12_OUT),
        }
    }
}

fn drv(what: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| CudaError::Failed(format!("{what}: {e}"))
}

/// One element instance's GPU state: stream, arena, graph cache and temporal ring.
pub struct CudaPipeline {
    // Field order is drop order: graphs go before the arena their kernels address.
    cache: GraphCache<GraphKey, OwnedGraph>,
    arena: Option<Arena>,
    host: PinnedHostBuffer,
    events: [CudaEvent; 4],
    stream: Arc<CudaStream>,
    kernels: Arc<Kernels>,
    ctx: Arc<CudaContext>,
    device_id: usize,
    device_name: String,
    shape: Shape,
    plan: MemoryPlan,
    ptrs: Ptrs,
    max_device_memory: u64,
    use_graph: bool,
    reset_pending: bool,
    frames: u64,
    device_free: u64,
    stats: GpuFrameStats,
    log: Vec<PipelineEvent>,
}

impl std::fmt::Debug for CudaPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPipeline")
            .field("device", &self.device_name)
            .field("shape", &self.shape)
            .field("arena_bytes", &self.plan.arena_bytes)
            .finish()
    }
}

fn precision_name(s: &Shape) -> String {
    match s.precision {
        crate::pipeline::Precision::Fp16 => "fp16".into(),
        crate::pipeline::Precision::Fp32 => "fp32".into(),
    }
}

impl CudaPipeline {
    pub fn new(
        device_id: usize,
        geometry: FrameGeometry,
        shape: Shape,
        max_device_memory: u64,
        use_graph: bool,
    ) -> Result<Self, CudaError> {
        if geometry.width != shape.width as usize || geometry.height != shape.height as usize {
            return Err(CudaError::Failed(format!(
                "geometry {}x{} differs from the shape's {}x{}",
                geometry.width, geometry.height, shape.width, shape.height
            )));
        }
        let plan = MemoryPlan::for_shape(&shape);
        plan.check_cap(max_device_memory)?;
        let ctx = context(device_id)?;
        let (device_name, _) = describe(&ctx)?;
        let kernels = kernels(&ctx, shape.precision)?;
        let host = PinnedHostBuffer::new(device_id, HOST_BYTES)?;
        let (stream, events) = guard("creating the stream", || {
            let stream = ctx.new_stream().map_err(failed("cuStreamCreate"))?;
            let ev = || {
                ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(failed("cuEventCreate"))
            };
            Ok((stream, [ev()?, ev()?, ev()?, ev()?]))
        })?;
        let mut p = CudaPipeline {
            cache: GraphCache::new(GRAPH_CACHE_SIZE, GRAPH_WARMUP_FRAMES),
            arena: None,
            host,
            events,
            stream,
            kernels: kernels.clone(),
            ctx,
            device_id,
            device_name,
            shape,
            plan: plan.clone(),
            ptrs: Ptrs::new(&plan, 0),
            max_device_memory,
            use_graph,
            reset_pending: true,
            frames: 0,
            device_free: 0,
            stats: GpuFrameStats::default(),
            log: vec![PipelineEvent::KernelsReady {
                arch: kernels.arch.clone(),
                precision: precision_name(&shape),
                compile_ms: kernels.compile_ms,
            }],
        };
        p.install_plan(plan)?;
        Ok(p)
    }

    /// Allocates (or reuses) the arena for `plan`.
    fn install_plan(&mut self, plan: MemoryPlan) -> Result<(), CudaError> {
        let need = plan.arena_bytes.max(1);
        let reuse = self.arena.as_ref().is_some_and(|a| a.bytes >= need);
        if !reuse {
            for (k, _) in self.cache.clear() {
                self.log
                    .push(PipelineEvent::GraphEvicted { key: k.to_string() });
            }
            self.arena = None;
            let ctx = self.ctx.clone();
            let (free, _) = memory_info(&ctx)?;
            let alloc_fault = injected(Fault::Alloc);
            let ask = if alloc_fault {
                free.saturating_mul(4)
            } else {
                need
            };
            if need > free {
                return Err(CudaError::OutOfMemory(format!(
                    "the memory plan for {} needs {} bytes, the device has {} bytes free",
                    plan.label, need, free
                )));
            }
            let stream = self.stream.clone();
            let arena = guard("cuMemAlloc", || {
                ctx.bind_to_thread()
                    .map_err(failed("binding the context"))?;
                let ptr = unsafe { result::malloc_sync(ask as usize) }.map_err(|e| {
                    CudaError::OutOfMemory(format!(
                        "cuMemAlloc of {ask} bytes for the memory plan of {} failed: {e}",
                        plan.label
                    ))
                })?;
                let arena = Arena {
                    ptr,
                    bytes: need,
                    ctx: ctx.clone(),
                };
                unsafe {
                    result::memset_d8_async(ptr, 0, need as usize, stream.cu_stream())
                        .map_err(failed("cuMemsetD8Async"))?;
                }
                stream
                    .synchronize()
                    .map_err(failed("cuStreamSynchronize"))?;
                Ok(arena)
            })?;
            self.arena = Some(arena);
            self.device_free = memory_info(&self.ctx).map(|m| m.0).unwrap_or(0);
        }
        let base = self.arena.as_ref().map_or(0, |a| a.ptr);
        self.ptrs = Ptrs::new(&plan, base);
        self.log.push(PipelineEvent::Plan {
            text: plan.describe(),
            arena_allocated: !reuse,
        });
        self.plan = plan;
        self.reset_pending = true;
        Ok(())
    }

    /// Changes the shape (resolution, iterations, history, precision, auto-levels). The arena is
    /// reused when the new plan fits, and graphs of earlier shapes stay cached; the temporal
    /// ring and scene detector start empty.
    pub fn set_shape(&mut self, shape: Shape) -> Result<(), CudaError> {
        if shape == self.shape {
            return Ok(());
        }
        let plan = MemoryPlan::for_shape(&shape);
        plan.check_cap(self.max_device_memory)?;
        if shape.precision != self.shape.precision {
            self.kernels = kernels(&self.ctx, shape.precision)?;
            self.log.push(PipelineEvent::KernelsReady {
                arch: self.kernels.arch.clone(),
                precision: precision_name(&shape),
                compile_ms: self.kernels.compile_ms,
            });
        }
        self.shape = shape;
        self.install_plan(plan)
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    pub fn device_id(&self) -> usize {
        self.device_id
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The memory plan in use (arena bytes, peak, utilisation, per-buffer layout).
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// Kernel launches a frame with these parameters takes.
    pub fn launches_per_frame(&self, params: &ToonParams) -> u32 {
        self.graph_key(params).launches()
    }

    /// Switches graph replay on or off (cuda-graph property).
    pub fn set_use_graph(&mut self, on: bool) {
        self.use_graph = on;
    }

    /// Drains what should be logged since the last call.
    pub fn take_events(&mut self) -> Vec<PipelineEvent> {
        std::mem::take(&mut self.log)
    }

    /// Empties the temporal ring and the scene detector's memory (applied with the next frame).
    pub fn reset(&mut self) {
        self.reset_pending = true;
    }

    pub fn last_frame_stats(&self) -> GpuFrameStats {
        self.stats
    }

    fn iterations(&self) -> u32 {
        self.shape.bilateral_iterations.min(MAX_ITERATIONS)
    }

    fn capacity(&self) -> u32 {
        self.shape.temporal_history.min(MAX_HISTORY)
    }

    fn graph_key(&self, params: &ToonParams) -> GraphKey {
        GraphKey {
            shape: self.shape,
            edge_iteration: params.edge_iteration.clamp(0, self.iterations() as i32) as u32,
        }
    }

    pub fn process(
        &mut self,
        params: &ToonParams,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<FrameReport, CudaError> {
        let (w, h) = (self.shape.width as usize, self.shape.height as usize);
        let g = FrameGeometry {
            width: w,
            height: h,
        };
        if input.geometry != g || output.geometry != g {
            return Err(CudaError::Failed(format!(
                "frame geometry {}x{} / {}x{} differs from the pipeline's {w}x{h}",
                input.geometry.width,
                input.geometry.height,
                output.geometry.width,
                output.geometry.height
            )));
        }
        if params.width as usize != w
            || params.height as usize != h
            || params.bilateral_iterations != self.iterations() as i32
        {
            return Err(CudaError::Failed(format!(
                "parameters are for {}x{} with {} iterations, the pipeline's shape is {w}x{h} \
                 with {}; call set_shape first",
                params.width,
                params.height,
                params.bilateral_iterations,
                self.iterations()
            )));
        }
        // Re-check the planes (the fields are public): no copy may run past a slice.
        Nv12Frame::new(g, input.y, input.y_stride, input.uv, input.uv_stride)
            .map_err(|e| CudaError::Failed(format!("input frame: {e}")))?;
        Nv12Frame::new(
            g,
            &*output.y,
            output.y_stride,
            &*output.uv,
            output.uv_stride,
        )
        .map_err(|e| CudaError::Failed(format!("output frame: {e}")))?;
        let host_start = Instant::now();
        let r = guard("processing a frame", || {
            self.process_inner(params, input, output)
        });
        if r.is_ok() {
            self.stats.host_time_us = host_start.elapsed().as_secs_f64() * 1e6;
        }
        r
    }

    fn process_inner(
        &mut self,
        params: &ToonParams,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<FrameReport, CudaError> {
        let (w, h) = (self.shape.width as usize, self.shape.height as usize);
        let ch = h / 2;
        let s = self.stream.clone();
        let cs = s.cu_stream();
        self.ctx
            .bind_to_thread()
            .map_err(failed("binding the context"))?;

        // Parameter block + control, one async copy from page-locked memory.
        {
            let pbytes = unsafe {
                std::slice::from_raw_parts(
                    params as *const ToonParams as *const u8,
                    std::mem::size_of::<ToonParams>(),
                )
            };
            self.host[HOST_PARAMS..HOST_PARAMS + pbytes.len()].copy_from_slice(pbytes);
            let reset = self.reset_pending as i32;
            self.host[HOST_CONTROL..HOST_CONTROL + 4].copy_from_slice(&reset.to_ne_bytes());
        }
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.ptrs.params,
                self.host.as_ptr().add(HOST_PARAMS) as *const _,
                HOST_CONTROL + 16,
                cs,
            )
            .result()
            .map_err(drv("parameter upload"))?;
        }
        self.events[0].record(&s).map_err(drv("cuEventRecord"))?;
        unsafe {
            copy_2d_h2d(
                cs,
                input.y.as_ptr(),
                input.y_stride,
                self.ptrs.nv12_in,
                w,
                w,
                h,
            )
            .map_err(drv("Y upload"))?;
            copy_2d_h2d(
                cs,
                input.uv.as_ptr(),
                input.uv_stride,
                self.ptrs.nv12_in + (w * h) as u64,
                w,
                w,
                ch,
            )
            .map_err(drv("UV upload"))?;
        }
        self.events[1].record(&s).map_err(drv("cuEventRecord"))?;

        let key = self.graph_key(params);
        let replayed = self.run_frame(&key)?;

        self.events[2].record(&s).map_err(drv("cuEventRecord"))?;
        unsafe {
            copy_2d_d2h(
                cs,
                self.ptrs.nv12_out,
                w,
                output.y.as_mut_ptr(),
                output.y_stride,
                w,
                h,
            )
            .map_err(drv("Y download"))?;
            copy_2d_d2h(
                cs,
                self.ptrs.nv12_out + (w * h) as u64,
                w,
                output.uv.as_mut_ptr(),
                output.uv_stride,
                w,
                ch,
            )
            .map_err(drv("UV download"))?;
            sys::cuMemcpyDtoHAsync_v2(
                self.host.as_mut_ptr().add(HOST_FRAME) as *mut _,
                self.ptrs.frame,
                FRAME_BLOCK_BYTES as usize,
                cs,
            )
            .result()
            .map_err(drv("frame block download"))?;
        }
        self.events[3].record(&s).map_err(drv("cuEventRecord"))?;
        s.synchronize().map_err(drv("cuStreamSynchronize"))?;
        self.reset_pending = false;

        let fb: FrameBlock = unsafe {
            std::ptr::read_unaligned(self.host.as_ptr().add(HOST_FRAME) as *const FrameBlock)
        };
        let ms = |a: usize, b: usize| {
            self.events[a]
                .elapsed_ms(&self.events[b])
                .map(|v| v as f64 * 1e3)
                .unwrap_or(0.0)
        };
        let up = ms(0, 1);
        let gpu = ms(1, 2);
        let down = ms(2, 3);
        self.frames += 1;
        if self.frames % 64 == 1 {
            self.device_free = memory_info(&self.ctx)
                .map(|m| m.0)
                .unwrap_or(self.device_free);
        }
        self.stats = GpuFrameStats {
            gpu_time_us: gpu,
            transfer_time_us: up + down,
            launches: self.launches_per_frame(params),
            graph_replayed: replayed,
            arena_bytes: self.plan.arena_bytes,
            peak_live_bytes: self.plan.peak_live_bytes,
            device_free_bytes: self.device_free,
            host_time_us: 0.0,
            upload_time_us: up,
            download_time_us: down,
        };
        Ok(FrameReport {
            scene_cut: fb.scene_cut != 0,
            scene_score: fb.scene_score,
            history_used: fb.history_used.max(0) as usize,
        })
    }

    /// Runs the kernels of a frame: eagerly, by capturing them, or by replaying a graph.
    /// Returns whether a graph ran.
    fn run_frame(&mut self, key: &GraphKey) -> Result<bool, CudaError> {
        if !self.use_graph {
            self.enqueue(key)?;
            return Ok(false);
        }
        match self.cache.decide(key) {
            Decision::Eager => {
                self.enqueue(key)?;
                Ok(false)
            }
            Decision::Replay => {
                let g = self.cache.get(key).expect("decide said replay");
                g.0.launch().map_err(drv("cuGraphLaunch"))?;
                Ok(true)
            }
            Decision::Capture => {
                let t = Instant::now();
                match self.capture(key) {
                    Ok(graph) => {
                        let capture_us = t.elapsed().as_secs_f64() * 1e6;
                        graph.0.launch().map_err(drv("cuGraphLaunch"))?;
                        self.log.push(PipelineEvent::GraphCaptured {
                            key: key.to_string(),
                            capture_us,
                            launches: key.launches(),
                        });
                        if let Some((old, _)) = self.cache.insert(*key, graph) {
                            self.log.push(PipelineEvent::GraphEvicted {
                                key: old.to_string(),
                            });
                        }
                        Ok(true)
                    }
                    Err(reason) => {
                        self.cache.mark_failed(*key);
                        self.log.push(PipelineEvent::GraphCaptureFailed {
                            key: key.to_string(),
                            reason,
                        });
                        self.enqueue(key)?;
                        Ok(false)
                    }
                }
            }
        }
    }

    fn capture(&self, key: &GraphKey) -> Result<OwnedGraph, String> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("cuStreamBeginCapture: {e}"))?;
        let mut r = self.enqueue(key);
        if injected(Fault::Capture) && r.is_ok() {
            r = self.stream.synchronize().map_err(drv(
                "cuStreamSynchronize inside the capture (injected fault)",
            ));
        }
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags_enum(0));
        match (r, g) {
            (Ok(()), Ok(Some(g))) => {
                g.upload().map_err(|e| format!("cuGraphUpload: {e}"))?;
                Ok(OwnedGraph(g))
            }
            (Err(e), _) => Err(format!("while capturing: {e}")),
            (_, Err(e)) => Err(format!("cuStreamEndCapture/instantiate: {e}")),
            (_, Ok(None)) => Err("the capture produced no graph".into()),
        }
    }

    /// Puts the frame's memset and kernels on the stream (no host reads, no allocation).
    fn enqueue(&self, key: &GraphKey) -> Result<(), CudaError> {
        let s = &self.stream;
        let k = &self.kernels;
        let p = &self.ptrs;
        let (w, h) = (self.shape.width, self.shape.height);
        let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
        let n = self.iterations();
        let capacity = self.capacity() as i32;
        unsafe {
            sys::cuMemsetD32Async(p.thumb, 0, (STATS_BYTES / 4) as usize, s.cu_stream())
                .result()
                .map_err(drv("cuMemsetD32Async"))?;
        }
        let cfg = |gx: u32, gy: u32, bx: u32, by: u32| LaunchConfig {
            grid_dim: (gx.max(1), gy.max(1), 1),
            block_dim: (bx, by, 1),
            shared_mem_bytes: 0,
        };
        let tile = cfg(cw.div_ceil(32), ch.div_ceil(8), 32, 8);
        let luma_blocks_y = h.div_ceil(4) as i32;
        let bil = cfg(w.div_ceil(64), h.div_ceil(4) + ch.div_ceil(4), 64, 4);
        unsafe {
            s.launch_builder(&k.unpack)
                .arg(&p.params)
                .arg(&p.nv12_in)
                .arg(&p.feat_l)
                .arg(&p.feat_uv)
                .arg(&p.thumb)
                .arg(&p.hist)
                .launch(tile)
                .map_err(drv("tf_unpack"))?;
            s.launch_builder(&k.analyze)
                .arg(&p.params)
                .arg(&p.control)
                .arg(&p.thumb)
                .arg(&p.hist)
                .arg(&p.state)
                .arg(&p.frame)
                .arg(&capacity)
                .launch(cfg(1, 1, 256, 1))
                .map_err(drv("tf_analyze"))?;
            let luma_elems = (w as i64) * (h as i64);
            let slot_elems = luma_elems + 2 * (cw as i64) * (ch as i64);
            // The temporal filter runs on the features after `edge_iteration` iterations; the
            // x pass that follows it (or tf_dog_x) takes the DoG x pass of the filtered luma.
            let temporal = || {
                if !key.has_ring() {
                    return Ok(());
                }
                s.launch_builder(&k.temporal)
                    .arg(&p.params)
                    .arg(&p.frame)
                    .arg(&p.feat_l)
                    .arg(&p.feat_uv)
                    .arg(&p.ring)
                    .arg(&slot_elems)
                    .arg(&luma_elems)
                    .launch(tile)
                    .map(|_| ())
                    .map_err(drv("tf_temporal"))
            };
            let iters: Vec<i32> = (0..n as i32).collect();
            for it in &iters {
                if *it as u32 == key.edge_iteration {
                    temporal()?;
                }
                s.launch_builder(&k.bilateral_x)
                    .arg(&p.params)
                    .arg(&p.feat_l)
                    .arg(&p.feat_uv)
                    .arg(&p.tmp_l)
                    .arg(&p.tmp_uv)
                    .arg(&p.dog1)
                    .arg(&p.dog2)
                    .arg(it)
                    .arg(&luma_blocks_y)
                    .launch(bil)
                    .map_err(drv("tf_bilateral_x"))?;
                s.launch_builder(&k.bilateral_y)
                    .arg(&p.params)
                    .arg(&p.tmp_l)
                    .arg(&p.tmp_uv)
                    .arg(&p.feat_l)
                    .arg(&p.feat_uv)
                    .arg(&luma_blocks_y)
                    .launch(bil)
                    .map_err(drv("tf_bilateral_y"))?;
            }
            if key.edge_at_end() {
                temporal()?;
                s.launch_builder(&k.dog_x)
                    .arg(&p.params)
                    .arg(&p.feat_l)
                    .arg(&p.dog1)
                    .arg(&p.dog2)
                    .launch(cfg(w.div_ceil(64), h.div_ceil(4), 64, 4))
                    .map_err(drv("tf_dog_x"))?;
            }
            s.launch_builder(&k.final_)
                .arg(&p.params)
                .arg(&p.frame)
                .arg(&p.feat_l)
                .arg(&p.feat_uv)
                .arg(&p.dog1)
                .arg(&p.dog2)
                .arg(&p.nv12_out)
                .launch(tile)
                .map_err(drv("tf_final"))?;
        }
        Ok(())
    }
}

/// A 2D copy between host and device rows (pitches may differ); every field set explicitly
/// (the struct holds enums, so it must not be zero-initialised).
#[allow(clippy::too_many_arguments)]
fn memcpy_2d(
    src_type: sys::CUmemorytype,
    src_host: *const u8,
    src_device: CUdeviceptr,
    src_pitch: usize,
    dst_type: sys::CUmemorytype,
    dst_host: *mut u8,
    dst_device: CUdeviceptr,
    dst_pitch: usize,
    width: usize,
    rows: usize,
) -> sys::CUDA_MEMCPY2D {
    sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: src_type,
        srcHost: src_host as *const _,
        srcDevice: src_device,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dst_type,
        dstHost: dst_host as *mut _,
        dstDevice: dst_device,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: rows,
    }
}

unsafe fn copy_2d_h2d(
    stream: sys::CUstream,
    src: *const u8,
    src_pitch: usize,
    dst: CUdeviceptr,
    dst_pitch: usize,
    width: usize,
    rows: usize,
) -> Result<(), DriverError> {
    use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
    let c = memcpy_2d(
        CU_MEMORYTYPE_HOST,
        src,
        0,
        src_pitch,
        CU_MEMORYTYPE_DEVICE,
        std::ptr::null_mut(),
        dst,
        dst_pitch,
        width,
        rows,
    );
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream).result() }
}

unsafe fn copy_2d_d2h(
    stream: sys::CUstream,
    src: CUdeviceptr,
    src_pitch: usize,
    dst: *mut u8,
    dst_pitch: usize,
    width: usize,
    rows: usize,
) -> Result<(), DriverError> {
    use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
    let c = memcpy_2d(
        CU_MEMORYTYPE_DEVICE,
        std::ptr::null(),
        src,
        src_pitch,
        CU_MEMORYTYPE_HOST,
        dst,
        0,
        dst_pitch,
        width,
        rows,
    );
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream).result() }
}
