//! The element's engine: which backend runs (auto/cpu/cuda), building its processor for the
//! negotiated format, falling back from CUDA to the CPU reference, and reconfiguring when caps
//! or properties change. No GStreamer callbacks here: imp.rs drives it and turns its errors
//! and events into bus messages and log lines.

use thiserror::Error;

use super::settings::{BackendChoice, Settings};
use crate::cuda::{self, CudaError, CudaPipeline, GpuFrameStats, PipelineEvent};
use crate::neural::frame::{ColorMatrix, ColorRange};
use crate::pipeline::cpu::{CpuPipeline, FrameReport};
use crate::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, Shape, StageParams, ToonParams};

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
    /// CUDA cannot be used (the reason): the CPU reference runs from now on. The element posts
    /// a warning on the bus.
    FellBack(String),
}

/// The per-stream processor. A neural sibling slots in here.
enum Processor {
    ClassicCpu(Box<CpuPipeline>),
    ClassicCuda(Box<CudaPipeline>),
}

impl Processor {
    fn reset(&mut self) {
        match self {
            Processor::ClassicCpu(p) => p.reset(),
            Processor::ClassicCuda(p) => p.reset(),
        }
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
    shape: Shape,
    stage: StageParams,
    params: ToonParams,
}

/// One element instance's engine, created in `start` and dropped in `stop`.
pub struct Engine {
    choice: BackendChoice,
    backend: Backend,
    max_device_memory: u64,
    use_graph: bool,
    stream: Option<Stream>,
    processor: Option<Processor>,
    events: Vec<EngineEvent>,
}

impl Engine {
    /// Chooses the backend: backend=cuda fails without a usable device, backend=auto falls
    /// back to the CPU reference (a [`EngineEvent::FellBack`]).
    pub fn start(settings: &Settings) -> Result<Engine, EngineError> {
        let device_id = settings.device_id;
        let mut events = Vec::new();
        let backend = match settings.backend {
            BackendChoice::Cpu => Backend::Cpu,
            choice => match cuda::probe(device_id as usize) {
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
                Err(err) => {
                    events.push(EngineEvent::FellBack(err.to_string()));
                    Backend::Cpu
                }
            },
        };
        Ok(Engine {
            choice: settings.backend,
            backend,
            max_device_memory: settings.max_device_memory,
            use_graph: settings.cuda_graph,
            stream: None,
            processor: None,
            events,
        })
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
        self.stream = None;
        self.use_graph = settings.cuda_graph;
        self.install(shape, geometry)?;
        if let Some(p) = &mut self.processor {
            p.reset();
        }
        self.stream = Some(Stream {
            format,
            shape,
            stage: settings.stage.clone(),
            params: ToonParams::new(
                &settings.stage,
                geometry.width as u32,
                geometry.height as u32,
            ),
        });
        self.log(
            Level::Info,
            format!(
                "configured for {}x{} ({:?}, {:?} {:?})",
                geometry.width, geometry.height, shape, format.matrix, format.range
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
        let stream = self.stream.as_mut().expect("checked above");
        if settings.stage != stream.stage {
            stream.params = ToonParams::new(
                &settings.stage,
                geometry.width as u32,
                geometry.height as u32,
            );
            stream.stage = settings.stage.clone();
        }
        if settings.cuda_graph != self.use_graph {
            self.use_graph = settings.cuda_graph;
            if let Some(Processor::ClassicCuda(p)) = &mut self.processor {
                p.set_use_graph(self.use_graph);
            }
        }
        Ok(())
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
                self.processor = Some(Self::classic_cpu(geometry, shape));
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
                match CudaPipeline::new(
                    device_id as usize,
                    geometry,
                    shape,
                    self.max_device_memory,
                    self.use_graph,
                ) {
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
                self.processor = Some(Self::classic_cpu(geometry, shape));
                Ok(())
            }
            err => Err(EngineError::CudaInit(err)),
        }
    }

    fn classic_cpu(geometry: FrameGeometry, shape: Shape) -> Processor {
        Processor::ClassicCpu(Box::new(CpuPipeline::new(
            geometry,
            shape.temporal_history as usize,
        )))
    }

    fn fall_back(&mut self, err: &CudaError) {
        self.backend = Backend::Cpu;
        self.events.push(EngineEvent::FellBack(err.to_string()));
    }

    /// Stylizes one frame. With backend=auto a GPU failure switches to the CPU reference for
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
                });
            }
            Processor::ClassicCuda(p) => p
                .process(params, input, output)
                .map(|report| (report, p.last_frame_stats())),
        };
        match result {
            Ok((report, gpu)) => {
                if let Some(Processor::ClassicCuda(mut p)) = self.processor.take() {
                    self.drain_cuda_events(&mut p);
                    self.processor = Some(Processor::ClassicCuda(p));
                }
                Ok(FrameOutcome {
                    report,
                    gpu: Some(gpu),
                })
            }
            Err(err) if self.choice == BackendChoice::Auto => {
                self.backend = Backend::Cpu;
                self.events.push(EngineEvent::FellBack(err.to_string()));
                self.processor = None; // the GPU state goes before the CPU planes are allocated
                let shape = stream.shape;
                let mut cpu =
                    CpuPipeline::new(stream.format.geometry, shape.temporal_history as usize);
                let report = cpu.process(&stream.params, input, output);
                self.processor = Some(Processor::ClassicCpu(Box::new(cpu)));
                Ok(FrameOutcome { report, gpu: None })
            }
            Err(err) => Err(EngineError::CudaProcessing(err)),
        }
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
                    format!("kernels for {arch} {precision} ready (NVRTC {compile_ms:.1} ms)"),
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
    fn cpu_backend_matches_the_cpu_pipeline_bit_for_bit() {
        let settings = cpu_settings();
        let mut engine = Engine::start(&settings).unwrap();
        assert_eq!(engine.backend(), Backend::Cpu);
        assert_eq!(engine.cuda_device(), None);
        let f = format(96, 64);
        engine.configure(f, &settings).unwrap();
        let g = f.geometry;
        let mut reference = CpuPipeline::new(g, settings.stage.temporal_history as usize);
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
