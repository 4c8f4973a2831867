//! The `toonflow` element: a GstVideoFilter on NV12. GStreamer glue only: the engine
//! (engine.rs) chooses the backend and makes the picture, the properties are declared in
//! properties.rs and the statistics kept in stats.rs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::subclass::base_transform::{
    GenerateOutputSuccess, InputBuffer, PrepareOutputBufferSuccess,
};
use gst_base::subclass::prelude::*;
use gst_video::subclass::prelude::*;
use parking_lot::Mutex;

use super::cuda_memory::{self, CudaShare, MemoryKind, SharedContext};
use super::engine::{Engine, EngineEvent, FrameOutcome, Level, StreamFormat};
use super::properties;
use super::pusher::{Completion, Disposal, Pusher};
use super::settings::{BackendChoice, Settings};
use super::stats::Stats;
use super::{frames, hostmem, pool};
use crate::cuda::gstcuda::{self, GstCudaContext};
use crate::cuda::{self, hostreg::Verdict};
use crate::pipeline::FrameGeometry;

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        "toonflow",
        gst::DebugColorFlags::empty(),
        Some("toonflow cartoon filter"),
    )
});

/// Built in `start`, dropped in `stop`; `info` is set by `set_info`.
struct State {
    engine: Engine,
    info: Option<gst_video::VideoInfo>,
    /// Memory of the input and output frames (set by `set_info` from the caps features).
    memory: [MemoryKind; 2],
    /// The CUDA context shared with the pipeline, when the engine runs in it.
    shared: Option<SharedContext>,
    /// Queuing a frame failed this stream (e.g. no device memory for the landing slot): frames
    /// run one at a time until the next caps.
    overlap_failed: bool,
}

/// A frame on the overlap path between the streaming thread and the push thread.
struct Pending {
    outbuf: gst::Buffer,
    /// Held until the upload has read it (an upstream pool must not reuse it before).
    inbuf: gst::Buffer,
    done: Completion,
    /// When `generate_output` took the input: the frame's time in the stats runs to its
    /// completion, as the synchronous path's covers its whole processing.
    arrived: Instant,
}

/// How a frame went.
enum Ran {
    /// Made: the output buffer is complete.
    Done,
    /// Queued on the overlap path: complete once `Completion` says so.
    Queued(Completion),
}

/// Frames on the overlap path not yet pushed (the one whose upload runs is not counted): one
/// in the kernels, one waiting for the previous one's download.
const MAX_IN_FLIGHT: usize = 2;

/// `TOONFLOW_OVERLAP_EMULATE_US=N`: with the CPU backend, frames still go through the overlap
/// path's push thread, each complete N µs after it was made, as if a GPU still worked on it
/// (a test hook: the element's ordering, events, flushes and caps changes are tested on
/// machines without a GPU).
fn emulated_completion() -> Option<Duration> {
    std::env::var("TOONFLOW_OVERLAP_EMULATE_US")
        .ok()?
        .parse()
        .ok()
        .map(Duration::from_micros)
}

#[derive(Default)]
pub struct Toonflow {
    settings: Mutex<Settings>,
    state: Mutex<Option<State>>,
    stats: Mutex<Stats>,
    /// The pipeline's CUDA context (chosen at NULL→READY, dropped at READY→NULL).
    cuda: Mutex<CudaShare>,
    /// The overlap path's push thread (made in `start` when `overlap` is on and frames can be
    /// queued, joined in `stop`).
    pusher: Mutex<Option<Arc<Pusher<Pending>>>>,
    /// A late frame was skipped (QoS): the next frame pushed by the push thread is DISCONT, as
    /// base transform marks the ones it pushes.
    discont_pending: AtomicBool,
    /// With `TOONFLOW_OVERLAP_EMULATE_US`, read at start.
    emulate: Mutex<Option<Duration>>,
}

