//! The `toonflow` element: a GstVideoFilter on NV12 that hands each frame to the CPU reference
//! or the CUDA backend. Glue only: the picture is made in `crate::pipeline` and `crate::cuda`.

use std::sync::LazyLock;
use std::time::Instant;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::subclass::prelude::*;
use gst_video::prelude::*;
use gst_video::subclass::prelude::*;
use parking_lot::Mutex;

use super::pool::PinnedPool;
use super::settings::{BackendChoice, PrecisionChoice, Settings};
use crate::cuda::{self, CudaError, CudaPipeline, GpuFrameStats, PipelineEvent};
use crate::pipeline::cpu::{CpuPipeline, FrameReport};
use crate::pipeline::params::{MAX_HISTORY, MAX_ITERATIONS};
use crate::pipeline::stats::TimeWindow;
use crate::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, Shape, StageParams, ToonParams};

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        "toonflow",
        gst::DebugColorFlags::empty(),
        Some("toonflow cartoon filter"),
    )
});

/// Frames kept for the latency percentiles.
const TIME_WINDOW: usize = 1024;

/// The backend chosen in `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Active {
    Cpu,
    Cuda { device_id: u32 },
}

impl Active {
    fn name(self) -> &'static str {
        match self {
            Active::Cpu => "cpu",
            Active::Cuda { .. } => "cuda",
        }
    }
}

enum Engine {
    Cpu(Box<CpuPipeline>),
    Cuda(Box<CudaPipeline>),
}

impl Engine {
    fn reset(&mut self) {
        match self {
            Engine::Cpu(p) => p.reset(),
            Engine::Cuda(p) => p.reset(),
        }
    }
}

/// Per-stream state, built in `set_info` and dropped in `stop`.
struct State {
    info: gst_video::VideoInfo,
    geometry: FrameGeometry,
    shape: Shape,
    engine: Engine,
    stage: StageParams,
    params: ToonParams,
}

/// Counters behind the `stats` property and the `toonflow-stats` message.
struct Stats {
    backend: &'static str,
    frames: u64,
    scene_cuts: u64,
    last_scene_score: f32,
    history_used: usize,
    width: u32,
    height: u32,
    times: TimeWindow,
    gpu: GpuFrameStats,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            backend: "none",
            frames: 0,
            scene_cuts: 0,
            last_scene_score: 0.0,
            history_used: 0,
            width: 0,
            height: 0,
            times: TimeWindow::new(TIME_WINDOW),
            gpu: GpuFrameStats::default(),
        }
    }
}

impl Stats {
    fn snapshot(&mut self) -> gst::Structure {
        let [p50, p99] = self.times.percentiles([50.0, 99.0]);
        gst::Structure::builder("toonflow-stats")
            .field("backend", self.backend)
            .field("frames", self.frames)
            .field("scene-cuts", self.scene_cuts)
            .field("last-scene-score", self.last_scene_score as f64)
            .field("history-used", self.history_used as u32)
            .field("width", self.width)
            .field("height", self.height)
            .field("mean-us", self.times.mean())
            .field("p50-us", p50)
            .field("p99-us", p99)
            .field("gpu-time-us", self.gpu.gpu_time_us)
            .field("transfer-time-us", self.gpu.transfer_time_us)
            .field("upload-time-us", self.gpu.upload_time_us)
            .field("download-time-us", self.gpu.download_time_us)
            .field("launches", self.gpu.launches)
            .field("graph-replayed", self.gpu.graph_replayed)
            .field("arena-bytes", self.gpu.arena_bytes)
            .field("peak-live-bytes", self.gpu.peak_live_bytes)
            .field("device-free-bytes", self.gpu.device_free_bytes)
            .build()
    }
}

#[derive(Default)]
pub struct Toonflow {
    settings: Mutex<Settings>,
    active: Mutex<Option<Active>>,
    state: Mutex<Option<State>>,
    stats: Mutex<Stats>,
}

fn shape_of(settings: &Settings, geometry: FrameGeometry) -> Shape {
    Shape {
        width: geometry.width as u32,
        height: geometry.height as u32,
        bilateral_iterations: settings.stage.bilateral_iterations,
        temporal_history: settings.stage.temporal_history,
        precision: settings.precision.into(),
        auto_levels: settings.stage.auto_levels,
    }
}

