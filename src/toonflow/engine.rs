//! The element's engine: which backend runs (auto/cpu/cuda), building its processor for the
//! negotiated format, falling back from CUDA to the fast CPU path, and reconfiguring when caps
//! or properties change. No GStreamer callbacks here: imp.rs drives it and turns its errors
//! and events into bus messages and log lines.

use std::path::Path;
use std::sync::Arc;

use thiserror::Error;

use super::neural_cpu::{self, NeuralCpu, NeuralFrameStats, NeuralTemporalParams};
use super::neural_cuda::NeuralCuda;
use super::settings::{BackendChoice, Settings};
use cudarc::driver::CudaContext;

use crate::cuda::neural::NeuralGpuError;
use crate::cuda::{
    self, CudaError, CudaPipeline, FrameSource, FrameTarget, GpuFrameStats, PipelineEvent,
};
use crate::neural::NeuralError;
use crate::neural::engine::NeuralModel;
use crate::neural::frame::{ColorMatrix, ColorRange, ConverterConfig};
use crate::pipeline::cpu::FrameReport;
use crate::pipeline::fast::CpuClassic;
use crate::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, Shape, StageParams, ToonParams};
use cudarc::driver::CudaEvent;

/// What the engine needs to know about the negotiated caps, read from them in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamFormat {
    pub geometry: FrameGeometry,
    /// YCbCr matrix and range of the caps' colorimetry (the neural path converts to RGB).
    pub matrix: ColorMatrix,
    pub range: ColorRange,
}

impl StreamFormat {
    /// Reads size and colorimetry from negotiated NV12 caps. Matrices other than BT.709 and
    /// BT.2020 (BT.601, FCC, SMPTE 240M, unknown) are taken as BT.601, the SD convention.
    pub fn from_info(info: &gst_video::VideoInfo) -> Result<StreamFormat, String> {
        let geometry = FrameGeometry::new(info.width() as usize, info.height() as usize)?;
        let colorimetry = info.colorimetry();
        let matrix = match colorimetry.matrix() {
            gst_video::VideoColorMatrix::Bt709 => ColorMatrix::Bt709,
            gst_video::VideoColorMatrix::Bt2020 => ColorMatrix::Bt2020,
            _ => ColorMatrix::Bt601,
        };
        let range = match colorimetry.range() {
            gst_video::VideoColorRange::Range0_255 => ColorRange::Full,
            _ => ColorRange::Limited,
        };
        Ok(StreamFormat {
            geometry,
            matrix,
            range,
        })
    }
}

/// The backend the engine runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda { device_id: u32 },
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda { .. } => "cuda",
        }
    }
}

/// What one processed frame reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FrameOutcome {
    pub report: FrameReport,
    /// GPU timings and memory, when CUDA made the frame.
    pub gpu: Option<GpuFrameStats>,
    /// Plan and stages, when the network made the frame.
    pub neural: Option<NeuralFrameStats>,
}

/// A frame queued on the GPU by [`Engine::submit`].
pub struct Queued {
    /// Fires when the frame's output buffer is complete.
    pub done: Arc<CudaEvent>,
    /// Earlier queued frames found complete meanwhile, oldest first.
    pub finished: Vec<FrameOutcome>,
}

/// Why the engine cannot start, configure or process. imp.rs maps each to a GStreamer error
/// domain; the texts are what the bus shows.
#[derive(Debug, Error)]
pub enum EngineError {
    /// backend=cuda and the device cannot be used.
    #[error("backend=cuda was requested but CUDA device {device_id} cannot be used: {source}")]
    CudaRequired {
        device_id: u32,
        #[source]
        source: CudaError,
    },
    /// The memory plan does not fit (max-device-memory or the device's free memory).
    #[error("Cannot process {width}x{height}: {source}")]
    OutOfMemory {
        width: usize,
        height: usize,
        #[source]
        source: CudaError,
    },
    /// Building the CUDA pipeline failed and backend=cuda forbids the fallback.
    #[error("CUDA backend failed: {0}")]
    CudaInit(#[source] CudaError),
    /// A frame failed on the GPU and backend=cuda forbids the fallback.
    #[error("CUDA processing failed: {0}")]
    CudaProcessing(#[source] CudaError),
    /// A frame arrived before caps.
    #[error("Buffer received before caps")]
    NotConfigured,
    /// The model cannot be loaded, specialised for the caps, or run.
    #[error("model {path}: {source}")]
    Model {
        path: String,
        #[source]
        source: NeuralError,
    },
}

impl EngineError {
    /// The bus message for this error, in the GStreamer error domain that fits it.
    pub fn message(&self) -> gst::ErrorMessage {
        let err = self;
        match err {
            EngineError::CudaRequired { .. } => gst::error_msg!(
                gst::LibraryError::Init,
                ("{}", err),
                ["set backend=auto or backend=cpu to run without a GPU"]
            ),
            EngineError::OutOfMemory { .. } => {
                gst::error_msg!(gst::ResourceError::NoSpaceLeft, ("{}", err))
            }
            EngineError::CudaInit(_) => gst::error_msg!(gst::LibraryError::Init, ("{}", err)),
            EngineError::CudaProcessing(_) => {
                gst::error_msg!(gst::StreamError::Failed, ("{}", err))
            }
            EngineError::NotConfigured => gst::error_msg!(gst::CoreError::Negotiation, ("{}", err)),
            EngineError::Model { source, .. } => match source {
                NeuralError::Io(_) => gst::error_msg!(gst::ResourceError::OpenRead, ("{}", err)),
                NeuralError::Parse(_) | NeuralError::Graph(_) => {
                    gst::error_msg!(gst::StreamError::Format, ("{}", err))
                }
                NeuralError::Unsupported(_) => {
                    gst::error_msg!(gst::StreamError::NotImplemented, ("{}", err))
                }
                NeuralError::Model(_) => gst::error_msg!(gst::ResourceError::Settings, ("{}", err)),
            },
        }
    }
}

/// Severity of a log line the engine asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warning,
}

/// What the engine wants logged or posted (drained with [`Engine::take_events`]).
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Log(Level, String),
    /// CUDA cannot be used (the reason): the fast CPU path runs from now on. The element posts
    /// a warning on the bus.
    FellBack(String),
}

/// The per-stream processor.
enum Processor {
    ClassicCpu(CpuClassic),
    ClassicCuda(Box<CudaPipeline>),
    NeuralCpu(Box<NeuralCpu>),
    NeuralCuda(Box<NeuralCuda>),
}