impl Toonflow {
    /// Logs what the engine reported and posts a warning when it fell back to the CPU.
    fn drain(&self, engine: &mut Engine) {
        for event in engine.take_events() {
            match event {
                EngineEvent::Log(Level::Debug, text) => gst::debug!(CAT, imp = self, "{text}"),
                EngineEvent::Log(Level::Info, text) => gst::info!(CAT, imp = self, "{text}"),
                EngineEvent::Log(Level::Warning, text) => gst::warning!(CAT, imp = self, "{text}"),
                EngineEvent::FellBack(reason) => {
                    gst::warning!(CAT, imp = self, "{reason}; falling back to the CPU backend");
                    gst::element_imp_warning!(
                        self,
                        gst::LibraryError::Init,
                        ("{}; using the CPU backend (slower than a GPU)", reason)
                    );
                    self.stats.lock().set_backend(engine.backend().name());
                }
            }
        }
    }

    fn log_pool(&self, result: Result<Option<String>, String>) {
        match result {
            Ok(Some(text)) => gst::debug!(CAT, imp = self, "{text}"),
            Ok(None) => {}
            Err(text) => gst::warning!(CAT, imp = self, "{text}"),
        }
    }

    /// The CUDA context host buffers are page-locked in (pinned pools, registrations): the
    /// shared one, else the device's primary context; `None` when the engine is not on CUDA.
    fn host_context(&self) -> Option<Arc<CudaContext>> {
        let state = self.state.lock();
        let state = state.as_ref()?;
        self.host_context_of(&state.engine, state.shared.as_ref())
    }

    fn host_context_of(
        &self,
        engine: &Engine,
        shared: Option<&SharedContext>,
    ) -> Option<Arc<CudaContext>> {
        let device_id = engine.cuda_device()?;
        match shared {
            Some(shared) => Some(shared.cuda.clone()),
            None => cuda::context::context(device_id as usize)
                .inspect_err(|e| gst::warning!(CAT, imp = self, "no CUDA context: {e}"))
                .ok(),
        }
    }

    /// Registers the system-memory sides' buffers with the driver when they are reused (see
    /// hostmem.rs), so their copies run at page-locked speed.
    fn prepare_host_memory(
        &self,
        buffers: [(&gst::BufferRef, MemoryKind); 2],
        frame_bytes: usize,
        ctx: &Arc<CudaContext>,
    ) {
        for (side, (buffer, kind)) in ["input", "output"].into_iter().zip(buffers) {
            if kind != MemoryKind::System {
                continue;
            }
            match hostmem::prepare(buffer, frame_bytes, ctx) {
                Verdict::NewlyRegistered => gst::debug!(
                    CAT,
                    imp = self,
                    "{side} buffer memory registered with the driver ({:?})",
                    cuda::hostreg::Registry::global().counts()
                ),
                Verdict::Fast => {}
                other => gst::log!(CAT, imp = self, "{side} buffer memory: {other:?}"),
            }
        }
    }

    /// Settings under which the CUDA pipeline or the network's device frame path may run (no
    /// CPU backend).
    fn wants_cuda(settings: &Settings) -> bool {
        !matches!(
            settings.backend,
            BackendChoice::Cpu | BackendChoice::CpuReference
        )
    }

    /// Whether `memory:CUDAMemory` caps are offered now: the GPU path may run and a context is
    /// shared (before NULL→READY: libgstcuda and the driver load at all).
    fn cuda_caps_offered(&self) -> bool {
        if !Self::wants_cuda(&self.settings.lock()) {
            return false;
        }
        if let Some(state) = self.state.lock().as_ref() {
            return state.shared.is_some() && state.engine.cuda_device().is_some();
        }
        let share = self.cuda.lock();
        if share.decided {
            share.shared.is_some()
        } else {
            cuda_memory::cuda_memory_possible()
        }
    }

    /// Takes a `gst.cuda.context` of our device from the pipeline, unless one is held already.
    fn adopt_context(&self, found: GstCudaContext) {
        match SharedContext::adopt(found) {
            Ok(shared) => {
                gst::info!(CAT, imp = self, "sharing the pipeline's {shared:?}");
                let mut share = self.cuda.lock();
                if share.shared.is_none() {
                    share.shared = Some(shared);
                }
            }
            Err(e) => gst::warning!(
                CAT,
                imp = self,
                "cannot use the pipeline's CUDA context: {e}"
            ),
        }
    }