impl Toonflow {
    /// Builds the per-stream engine for `shape`. With backend=auto a CUDA failure other than
    /// an exceeded memory cap falls back to the CPU reference with a warning.
    fn build_engine(
        &self,
        settings: &Settings,
        geometry: FrameGeometry,
        shape: Shape,
    ) -> Result<Engine, gst::ErrorMessage> {
        let active = self.active.lock().unwrap_or(Active::Cpu);
        match active {
            Active::Cpu => Ok(Engine::Cpu(Box::new(CpuPipeline::new(
                geometry,
                shape.temporal_history as usize,
            )))),
            Active::Cuda { device_id } => {
                match CudaPipeline::new(
                    device_id as usize,
                    geometry,
                    shape,
                    settings.max_device_memory,
                    settings.cuda_graph,
                ) {
                    Ok(mut p) => {
                        gst::info!(CAT, imp = self, "CUDA pipeline ready for {:?}", shape);
                        self.log_cuda_events(&mut p);
                        Ok(Engine::Cuda(Box::new(p)))
                    }
                    Err(err @ CudaError::OutOfMemory(_)) => Err(gst::error_msg!(
                        gst::ResourceError::NoSpaceLeft,
                        (
                            "Cannot process {}x{}: {}",
                            geometry.width,
                            geometry.height,
                            err
                        )
                    )),
                    Err(err) if settings.backend == BackendChoice::Auto => {
                        self.fall_back_to_cpu(&err);
                        Ok(Engine::Cpu(Box::new(CpuPipeline::new(
                            geometry,
                            shape.temporal_history as usize,
                        ))))
                    }
                    Err(err) => Err(gst::error_msg!(
                        gst::LibraryError::Init,
                        ("CUDA backend failed: {}", err)
                    )),
                }
            }
        }
    }

    fn fall_back_to_cpu(&self, err: &CudaError) {
        gst::warning!(
            CAT,
            imp = self,
            "{err}; falling back to the CPU reference backend"
        );
        gst::element_imp_warning!(
            self,
            gst::LibraryError::Init,
            ("{}; using the CPU reference backend (much slower)", err)
        );
        *self.active.lock() = Some(Active::Cpu);
        self.stats.lock().backend = Active::Cpu.name();
    }

