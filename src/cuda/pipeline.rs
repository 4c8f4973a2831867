//! [`CudaPipeline`]: one element instance's stream, arena, graph cache and temporal ring.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result};

use super::GpuFrameStats;
use super::abi::{CONTROL_OFFSET, TfControl, TfFrame};
use super::alloc::{DeviceBlock, allocate};
use super::context::{context, describe, guard, memory_info};
use super::copy::{Rows, copy_2d, copy_d2h, copy_h2d};
use super::error::{CudaError, driver};
use super::graph::{GraphCache, GraphKey, OwnedGraph, Ran};
use super::kernels::{Kernels, kernels};
use super::launch::{DevicePtrs, clear_statistics, enqueue_frame};
use super::overlap::{FlightSlot, HOST_SLOTS, InFlight, SlotRing};
use super::pinned::{PinnedHostBuffer, is_page_locked};
use super::plan::{MemoryPlan, check_cap, classic_plan};
use super::staging::{self, HostPlane, StagedUpload};
use crate::pipeline::cpu::FrameReport;
use crate::pipeline::params::MAX_ITERATIONS;
use crate::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, Precision, Shape, ToonParams};

/// Frames a new shape runs eagerly before it is captured.
pub const GRAPH_WARMUP_FRAMES: u32 = 2;
/// Graphs kept per pipeline.
pub const GRAPH_CACHE_SIZE: usize = 4;

/// What the pipeline wants logged (the element drains these with [`CudaPipeline::take_events`]).
#[derive(Debug, Clone, PartialEq)]
pub enum PipelineEvent {
    /// A memory plan was made (multi-line text) and the arena allocated or reused.
    Plan { text: String, arena_allocated: bool },
    /// The kernels are loaded (compile_ms = 0: the PTX came from the per-process or the disk
    /// cache, NVRTC did not run).
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

/// The two NV12 planes of a frame in device memory of the pipeline's context (a mapped
/// GstCudaMemory): addresses and row pitches in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceNv12 {
    pub y: CUdeviceptr,
    pub y_pitch: usize,
    pub uv: CUdeviceptr,
    pub uv_pitch: usize,
}

impl DeviceNv12 {
    pub(crate) fn rows(&self) -> [Rows; 2] {
        [
            Rows::device(self.y, self.y_pitch),
            Rows::device(self.uv, self.uv_pitch),
        ]
    }

    pub(crate) fn check(&self, width: usize, what: &str) -> Result<(), CudaError> {
        if self.y == 0 || self.uv == 0 || self.y_pitch < width || self.uv_pitch < width {
            return Err(CudaError::Failed(format!(
                "{what} device frame {self:?} does not hold rows of {width} bytes"
            )));
        }
        Ok(())
    }
}

/// Copies an NV12 frame of `w`×`h` (Y rows, then UV rows at half height) from `src` to `dst`
/// planes; `what` names the copy in errors.
///
/// # Safety
/// As for [`copy_2d`], for both planes.
pub(crate) unsafe fn copy_nv12(
    stream: sys::CUstream,
    src: [Rows; 2],
    dst: [Rows; 2],
    w: usize,
    h: usize,
    what: &str,
) -> Result<(), CudaError> {
    for (plane, (name, rows)) in [("Y", h), ("UV", h / 2)].into_iter().enumerate() {
        // SAFETY: the caller guarantees both planes (see above).
        unsafe { copy_2d(stream, src[plane], dst[plane], w, rows) }
            .map_err(driver(format!("{name} {what}")))?;
    }
    Ok(())
}

/// Where a frame comes from: host memory (uploaded over PCIe) or device memory of the
/// pipeline's context (copied on the device into the arena).
#[derive(Clone, Copy)]
pub enum FrameSource<'a, 'b> {
    Host(&'a Nv12Frame<'b>),
    Device(DeviceNv12),
}

/// Where a frame goes: host memory (downloaded over PCIe) or device memory of the pipeline's
/// context.
pub enum FrameTarget<'a, 'b> {
    Host(&'a mut Nv12FrameMut<'b>),
    Device(DeviceNv12),
}

/// Allocates and zeroes an arena of `bytes` for `plan` (see [`allocate`] for its errors and the
/// injected alloc fault).
fn allocate_arena(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    plan: &MemoryPlan,
    bytes: u64,
) -> Result<DeviceBlock, CudaError> {
    let arena = allocate(ctx, bytes, &format!("the memory plan for {}", plan.label))?;
    guard("zeroing the arena", || {
        // SAFETY: `arena` is a fresh allocation of `bytes` bytes in this context, which
        // `allocate` left current.
        unsafe {
            result::memset_d8_async(arena.ptr, 0, bytes as usize, stream.cu_stream())
                .map_err(driver("cuMemsetD8Async"))?;
        }
        stream.synchronize().map_err(driver("cuStreamSynchronize"))
    })?;
    Ok(arena)
}