    /// NULL→READY: finds the pipeline's CUDA context (neighbours, then the application through
    /// need-context) or wraps toonflow's own and announces it, so one context serves the whole
    /// pipeline. Without a usable GPU or libgstcuda nothing is shared and CUDA caps are not
    /// offered.
    fn ensure_cuda_context(&self) {
        let settings = self.settings.lock().clone();
        let device_id = settings.device_id;
        if !Self::wants_cuda(&settings) || self.cuda.lock().shared.is_some() {
            self.cuda.lock().decided = true;
            return;
        }
        if !cuda_memory::cuda_memory_possible() {
            gst::debug!(
                CAT,
                imp = self,
                "no libgstcuda or CUDA driver: system memory only"
            );
            self.cuda.lock().decided = true;
            return;
        }
        let element = self.obj().clone().upcast::<gst::Element>();
        if let Some(found) = cuda_memory::query_neighbours(&element, device_id) {
            self.adopt_context(found);
        }
        if self.cuda.lock().shared.is_none() {
            // A bin or the application may answer through set_context.
            let msg = gst::message::NeedContext::builder(gstcuda::CONTEXT_TYPE)
                .src(&element)
                .build();
            let _ = element.post_message(msg);
        }
        if self.cuda.lock().shared.is_none() {
            match SharedContext::own(device_id) {
                Ok(shared) => {
                    gst::info!(CAT, imp = self, "sharing toonflow's {shared:?}");
                    let context = shared.gst.to_context();
                    self.cuda.lock().shared = Some(shared);
                    let msg = gst::message::HaveContext::builder(context)
                        .src(&element)
                        .build();
                    let _ = element.post_message(msg);
                }
                Err(e) => gst::info!(CAT, imp = self, "no CUDA memory: {e}"),
            }
        }
        self.cuda.lock().decided = true;
    }

    /// The push thread of the overlap path: waits for each frame's completion, then pushes
    /// it on the source pad in order (or drops it while flushing).
    fn start_pusher(&self) -> Result<Pusher<Pending>, gst::ErrorMessage> {
        let srcpad = gst_base::prelude::BaseTransformExtManual::src_pad(&*self.obj()).clone();
        let weak = self.obj().downgrade();
        Pusher::new(
            "toonflow-push",
            MAX_IN_FLIGHT,
            move |p: Pending, disposal| {
                let waited = p.done.wait();
                drop(p.inbuf);
                if waited.is_ok()
                    && disposal == Disposal::Push
                    && let Some(element) = weak.upgrade()
                {
                    let us = p.arrived.elapsed().as_secs_f64() * 1e6;
                    element.imp().stats.lock().record_time(us);
                }
                if let Err(e) = waited {
                    if let Some(element) = weak.upgrade() {
                        gst::element_error!(
                            element,
                            gst::StreamError::Failed,
                            ("CUDA processing failed: {}", e)
                        );
                    }
                    return Err(gst::FlowError::Error);
                }
                match disposal {
                    Disposal::Discard => Ok(()),
                    Disposal::Push => srcpad.push(p.outbuf).map(|_| ()),
                }
            },
        )
        .map_err(|e| {
            gst::error_msg!(
                gst::CoreError::Thread,
                ("cannot start the push thread: {}", e)
            )
        })
    }

    fn pusher(&self) -> Option<Arc<Pusher<Pending>>> {
        self.pusher.lock().clone()
    }

    /// Waits until every frame on the overlap path is pushed (or dropped, when flushing), then
    /// counts them: before serialized events and queries, renegotiation and a frame that takes
    /// the synchronous path.
    fn finish_pending(&self) {
        let Some(pusher) = self.pusher() else {
            return;
        };
        let _ = pusher.drain();
        let (outcomes, geometry) = {
            let mut guard = self.state.lock();
            let Some(state) = guard.as_mut() else {
                return;
            };
            if state.engine.in_flight() == 0 {
                return;
            }
            let harvested = state.engine.harvest(true);
            let geometry = state.engine.format().map(|f| f.geometry);
            match (harvested, geometry) {
                (Ok(o), Some(g)) => (o, g),
                (Err(e), _) => {
                    gst::warning!(CAT, imp = self, "frames in flight: {e}");
                    return;
                }
                _ => return,
            }
        };
        self.record_all(&outcomes, geometry);
    }