    fn process(
        &self,
        state: &mut State,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<(FrameReport, Option<GpuFrameStats>), gst::FlowError> {
        match &mut state.engine {
            Engine::Cpu(p) => Ok((p.process(&state.params, input, output), None)),
            Engine::Cuda(p) => match p.process(&state.params, input, output) {
                Ok(report) => {
                    self.log_cuda_events(p);
                    Ok((report, Some(p.last_frame_stats())))
                }
                Err(err) => {
                    if self.settings.lock().backend == BackendChoice::Auto {
                        self.fall_back_to_cpu(&err);
                        let mut cpu =
                            CpuPipeline::new(state.geometry, state.shape.temporal_history as usize);
                        let report = cpu.process(&state.params, input, output);
                        state.engine = Engine::Cpu(Box::new(cpu));
                        Ok((report, None))
                    } else {
                        gst::element_imp_error!(
                            self,
                            gst::StreamError::Failed,
                            ("CUDA processing failed: {}", err)
                        );
                        Err(gst::FlowError::Error)
                    }
                }
            },
        }
    }

    /// Logs what the CUDA pipeline reported: plans, kernel builds, captures and their cost.
    fn log_cuda_events(&self, pipeline: &mut CudaPipeline) {
        for event in pipeline.take_events() {
            match event {
                PipelineEvent::Plan {
                    text,
                    arena_allocated,
                } => {
                    gst::info!(
                        CAT,
                        imp = self,
                        "memory plan (arena allocated: {arena_allocated}):\n{text}"
                    )
                }
                PipelineEvent::KernelsReady {
                    arch,
                    precision,
                    compile_ms,
                } => {
                    gst::info!(
                        CAT,
                        imp = self,
                        "kernels for {arch} {precision} ready (NVRTC {compile_ms:.1} ms)"
                    )
                }
                PipelineEvent::GraphCaptured {
                    key,
                    capture_us,
                    launches,
                } => {
                    gst::info!(
                        CAT,
                        imp = self,
                        "captured CUDA graph for {key}: {launches} launches, {capture_us:.0} µs"
                    )
                }
                PipelineEvent::GraphCaptureFailed { key, reason } => {
                    gst::warning!(
                        CAT,
                        imp = self,
                        "graph capture failed for {key}, running eagerly: {reason}"
                    )
                }
                PipelineEvent::GraphEvicted { key } => {
                    gst::debug!(CAT, imp = self, "graph evicted: {key}")
                }
            }
        }
    }

    fn record(
        &self,
        report: &FrameReport,
        gpu: Option<GpuFrameStats>,
        elapsed_us: f64,
        geometry: FrameGeometry,
    ) {
        let interval = self.settings.lock().stats_interval as u64;
        let message = {
            let mut stats = self.stats.lock();
            stats.frames += 1;
            stats.scene_cuts += report.scene_cut as u64;
            stats.last_scene_score = report.scene_score;
            stats.history_used = report.history_used;
            stats.width = geometry.width as u32;
            stats.height = geometry.height as u32;
            stats.times.push(elapsed_us);
            if let Some(gpu) = gpu {
                stats.gpu = gpu;
            }
            (interval > 0 && stats.frames.is_multiple_of(interval)).then(|| stats.snapshot())
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

macro_rules! float_prop {
    ($name:expr, $nick:expr, $blurb:expr, $min:expr, $max:expr, $default:expr) => {
        glib::ParamSpecFloat::builder($name)
            .nick($nick)
            .blurb($blurb)
            .minimum($min)
            .maximum($max)
            .default_value($default)
            .mutable_playing()
            .build()
    };
}

macro_rules! uint_prop {
    ($name:expr, $nick:expr, $blurb:expr, $min:expr, $max:expr, $default:expr) => {
        glib::ParamSpecUInt::builder($name)
            .nick($nick)
            .blurb($blurb)
            .minimum($min)
            .maximum($max)
            .default_value($default)
            .mutable_playing()
            .build()
    };
}

impl ObjectImpl for Toonflow {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            let d = StageParams::default();
            vec![
                glib::ParamSpecEnum::builder_with_default("backend", BackendChoice::Auto)
                    .nick("Backend")
                    .blurb("Where frames are processed; read at start (READY->PAUSED)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("device-id")
                    .nick("CUDA device")
                    .blurb("Index of the CUDA device to use; read at start")
                    .maximum(63)
                    .default_value(super::settings::DEFAULT_DEVICE_ID)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("precision", PrecisionChoice::Fp16)
                    .nick("Precision")
                    .blurb("Storage precision of the GPU's working planes and temporal history (math is fp32; the CPU backend always uses fp32)")
                    .mutable_playing()
                    .build(),
                uint_prop!("bilateral-iterations", "Bilateral iterations", "Passes of the edge-preserving smoothing (0 disables it)", 0, MAX_ITERATIONS, d.bilateral_iterations),
                uint_prop!("edge-iterations", "Edge iterations", "Smoothing pass whose luma feeds the edge detector (0 = unsmoothed; capped at bilateral-iterations)", 0, MAX_ITERATIONS, d.edge_iterations),
                float_prop!("spatial-sigma", "Spatial sigma", "Spatial extent of the bilateral filter in luma pixels (radius = ceil(2 sigma))", 0.5, 12.0, d.spatial_sigma),
                float_prop!("range-sigma", "Range sigma", "Tonal extent of the bilateral filter in L units (0-100): smaller keeps more detail", 0.1, 100.0, d.range_sigma),
                float_prop!("edge-sigma", "Edge sigma", "Scale of the difference-of-Gaussians edge detector in pixels: larger draws thicker, fewer lines", 0.3, 7.0, d.edge_sigma),
                float_prop!("edge-tau", "Edge tau", "Weight of the wider Gaussian in the DoG: closer to 1 draws fewer lines", 0.5, 1.0, d.edge_tau),
                float_prop!("edge-sharpness", "Edge sharpness", "Steepness (phi_e) of the line ramp: larger gives crisper, darker lines", 0.1, 100.0, d.edge_sharpness),
                float_prop!("edge-strength", "Edge strength", "How dark lines are drawn: 0 = no lines, 1 = full black", 0.0, 1.0, d.edge_strength),
                uint_prop!("levels", "Levels", "Number of luminance bands of the quantizer", 2, 64, d.levels),
                float_prop!("level-sharpness", "Level sharpness", "Steepness (phi_q) of the step between bands: 0 = no quantization, larger = harder bands", 0.0, 100.0, d.level_sharpness),
                float_prop!("saturation", "Saturation", "Chroma gain of the output (1 = unchanged, 0 = grey)", 0.0, 4.0, d.saturation),
                glib::ParamSpecBoolean::builder("auto-levels")
                    .nick("Auto levels")
                    .blurb("Stretch each frame's luminance between its 0.5% and 99.5% points before quantizing")
                    .default_value(d.auto_levels)
                    .mutable_playing()
                    .build(),
                uint_prop!("temporal-history", "Temporal history", "Frames of smoothed features kept to steady the picture over time (0 disables the temporal filter)", 0, MAX_HISTORY, d.temporal_history),
                float_prop!("temporal-strength", "Temporal strength", "Weight decay per frame of age in the temporal filter (0 = current frame only)", 0.0, 1.0, d.temporal_strength),
                float_prop!("motion-sigma", "Motion sigma", "Motion guard of the temporal filter in L units: pixels that changed by more fall back to the current frame", 0.1, 100.0, d.motion_sigma),
                float_prop!("scene-cut-threshold", "Scene-cut threshold", "Mean thumbnail change (L units) above which a frame starts a new scene and the temporal history is dropped", 0.0, 100.0, d.scene_cut_threshold),
                glib::ParamSpecBoolean::builder("cuda-graph")
                    .nick("CUDA graph")
                    .blurb("Replay each frame's kernels as a captured CUDA graph (false = launch them one by one)")
                    .default_value(super::settings::DEFAULT_CUDA_GRAPH)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt64::builder("max-device-memory")
                    .nick("Max device memory")
                    .blurb("Largest device arena in bytes this element may allocate (0 = no limit); a larger plan fails negotiation with an error")
                    .default_value(super::settings::DEFAULT_MAX_DEVICE_MEMORY)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("stats-interval")
                    .nick("Stats interval")
                    .blurb("Post a toonflow-stats element message every this many frames (0 = never)")
                    .default_value(super::settings::DEFAULT_STATS_INTERVAL)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecBoxed::builder::<gst::Structure>("stats")
                    .nick("Statistics")
                    .blurb("Running statistics: backend, frames, scene-cuts, mean-us/p50-us/p99-us per frame, and on CUDA gpu-time-us, transfer-time-us, launches, graph-replayed, arena-bytes, peak-live-bytes, device-free-bytes")
                    .read_only()
                    .build(),
            ]
        });
        PROPERTIES.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let mut s = self.settings.lock();
        let st = &mut s.stage;
        match pspec.name() {
            "backend" => s.backend = value.get().expect("type checked upstream"),
            "device-id" => s.device_id = value.get().expect("type checked upstream"),
            "precision" => s.precision = value.get().expect("type checked upstream"),
            "bilateral-iterations" => {
                st.bilateral_iterations = value.get().expect("type checked upstream")
            }
            "edge-iterations" => st.edge_iterations = value.get().expect("type checked upstream"),
            "spatial-sigma" => st.spatial_sigma = value.get().expect("type checked upstream"),
            "range-sigma" => st.range_sigma = value.get().expect("type checked upstream"),
            "edge-sigma" => st.edge_sigma = value.get().expect("type checked upstream"),
            "edge-tau" => st.edge_tau = value.get().expect("type checked upstream"),
            "edge-sharpness" => st.edge_sharpness = value.get().expect("type checked upstream"),
            "edge-strength" => st.edge_strength = value.get().expect("type checked upstream"),
            "levels" => st.levels = value.get().expect("type checked upstream"),
            "level-sharpness" => st.level_sharpness = value.get().expect("type checked upstream"),
            "saturation" => st.saturation = value.get().expect("type checked upstream"),
            "auto-levels" => st.auto_levels = value.get().expect("type checked upstream"),
            "temporal-history" => st.temporal_history = value.get().expect("type checked upstream"),
            "temporal-strength" => {
                st.temporal_strength = value.get().expect("type checked upstream")
            }
            "motion-sigma" => st.motion_sigma = value.get().expect("type checked upstream"),
            "scene-cut-threshold" => {
                st.scene_cut_threshold = value.get().expect("type checked upstream")
            }
            "cuda-graph" => s.cuda_graph = value.get().expect("type checked upstream"),
            "max-device-memory" => {
                s.max_device_memory = value.get().expect("type checked upstream")
            }
            "stats-interval" => s.stats_interval = value.get().expect("type checked upstream"),
            other => unreachable!("unknown property {other}"),
        }
        gst::debug!(CAT, imp = self, "{} set to {:?}", pspec.name(), value);
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        if pspec.name() == "stats" {
            return self.stats.lock().snapshot().to_value();
        }
        let s = self.settings.lock();
        let st = &s.stage;
        match pspec.name() {
            "backend" => s.backend.to_value(),
            "device-id" => s.device_id.to_value(),
            "precision" => s.precision.to_value(),
            "bilateral-iterations" => st.bilateral_iterations.to_value(),
            "edge-iterations" => st.edge_iterations.to_value(),
            "spatial-sigma" => st.spatial_sigma.to_value(),
            "range-sigma" => st.range_sigma.to_value(),
            "edge-sigma" => st.edge_sigma.to_value(),
            "edge-tau" => st.edge_tau.to_value(),
            "edge-sharpness" => st.edge_sharpness.to_value(),
            "edge-strength" => st.edge_strength.to_value(),
            "levels" => st.levels.to_value(),
            "level-sharpness" => st.level_sharpness.to_value(),
            "saturation" => st.saturation.to_value(),
            "auto-levels" => st.auto_levels.to_value(),
            "temporal-history" => st.temporal_history.to_value(),
            "temporal-strength" => st.temporal_strength.to_value(),
            "motion-sigma" => st.motion_sigma.to_value(),
            "scene-cut-threshold" => st.scene_cut_threshold.to_value(),
            "cuda-graph" => s.cuda_graph.to_value(),
            "max-device-memory" => s.max_device_memory.to_value(),
            "stats-interval" => s.stats_interval.to_value(),
            other => unreachable!("unknown property {other}"),
        }
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
                 quantization) on an NVIDIA GPU through CUDA, or on the CPU reference backend",
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
            let caps = gst::Caps::builder("video/x-raw")
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
            vec![
                gst::PadTemplate::new(
                    "src",
                    gst::PadDirection::Src,
                    gst::PadPresence::Always,
                    &caps,
                )
                .unwrap(),
                gst::PadTemplate::new(
                    "sink",
                    gst::PadDirection::Sink,
                    gst::PadPresence::Always,
                    &caps,
                )
                .unwrap(),
            ]
        });
        PAD_TEMPLATES.as_ref()
    }
}