/// Layout of the page-locked staging block: parameters and control go up in one copy, the
/// frame's decisions come back.
const HOST_PARAMS: usize = 0;
const HOST_CONTROL: usize = CONTROL_OFFSET as usize;
const HOST_CONTROL_END: usize = HOST_CONTROL + std::mem::size_of::<TfControl>();
const HOST_FRAME: usize = 1024;
const HOST_FRAME_END: usize = HOST_FRAME + std::mem::size_of::<TfFrame>();
const HOST_BYTES: usize = HOST_FRAME_END;
const _: () = assert!(HOST_CONTROL_END <= HOST_FRAME);

fn precision_name(s: &Shape) -> String {
    match s.precision {
        Precision::Fp16 => "fp16".into(),
        Precision::Fp32 => "fp32".into(),
    }
}

/// A host frame against the size a frame path was set up for, then `planes`, its planes'
/// check (`Nv12Frame::check`: the fields are public, so no copy may run past a slice).
/// The classic pipeline and the network's frame path both check this way.
pub(crate) fn check_host_frame(
    g: FrameGeometry,
    planes: Result<(), String>,
    (w, h): (usize, usize),
    what: &str,
) -> Result<(), CudaError> {
    if (g.width, g.height) != (w, h) {
        return Err(CudaError::Failed(format!(
            "{what} frame of {}x{}, the frame path holds {w}x{h}",
            g.width, g.height
        )));
    }
    planes.map_err(|e| CudaError::Failed(format!("{what} frame: {e}")))
}

/// Writes the parameter block and the frame's control into the page-locked `host` block and
/// queues their upload into `dst` on `stream`: one async copy.
///
/// # Safety
/// `dst` holds CONTROL_OFFSET + TfControl bytes (the plan's "params" buffer), and `host` is
/// neither written nor freed before the copy has run.
unsafe fn queue_params(
    stream: sys::CUstream,
    host: &mut PinnedHostBuffer,
    params: &ToonParams,
    reset: bool,
    dst: CUdeviceptr,
) -> Result<(), CudaError> {
    let control = TfControl {
        reset: reset as i32,
        pad: [0; 3],
    };
    let params_bytes = bytemuck::bytes_of(params);
    host[HOST_PARAMS..HOST_PARAMS + params_bytes.len()].copy_from_slice(params_bytes);
    host[HOST_CONTROL..HOST_CONTROL_END].copy_from_slice(bytemuck::bytes_of(&control));
    // SAFETY: `host` is page-locked and holds HOST_CONTROL_END bytes; the caller guarantees
    // the rest (see above).
    unsafe {
        copy_h2d(
            stream,
            host.as_ptr().add(HOST_PARAMS),
            dst,
            HOST_CONTROL_END - HOST_PARAMS,
        )
    }
    .map_err(driver("parameter upload"))
}

/// Time from `a` to `b` in µs (0 when the driver cannot tell).
pub(crate) fn elapsed_us(a: &CudaEvent, b: &CudaEvent) -> f64 {
    a.elapsed_ms(b).map(|v| v as f64 * 1e3).unwrap_or(0.0)
}

/// The analysis report in a staging block's frame block (TfFrame), once its download is done.
fn read_report(host: &PinnedHostBuffer) -> FrameReport {
    let fb: TfFrame = bytemuck::pod_read_unaligned(&host[HOST_FRAME..HOST_FRAME_END]);
    FrameReport {
        scene_cut: fb.scene_cut != 0,
        scene_score: fb.scene_score,
        history_used: fb.history_used.max(0) as usize,
    }
}

/// The overlap path's device and host resources, made on its first frame.
struct Overlap {
    slots: Vec<FlightSlot>,
    ring: SlotRing,
    /// The landing slot: one packed NV12 frame.
    landing: DeviceBlock,
    copy: Arc<CudaStream>,
}

impl Overlap {
    /// The copy stream, a landing slot of `frame_bytes` and the host slots. The landing slot
    /// counts against `max_device_memory` with the plan's arena (0: no cap).
    fn new(
        ctx: &Arc<CudaContext>,
        plan: &MemoryPlan,
        frame_bytes: u64,
        max_device_memory: u64,
    ) -> Result<Self, CudaError> {
        if max_device_memory != 0 && plan.arena_bytes + frame_bytes > max_device_memory {
            return Err(CudaError::out_of_memory(format!(
                "overlap needs a landing slot of {frame_bytes} bytes beside the arena's {} \
                 bytes, over max-device-memory ({max_device_memory} bytes)",
                plan.arena_bytes
            )));
        }
        let landing = allocate(ctx, frame_bytes, "overlap's landing slot")?;
        guard("setting up overlap", || {
            let copy = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
            Ok(Overlap {
                slots: FlightSlot::make_all(ctx, HOST_BYTES)?,
                ring: SlotRing::new(HOST_SLOTS),
                landing,
                copy,
            })
        })
    }
}