    /// Counts frames of the overlap path whose completion was seen.
    fn record_all(&self, outcomes: &[FrameOutcome], geometry: FrameGeometry) {
        for outcome in outcomes {
            self.log_scene_cut(outcome);
            // (its time comes from the push thread)
            self.record(outcome, None, geometry);
        }
    }

    fn log_scene_cut(&self, outcome: &FrameOutcome) {
        if outcome.report.scene_cut {
            gst::debug!(
                CAT,
                imp = self,
                "scene cut (score {:.2}): temporal history dropped",
                outcome.report.scene_score
            );
        }
    }

    /// Counts a frame and posts `toonflow-stats` when one is due.
    fn record(&self, outcome: &FrameOutcome, elapsed_us: Option<f64>, geometry: FrameGeometry) {
        let interval = self.settings.lock().stats_interval;
        let message = {
            let mut stats = self.stats.lock();
            stats
                .record(outcome, elapsed_us, geometry, interval)
                .then(|| stats.snapshot())
        };
        if let Some(s) = message {
            let obj = self.obj();
            let _ = obj.post_message(gst::message::Element::builder(s).src(&*obj).build());
        }
    }
}

#[glib::object_subclass]
impl ObjectSubclass for Toonflow {
    const NAME: &'static str = "GstToonflow";
    type Type = super::Toonflow;
    type ParentType = gst_video::VideoFilter;
}

impl ObjectImpl for Toonflow {
    fn constructed(&self) {
        self.parent_constructed();
        // Late frames are skipped before they are processed, as video filters do: base
        // transform compares each buffer's running time with the sink's QoS events, drops
        // the late ones and posts the standard QoS message for each (its `qos` property can
        // turn this off).
        gst_base::prelude::BaseTransformExt::set_qos(&*self.obj(), true);
    }

    fn properties() -> &'static [glib::ParamSpec] {
        properties::specs()
    }

    fn set_property(&self, id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        properties::set(&mut self.settings.lock(), id, value);
        gst::debug!(CAT, imp = self, "{} set to {:?}", pspec.name(), value);
    }

    fn property(&self, id: usize, _pspec: &glib::ParamSpec) -> glib::Value {
        if properties::is_stats(id) {
            return self.stats.lock().snapshot().to_value();
        }
        properties::get(&self.settings.lock(), id)
    }
}

impl GstObjectImpl for Toonflow {}

impl ElementImpl for Toonflow {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static METADATA: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "Toonflow cartoon filter",
                "Filter/Effect/Video",
                "Turns NV12 video into a temporally stable cartoon (bilateral smoothing, DoG lines, soft \
                 quantization) on an NVIDIA GPU through CUDA, or on the CPU (a fast SIMD path; the exact reference on request). \
                 The CUDA kernels' PTX is cached on disk ($TOONFLOW_KERNEL_CACHE, else ~/.cache/toonflow/kernels; \
                 TOONFLOW_KERNEL_CACHE=off disables it)",
                "toonflow developers",
            )
        });
        Some(&*METADATA)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static PAD_TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            let size = gst::IntRange::with_step(
                FrameGeometry::MIN_SIZE as i32,
                FrameGeometry::MAX_SIZE as i32,
                2,
            );
            let structure = gst::Structure::builder("video/x-raw")
                .field("format", gst_video::VideoFormat::Nv12.to_str())
                .field("width", size)
                .field("height", size)
                .field(
                    "framerate",
                    gst::FractionRange::new(
                        gst::Fraction::new(0, 1),
                        gst::Fraction::new(i32::MAX, 1),
                    ),
                )
                .build();
            let caps = cuda_memory::template_caps(structure);
            [
                ("src", gst::PadDirection::Src),
                ("sink", gst::PadDirection::Sink),
            ]
            .into_iter()
            .map(|(name, direction)| {
                gst::PadTemplate::new(name, direction, gst::PadPresence::Always, &caps).unwrap()
            })
            .collect()
        });
        PAD_TEMPLATES.as_ref()
    }

    fn set_context(&self, context: &gst::Context) {
        if context.context_type() == gstcuda::CONTEXT_TYPE
            && self.cuda.lock().shared.is_none()
            && Self::wants_cuda(&self.settings.lock())
        {
            let device_id = self.settings.lock().device_id;
            let element = self.obj().clone().upcast::<gst::Element>();
            if let Some(found) = GstCudaContext::from_context(&element, context, device_id) {
                self.adopt_context(found);
            }
        }
        self.parent_set_context(context)
    }

    fn change_state(
        &self,
        transition: gst::StateChange,
    ) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        if transition == gst::StateChange::NullToReady {
            self.ensure_cuda_context();
        }
        let result = self.parent_change_state(transition);
        if transition == gst::StateChange::ReadyToNull {
            *self.cuda.lock() = CudaShare::default();
        }
        result
    }
}