impl BaseTransformImpl for Toonflow {
    const MODE: gst_base::subclass::BaseTransformMode =
        gst_base::subclass::BaseTransformMode::NeverInPlace;
    const PASSTHROUGH_ON_SAME_CAPS: bool = false;
    const TRANSFORM_IP_ON_PASSTHROUGH: bool = false;

    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let (choice, device_id) = {
            let s = self.settings.lock();
            (s.backend, s.device_id)
        };
        let active = match choice {
            BackendChoice::Cpu => Active::Cpu,
            BackendChoice::Cuda => match cuda::probe(device_id as usize) {
                Ok(name) => {
                    gst::info!(CAT, imp = self, "using CUDA device {device_id}: {name}");
                    Active::Cuda { device_id }
                }
                Err(err) => {
                    return Err(gst::error_msg!(
                        gst::LibraryError::Init,
                        (
                            "backend=cuda was requested but CUDA device {} cannot be used: {}",
                            device_id,
                            err
                        ),
                        ["set backend=auto or backend=cpu to run without a GPU"]
                    ));
                }
            },
            BackendChoice::Auto => match cuda::probe(device_id as usize) {
                Ok(name) => {
                    gst::info!(CAT, imp = self, "using CUDA device {device_id}: {name}");
                    Active::Cuda { device_id }
                }
                Err(err) => {
                    gst::warning!(CAT, imp = self, "{err}; using the CPU reference backend");
                    gst::element_imp_warning!(
                        self,
                        gst::LibraryError::Init,
                        ("{}; using the CPU reference backend (much slower)", err)
                    );
                    Active::Cpu
                }
            },
        };
        *self.active.lock() = Some(active);
        *self.stats.lock() = Stats {
            backend: active.name(),
            ..Stats::default()
        };
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        *self.state.lock() = None;
        *self.active.lock() = None;
        Ok(())
    }

    fn propose_allocation(
        &self,
        decide_query: Option<&gst::query::Allocation>,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        self.parent_propose_allocation(decide_query, query)?;
        query.add_allocation_meta::<gst_video::VideoMeta>(None);
        let Some(Active::Cuda { device_id }) = *self.active.lock() else {
            return Ok(());
        };
        let (caps, need_pool) = query.get_owned();
        if let (Some(caps), true) = (caps, need_pool) {
            // Upstream that writes into these buffers saves the upload a staging copy.
            match PinnedPool::configured(device_id as usize, &caps, 2, 0) {
                Ok((pool, size)) => {
                    gst::debug!(
                        CAT,
                        imp = self,
                        "offering upstream a pinned pool of {size}-byte buffers"
                    );
                    query.add_allocation_pool(Some(&pool), size, 2, 0);
                }
                Err(e) => gst::warning!(CAT, imp = self, "no pinned pool for upstream: {e}"),
            }
        }
        Ok(())
    }

    fn decide_allocation(
        &self,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        if let Some(Active::Cuda { device_id }) = *self.active.lock()
            && let (Some(caps), _) = query.get_owned()
        {
            let min = query.allocation_pools().next().map_or(2, |p| p.2.max(2));
            match PinnedPool::configured(device_id as usize, &caps, min, 0) {
                Ok((pool, size)) => {
                    gst::debug!(
                        CAT,
                        imp = self,
                        "output buffers from a pinned pool ({size} bytes, min {min})"
                    );
                    if query.allocation_pools().len() == 0 {
                        query.add_allocation_pool(Some(&pool), size, min, 0);
                    } else {
                        query.set_nth_allocation_pool(0, Some(&pool), size, min, 0);
                    }
                }
                Err(e) => gst::warning!(
                    CAT,
                    imp = self,
                    "no pinned output pool, downloads go through pageable memory: {e}"
                ),
            }
        }
        self.parent_decide_allocation(query)
    }

    fn sink_event(&self, event: gst::Event) -> bool {
        if let gst::EventView::FlushStop(_) = event.view()
            && let Some(state) = self.state.lock().as_mut()
        {
            gst::debug!(CAT, imp = self, "flush: temporal history dropped");
            state.engine.reset();
        }
        self.parent_sink_event(event)
    }

    fn transform(
        &self,
        inbuf: &gst::Buffer,
        outbuf: &mut gst::BufferRef,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        let settings = self.settings.lock().clone();
        let mut guard = self.state.lock();
        let Some(state) = guard.as_mut() else {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Buffer received before caps")
            );
            return Err(gst::FlowError::NotNegotiated);
        };

        // Shape changes rebuild the per-stream state; other changes only refresh the parameters.
        let shape = shape_of(&settings, state.geometry);
        if shape != state.shape {
            gst::info!(CAT, imp = self, "shape changed to {:?}: rebuilding", shape);
            state.engine = self
                .build_engine(&settings, state.geometry, shape)
                .map_err(|e| {
                    self.post_error_message(e);
                    gst::FlowError::Error
                })?;
            state.shape = shape;
        }
        if settings.stage != state.stage {
            state.params = ToonParams::new(
                &settings.stage,
                state.geometry.width as u32,
                state.geometry.height as u32,
            );
            state.stage = settings.stage.clone();
        }
        if let Engine::Cuda(p) = &mut state.engine {
            p.set_use_graph(settings.cuda_graph);
        }
        if inbuf.flags().contains(gst::BufferFlags::DISCONT) {
            gst::debug!(CAT, imp = self, "discont: temporal history dropped");
            state.engine.reset();
        }

        let in_frame =
            gst_video::VideoFrameRef::from_buffer_ref_readable(inbuf.as_ref(), &state.info)
                .map_err(|_| {
                    gst::element_imp_error!(
                        self,
                        gst::StreamError::Format,
                        (
                            "Input buffer of {} bytes does not hold a {}x{} NV12 frame ({} bytes)",
                            inbuf.size(),
                            state.geometry.width,
                            state.geometry.height,
                            state.info.size()
                        )
                    );
                    gst::FlowError::Error
                })?;
        let info = state.info.clone();
        let mut out_frame = gst_video::VideoFrameRef::from_buffer_ref_writable(outbuf, &info)
            .map_err(|_| {
                gst::element_imp_error!(
                    self,
                    gst::CoreError::Failed,
                    ("Cannot map the output buffer")
                );
                gst::FlowError::Error
            })?;

        let geometry = state.geometry;
        let input = Nv12Frame::new(
            geometry,
            in_frame.plane_data(0).map_err(|_| gst::FlowError::Error)?,
            in_frame.plane_stride()[0] as usize,
            in_frame.plane_data(1).map_err(|_| gst::FlowError::Error)?,
            in_frame.plane_stride()[1] as usize,
        )
        .map_err(|e| {
            gst::element_imp_error!(self, gst::StreamError::Format, ("Bad input frame: {}", e));
            gst::FlowError::Error
        })?;
        let strides = [
            out_frame.plane_stride()[0] as usize,
            out_frame.plane_stride()[1] as usize,
        ];
        let [y, uv, ..] = out_frame.planes_data_mut();
        let mut output =
            Nv12FrameMut::new(geometry, y, strides[0], uv, strides[1]).map_err(|e| {
                gst::element_imp_error!(self, gst::CoreError::Failed, ("Bad output frame: {}", e));
                gst::FlowError::Error
            })?;

        let started = Instant::now();
        let (report, gpu) = self.process(state, &input, &mut output)?;
        let elapsed_us = started.elapsed().as_secs_f64() * 1e6;
        drop(guard);
        if report.scene_cut {
            gst::debug!(
                CAT,
                imp = self,
                "scene cut (score {:.2}): temporal history dropped",
                report.scene_score
            );
        }
        self.record(&report, gpu, elapsed_us, geometry);
        Ok(gst::FlowSuccess::Ok)
    }
}