impl Processor {
    fn reset(&mut self) {
        match self {
            Processor::ClassicCpu(p) => p.reset(),
            Processor::ClassicCuda(p) => p.reset(),
            Processor::NeuralCpu(p) => p.reset(),
            Processor::NeuralCuda(p) => p.reset(),
        }
    }
}

/// The neural stage's temporal settings.
fn neural_params(settings: &Settings) -> NeuralTemporalParams {
    NeuralTemporalParams {
        history: settings.stage.temporal_history as usize,
        strength: settings.stage.temporal_strength,
        motion_sigma: settings.stage.motion_sigma,
        stat_smoothing: settings.model.stat_smoothing as f32,
        scene_cut_threshold: settings.stage.scene_cut_threshold,
    }
}

/// The frame converter's configuration for `model` on `format` with these settings.
fn converter_config(
    model: &NeuralModel,
    format: &StreamFormat,
    settings: &Settings,
) -> ConverterConfig {
    ConverterConfig {
        width: format.geometry.width,
        height: format.geometry.height,
        matrix: format.matrix,
        range: format.range,
        layout: model.input_layout(),
        value_range: settings.model.range.into(),
        multiple: neural_cpu::size_multiple(model, settings.model.size_multiple),
        scale: settings.model.scale,
    }
}

/// The classic pipeline's shape for these settings and this frame size.
fn classic_shape(settings: &Settings, geometry: FrameGeometry) -> Shape {
    Shape {
        width: geometry.width as u32,
        height: geometry.height as u32,
        bilateral_iterations: settings.stage.bilateral_iterations,
        temporal_history: settings.stage.temporal_history,
        precision: settings.precision.into(),
        auto_levels: settings.stage.auto_levels,
    }
}

/// Configured per-stream values (set by [`Engine::configure`]).
struct Stream {
    format: StreamFormat,
    /// `model-edges`: the classic lines over the network's output.
    model_edges: bool,
    shape: Shape,
    stage: StageParams,
    params: ToonParams,
}

/// One element instance's engine, created in `start` and dropped in `stop`.
pub struct Engine {
    choice: BackendChoice,
    /// The network of `model=`, loaded at start; `None` runs the classic pipeline.
    model: Option<(String, Arc<NeuralModel>)>,
    backend: Backend,
    max_device_memory: u64,
    /// `model-low-memory`.
    low_memory: bool,
    use_graph: bool,
    stream: Option<Stream>,
    processor: Option<Processor>,
    /// Outcomes of queued frames whose processor was replaced (a network re-specialised
    /// while playing), for the next harvest or submit.
    orphaned: Vec<FrameOutcome>,
    events: Vec<EngineEvent>,
    /// The CUDA context shared with the pipeline (nvcodec's GstCudaContext); `None`: the
    /// process's primary context of the device.
    cuda_context: Option<Arc<CudaContext>>,
    /// The settings of the last configure/update (a GPU network falling back mid-stream
    /// rebuilds the CPU one from them).
    settings_for_fallback: Settings,
}