impl BaseTransformImpl for Toonflow {
    const MODE: gst_base::subclass::BaseTransformMode =
        gst_base::subclass::BaseTransformMode::NeverInPlace;
    const PASSTHROUGH_ON_SAME_CAPS: bool = false;
    const TRANSFORM_IP_ON_PASSTHROUGH: bool = false;

    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let settings = self.settings.lock().clone();
        let shared = self
            .cuda
            .lock()
            .shared
            .clone()
            .filter(|_| Self::wants_cuda(&settings));
        let mut engine = Engine::start_in(&settings, shared.as_ref().map(|s| s.cuda.clone()))
            .map_err(|e| e.message())?;
        let mut stats = Stats::new(engine.backend().name());
        stats.set_model(engine.model_name().unwrap_or(""));
        *self.stats.lock() = stats;
        self.drain(&mut engine);
        let emulate = emulated_completion().filter(|_| engine.cuda_device().is_none());
        let pusher = if settings.overlap && (engine.cuda_device().is_some() || emulate.is_some()) {
            gst::debug!(
                CAT,
                imp = self,
                "overlap on: frames are pushed from a second thread"
            );
            Some(Arc::new(self.start_pusher()?))
        } else {
            None
        };
        *self.emulate.lock() = emulate;
        self.discont_pending.store(false, Ordering::Relaxed);
        *self.state.lock() = Some(State {
            engine,
            info: None,
            memory: [MemoryKind::System; 2],
            shared,
            overlap_failed: false,
        });
        *self.pusher.lock() = pusher;
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        // The push thread finishes (drops) what is in flight and is joined before the engine
        // and its device memory go.
        let pusher = self.pusher.lock().take();
        drop(pusher);
        *self.state.lock() = None;
        Ok(())
    }

    fn query(&self, direction: gst::PadDirection, query: &mut gst::QueryRef) -> bool {
        // A serialized query (allocation, drain) comes after the frames before it.
        if direction == gst::PadDirection::Sink && query.is_serialized() {
            self.finish_pending();
        }
        if let gst::QueryViewMut::Context(q) = query.view_mut()
            && q.context_type() == gstcuda::CONTEXT_TYPE
        {
            let shared = self.cuda.lock().shared.clone();
            let element = self.obj().clone().upcast::<gst::Element>();
            if let Some(shared) = shared
                && shared.gst.answer_query(&element, query)
            {
                return true;
            }
        }
        BaseTransformImplExt::parent_query(self, direction, query)
    }

    fn transform_caps(
        &self,
        _direction: gst::PadDirection,
        caps: &gst::Caps,
        filter: Option<&gst::Caps>,
    ) -> Option<gst::Caps> {
        Some(cuda_memory::transform_caps(
            caps,
            filter,
            self.cuda_caps_offered(),
        ))
    }

    fn fixate_caps(
        &self,
        direction: gst::PadDirection,
        caps: &gst::Caps,
        othercaps: gst::Caps,
    ) -> gst::Caps {
        // Our memory preference, not the peer's caps order, picks the other pad's memory.
        let kinds =
            cuda_memory::offered_kinds(&[MemoryKind::of_caps(caps)], self.cuda_caps_offered());
        let othercaps = cuda_memory::prefer(&othercaps, kinds[0]);
        self.parent_fixate_caps(direction, caps, othercaps)
    }

    fn propose_allocation(
        &self,
        decide_query: Option<&gst::query::Allocation>,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        self.parent_propose_allocation(decide_query, query)?;
        query.add_allocation_meta::<gst_video::VideoMeta>(None);
        let Some(ctx) = self.host_context() else {
            return Ok(());
        };
        let shared = self.state.lock().as_ref().and_then(|s| s.shared.clone());
        if let (Some(caps), Some(shared)) = (query.get_owned().0, &shared)
            && MemoryKind::of_caps(&caps) == MemoryKind::Cuda
        {
            match cuda_memory::cuda_pool(&shared.gst, &caps, 2, 0) {
                Ok((pool, size)) => query.add_allocation_pool(Some(&pool), size, 2, 0),
                Err(e) => gst::warning!(CAT, imp = self, "no CUDA pool for upstream: {e}"),
            }
            return Ok(());
        }
        self.log_pool(pool::offer_upstream(query, ctx));
        Ok(())
    }

    fn decide_allocation(
        &self,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        // Renegotiation: frames in flight write into buffers of the old pool.
        self.finish_pending();
        let shared = self.state.lock().as_ref().and_then(|s| s.shared.clone());
        let caps = query.get_owned().0;
        if let (Some(caps), Some(shared)) = (&caps, &shared)
            && MemoryKind::of_caps(caps) == MemoryKind::Cuda
        {
            let min = query.allocation_pools().next().map_or(2, |p| p.2.max(2));
            let (pool, size) = cuda_memory::cuda_pool(&shared.gst, caps, min, 0)
                .map_err(|e| gst::loggable_error!(CAT, "no CUDA output pool: {e}"))?;
            if query.allocation_pools().len() == 0 {
                query.add_allocation_pool(Some(&pool), size, min, 0);
            } else {
                query.set_nth_allocation_pool(0, Some(&pool), size, min, 0);
            }
            gst::debug!(
                CAT,
                imp = self,
                "output buffers from a CUDA pool ({size} bytes)"
            );
        } else if let Some(ctx) = self.host_context() {
            self.log_pool(pool::use_for_output(query, ctx));
        }
        self.parent_decide_allocation(query)
    }

    fn sink_event(&self, event: gst::Event) -> bool {
        if let Some(pusher) = self.pusher() {
            match event.view() {
                // Frames in flight are dropped, not pushed; a streaming thread waiting for
                // room returns FLUSHING.
                gst::EventView::FlushStart(_) => pusher.set_flushing(),
                gst::EventView::FlushStop(_) => {
                    pusher.flush_stop();
                    self.finish_pending();
                }
                // EOS, caps, segment, gap...: after the frames before them.
                _ if event.is_serialized() => self.finish_pending(),
                _ => {}
            }
        }
        // A flush, a new stream or a new segment (a seek, a source that restarted) breaks the
        // sequence of frames the temporal history was built from.
        let reason = match event.view() {
            gst::EventView::FlushStop(_) => Some("flush"),
            gst::EventView::StreamStart(_) => Some("stream start"),
            gst::EventView::Segment(_) => Some("new segment"),
            _ => None,
        };
        if let Some(reason) = reason
            && let Some(state) = self.state.lock().as_mut()
        {
            gst::debug!(CAT, imp = self, "{reason}: temporal history dropped");
            state.engine.reset();
        }
        self.parent_sink_event(event)
    }

    fn submit_input_buffer(
        &self,
        is_discont: bool,
        inbuf: gst::Buffer,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        let result = self.parent_submit_input_buffer(is_discont, inbuf);
        // The parent answers DROPPED only for a buffer it skipped as late (QoS).
        if result == Ok(gst_base::BASE_TRANSFORM_FLOW_DROPPED) {
            self.stats.lock().record_dropped();
            self.discont_pending.store(true, Ordering::Relaxed);
        }
        result
    }

    /// With overlap, frames are queued and pushed by the push thread: the output buffer is
    /// prepared as base transform prepares it (pool, timestamps, flags, metas), the frame's
    /// GPU work is queued and nothing is returned here. Frames that cannot be queued (CUDA
    /// memory, the network, a CPU fallback) take base transform's path after those in flight.
    fn generate_output(&self) -> Result<GenerateOutputSuccess, gst::FlowError> {
        let Some(pusher) = self.pusher() else {
            return self.parent_generate_output();
        };
        let Some(inbuf) = self.take_queued_buffer() else {
            return Ok(GenerateOutputSuccess::NoOutput);
        };
        let arrived = Instant::now();
        // An earlier frame's push failed (NOT_LINKED, EOS, FLUSHING...): this frame returns it.
        pusher.wait_room()?;
        let mut outbuf = match self.parent_prepare_output_buffer(InputBuffer::Readable(&inbuf))? {
            PrepareOutputBufferSuccess::Buffer(b) => b,
            PrepareOutputBufferSuccess::InputBuffer => {
                gst::error!(CAT, imp = self, "no output buffer (in place)");
                return Err(gst::FlowError::Error);
            }
        };
        if self.discont_pending.swap(false, Ordering::Relaxed) {
            outbuf.make_mut().set_flags(gst::BufferFlags::DISCONT);
        }
        match self.process(&inbuf, outbuf.make_mut(), Some(&pusher))? {
            Ran::Queued(done) => {
                pusher.push(Pending {
                    outbuf,
                    inbuf,
                    done,
                    arrived,
                });
                Ok(GenerateOutputSuccess::NoOutput)
            }
            Ran::Done => Ok(GenerateOutputSuccess::Buffer(outbuf)),
        }
    }

    fn transform(
        &self,
        inbuf: &gst::Buffer,
        outbuf: &mut gst::BufferRef,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        match self.process(inbuf, outbuf, None)? {
            Ran::Done => Ok(gst::FlowSuccess::Ok),
            Ran::Queued(_) => unreachable!("frames are queued only with a push thread"),
        }
    }
}