/// Frames of the overlap path seen complete, oldest first: each one's analysis report and
/// figures.
pub type CompletedFrames = Vec<(FrameReport, GpuFrameStats)>;

/// A frame queued by [`CudaPipeline::submit_host`].
pub struct Submitted {
    /// Recorded after the frame's download: the output buffer is complete once it has fired.
    pub done: Arc<CudaEvent>,
    /// Earlier frames seen complete meanwhile (oldest first): analysis report and figures.
    pub finished: CompletedFrames,
}

/// One element instance's GPU state: stream, arena, graph cache and temporal ring.
pub struct CudaPipeline {
    // Field order is drop order: the overlap path's landing slot and events first (`Drop`
    // synchronises its frames in flight), graphs before the arena their kernels address.
    overlap: Option<Overlap>,
    /// Overlap frames completed by a shape change (`finish_in_flight`) before anyone read them:
    /// handed out first by the next `submit_host` or `harvest`, so none goes uncounted.
    finished_early: CompletedFrames,
    cache: GraphCache<GraphKey, OwnedGraph>,
    /// `None` only after a shape change failed to allocate: frames are refused until a
    /// [`CudaPipeline::set_shape`] succeeds.
    arena: Option<DeviceBlock>,
    host: PinnedHostBuffer,
    /// Uploads of pageable frames, staged in bands by `staging_threads` threads (made on the
    /// first pageable frame; 0 threads: the driver stages them).
    stager: Option<StagedUpload>,
    staging_threads: usize,
    events: [CudaEvent; 4],
    stream: Arc<CudaStream>,
    kernels: Arc<Kernels>,
    ctx: Arc<CudaContext>,
    device_id: usize,
    device_name: String,
    shape: Shape,
    plan: MemoryPlan,
    ptrs: DevicePtrs,
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

/// The shape's memory plan, once the shape matches `geometry` and the plan fits under
/// `max_device_memory` (0: no cap).
fn check_shape(
    geometry: &FrameGeometry,
    shape: &Shape,
    max_device_memory: u64,
) -> Result<MemoryPlan, CudaError> {
    if geometry.width != shape.width as usize || geometry.height != shape.height as usize {
        return Err(CudaError::Failed(format!(
            "geometry {}x{} differs from the shape's {}x{}",
            geometry.width, geometry.height, shape.width, shape.height
        )));
    }
    let plan = classic_plan(shape);
    check_cap(&plan, max_device_memory)?;
    Ok(plan)
}

impl CudaPipeline {
    /// The frame geometry of the pipeline's shape.
    fn geometry(&self) -> FrameGeometry {
        FrameGeometry {
            width: self.shape.width as usize,
            height: self.shape.height as usize,
        }
    }

    /// A pipeline in the process's primary context of `device_id`.
    pub fn new(
        device_id: usize,
        geometry: FrameGeometry,
        shape: Shape,
        max_device_memory: u64,
        use_graph: bool,
    ) -> Result<Self, CudaError> {
        // The plan is checked before the driver is touched: a cap below it is the same clear
        // error with or without a GPU.
        check_shape(&geometry, &shape, max_device_memory)?;
        let ctx = context(device_id)?;
        Self::new_in(ctx, geometry, shape, max_device_memory, use_graph)
    }