impl Engine {
    /// Chooses the backend: backend=cuda fails without a usable device, backend=auto falls
    /// back to the fast CPU path (a [`EngineEvent::FellBack`]); backend=cpu-reference runs the
    /// exact reference.
    ///
    /// With `model=` the model is loaded and checked first; the network then runs on the same
    /// backend (backend=auto without CUDA warns that the CPU reference is slow).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn start(settings: &Settings) -> Result<Engine, EngineError> {
        Self::start_in(settings, None)
    }

    /// [`Engine::start`] with the CUDA context the pipeline shares (zero-copy with nvcodec):
    /// the CUDA backend then runs in it instead of the primary context.
    pub fn start_in(
        settings: &Settings,
        cuda_context: Option<Arc<CudaContext>>,
    ) -> Result<Engine, EngineError> {
        let device_id = settings.device_id;
        let mut events = Vec::new();
        let model = Self::load_model(&settings.model.path, &mut events)?;
        let backend = match settings.backend {
            BackendChoice::Cpu | BackendChoice::CpuReference => Backend::Cpu,
            choice => match cuda_context
                .as_ref()
                .map_or_else(|| cuda::probe(device_id as usize), cuda::probe_context)
            {
                Ok(name) => {
                    events.push(EngineEvent::Log(
                        Level::Info,
                        format!("using CUDA device {device_id}: {name}"),
                    ));
                    Backend::Cuda { device_id }
                }
                Err(source) if choice == BackendChoice::Cuda => {
                    return Err(EngineError::CudaRequired { device_id, source });
                }
                Err(err) if model.is_some() => {
                    events.push(EngineEvent::FellBack(format!(
                        "{err}; model= runs on the CPU reference (slow: seconds per HD frame)"
                    )));
                    Backend::Cpu
                }
                Err(err) => {
                    events.push(EngineEvent::FellBack(err.to_string()));
                    Backend::Cpu
                }
            },
        };
        Ok(Engine {
            choice: settings.backend,
            model,
            backend,
            max_device_memory: settings.max_device_memory,
            low_memory: settings.model.low_memory,
            use_graph: settings.cuda_graph,
            stream: None,
            processor: None,
            orphaned: Vec::new(),
            events,
            cuda_context,
            settings_for_fallback: settings.clone(),
        })
    }

    /// Reads and checks the ONNX file at `path` (`None` for an empty path).
    fn load_model(
        path: &str,
        events: &mut Vec<EngineEvent>,
    ) -> Result<Option<(String, Arc<NeuralModel>)>, EngineError> {
        if path.is_empty() {
            return Ok(None);
        }
        let model = NeuralModel::load(Path::new(path)).map_err(|source| EngineError::Model {
            path: path.to_string(),
            source,
        })?;
        events.push(EngineEvent::Log(
            Level::Info,
            format!(
                "model {path} ({}): {} bytes of weights, {:?} input, size multiple {}",
                model.name(),
                model.weight_bytes(),
                model.input_layout(),
                model.size_multiple()
            ),
        ));
        Ok(Some((path.to_string(), Arc::new(model))))
    }

    /// The model's name, when `model=` is set.
    pub fn model_name(&self) -> Option<&str> {
        self.model.as_ref().map(|(_, m)| m.name())
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The CUDA device frames go to, for pinned buffer pools.
    pub fn cuda_device(&self) -> Option<u32> {
        match self.backend {
            Backend::Cuda { device_id } => Some(device_id),
            Backend::Cpu => None,
        }
    }

    pub fn format(&self) -> Option<&StreamFormat> {
        self.stream.as_ref().map(|s| &s.format)
    }

    /// Sets up for new caps. The processor of the previous caps is reshaped when it can be
    /// (CUDA: the same arena when the plan fits, never two at once) or dropped before the new
    /// one is built. The temporal history starts empty.
    pub fn configure(
        &mut self,
        format: StreamFormat,
        settings: &Settings,
    ) -> Result<(), EngineError> {
        let geometry = format.geometry;
        let shape = classic_shape(settings, geometry);
        self.settings_for_fallback = settings.clone();
        self.stream = None;
        self.use_graph = settings.cuda_graph;
        if self.model.is_some() {
            self.install_neural(&format, settings)?;
        } else {
            self.install(shape, geometry)?;
        }
        if let Some(p) = &mut self.processor {
            p.reset();
        }
        self.stream = Some(Stream {
            format,
            model_edges: settings.model.edges,
            shape,
            stage: settings.stage.clone(),
            params: ToonParams::new(
                &settings.stage,
                geometry.width as u32,
                geometry.height as u32,
            ),
        });
        let what = match &self.model {
            Some((path, _)) => format!("model {path}"),
            None => format!("{shape:?}"),
        };
        self.log(
            Level::Info,
            format!(
                "configured for {}x{} ({what}; {:?} {:?})",
                geometry.width, geometry.height, format.matrix, format.range
            ),
        );
        Ok(())
    }

    /// Applies property changes (called before each frame). A new shape reshapes the
    /// processor; other changes only refresh the parameter block.
    pub fn update(&mut self, settings: &Settings) -> Result<(), EngineError> {
        let Some(stream) = &self.stream else {
            return Ok(());
        };
        let geometry = stream.format.geometry;
        self.settings_for_fallback = settings.clone();
        if let Some((_, model)) = &self.model {
            let config = converter_config(model, &stream.format, settings);
            let format = stream.format;
            self.refresh_params(settings);
            let current = match &self.processor {
                Some(Processor::NeuralCpu(p)) => Some(*p.config()),
                Some(Processor::NeuralCuda(p)) => Some(*p.config()),
                _ => None,
            };
            if current != Some(config) {
                self.log(
                    Level::Info,
                    format!("network configuration changed to {config:?}: re-specialising"),
                );
                self.install_neural(&format, settings)?;
            } else if let Some(Processor::NeuralCpu(p)) = &mut self.processor {
                p.set_params(neural_params(settings));
            } else if let Some(Processor::NeuralCuda(p)) = &mut self.processor {
                p.set_params(neural_params(settings));
                if settings.cuda_graph != self.use_graph {
                    self.use_graph = settings.cuda_graph;
                    p.set_use_graph(self.use_graph);
                }
            }
            return Ok(());
        }
        let shape = classic_shape(settings, geometry);
        if shape != stream.shape {
            self.log(
                Level::Info,
                format!("shape changed to {shape:?}: rebuilding"),
            );
            self.install(shape, geometry)?;
            if let Some(s) = &mut self.stream {
                s.shape = shape;
            }
        }
        self.refresh_params(settings);
        if settings.cuda_graph != self.use_graph {
            self.use_graph = settings.cuda_graph;
            if let Some(Processor::ClassicCuda(p)) = &mut self.processor {
                p.set_use_graph(self.use_graph);
            }
        }
        Ok(())
    }

    /// Follows the stage parameters (the classic pipeline's, and the lines of model-edges).
    fn refresh_params(&mut self, settings: &Settings) {
        let Some(stream) = &mut self.stream else {
            return;
        };
        let geometry = stream.format.geometry;
        if settings.stage != stream.stage {
            stream.params = ToonParams::new(
                &settings.stage,
                geometry.width as u32,
                geometry.height as u32,
            );
            stream.stage = settings.stage.clone();
        }
        stream.model_edges = settings.model.edges;
    }

    /// Specialises the model for `format` and the settings. The previous processor goes first,
    /// so two networks' buffers are never alive at once.
    fn install_neural(
        &mut self,
        format: &StreamFormat,
        settings: &Settings,
    ) -> Result<(), EngineError> {
        let (path, model) = self.model.clone().expect("neural mode");
        self.keep_queued_outcomes();
        self.processor = None;
        let config = converter_config(&model, format, settings);
        if let Backend::Cuda { device_id } = self.backend {
            let fp16 = matches!(settings.precision.into(), crate::pipeline::Precision::Fp16);
            match NeuralCuda::new(
                device_id as usize,
                model.clone(),
                config,
                neural_params(settings),
                self.max_device_memory,
                fp16,
                self.low_memory,
                self.use_graph,
            ) {
                Ok(mut p) => {
                    let (h, w) = p.network_size();
                    let gpu = p.gpu().expect("built");
                    let prog = gpu.program();
                    let text = format!(
                        "network {} for {}x{} runs on CUDA device {device_id} ({}) at {w}x{h}: \
                         {} stages, {} launches per frame, activations {} bytes (peak live {}), \
                         weights and state {} bytes{}",
                        model.name(),
                        config.width,
                        config.height,
                        gpu.device_name(),
                        p.frame_stats().stages,
                        gpu.launches_per_frame(),
                        prog.arena.arena_bytes,
                        prog.arena.peak_live_bytes,
                        prog.static_bytes,
                        if fp16 {
                            "; fp16 storage is calibrated on the first frame"
                        } else {
                            ""
                        }
                    );
                    self.log(Level::Info, text);
                    self.log(
                        Level::Debug,
                        format!("activation plan:\n{}", prog.arena.describe()),
                    );
                    for line in p.take_log() {
                        self.log(Level::Info, line);
                    }
                    self.processor = Some(Processor::NeuralCuda(Box::new(p)));
                    return Ok(());
                }
                Err(err) => self.neural_cuda_failed(err, &path, format)?,
            }
        }
        let p = NeuralCpu::new(
            model,
            config,
            neural_params(settings),
            self.max_device_memory,
        )
        .map_err(|source| EngineError::Model { path, source })?;
        let (h, w) = p.network_size();
        let plan = p.plan();
        let frame = p.frame_stats();
        self.log(
            Level::Info,
            format!(
                "network {} for {}x{} runs at {w}x{h} (scale {}, multiple {}): {} stages, arena {} \
                 bytes, peak live {} bytes",
                p.model().name(),
                config.width,
                config.height,
                config.scale,
                config.multiple,
                frame.stages,
                plan.arena_bytes,
                plan.peak_live_bytes
            ),
        );
        self.log(Level::Debug, format!("activation ledger:\n{}", p.ledger()));
        self.processor = Some(Processor::NeuralCpu(Box::new(p)));
        Ok(())
    }

    /// The network could not be built on the GPU: an exceeded memory plan is an error; with
    /// backend=auto anything else falls back to the CPU reference (the caller builds it), with
    /// backend=cuda it is an error.
    fn neural_cuda_failed(
        &mut self,
        err: NeuralGpuError,
        path: &str,
        format: &StreamFormat,
    ) -> Result<(), EngineError> {
        let (width, height) = (format.geometry.width, format.geometry.height);
        match err {
            NeuralGpuError::Cuda(e @ CudaError::OutOfMemory(_)) => Err(EngineError::OutOfMemory {
                width,
                height,
                source: e,
            }),
            NeuralGpuError::Model(source) if self.choice == BackendChoice::Cuda => {
                Err(EngineError::Model {
                    path: path.to_string(),
                    source,
                })
            }
            NeuralGpuError::Cuda(e) if self.choice == BackendChoice::Cuda => {
                Err(EngineError::CudaInit(e))
            }
            err => {
                self.backend = Backend::Cpu;
                self.events.push(EngineEvent::FellBack(format!(
                    "the network cannot run on the GPU ({err}); model= runs on the CPU reference \
                     (slow: seconds per HD frame)"
                )));
                Ok(())
            }
        }
    }

    /// Makes the processor fit `shape`, reusing what it can.
    fn install(&mut self, shape: Shape, geometry: FrameGeometry) -> Result<(), EngineError> {
        match (self.backend, self.processor.take()) {
            (Backend::Cpu, Some(Processor::ClassicCpu(mut p)))
                if p.geometry() == geometry
                    && p.history_capacity() == shape.temporal_history as usize =>
            {
                // Same planes and ring: keep them (a new shape still starts a new history).
                p.reset();
                self.processor = Some(Processor::ClassicCpu(p));
                Ok(())
            }
            (Backend::Cpu, old) => {
                drop(old); // the old planes go before the new ones are allocated
                let cpu = self.classic_cpu(geometry, shape);
                self.processor = Some(cpu);
                Ok(())
            }
            (Backend::Cuda { .. }, Some(Processor::ClassicCuda(mut p))) => {
                let result = p.set_shape(shape);
                self.drain_cuda_events(&mut p);
                match result {
                    Ok(()) => {
                        self.log(Level::Info, format!("CUDA pipeline reshaped for {shape:?}"));
                        self.processor = Some(Processor::ClassicCuda(p));
                        Ok(())
                    }
                    Err(err) => {
                        drop(p);
                        self.cuda_build_failed(err, shape, geometry)
                    }
                }
            }
            (Backend::Cuda { device_id }, old) => {
                drop(old);
                let ctx = match &self.cuda_context {
                    Some(ctx) => Ok(ctx.clone()),
                    None => cuda::context::context(device_id as usize),
                };
                match ctx.and_then(|ctx| {
                    CudaPipeline::new_in(
                        ctx,
                        geometry,
                        shape,
                        self.max_device_memory,
                        self.use_graph,
                    )
                }) {
                    Ok(mut p) => {
                        self.log(Level::Info, format!("CUDA pipeline ready for {shape:?}"));
                        self.drain_cuda_events(&mut p);
                        self.processor = Some(Processor::ClassicCuda(Box::new(p)));
                        Ok(())
                    }
                    Err(err) => self.cuda_build_failed(err, shape, geometry),
                }
            }
        }
    }

    /// A CUDA pipeline could not be built or reshaped: an exceeded memory plan is an error;
    /// anything else falls back to the CPU with backend=auto.
    fn cuda_build_failed(
        &mut self,
        err: CudaError,
        shape: Shape,
        geometry: FrameGeometry,
    ) -> Result<(), EngineError> {
        match err {
            CudaError::OutOfMemory(_) => Err(EngineError::OutOfMemory {
                width: geometry.width,
                height: geometry.height,
                source: err,
            }),
            err if self.choice == BackendChoice::Auto => {
                self.fall_back(&err);
                let cpu = self.classic_cpu(geometry, shape);
                self.processor = Some(cpu);
                Ok(())
            }
            err => Err(EngineError::CudaInit(err)),
        }
    }

    /// The classic CPU processor: the fast path, or the reference with backend=cpu-reference.
    fn classic_cpu(&mut self, geometry: FrameGeometry, shape: Shape) -> Processor {
        let reference = self.choice == BackendChoice::CpuReference;
        let cpu = CpuClassic::new(geometry, shape.temporal_history as usize, reference);
        self.log(
            Level::Info,
            match &cpu {
                CpuClassic::Fast(p) => format!(
                    "classic pipeline on the fast CPU path ({} kernels, {} threads)",
                    p.isa_name(),
                    p.threads()
                ),
                CpuClassic::Reference(_) => "classic pipeline on the CPU reference".into(),
            },
        );
        Processor::ClassicCpu(cpu)
    }

    fn fall_back(&mut self, err: &CudaError) {
        self.backend = Backend::Cpu;
        self.events.push(EngineEvent::FellBack(err.to_string()));
    }

    /// Stylizes one frame. With backend=auto a GPU failure switches to the fast CPU path for
    /// this frame and the rest of the stream.
    pub fn process(
        &mut self,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<FrameOutcome, EngineError> {
        let (Some(stream), Some(processor)) = (&self.stream, &mut self.processor) else {
            return Err(EngineError::NotConfigured);
        };
        let params = &stream.params;
        let result = match processor {
            Processor::ClassicCpu(p) => {
                return Ok(FrameOutcome {
                    report: p.process(params, input, output),
                    gpu: None,
                    neural: None,
                });
            }
            Processor::NeuralCpu(p) => {
                let lines = stream.model_edges.then_some(params);
                let report =
                    p.process(input, output, lines)
                        .map_err(|source| EngineError::Model {
                            path: self
                                .model
                                .as_ref()
                                .map_or_else(String::new, |m| m.0.clone()),
                            source,
                        })?;
                return Ok(FrameOutcome {
                    report,
                    gpu: None,
                    neural: Some(p.frame_stats()),
                });
            }
            Processor::NeuralCuda(p) => {
                let lines = stream.model_edges.then_some(params);
                let result = p.process(input, output, lines);
                let log = p.take_log();
                let (gpu, neural) = (p.gpu_stats(), p.frame_stats());
                for line in log {
                    self.log(Level::Info, line);
                }
                return match result {
                    Ok(report) => Ok(FrameOutcome {
                        report,
                        gpu: Some(gpu),
                        neural: Some(neural),
                    }),
                    Err(err) => self.neural_cuda_frame_failed(err, input, output),
                };
            }
            Processor::ClassicCuda(p) => p
                .process(params, input, output)
                .map(|report| (report, p.last_frame_stats())),
        };
        match result {
            Ok((report, gpu)) => Ok(self.classic_cuda_frame_done(report, gpu)),
            Err(err) if self.choice == BackendChoice::Auto => {
                self.backend = Backend::Cpu;
                self.events.push(EngineEvent::FellBack(err.to_string()));
                self.processor = None; // the GPU state goes before the CPU planes are allocated
                let shape = stream.shape;
                let mut cpu = CpuClassic::new(
                    stream.format.geometry,
                    shape.temporal_history as usize,
                    false,
                );
                let report = cpu.process(&stream.params, input, output);
                self.processor = Some(Processor::ClassicCpu(cpu));
                Ok(FrameOutcome {
                    report,
                    gpu: None,
                    neural: None,
                })
            }
            Err(err) => Err(EngineError::CudaProcessing(err)),
        }
    }

    /// Stylizes one frame on the CUDA pipeline or the network's device frame path with either
    /// side in device memory of the shared context (zero-copy with nvcodec). Only where
    /// [`Engine::runs_on_gpu`]; a GPU failure is an error here (the element maps CUDA memory
    /// as system memory for the CPU fallback).
    pub fn process_frames(
        &mut self,
        input: FrameSource,
        output: FrameTarget,
    ) -> Result<FrameOutcome, EngineError> {
        let (Some(stream), Some(processor)) = (&self.stream, &mut self.processor) else {
            return Err(EngineError::NotConfigured);
        };
        let p = match processor {
            Processor::ClassicCuda(p) => {
                let report = p
                    .process_frames(&stream.params, input, output)
                    .map_err(EngineError::CudaProcessing)?;
                let gpu = p.last_frame_stats();
                return Ok(self.classic_cuda_frame_done(report, gpu));
            }
            Processor::NeuralCuda(p) => p,
            _ => return Err(EngineError::NotConfigured),
        };
        let result = p.process_frames(input, output);
        let log = p.take_log();
        let (gpu, neural) = (p.gpu_stats(), p.frame_stats());
        for line in log {
            self.log(Level::Info, line);
        }
        let report = result.map_err(|err| self.neural_gpu_error(err))?;
        Ok(FrameOutcome {
            report,
            gpu: Some(gpu),
            neural: Some(neural),
        })
    }

    /// Whether frames can be queued with [`Engine::submit`] (the overlap path): the classic
    /// pipeline on CUDA, or the network's device frame path once calibrated and without
    /// model-edges (its lines are drawn on the finished host frame).
    pub fn can_submit(&self) -> bool {
        match &self.processor {
            Some(Processor::ClassicCuda(_)) => true,
            Some(Processor::NeuralCuda(p)) => {
                p.can_submit() && self.stream.as_ref().is_some_and(|s| !s.model_edges)
            }
            _ => false,
        }
    }

    /// The overlap path: queues a host frame on the classic CUDA pipeline or the network's
    /// device frame path and returns without waiting (see `CudaPipeline::submit_host` and
    /// `NeuralCuda::submit_host`). A failure is returned as is, with no CPU fallback: the
    /// element then runs the frame through [`Engine::process`].
    ///
    /// # Safety
    /// The frames' memory must stay valid, `output` unread and `input` unwritten, until
    /// [`Queued::done`] has fired.
    pub unsafe fn submit(
        &mut self,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<Queued, EngineError> {
        if let Some(Processor::NeuralCuda(p)) = &mut self.processor {
            // SAFETY: passed on to the caller (see above).
            let result = unsafe { p.submit_host(input, output) };
            let log = p.take_log();
            let neural = p.frame_stats();
            for line in log {
                self.log(Level::Info, line);
            }
            let (done, finished) = result.map_err(|e| self.neural_gpu_error(e))?;
            let mut outcomes = std::mem::take(&mut self.orphaned);
            outcomes.extend(
                finished
                    .into_iter()
                    .map(|f| Self::neural_outcome(f, neural)),
            );
            return Ok(Queued {
                done,
                finished: outcomes,
            });
        }
        let (Some(stream), Some(Processor::ClassicCuda(p))) = (&self.stream, &mut self.processor)
        else {
            return Err(EngineError::NotConfigured);
        };
        // SAFETY: passed on to the caller (see above).
        let result = unsafe { p.submit_host(&stream.params, input, output) };
        self.drain_classic_events();
        let submitted = result.map_err(EngineError::CudaProcessing)?;
        let mut finished = std::mem::take(&mut self.orphaned);
        finished.extend(submitted.finished.into_iter().map(Self::classic_outcome));
        Ok(Queued {
            done: submitted.done,
            finished,
        })
    }

    /// Outcomes of queued frames found complete, oldest first; with `wait`, of all of them.
    pub fn harvest(&mut self, wait: bool) -> Result<Vec<FrameOutcome>, EngineError> {
        let mut outcomes = std::mem::take(&mut self.orphaned);
        outcomes.extend(self.harvest_processor(wait)?);
        Ok(outcomes)
    }

    fn harvest_processor(&mut self, wait: bool) -> Result<Vec<FrameOutcome>, EngineError> {
        match &mut self.processor {
            Some(Processor::ClassicCuda(p)) => {
                let finished = p.harvest(wait).map_err(EngineError::CudaProcessing)?;
                Ok(finished.into_iter().map(Self::classic_outcome).collect())
            }
            Some(Processor::NeuralCuda(p)) => {
                let result = p.harvest(wait);
                let neural = p.frame_stats();
                let finished = result.map_err(|e| self.neural_gpu_error(e))?;
                Ok(finished
                    .into_iter()
                    .map(|f| Self::neural_outcome(f, neural))
                    .collect())
            }
            _ => Ok(Vec::new()),
        }
    }

    /// Frames queued by [`Engine::submit`] whose outcome has not been harvested.
    pub fn in_flight(&self) -> usize {
        self.orphaned.len()
            + match &self.processor {
                Some(Processor::ClassicCuda(p)) => p.in_flight(),
                Some(Processor::NeuralCuda(p)) => p.in_flight(),
                _ => 0,
            }
    }

    /// Before the processor is replaced: waits for its queued frames and keeps their outcomes
    /// (a failure is logged; the frames' memory is safe either way, the network waits for them
    /// when it is dropped).
    fn keep_queued_outcomes(&mut self) {
        if self.in_flight() == self.orphaned.len() {
            return;
        }
        match self.harvest_processor(true) {
            Ok(outcomes) => self.orphaned.extend(outcomes),
            Err(e) => self.log(
                Level::Warning,
                format!("frames in flight before re-specialising: {e}"),
            ),
        }
    }

    fn neural_outcome(
        (report, gpu): (FrameReport, GpuFrameStats),
        neural: NeuralFrameStats,
    ) -> FrameOutcome {
        FrameOutcome {
            report,
            gpu: Some(gpu),
            neural: Some(neural),
        }
    }

    fn classic_outcome((report, gpu): (FrameReport, GpuFrameStats)) -> FrameOutcome {
        FrameOutcome {
            report,
            gpu: Some(gpu),
            neural: None,
        }
    }

    fn drain_classic_events(&mut self) {
        if let Some(Processor::ClassicCuda(mut p)) = self.processor.take() {
            self.drain_cuda_events(&mut p);
            self.processor = Some(Processor::ClassicCuda(p));
        }
    }

    /// After a classic CUDA frame: logs what the pipeline reported (plans, fallbacks) and wraps
    /// the frame's figures.
    fn classic_cuda_frame_done(&mut self, report: FrameReport, gpu: GpuFrameStats) -> FrameOutcome {
        self.drain_classic_events();
        Self::classic_outcome((report, gpu))
    }

    /// Whether frames go to the classic CUDA pipeline or the network's device frame path
    /// (device frames can be processed): the network runs in the process's primary context,
    /// so only when that is the shared one, and without model-edges (it draws on host frames).
    pub fn runs_on_gpu(&self) -> bool {
        match &self.processor {
            Some(Processor::ClassicCuda(_)) => true,
            Some(Processor::NeuralCuda(p)) => {
                p.takes_device_frames()
                    && self.stream.as_ref().is_some_and(|s| !s.model_edges)
                    && self.cuda_context.as_ref().is_none_or(|c| c.is_primary())
            }
            _ => false,
        }
    }

    /// The engine's error for a network that failed on the GPU.
    fn neural_gpu_error(&self, err: NeuralGpuError) -> EngineError {
        match err {
            NeuralGpuError::Cuda(e) => EngineError::CudaProcessing(e),
            NeuralGpuError::Model(source) => EngineError::Model {
                path: self
                    .model
                    .as_ref()
                    .map_or_else(String::new, |m| m.0.clone()),
                source,
            },
        }
    }

    /// A frame failed on the GPU network: backend=auto switches to the CPU reference (this
    /// frame and the rest of the stream), backend=cuda is an error.
    fn neural_cuda_frame_failed(
        &mut self,
        err: NeuralGpuError,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<FrameOutcome, EngineError> {
        if self.choice != BackendChoice::Auto {
            return Err(self.neural_gpu_error(err));
        }
        let path = self
            .model
            .as_ref()
            .map_or_else(String::new, |m| m.0.clone());
        self.backend = Backend::Cpu;
        self.events.push(EngineEvent::FellBack(format!(
            "the network failed on the GPU ({err}); model= runs on the CPU reference from now on"
        )));
        self.processor = None; // the device memory goes before the CPU's buffers are allocated
        let Some(stream) = &self.stream else {
            return Err(EngineError::NotConfigured);
        };
        let (format, edges, params) = (stream.format, stream.model_edges, stream.params);
        let settings = self.settings_for_fallback.clone();
        self.install_neural(&format, &settings)?;
        let Some(Processor::NeuralCpu(p)) = &mut self.processor else {
            return Err(EngineError::NotConfigured);
        };
        let report = p
            .process(input, output, edges.then_some(&params))
            .map_err(|source| EngineError::Model { path, source })?;
        Ok(FrameOutcome {
            report,
            gpu: None,
            neural: Some(p.frame_stats()),
        })
    }

    /// Empties the temporal history (flush, discont).
    pub fn reset(&mut self) {
        if let Some(p) = &mut self.processor {
            p.reset();
        }
    }

    /// Drains what should be logged or posted since the last call.
    pub fn take_events(&mut self) -> Vec<EngineEvent> {
        std::mem::take(&mut self.events)
    }

    fn log(&mut self, level: Level, text: String) {
        self.events.push(EngineEvent::Log(level, text));
    }

    /// Turns what the CUDA pipeline reported (plans, kernel builds, captures) into log lines.
    fn drain_cuda_events(&mut self, pipeline: &mut CudaPipeline) {
        for event in pipeline.take_events() {
            let (level, text) = match event {
                PipelineEvent::Plan {
                    text,
                    arena_allocated,
                } => (
                    Level::Info,
                    format!("memory plan (arena allocated: {arena_allocated}):\n{text}"),
                ),
                PipelineEvent::KernelsReady {
                    arch,
                    precision,
                    compile_ms,
                } => (
                    Level::Info,
                    format!(
                        "kernels for {arch} {precision} ready ({})",
                        crate::cuda::kernels::build_note(compile_ms)
                    ),
                ),
                PipelineEvent::GraphCaptured {
                    key,
                    capture_us,
                    launches,
                } => (
                    Level::Info,
                    format!(
                        "captured CUDA graph for {key}: {launches} launches, {capture_us:.0} µs"
                    ),
                ),
                PipelineEvent::GraphCaptureFailed { key, reason } => (
                    Level::Warning,
                    format!("graph capture failed for {key}, running eagerly: {reason}"),
                ),
                PipelineEvent::GraphEvicted { key } => {
                    (Level::Debug, format!("graph evicted: {key}"))
                }
            };
            self.log(level, text);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::frame::FrameGeometry;

    fn cpu_settings() -> Settings {
        Settings {
            backend: BackendChoice::Cpu,
            ..Settings::default()
        }
    }

    fn format(width: usize, height: usize) -> StreamFormat {
        StreamFormat {
            geometry: FrameGeometry::new(width, height).unwrap(),
            matrix: ColorMatrix::Bt601,
            range: ColorRange::Limited,
        }
    }

    /// A gradient frame with a moving square, `t` steps along.
    fn frame(g: FrameGeometry, t: usize) -> (Vec<u8>, Vec<u8>) {
        let y = (0..g.height)
            .flat_map(|r| {
                (0..g.width).map(move |c| {
                    let inside = (c + 64 - t * 3) % 64 < 12 && r % 32 < 12;
                    if inside {
                        220
                    } else {
                        (16 + (r + c) % 200) as u8
                    }
                })
            })
            .collect();
        let uv = (0..g.width * g.height / 2)
            .map(|i| (100 + i % 50) as u8)
            .collect();
        (y, uv)
    }

    fn run(engine: &mut Engine, g: FrameGeometry, t: usize) -> (Vec<u8>, FrameOutcome) {
        let (y, uv) = frame(g, t);
        let input = Nv12Frame::new(g, &y, g.width, &uv, g.width).unwrap();
        let mut out_y = vec![0u8; g.width * g.height];
        let mut out_uv = vec![0u8; g.width * g.height / 2];
        let mut output = Nv12FrameMut::new(g, &mut out_y, g.width, &mut out_uv, g.width).unwrap();
        let outcome = engine.process(&input, &mut output).unwrap();
        out_y.extend_from_slice(&out_uv);
        (out_y, outcome)
    }

    #[test]
    fn cpu_reference_backend_matches_the_cpu_pipeline_bit_for_bit() {
        let settings = Settings {
            backend: BackendChoice::CpuReference,
            ..Settings::default()
        };
        let mut engine = Engine::start(&settings).unwrap();
        assert_eq!(engine.backend(), Backend::Cpu);
        assert_eq!(engine.cuda_device(), None);
        let f = format(96, 64);
        engine.configure(f, &settings).unwrap();
        let g = f.geometry;
        let mut reference =
            crate::pipeline::cpu::CpuPipeline::new(g, settings.stage.temporal_history as usize);
        let params = ToonParams::new(&settings.stage, g.width as u32, g.height as u32);
        for t in 0..4 {
            let (got, outcome) = run(&mut engine, g, t);
            let (y, uv) = frame(g, t);
            let mut want = vec![0u8; g.width * g.height * 3 / 2];
            let (wy, wuv) = want.split_at_mut(g.width * g.height);
            let report = reference.process(
                &params,
                &Nv12Frame::new(g, &y, g.width, &uv, g.width).unwrap(),
                &mut Nv12FrameMut::new(g, wy, g.width, wuv, g.width).unwrap(),
            );
            assert_eq!(got, want, "frame {t}");
            assert_eq!(outcome.report, report);
            assert!(outcome.gpu.is_none());
        }
    }

    #[test]
    fn cpu_backend_runs_the_fast_path() {
        let settings = cpu_settings();
        let mut engine = Engine::start(&settings).unwrap();
        let f = format(96, 64);
        engine.configure(f, &settings).unwrap();
        assert!(matches!(
            &engine.processor,
            Some(Processor::ClassicCpu(CpuClassic::Fast(_)))
        ));
        let (got, outcome) = run(&mut engine, f.geometry, 0);
        assert!(outcome.gpu.is_none());
        let (y, _) = frame(f.geometry, 0);
        assert!(got.iter().zip(&y).filter(|(a, b)| a != b).count() > y.len() / 4);
    }

    #[test]
    fn frames_before_caps_are_refused() {
        let mut engine = Engine::start(&cpu_settings()).unwrap();
        let g = FrameGeometry::new(8, 8).unwrap();
        let (y, uv) = frame(g, 0);
        let input = Nv12Frame::new(g, &y, 8, &uv, 8).unwrap();
        let (mut oy, mut ouv) = (vec![0; 64], vec![0; 32]);
        let mut output = Nv12FrameMut::new(g, &mut oy, 8, &mut ouv, 8).unwrap();
        assert!(matches!(
            engine.process(&input, &mut output),
            Err(EngineError::NotConfigured)
        ));
    }

    #[test]
    fn history_grows_resets_on_caps_and_on_reset() {
        let settings = cpu_settings();
        let mut engine = Engine::start(&settings).unwrap();
        let f = format(64, 48);
        engine.configure(f, &settings).unwrap();
        let used: Vec<usize> = (0..3)
            .map(|t| run(&mut engine, f.geometry, t).1.report.history_used)
            .collect();
        assert!(used[2] > used[0], "{used:?}");
        engine.reset();
        assert_eq!(
            run(&mut engine, f.geometry, 3).1.report.history_used,
            used[0]
        );
        run(&mut engine, f.geometry, 4);
        // Same caps again: still a fresh history.
        engine.configure(f, &settings).unwrap();
        assert_eq!(
            run(&mut engine, f.geometry, 5).1.report.history_used,
            used[0]
        );
        // New size.
        let f2 = format(32, 32);
        engine.configure(f2, &settings).unwrap();
        assert_eq!(engine.format(), Some(&f2));
        let (out, outcome) = run(&mut engine, f2.geometry, 0);
        assert_eq!(out.len(), 32 * 32 * 3 / 2);
        assert_eq!(outcome.report.history_used, used[0]);
    }

    #[test]
    fn a_new_shape_while_playing_changes_the_output_and_resets_history() {
        let mut settings = cpu_settings();
        let mut engine = Engine::start(&settings).unwrap();
        let f = format(64, 48);
        engine.configure(f, &settings).unwrap();
        let (a, _) = run(&mut engine, f.geometry, 0);
        run(&mut engine, f.geometry, 1);
        settings.stage.temporal_history = 1;
        settings.stage.levels = 3;
        engine.update(&settings).unwrap();
        let events = engine.take_events();
        assert!(
            events
                .iter()
                .any(|e| matches!(e, EngineEvent::Log(_, t) if t.contains("shape changed"))),
            "{events:?}"
        );
        let (b, outcome) = run(&mut engine, f.geometry, 0);
        assert_ne!(a, b, "levels=3 must change the picture");
        assert!(outcome.report.history_used <= 1);
    }

    /// Writes y = −x (NCHW, 1x1 convolution) to a temporary file.
    fn negate_model(tag: &str) -> std::path::PathBuf {
        use crate::neural::onnx::{self, GraphProto, float_tensor, node, value_info};
        let float = onnx::data_type::FLOAT;
        let mut g = GraphProto {
            name: "negate".into(),
            ..Default::default()
        };
        g.input.push(value_info("x", float, &[1, 3, -1, -1]));
        g.output.push(value_info("y", float, &[1, 3, -1, -1]));
        let mut w = vec![0.0f32; 9];
        for c in 0..3 {
            w[c * 3 + c] = -1.0;
        }
        g.initializer.push(float_tensor("w", &[3, 3, 1, 1], &w));
        g.node.push(node("Conv", &["x", "w"], &["y"], vec![]));
        let path =
            std::env::temp_dir().join(format!("toonflow-engine-{tag}-{}.onnx", std::process::id()));
        std::fs::write(&path, onnx::encode_model(&onnx::model(g, 13))).unwrap();
        path
    }

    fn neural_settings(path: &std::path::Path) -> Settings {
        let mut s = cpu_settings();
        s.model.path = path.to_str().unwrap().into();
        s.stage.temporal_history = 0;
        s
    }

    #[test]
    fn a_model_runs_the_network_and_follows_its_properties() {
        let path = negate_model("follow");
        let mut settings = neural_settings(&path);
        let mut engine = Engine::start(&settings).unwrap();
        let file = path.file_name().unwrap().to_str().unwrap();
        assert_eq!(engine.model_name(), Some(file));
        let f = format(64, 48);
        engine.configure(f, &settings).unwrap();
        let events = engine.take_events();
        assert!(
            events
                .iter()
                .any(|e| matches!(e, EngineEvent::Log(Level::Debug, t) if t.contains("ledger"))),
            "{events:?}"
        );
        let (out, outcome) = run(&mut engine, f.geometry, 0);
        let (y, _) = frame(f.geometry, 0);
        // Limited-range negative: 16 + 235 − Y.
        assert!(
            out[..64 * 48]
                .iter()
                .zip(&y)
                .all(|(&o, &i)| (o as i32 - (251 - i as i32)).abs() <= 1)
        );
        let n = outcome.neural.expect("neural stats");
        assert_eq!((n.network_width, n.network_height), (64, 48));
        assert!(n.stages >= 1 && n.arena_bytes >= 3 * 64 * 48 * 4);

        settings.model.scale = 0.5;
        engine.update(&settings).unwrap();
        let n = run(&mut engine, f.geometry, 0).1.neural.unwrap();
        assert_eq!((n.network_width, n.network_height), (32, 24));

        // model-edges draws lines: the picture gets darker somewhere, nowhere brighter.
        settings.model.scale = 1.0;
        engine.update(&settings).unwrap();
        let (plain, _) = run(&mut engine, f.geometry, 0);
        settings.model.edges = true;
        engine.update(&settings).unwrap();
        let (lined, _) = run(&mut engine, f.geometry, 0);
        let luma = 64 * 48;
        assert!(
            lined[..luma]
                .iter()
                .zip(&plain[..luma])
                .all(|(a, b)| a <= b)
        );
        assert!(lined[..luma] != plain[..luma]);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_model_follows_the_backend_choice() {
        let path = negate_model("backend");
        let mut settings = neural_settings(&path);
        let gpu = cuda::probe(0).is_ok();
        settings.backend = BackendChoice::Auto;
        let mut engine = Engine::start(&settings).unwrap();
        let events = engine.take_events();
        if gpu {
            assert_eq!(engine.backend(), Backend::Cuda { device_id: 0 });
        } else {
            // without CUDA the CPU reference runs, and the warning says it is slow
            assert_eq!(engine.backend(), Backend::Cpu);
            assert!(
                events
                    .iter()
                    .any(|e| matches!(e, EngineEvent::FellBack(t) if t.contains("CPU reference"))),
                "{events:?}"
            );
        }
        settings.backend = BackendChoice::Cuda;
        match Engine::start(&settings) {
            Ok(engine) => {
                assert!(gpu);
                assert_eq!(engine.backend(), Backend::Cuda { device_id: 0 });
            }
            Err(err) => {
                assert!(!gpu, "{err}");
                assert!(matches!(err, EngineError::CudaRequired { .. }), "{err}");
            }
        }
        settings.backend = BackendChoice::Cpu;
        assert_eq!(Engine::start(&settings).unwrap().backend(), Backend::Cpu);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_missing_model_fails_start_naming_the_file() {
        let settings = neural_settings(std::path::Path::new("/nonexistent/none.onnx"));
        let err = Engine::start(&settings).err().expect("missing file");
        assert!(err.to_string().contains("/nonexistent/none.onnx"), "{err}");
        assert!(matches!(
            err,
            EngineError::Model {
                source: NeuralError::Io(_),
                ..
            }
        ));
    }

    #[test]
    fn a_plan_over_the_cap_fails_configure() {
        let path = negate_model("cap");
        let mut settings = neural_settings(&path);
        settings.max_device_memory = 4096;
        let mut engine = Engine::start(&settings).unwrap();
        let err = engine.configure(format(64, 48), &settings).unwrap_err();
        assert!(err.to_string().contains("max-device-memory"), "{err}");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn stream_format_reads_matrix_and_range_from_caps() {
        gst::init().unwrap();
        let info = |colorimetry: &str| {
            let caps: gst::Caps = format!(
                "video/x-raw,format=NV12,width=64,height=48,framerate=30/1,colorimetry={colorimetry}"
            )
            .parse()
            .unwrap();
            gst_video::VideoInfo::from_caps(&caps).unwrap()
        };
        let f = StreamFormat::from_info(&info("bt709")).unwrap();
        assert_eq!(
            (f.matrix, f.range),
            (ColorMatrix::Bt709, ColorRange::Limited)
        );
        assert_eq!(f.geometry, FrameGeometry::new(64, 48).unwrap());
        let f = StreamFormat::from_info(&info("bt601")).unwrap();
        assert_eq!(
            (f.matrix, f.range),
            (ColorMatrix::Bt601, ColorRange::Limited)
        );
        let f = StreamFormat::from_info(&info("1:3:5:1")).unwrap();
        assert_eq!((f.matrix, f.range), (ColorMatrix::Bt709, ColorRange::Full));
        let f = StreamFormat::from_info(&info("bt2020")).unwrap();
        assert_eq!(f.matrix, ColorMatrix::Bt2020);
    }
}