impl Toonflow {
    /// Makes one frame: queued on the overlap path when `pusher` is given and the frame can go
    /// there, else synchronously (after the frames in flight).
    fn process(
        &self,
        inbuf: &gst::Buffer,
        outbuf: &mut gst::BufferRef,
        pusher: Option<&Pusher<Pending>>,
    ) -> Result<Ran, gst::FlowError> {
        let settings = self.settings.lock().clone();
        let mut guard = self.state.lock();
        let Some((engine, info, memory, state_shared)) = guard
            .as_mut()
            .and_then(|s| Some((&mut s.engine, s.info.clone()?, s.memory, s.shared.clone())))
        else {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Buffer received before caps")
            );
            return Err(gst::FlowError::NotNegotiated);
        };
        let updated = engine.update(&settings);
        self.drain(engine);
        if let Err(e) = updated {
            self.post_error_message(e.message());
            return Err(gst::FlowError::Error);
        }
        if inbuf.flags().contains(gst::BufferFlags::DISCONT) {
            gst::debug!(CAT, imp = self, "discont: temporal history dropped");
            engine.reset();
        }

        let geometry = engine
            .format()
            .ok_or(gst::FlowError::NotNegotiated)?
            .geometry;
        if let Some(ctx) = self.host_context_of(engine, state_shared.as_ref()) {
            self.prepare_host_memory(
                [(inbuf.as_ref(), memory[0]), (&*outbuf, memory[1])],
                info.size(),
                &ctx,
            );
        }
        let host_frames = memory == [MemoryKind::System; 2];
        let overlap_failed = guard.as_ref().is_some_and(|s| s.overlap_failed);
        let Some(state) = guard.as_mut() else {
            return Err(gst::FlowError::Flushing);
        };
        let engine = &mut state.engine;
        if pusher.is_some() && host_frames && !overlap_failed && engine.can_submit() {
            let queued = frames::with_nv12(inbuf, outbuf, &info, geometry, |input, output| {
                let started = Instant::now();
                // SAFETY: the planes are system memory of `inbuf` and `outbuf`, which the
                // caller hands to the push thread with the completion; it holds both until the
                // completion fires, and nothing reads `outbuf` or writes `inbuf` before.
                let result = unsafe { engine.submit(input, output) };
                (result, started.elapsed().as_secs_f64() * 1e6)
            })
            .map_err(|e| {
                self.post_error_message(e);
                gst::FlowError::Error
            })?;
            self.drain(engine);
            match queued {
                (Ok(q), _) => {
                    drop(guard);
                    self.record_all(&q.finished, geometry);
                    return Ok(Ran::Queued(Completion::Cuda(q.done)));
                }
                (Err(e), _) => {
                    gst::warning!(
                        CAT,
                        imp = self,
                        "overlap off for this stream, frames run one at a time: {e}"
                    );
                    state.overlap_failed = true;
                }
            }
        }
        // The CPU emulation of the overlap path (tests): made here, queued like a GPU frame.
        let emulate = (*self.emulate.lock()).filter(|_| pusher.is_some() && host_frames);
        // The synchronous path: after the frames in flight.
        let pending = emulate.is_none()
            && (pusher.is_some_and(|p| p.in_flight() > 0) || engine.in_flight() > 0);
        if pending {
            drop(guard);
            self.finish_pending();
            guard = self.state.lock();
        }
        let Some(state) = guard.as_mut() else {
            return Err(gst::FlowError::Flushing);
        };
        let engine = &mut state.engine;
        let mapped = match (&state_shared, engine.runs_on_gpu()) {
            // Frames in GstCudaMemory of the shared context go to the GPU without a PCIe copy.
            (Some(shared), true) if memory != [MemoryKind::System; 2] => {
                cuda_memory::with_frames(inbuf, outbuf, &info, geometry, shared, memory, |i, o| {
                    let started = Instant::now();
                    let result = engine.process_frames(i, o);
                    (result, started.elapsed().as_secs_f64() * 1e6)
                })
            }
            _ => frames::with_nv12(inbuf, outbuf, &info, geometry, |input, output| {
                let started = Instant::now();
                let result = engine.process(input, output);
                (result, started.elapsed().as_secs_f64() * 1e6)
            }),
        };
        let (result, elapsed_us) = mapped.map_err(|e| {
            self.post_error_message(e);
            gst::FlowError::Error
        })?;
        self.drain(engine);
        drop(guard);
        let outcome = result.map_err(|e| {
            self.post_error_message(e.message());
            gst::FlowError::Error
        })?;
        self.log_scene_cut(&outcome);
        // An emulated overlap frame's time comes from the push thread, as a CUDA one's does.
        self.record(&outcome, emulate.is_none().then_some(elapsed_us), geometry);
        if let Some(delay) = emulate {
            return Ok(Ran::Queued(Completion::At(Instant::now() + delay)));
        }
        Ok(Ran::Done)
    }
}