impl VideoFilterImpl for Toonflow {
    fn set_info(
        &self,
        incaps: &gst::Caps,
        in_info: &gst_video::VideoInfo,
        _outcaps: &gst::Caps,
        _out_info: &gst_video::VideoInfo,
    ) -> Result<(), gst::LoggableError> {
        let geometry = FrameGeometry::new(in_info.width() as usize, in_info.height() as usize)
            .map_err(|e| gst::loggable_error!(CAT, "Unsupported caps {incaps}: {e}"))?;
        let settings = self.settings.lock().clone();
        let shape = shape_of(&settings, geometry);
        // A new state means an empty temporal ring: caps changes reset the history.
        *self.state.lock() = None;
        let engine = self.build_engine(&settings, geometry, shape).map_err(|e| {
            let text = e.to_string();
            self.post_error_message(e);
            gst::loggable_error!(CAT, "Cannot set up for {incaps}: {text}")
        })?;
        gst::info!(
            CAT,
            imp = self,
            "configured for {}x{} ({:?})",
            geometry.width,
            geometry.height,
            shape
        );
        *self.state.lock() = Some(State {
            info: in_info.clone(),
            geometry,
            shape,
            engine,
            params: ToonParams::new(
                &settings.stage,
                geometry.width as u32,
                geometry.height as u32,
            ),
            stage: settings.stage,
        });
        Ok(())
    }
}