    /// A pipeline in `ctx` (the primary context, or the pipeline's shared GstCudaContext's,
    /// see [`super::context::adopt`]), whose device memory it can then read and write.
    pub fn new_in(
        ctx: Arc<CudaContext>,
        geometry: FrameGeometry,
        shape: Shape,
        max_device_memory: u64,
        use_graph: bool,
    ) -> Result<Self, CudaError> {
        let device_id = ctx.ordinal();
        let plan = check_shape(&geometry, &shape, max_device_memory)?;
        let (device_name, _) = describe(&ctx)?;
        let kernels = kernels(&ctx, shape.precision)?;
        let host = PinnedHostBuffer::in_context(ctx.clone(), HOST_BYTES)?;
        let (stream, events) = guard("creating the stream", || {
            let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
            let ev = || {
                ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(driver("cuEventCreate"))
            };
            Ok((stream, [ev()?, ev()?, ev()?, ev()?]))
        })?;
        let mut p = CudaPipeline {
            overlap: None,
            finished_early: Vec::new(),
            cache: GraphCache::new(GRAPH_CACHE_SIZE, GRAPH_WARMUP_FRAMES),
            arena: None,
            host,
            stager: None,
            staging_threads: staging::threads_from_env(),
            events,
            stream,
            kernels: kernels.clone(),
            ctx,
            device_id,
            device_name,
            shape,
            plan: plan.clone(),
            ptrs: DevicePtrs::new(&plan, 0),
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

    /// Makes `plan` (the plan of `self.shape`) current, reusing the arena when it is large
    /// enough. Otherwise the graphs and the old arena are released *before* the new one is
    /// allocated, so a pipeline never holds two; if that allocation fails the pipeline is left
    /// without an arena (frames are refused) and the error is returned.
    fn install_plan(&mut self, plan: MemoryPlan) -> Result<(), CudaError> {
        // Frames in flight address the old plan's buffers and the landing slot of the old size.
        self.finish_in_flight();
        self.overlap = None;
        let need = plan.arena_bytes.max(1);
        let reuse = self.arena.as_ref().is_some_and(|a| a.bytes >= need);
        self.plan = plan;
        self.reset_pending = true;
        if !reuse {
            for (k, _) in self.cache.clear() {
                self.log
                    .push(PipelineEvent::GraphEvicted { key: k.to_string() });
            }
            self.arena = None;
            self.arena = Some(allocate_arena(&self.ctx, &self.stream, &self.plan, need)?);
            self.device_free = memory_info(&self.ctx).map(|m| m.0).unwrap_or(0);
        }
        let base = self.arena.as_ref().map_or(0, |a| a.ptr);
        self.ptrs = DevicePtrs::new(&self.plan, base);
        // A reused arena holds other buffers' bytes where the statistics now lie.
        clear_statistics(&self.stream, &self.ptrs)?;
        self.log.push(PipelineEvent::Plan {
            text: self.plan.describe(),
            arena_allocated: !reuse,
        });
        Ok(())
    }

    /// Changes the shape (resolution, iterations, history, precision, auto-levels). The arena is
    /// reused when the new plan fits, and graphs of earlier shapes stay cached; otherwise the
    /// old arena is freed before the new one is allocated. The temporal ring and scene detector
    /// start empty.
    ///
    /// A new plan over `max-device-memory`, or kernels that fail to build, leave the pipeline as
    /// it was. A failed allocation leaves it on the new shape without an arena: `process`
    /// refuses frames until a later `set_shape` succeeds.
    pub fn set_shape(&mut self, shape: Shape) -> Result<(), CudaError> {
        if shape == self.shape && self.arena.is_some() {
            return Ok(());
        }
        let plan = classic_plan(&shape);
        check_cap(&plan, self.max_device_memory)?;
        if shape.precision != self.kernels.precision {
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

    /// The memory plan of the current shape (arena bytes, peak, utilisation, per-buffer layout).
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

    /// Sets the threads that stage uploads of pageable frames, the calling thread included
    /// (0: the driver stages them; default from `TOONFLOW_STAGING_THREADS`, see staging.rs).
    pub fn set_staging_threads(&mut self, threads: usize) {
        let threads = threads.min(staging::MAX_THREADS);
        if threads != self.staging_threads {
            self.stager = None;
            self.staging_threads = threads;
        }
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
        self.process_frames(params, FrameSource::Host(input), FrameTarget::Host(output))
    }

    /// The CUDA context the pipeline runs in (device frames must belong to it).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Stylizes one frame read from host or device memory into host or device memory. Device
    /// frames are copied on the device (pitches respected), so no PCIe copy of the frame takes
    /// place for them; the stream is synchronised before return, so a device output may be
    /// read by any stream of the context (GStreamer 1.22 has no stream handover).
    pub fn process_frames(
        &mut self,
        params: &ToonParams,
        input: FrameSource,
        output: FrameTarget,
    ) -> Result<FrameReport, CudaError> {
        self.check_frames(params, &input, &output)?;
        let host_start = Instant::now();
        let r = guard("processing a frame", || {
            self.process_inner(params, input, output)
        });
        if r.is_ok() {
            self.stats.host_time_us = host_start.elapsed().as_secs_f64() * 1e6;
        }
        r
    }

    /// Frames queued on the overlap path whose completion has not been seen yet.
    pub fn in_flight(&self) -> usize {
        self.overlap.as_ref().map_or(0, |o| o.ring.in_flight()) + self.finished_early.len()
    }

    /// Waits for the overlap path's frames in flight, before the buffers they address are
    /// reused or freed, and keeps their reports and figures for the next `submit_host` or
    /// `harvest` (a property that changes the shape while playing).
    fn finish_in_flight(&mut self) {
        let Some(mut ov) = self.overlap.take() else {
            return;
        };
        if ov.ring.in_flight() > 0 {
            let _ = self.ctx.bind_to_thread();
            let _ = self.stream.synchronize();
            let _ = ov.copy.synchronize();
            match self.harvest_from(&mut ov, true) {
                Ok(done) => self.finished_early.extend(done),
                Err(_) => ov.ring.clear(),
            }
            // Every frame's work is over (both streams synchronised): none is left.
            ov.ring.clear();
        }
        self.overlap = Some(ov);
    }

    /// The overlap path (issue 12): queues a host frame and returns without waiting for it.
    ///
    /// The upload goes on a copy stream into the landing slot (a pageable upload blocks the
    /// calling thread for its staging, page-locked ones do not), after the previous frame has
    /// read the landing slot; the compute stream waits for it, copies it into the arena,
    /// replays the kernels and downloads the result into `output`, then records
    /// [`Submitted::done`]. So this frame's upload overlaps the previous frame's kernels and
    /// download, while each frame still completes as soon as its own work is done.
    ///
    /// # Safety
    /// Both frames' memory must stay valid and untouched (`output` unread, `input` unwritten)
    /// until `done` has fired: the copies run after this call returns.
    ///
    /// The analysis reports and figures of earlier frames found complete come back in
    /// [`Submitted::finished`] (and from [`CudaPipeline::harvest`]); at most [`HOST_SLOTS`]
    /// frames are in flight (a fourth waits for the oldest).
    pub unsafe fn submit_host(
        &mut self,
        params: &ToonParams,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<Submitted, CudaError> {
        self.check_frames(
            params,
            &FrameSource::Host(input),
            &FrameTarget::Host(output),
        )?;
        let host_start = Instant::now();
        let frame_bytes = self.geometry().nv12_bytes() as u64;
        if self.overlap.is_none() {
            let ov = Overlap::new(&self.ctx, &self.plan, frame_bytes, self.max_device_memory)?;
            self.overlap = Some(ov);
        }
        let mut ov = self.overlap.take().expect("made above");
        let r = guard("queuing a frame", || {
            self.submit_inner(&mut ov, params, input, output)
        });
        if r.is_err() {
            // A frame cut short: nothing of it may run on after the error is returned.
            let _ = self.stream.synchronize();
            let _ = ov.copy.synchronize();
        }
        self.overlap = Some(ov);
        let (slot, finished) = r?;
        if let Some(ov) = &mut self.overlap {
            ov.slots[slot].frame.host_time_us = host_start.elapsed().as_secs_f64() * 1e6;
            return Ok(Submitted {
                done: ov.slots[slot].done.clone(),
                finished,
            });
        }
        unreachable!("put back above")
    }

    /// Enqueues the frame on the copy and compute streams; returns its host slot and the
    /// frames found complete.
    fn submit_inner(
        &mut self,
        ov: &mut Overlap,
        params: &ToonParams,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<(usize, CompletedFrames), CudaError> {
        let (w, h) = (self.shape.width as usize, self.shape.height as usize);
        let frame_bytes = self.geometry().nv12_bytes();
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        let mut finished = std::mem::take(&mut self.finished_early);
        finished.extend(self.harvest_from(ov, false)?);
        if ov.ring.next_free().is_none() {
            finished.extend(self.harvest_from(ov, true)?);
        }
        let i = ov
            .ring
            .next_free()
            .ok_or_else(|| CudaError::Failed("no free host slot after a wait".into()))?;
        let (s, copy) = (self.stream.clone(), ov.copy.clone());
        // The landing slot is free once the last submitted frame has copied it into the arena.
        if let Some(prev) = ov.ring.last_submitted() {
            copy.wait(&ov.slots[prev].ev[3])
                .map_err(driver("cuStreamWaitEvent"))?;
        }
        let landing = ov.landing.ptr;
        let slot = &mut ov.slots[i];
        slot.ev[0].record(&copy).map_err(driver("cuEventRecord"))?;
        self.upload_host(copy.cu_stream(), input, landing, false)?;
        slot.ev[1].record(&copy).map_err(driver("cuEventRecord"))?;

        let cs = s.cu_stream();
        s.wait(&slot.ev[1]).map_err(driver("cuStreamWaitEvent"))?;
        slot.ev[2].record(&s).map_err(driver("cuEventRecord"))?;
        // SAFETY: the slot's page-locked block is not written again before its frame is seen
        // complete (the ring hands it out again only then); "params" is the plan's parameter
        // buffer; the landing slot and "nv12-in" both hold a packed frame.
        unsafe {
            queue_params(
                cs,
                &mut slot.host,
                params,
                self.reset_pending,
                self.ptrs.params,
            )?;
            result::memcpy_dtod_async(self.ptrs.nv12_in, landing, frame_bytes, cs)
                .map_err(driver("landing slot copy"))?;
        }
        slot.ev[3].record(&s).map_err(driver("cuEventRecord"))?;
        let key = self.graph_key(params);
        let replayed = self.run_frame(&key)?;
        let slot = &mut ov.slots[i];
        slot.ev[4].record(&s).map_err(driver("cuEventRecord"))?;
        let arena_out = Rows::device(self.ptrs.nv12_out, w);
        let target = [
            Rows::Host {
                ptr: output.y.as_mut_ptr(),
                pitch: output.y_stride,
            },
            Rows::Host {
                ptr: output.uv.as_mut_ptr(),
                pitch: output.uv_stride,
            },
        ];
        // SAFETY: "nv12-out" holds the packed frame; the output planes were checked to hold
        // the frame and the caller keeps them alive and unread until `done` fires (see
        // `submit_host`); the slot's block is read only after `done`.
        unsafe {
            copy_nv12(
                cs,
                [arena_out, arena_out.offset(w * h)],
                target,
                w,
                h,
                "download",
            )?;
            copy_d2h(
                cs,
                self.ptrs.frame,
                slot.host.as_mut_ptr().add(HOST_FRAME),
                HOST_FRAME_END - HOST_FRAME,
            )
            .map_err(driver("frame block download"))?;
        }
        slot.done.record(&s).map_err(driver("cuEventRecord"))?;
        slot.frame = InFlight {
            launches: self.launches_per_frame(params),
            replayed,
            host_time_us: 0.0,
        };
        self.reset_pending = false;
        ov.ring.begin(i);
        Ok((i, finished))
    }

    /// Reads the analysis report and figures of the overlap path's frames that are complete,
    /// oldest first; with `wait`, waits for all frames in flight first.
    pub fn harvest(&mut self, wait: bool) -> Result<CompletedFrames, CudaError> {
        let early = std::mem::take(&mut self.finished_early);
        let Some(mut ov) = self.overlap.take() else {
            return Ok(early);
        };
        let mut r = Ok(early);
        while let Ok(v) = &mut r {
            let more = self.harvest_from(&mut ov, wait);
            match more {
                Ok(m) if m.is_empty() => break,
                Ok(m) => v.extend(m),
                Err(e) => r = Err(e),
            }
            if !wait {
                break;
            }
        }
        self.overlap = Some(ov);
        r
    }

    /// Frames complete in `ov`, oldest first: without `wait_one` those already done, with it
    /// the oldest after waiting for it (and any done after it).
    fn harvest_from(
        &mut self,
        ov: &mut Overlap,
        wait_one: bool,
    ) -> Result<CompletedFrames, CudaError> {
        let mut out = Vec::new();
        while let Some(i) = ov.ring.oldest() {
            let slot = &ov.slots[i];
            if !slot.complete(wait_one && out.is_empty())? {
                break;
            }
            let bytes = self.geometry().nv12_bytes() as u64;
            let frame = GpuFrameStats {
                gpu_time_us: elapsed_us(&slot.ev[3], &slot.ev[4]),
                launches: slot.frame.launches,
                graph_replayed: slot.frame.replayed,
                host_time_us: slot.frame.host_time_us,
                upload_time_us: elapsed_us(&slot.ev[0], &slot.ev[1]),
                download_time_us: elapsed_us(&slot.ev[4], &slot.done),
                upload_bytes: bytes,
                download_bytes: bytes,
                device_copy_time_us: elapsed_us(&slot.ev[2], &slot.ev[3]),
                ..GpuFrameStats::default()
            };
            let report = read_report(&slot.host);
            ov.ring.finish_oldest();
            out.push((report, self.count_frame(frame, ov.landing.bytes)));
        }
        Ok(out)
    }

    /// Counts a completed frame and keeps its figures as the last frame's: `frame`'s own (times
    /// from its events, bytes, launches) completed with the transfer time (upload + download),
    /// the plan's arena plus `beside_arena` bytes (the overlap path's landing slot), its peak and
    /// the free device memory (queried every 64 frames).
    fn count_frame(&mut self, frame: GpuFrameStats, beside_arena: u64) -> GpuFrameStats {
        self.frames += 1;
        if self.frames % 64 == 1 {
            self.device_free = memory_info(&self.ctx)
                .map(|m| m.0)
                .unwrap_or(self.device_free);
        }
        self.stats = GpuFrameStats {
            transfer_time_us: frame.upload_time_us + frame.download_time_us,
            arena_bytes: self.plan.arena_bytes + beside_arena,
            peak_live_bytes: self.plan.peak_live_bytes,
            device_free_bytes: self.device_free,
            ..frame
        };
        self.stats
    }

    /// Refuses frames the pipeline cannot take now: no arena, parameters of another shape, planes
    /// that do not hold the pipeline's geometry (the fields are public).
    fn check_frames(
        &self,
        params: &ToonParams,
        input: &FrameSource,
        output: &FrameTarget,
    ) -> Result<(), CudaError> {
        if self.arena.is_none() {
            return Err(CudaError::Failed(format!(
                "no device memory for {}: the last shape change failed to allocate it; set a \
                 shape again",
                self.plan.label
            )));
        }
        let g = self.geometry();
        let (w, h) = (g.width, g.height);
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
        match input {
            FrameSource::Host(input) => {
                check_host_frame(input.geometry, input.check(), (w, h), "input")?
            }
            FrameSource::Device(d) => d.check(w, "input")?,
        }
        match output {
            FrameTarget::Host(output) => {
                check_host_frame(output.geometry, output.check(), (w, h), "output")?
            }
            FrameTarget::Device(d) => d.check(w, "output")?,
        }
        Ok(())
    }

    fn process_inner(
        &mut self,
        params: &ToonParams,
        input: FrameSource,
        output: FrameTarget,
    ) -> Result<FrameReport, CudaError> {
        let (w, h) = (self.shape.width as usize, self.shape.height as usize);
        let s = self.stream.clone();
        let cs = s.cu_stream();
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;

        // SAFETY: the staging block lives in `self` and is not written again before the
        // synchronisation below; "params" is the plan's parameter buffer.
        unsafe {
            queue_params(
                cs,
                &mut self.host,
                params,
                self.reset_pending,
                self.ptrs.params,
            )?
        };
        self.events[0].record(&s).map_err(driver("cuEventRecord"))?;
        let frame_bytes = self.geometry().nv12_bytes() as u64;
        let (y_bytes, arena_in, arena_out) = (
            w * h,
            Rows::device(self.ptrs.nv12_in, w),
            Rows::device(self.ptrs.nv12_out, w),
        );
        let upload_bytes = match input {
            FrameSource::Host(f) => {
                self.upload_host(cs, f, self.ptrs.nv12_in, true)?;
                frame_bytes
            }
            FrameSource::Device(d) => {
                // SAFETY: the caller mapped a device frame of this geometry in this context
                // (rows of at least `w` bytes, checked); "nv12-in" holds w·h + w·ch bytes.
                unsafe {
                    copy_nv12(
                        cs,
                        d.rows(),
                        [arena_in, arena_in.offset(y_bytes)],
                        w,
                        h,
                        "device upload",
                    )?
                };
                0
            }
        };
        self.events[1].record(&s).map_err(driver("cuEventRecord"))?;

        let key = self.graph_key(params);
        let replayed = self.run_frame(&key)?;

        self.events[2].record(&s).map_err(driver("cuEventRecord"))?;
        let (target, download_bytes) = match output {
            FrameTarget::Host(f) => (
                [
                    Rows::Host {
                        ptr: f.y.as_mut_ptr(),
                        pitch: f.y_stride,
                    },
                    Rows::Host {
                        ptr: f.uv.as_mut_ptr(),
                        pitch: f.uv_stride,
                    },
                ],
                frame_bytes,
            ),
            FrameTarget::Device(d) => (d.rows(), 0),
        };
        // SAFETY: as for the upload, with "nv12-out" as the source; the output planes are
        // writable (checked, or mapped writable by the caller) and not read before the
        // synchronisation below.
        unsafe {
            copy_nv12(
                cs,
                [arena_out, arena_out.offset(y_bytes)],
                target,
                w,
                h,
                "download",
            )?
        };
        // SAFETY: "frame" holds a TfFrame; the staging block is not read before the
        // synchronisation below.
        unsafe {
            copy_d2h(
                cs,
                self.ptrs.frame,
                self.host.as_mut_ptr().add(HOST_FRAME),
                HOST_FRAME_END - HOST_FRAME,
            )
            .map_err(driver("frame block download"))?;
        }
        self.events[3].record(&s).map_err(driver("cuEventRecord"))?;
        s.synchronize().map_err(driver("cuStreamSynchronize"))?;
        self.reset_pending = false;

        let ev = &self.events;
        let input_copy = elapsed_us(&ev[0], &ev[1]);
        let gpu = elapsed_us(&ev[1], &ev[2]);
        let output_copy = elapsed_us(&ev[2], &ev[3]);
        // PCIe transfers are what the host side costs; device copies are reported apart.
        let (up, in_device) = if upload_bytes > 0 {
            (input_copy, 0.0)
        } else {
            (0.0, input_copy)
        };
        let (down, out_device) = if download_bytes > 0 {
            (output_copy, 0.0)
        } else {
            (0.0, output_copy)
        };
        let frame = GpuFrameStats {
            gpu_time_us: gpu,
            launches: self.launches_per_frame(params),
            graph_replayed: replayed,
            // process_frames measures the host time around this call
            host_time_us: 0.0,
            upload_time_us: up,
            download_time_us: down,
            upload_bytes,
            download_bytes,
            device_copy_time_us: in_device + out_device,
            ..GpuFrameStats::default()
        };
        self.count_frame(frame, 0);
        Ok(read_report(&self.host))
    }

    /// Queues the upload of a host frame into "nv12-in" (packed planes). Planes in
    /// page-locked memory (toonflow's pool, registered memory) are copied straight; pageable
    /// planes are staged in bands by the stager's threads, overlapping their copy with the DMA,
    /// or, with no staging threads, left to the driver's staging.
    ///
    /// `dst` holds the frame packed (the arena's "nv12-in", or the overlap path's landing
    /// slot); without `allow_staging` the driver stages pageable planes (the stager's buffer is
    /// reused on the next frame, which the overlap path does not wait for).
    fn upload_host(
        &mut self,
        cs: sys::CUstream,
        f: &Nv12Frame,
        dst: CUdeviceptr,
        allow_staging: bool,
    ) -> Result<(), CudaError> {
        let (w, h) = (self.shape.width as usize, self.shape.height as usize);
        let plane_rows = [h, h / 2];
        let planes = [
            HostPlane {
                ptr: f.y.as_ptr(),
                stride: f.y_stride,
                rows: plane_rows[0],
            },
            HostPlane {
                ptr: f.uv.as_ptr(),
                stride: f.uv_stride,
                rows: plane_rows[1],
            },
        ];
        let staged =
            planes.map(|p| allow_staging && self.staging_threads > 0 && !is_page_locked(p.ptr));
        if staged.contains(&true) {
            let (ctx, threads) = (self.ctx.clone(), self.staging_threads);
            let stager = match &mut self.stager {
                Some(s) if s.fits(w, &plane_rows) => s,
                slot => {
                    *slot = None; // the old page-locked buffer goes first
                    slot.insert(StagedUpload::new(ctx, threads, w, &plane_rows)?)
                }
            };
            // SAFETY: `Nv12Frame::new` checked that each plane holds its rows of `w` bytes
            // `stride` apart; "nv12-in" holds both planes packed (the staging layout); the
            // frame outlives the call, and the stream is synchronised at the end of every
            // frame, before the staging buffer is written again.
            unsafe { stager.upload(cs, &planes, &staged, dst) }.map_err(driver("staged upload"))?;
        }
        // Planes packed one after the other (GStreamer's default NV12 layout when the width is
        // a multiple of 4, as appsrc and videotestsrc give it): one copy instead of two, one
        // driver call less on the way to the kernels.
        let packed = planes[0].stride == w
            && planes[1].stride == w
            && planes[1].ptr == planes[0].ptr.wrapping_add(w * h);
        if staged == [false, false] && packed {
            // SAFETY: the Y plane's h rows of exactly `w` bytes end where the UV plane's rows
            // begin, so the frame is one readable range of w·(h + h/2) bytes (both planes were
            // checked by `Nv12Frame::new`); "nv12-in" holds it packed the same way.
            return unsafe { copy_h2d(cs, planes[0].ptr, dst, w * (h + h / 2)) }
                .map_err(driver("frame upload"));
        }
        let mut offset = 0;
        for ((plane, staged), name) in planes.iter().zip(staged).zip(["Y", "UV"]) {
            if !staged {
                // SAFETY: as above; page-locked planes make the copy asynchronous, pageable
                // ones are copied by the driver before it returns.
                unsafe {
                    copy_2d(
                        cs,
                        Rows::host_source(plane.ptr, plane.stride),
                        Rows::device(dst + offset as u64, w),
                        w,
                        plane.rows,
                    )
                }
                .map_err(driver(format!("{name} upload")))?;
            }
            offset += plane.rows * w;
        }
        Ok(())
    }

    /// Runs the kernels of a frame: eagerly, by capturing them, or by replaying a graph.
    /// Returns whether a graph ran.
    fn run_frame(&mut self, key: &GraphKey) -> Result<bool, CudaError> {
        let ran = self.run_kernels(key);
        if ran.is_err() {
            // A sequence cut short between unpack and the analysis leaves statistics behind,
            // which the next frame's would add to.
            let _ = clear_statistics(&self.stream, &self.ptrs);
        }
        ran
    }

    fn run_kernels(&mut self, key: &GraphKey) -> Result<bool, CudaError> {
        let (stream, kernels, ptrs) = (&self.stream, &self.kernels, &self.ptrs);
        let enqueue = || enqueue_frame(stream, kernels, ptrs, key);
        if !self.use_graph {
            enqueue()?;
            return Ok(false);
        }
        match self.cache.run(key, stream, enqueue)? {
            Ran::Eager => Ok(false),
            Ran::Replayed => Ok(true),
            Ran::Captured {
                capture_us,
                evicted,
            } => {
                self.log.push(PipelineEvent::GraphCaptured {
                    key: key.to_string(),
                    capture_us,
                    launches: key.launches(),
                });
                if let Some(old) = evicted {
                    self.log.push(PipelineEvent::GraphEvicted {
                        key: old.to_string(),
                    });
                }
                Ok(true)
            }
            Ran::CaptureFailed { reason } => {
                self.log.push(PipelineEvent::GraphCaptureFailed {
                    key: key.to_string(),
                    reason: reason.to_string(),
                });
                Ok(false)
            }
        }
    }
}

impl Drop for CudaPipeline {
    fn drop(&mut self) {
        // The overlap path's frames in flight still read and write the arena, the landing slot
        // and their host buffers.
        self.finish_in_flight();
    }
}