impl VideoFilterImpl for Toonflow {
    fn set_info(
        &self,
        incaps: &gst::Caps,
        in_info: &gst_video::VideoInfo,
        outcaps: &gst::Caps,
        _out_info: &gst_video::VideoInfo,
    ) -> Result<(), gst::LoggableError> {
        let format = StreamFormat::from_info(in_info)
            .map_err(|e| gst::loggable_error!(CAT, "Unsupported caps {incaps}: {e}"))?;
        // Frames in flight were made for the old caps.
        self.finish_pending();
        let settings = self.settings.lock().clone();
        let mut guard = self.state.lock();
        let state = guard
            .as_mut()
            .ok_or_else(|| gst::loggable_error!(CAT, "caps {incaps} before start"))?;
        // Until the engine is configured for the new caps, frames are refused.
        state.info = None;
        state.overlap_failed = false;
        state.memory = [MemoryKind::of_caps(incaps), MemoryKind::of_caps(outcaps)];
        gst::debug!(
            CAT,
            imp = self,
            "input in {} memory, output in {} memory",
            state.memory[0].name(),
            state.memory[1].name()
        );
        let configured = state.engine.configure(format, &settings);
        self.drain(&mut state.engine);
        configured.map_err(|e| {
            self.post_error_message(e.message());
            gst::loggable_error!(CAT, "Cannot set up for {incaps}: {e}")
        })?;
        state.info = Some(in_info.clone());
        Ok(())
    }
}
