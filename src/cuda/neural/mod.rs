//! The style network on the GPU: [`NeuralGpu`] runs a specialised network's lowered stages
//! (src/neural/lower.rs) with the kernels of kernels/neural.cu, from one activation arena and
//! one static block allocated once per shape, as one CUDA graph per shape (through
//! [`GraphCache`], eager while a shape warms up or when capture fails).
//!
//! The statistics smoother runs on the device (its factor and reset travel in a control block
//! copied before each frame); [`NeuralGpu::run_with_hook`] keeps the CPU engine's stats hook
//! semantics (eager, the statistics go to the host and back after each normalize stage).

pub mod program;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::LaunchConfig;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, PushKernelArg, result};
use cudarc::nvrtc::Ptx;
use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::GpuFrameStats;
use super::alloc::{DeviceBlock, allocate};
use super::context::{context, describe, guard};
use super::copy::{copy_d2h, copy_h2d, download_values, stored_bytes, widen_halves};
use super::error::{CudaError, driver};
use super::fault::{Fault, injected};
use super::graph::{GraphCache, OwnedGraph, Ran};
use super::kernels::compile_cached;
use super::{GRAPH_CACHE_SIZE, GRAPH_WARMUP_FRAMES};
use crate::neural::engine::Specialised;
use crate::neural::lower::StatsHook;
use crate::neural::precision::OutputRange;
use crate::neural::{NeuralError, Tensor};
use program::{Kernel, NnControl, Program, Storage};

/// The kernel source, embedded at build time (without the ABI header, see [`full_source`]).
pub const KERNEL_SOURCE: &str = include_str!("../../../kernels/neural.cu");
pub const KERNEL_FILE: &str = "neural.cu";
pub use program::KERNEL_NAMES;

/// The translation unit NVRTC sees: the generated ABI ([`program::header`]), then neural.cu.
pub fn full_source() -> String {
    format!(
        "{}\n{}",
        program::header(),
        crate::cuda::kernels::with_neural_helpers(KERNEL_FILE, KERNEL_SOURCE)
    )
}

/// The programs kernels/neural.cu is compiled as, each defining its share of the kernels
/// (`#if NN_IN_PART(n)` there) and compiled on its own thread: NVRTC compiles one program on
/// one core, and the whole file took 22.6 s on an H100's host; its largest part takes about a
/// quarter of that. A kernel's PTX is the same in its part as in the whole file (up to the
/// numbering of its branch labels).
pub const PARTS: u32 = 5;

/// The translation unit of part `part` (< [`PARTS`]): `NN_PART` defined, then [`full_source`].
pub fn part_source(part: u32) -> String {
    format!("#define NN_PART {part}\n{}", full_source())
}

static PTX_CACHE: Lazy<Mutex<HashMap<(String, u32), String>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));
static MODULES: Lazy<Mutex<HashMap<usize, Arc<NeuralKernels>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// `job` for each item, each on a scoped thread of its own, the results in the items' order
/// (a panic in a job is its error, named by `what`).
fn each_on_a_thread<I, T, R>(
    items: I,
    what: &str,
    job: impl Fn(T) -> Result<R, CudaError> + Sync,
) -> Vec<Result<R, CudaError>>
where
    I: IntoIterator<Item = T>,
    T: Send,
    R: Send,
{
    let job = &job;
    std::thread::scope(|scope| {
        let threads: Vec<_> = items
            .into_iter()
            .map(|item| scope.spawn(move || guard(what, || job(item))))
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join().unwrap_or_else(|_| {
                    Err(CudaError::Failed(format!("a thread of {what} panicked")))
                })
            })
            .collect()
    })
}

/// The kernels a PTX module defines: the names of its `.entry` directives (whatever linkage
/// directive comes first: `.visible`, `.weak`, none).
pub fn ptx_entries(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.lines().filter_map(|line| {
        let line = line.trim_start();
        if !line.starts_with('.') {
            return None;
        }
        let mut words = line.split_whitespace().skip_while(|w| *w != ".entry");
        words.next()?;
        let name = words.next()?.split('(').next()?.trim();
        (!name.is_empty()).then_some(name)
    })
}

/// Compiles kernels/neural.cu to PTX for `arch` (e.g. "sm_90"), its [`PARTS`] programs at
/// once, each on a thread of its own; needs NVRTC, not a device. Returns each part's PTX and
/// the milliseconds NVRTC took from the first to the last (0 when every part was cached).
/// `TOONFLOW_CUDA_FAULT=compile` makes it fail with NVRTC's own error.
pub fn compile(arch: &str) -> Result<(Vec<String>, f64), CudaError> {
    let start = Instant::now();
    let parts = each_on_a_thread(0..PARTS, "NVRTC (neural.cu)", |part| {
        compile_cached(
            &PTX_CACHE,
            (arch.to_string(), part),
            KERNEL_FILE,
            arch,
            || part_source(part),
            true,
        )
    });
    let mut ptx = Vec::with_capacity(parts.len());
    let mut compiled = false;
    for part in parts {
        let (text, ms) = part?;
        compiled |= ms > 0.0;
        ptx.push(text);
    }
    let ms = if compiled {
        start.elapsed().as_secs_f64() * 1e3
    } else {
        0.0
    };
    Ok((ptx, ms))
}

/// The loaded kernels of one device.
pub struct NeuralKernels {
    functions: HashMap<&'static str, CudaFunction>,
    pub compile_ms: f64,
    pub arch: String,
}

impl NeuralKernels {
    fn get(&self, k: Kernel) -> &CudaFunction {
        &self.functions[k.name()]
    }
}

/// The kernels loaded into `ctx` (compiled on first use in this process).
pub fn kernels(ctx: &Arc<CudaContext>) -> Result<Arc<NeuralKernels>, CudaError> {
    let key = ctx.ordinal();
    let mut modules = MODULES.lock();
    if let Some(k) = modules.get(&key).filter(|_| !injected(Fault::Compile)) {
        return Ok(k.clone());
    }
    let (_, (major, minor)) = describe(ctx)?;
    let arch = format!("sm_{major}{minor}");
    let (ptx, compile_ms) = compile(&arch)?;
    // which part defines each kernel, from the PTX's entries (asking each module in turn would
    // leave a "not found" driver error for each miss, which compute-sanitizer reports)
    let part_of: HashMap<String, usize> = ptx
        .iter()
        .enumerate()
        .flat_map(|(part, text)| ptx_entries(text).map(move |name| (name.to_string(), part)))
        .collect();
    let k =
        guard("loading the neural kernels", || {
            // each part's module on a thread of its own: the driver compiles the PTX for the
            // device on first load (then from its own cache), one module on one core
            let loaded = each_on_a_thread(
                ptx.into_iter().enumerate(),
                "cuModuleLoadData (neural.cu)",
                |(part, text)| {
                    ctx.load_module(Ptx::from_src(text))
                        .map_err(driver(format!("cuModuleLoadData (neural.cu, part {part})")))
                },
            );
            let modules = loaded.into_iter().collect::<Result<Vec<_>, _>>()?;
            // the lookups below run on this thread (the loads ran on their own)
            ctx.bind_to_thread()
                .map_err(driver("cuCtxSetCurrent (neural kernels)"))?;
            let mut functions = HashMap::new();
            for kernel in Kernel::ALL {
                let name = kernel.name();
                // each kernel is defined in one part (tests/nvrtc_compile.rs checks it)
                let part = *part_of.get(name).ok_or_else(|| {
                    CudaError::Failed(format!("kernel {name}: in none of neural.cu's parts"))
                })?;
                let f = modules[part]
                    .load_function(name)
                    .map_err(driver(format!("kernel {name} (part {part})")))?;
                // the tensor-core convolutions may take more than the default 48 KiB of dynamic
                // shared memory (the double-buffered fixed 3x3); their mma.sync needs sm_80, where
                // every card allows at least 99 KiB a block
                if matches!(kernel, Kernel::ConvMma(..)) && major >= 8 {
                    f.set_attribute(
                    sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    program::TC_SHARED_OPT_IN as i32,
                )
                .map_err(driver(format!("cuFuncSetAttribute ({name}, dynamic shared memory)")))?;
                }
                functions.insert(name, f);
            }
            Ok(NeuralKernels {
                functions,
                compile_ms,
                arch: arch.clone(),
            })
        })?;
    let k = Arc::new(k);
    modules.insert(key, k.clone());
    Ok(k)
}

/// Why the network cannot run on the GPU: the model (an operator without a GPU kernel, a
/// shape the kernels do not take) or CUDA.
#[derive(Debug, thiserror::Error)]
pub enum NeuralGpuError {
    #[error("{0}")]
    Model(#[from] NeuralError),
    #[error("{0}")]
    Cuda(#[from] CudaError),
}

/// A frame path around the network (src/cuda/neural_frame.rs): its copies before and after
/// the launches, its kernels captured with them ([`NeuralGpu::run_device`]).
pub trait DeviceFrameIo {
    /// Host → device copies of the frame (before the launches, outside the graph).
    fn upload(&mut self, stream: &CudaStream) -> Result<(), CudaError>;
    /// Kernels that make the network's input.
    fn before(&self, stream: &CudaStream) -> Result<(), CudaError>;
    /// Kernels that take the network's output.
    fn after(&self, stream: &CudaStream) -> Result<(), CudaError>;
    /// Device → host copies of the result (after the launches).
    fn download(&mut self, stream: &CudaStream) -> Result<(), CudaError>;
    /// Kernels `before` and `after` launch.
    fn launches(&self) -> u32;
    /// Kernels `before` launches.
    fn launches_before(&self) -> u32;
}

/// What the executor wants logged.
#[derive(Debug, Clone, PartialEq)]
pub enum NeuralGpuEvent {
    KernelsReady { arch: String, compile_ms: f64 },
    GraphCaptured { launches: u32, capture_us: f64 },
    GraphCaptureFailed { reason: String },
}

/// Which graph cache a launch sequence goes to: the frame's (the network, or a whole frame), or
/// the overlap path's input or output kernels'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GraphPart {
    Frame,
    Input,
    Output,
    /// The overlap path's network after its last launch that reads the frame's NV12 planes
    /// (a network that gathers its input from them: `Program::frame_fed`).
    FrameTail,
}

/// The overlap path's wait before a frame's output kernels: `free` (none for the first
/// frame) fires once the previous frame's download has read the output planes; `before_wait`
/// and `after_wait` are recorded around the wait.
pub(crate) struct OutputGate<'a> {
    pub free: Option<&'a CudaEvent>,
    pub before_wait: &'a CudaEvent,
    pub after_wait: &'a CudaEvent,
}

/// A specialised network on one device.
pub struct NeuralGpu {
    // Field order is drop order: graphs go before the memory their kernels address.
    cache: GraphCache<u32, OwnedGraph>,
    /// The overlap path's input and output kernels ([`GraphPart`]): caches of their own, since
    /// a cache captures a key only after a streak of frames asking for it and the parts of a
    /// frame alternate.
    part_caches: [GraphCache<u32, OwnedGraph>; 3],
    arena: DeviceBlock,
    statics: DeviceBlock,
    host_control: Box<NnControl>,
    /// Before the upload, after it, after the launches, after the download.
    events: [CudaEvent; 4],
    stream: Arc<CudaStream>,
    kernels: Arc<NeuralKernels>,
    ctx: Arc<CudaContext>,
    program: Program,
    use_graph: bool,
    smoothing: f32,
    reset_pending: bool,
    stats: GpuFrameStats,
    log: Vec<NeuralGpuEvent>,
    device_name: String,
    /// An fp16 output's download before it is converted (`land_output`).
    output_halves: Vec<u16>,
    /// An fp16 input's upload (`upload_input`).
    input_halves: Vec<u16>,
    /// A network that gathers its input from the frame path's NV12 frame
    /// (`Program::frame_fed`): whether its launches point at the frame's block yet
    /// ([`attach_frame`](Self::attach_frame)).
    frame_attached: bool,
}

impl std::fmt::Debug for NeuralGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NeuralGpu")
            .field("device", &self.device_name)
            .field("arena_bytes", &self.program.arena.arena_bytes)
            .field("static_bytes", &self.program.static_bytes)
            .field("launches", &self.program.launches.len())
            .finish()
    }
}

impl NeuralGpu {
    /// Builds the program of `spec` with `storage` (tensor cores where asked for and the device
    /// is sm_80 or newer), checks it against `max_device_memory`
    /// (0: no cap) and the device's free memory, allocates its arena and static block once and
    /// uploads the weights. An operator without a GPU kernel is a [`NeuralGpuError::Model`]
    /// before anything touches the device.
    pub fn new(
        device_id: usize,
        spec: &Specialised,
        storage: &Storage,
        max_device_memory: u64,
        use_graph: bool,
    ) -> Result<Self, NeuralGpuError> {
        let ctx = context(device_id)?;
        let (device_name, (major, _)) = describe(&ctx)?;
        let tensor_cores = storage.tensor_cores && major >= TENSOR_CORE_MAJOR;
        // a double-buffered block takes up to ~60 KiB of shared memory: used where three fit a
        // multiprocessor (`PIPELINE_MIN_SHARED_PER_SM`)
        let shared_per_sm = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )
            .map_err(driver(
                "cuDeviceGetAttribute (shared memory per multiprocessor)",
            ))?;
        let roomy = shared_per_sm as u32 >= program::PIPELINE_MIN_SHARED_PER_SM;
        let storage = &Storage {
            tensor_cores,
            fusions: if roomy {
                storage.fusions
            } else {
                storage.fusions.single_buffered()
            },
            ..storage.clone()
        };
        let sizing = program::build(spec, storage, 0, 0)?;
        let total = sizing.arena.arena_bytes + sizing.static_bytes;
        if max_device_memory > 0 && total > max_device_memory {
            return Err(CudaError::out_of_memory(format!(
                "the network's plan for {} needs {total} bytes (activations {} + weights and \
                 state {}), over max-device-memory={max_device_memory}",
                sizing.arena.label, sizing.arena.arena_bytes, sizing.static_bytes
            ))
            .into());
        }
        let kernels = kernels(&ctx)?;
        let (stream, events) = guard("creating the stream", || {
            let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
            let ev = || {
                ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(driver("cuEventCreate"))
            };
            Ok((stream, [ev()?, ev()?, ev()?, ev()?]))
        })?;
        let arena = allocate(
            &ctx,
            sizing.arena.arena_bytes.max(1),
            &format!("the activation arena of {}", sizing.arena.label),
        )?;
        let statics = allocate(
            &ctx,
            sizing.static_bytes,
            &format!("the weights and state of {}", sizing.arena.label),
        )?;
        let program = program::build(spec, storage, arena.ptr, statics.ptr)?;
        debug_assert_eq!(program.static_bytes, sizing.static_bytes);
        // SAFETY: the static block holds `static_bytes` bytes, the initial image has exactly
        // that many, and the synchronisation below ends the copy before the image is dropped.
        unsafe {
            copy_h2d(
                stream.cu_stream(),
                program.static_init.as_ptr(),
                statics.ptr,
                program.static_init.len(),
            )
            .map_err(driver("weights upload"))?;
            result::memset_d8_async(arena.ptr, 0, arena.bytes as usize, stream.cu_stream())
                .map_err(driver("cuMemsetD8Async"))?;
        }
        stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        let log = vec![NeuralGpuEvent::KernelsReady {
            arch: kernels.arch.clone(),
            compile_ms: kernels.compile_ms,
        }];
        Ok(NeuralGpu {
            cache: GraphCache::new(GRAPH_CACHE_SIZE, GRAPH_WARMUP_FRAMES),
            part_caches: [
                GraphCache::new(1, GRAPH_WARMUP_FRAMES),
                GraphCache::new(1, GRAPH_WARMUP_FRAMES),
                GraphCache::new(1, GRAPH_WARMUP_FRAMES),
            ],
            arena,
            statics,
            host_control: Box::new(bytemuck::Zeroable::zeroed()),
            events,
            stream,
            kernels,
            ctx,
            program,
            use_graph,
            smoothing: 0.0,
            reset_pending: true,
            stats: GpuFrameStats::default(),
            log,
            device_name,
            output_halves: Vec::new(),
            input_halves: Vec::new(),
            frame_attached: false,
        })
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The program (arena plan, launches, static bytes).
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Points the launches that gather the input from the frame's NV12 planes
    /// (`Program::frame_fields`) at the frame path's `NfFrame` block `frame` (its NV12 input,
    /// sizes and conversion); nothing to do for a network with an input tensor.
    pub fn attach_frame(&mut self, frame: u64) -> Result<(), CudaError> {
        if !self.program.frame_fed() {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        for &field in &self.program.frame_fields {
            // SAFETY: each field is a u64 of a parameter block in the static block; the
            // synchronisation below ends the copies before `frame` goes out of scope, and no
            // launch reads the blocks meanwhile (they run on this stream, after it).
            unsafe {
                copy_h2d(
                    self.stream.cu_stream(),
                    (&frame as *const u64).cast(),
                    field,
                    std::mem::size_of::<u64>(),
                )
                .map_err(driver("frame source upload"))?;
            }
        }
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        self.frame_attached = frame != 0;
        Ok(())
    }

    /// A network gathering its input from a frame path that is not attached cannot run.
    fn check_frame(&self) -> Result<(), CudaError> {
        if self.program.frame_fed() && !self.frame_attached {
            return Err(CudaError::Failed(
                "this network gathers its input from the frame path's NV12 frame, and no \
                 frame path is attached"
                    .into(),
            ));
        }
        Ok(())
    }

    pub fn launches_per_frame(&self) -> u32 {
        self.program.launches.len() as u32
    }

    /// Device bytes this network holds: activations plus weights, state and parameters.
    pub fn device_bytes(&self) -> u64 {
        self.arena.bytes + self.statics.bytes
    }

    pub fn set_use_graph(&mut self, on: bool) {
        self.use_graph = on;
    }

    /// model-stat-smoothing, applied on the device from the next frame.
    pub fn set_smoothing(&mut self, a: f32) {
        self.smoothing = if a.is_nan() { 0.0 } else { a.clamp(0.0, 0.99) };
    }

    /// Forgets the smoothed statistics (applied with the next frame).
    pub fn reset(&mut self) {
        self.reset_pending = true;
    }

    pub fn take_events(&mut self) -> Vec<NeuralGpuEvent> {
        std::mem::take(&mut self.log)
    }

    pub fn last_frame_stats(&self) -> GpuFrameStats {
        self.stats
    }

    fn enqueue_range(&self, from: usize, to: usize) -> Result<(), CudaError> {
        for l in &self.program.launches[from..to] {
            self.enqueue(l)?;
        }
        Ok(())
    }

    fn enqueue(&self, l: &program::Launch) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: l.block,
            shared_mem_bytes: l.shared,
        };
        // SAFETY: every kernel of neural.cu takes one pointer to its parameter block, which
        // `program::build` wrote into the static block at `l.params` with the addresses of
        // this executor's arena and static block (both outlive the launches and any graph
        // captured from them); the kernels bound-check their index spaces.
        unsafe {
            self.stream
                .launch_builder(self.kernels.get(l.kernel))
                .arg(&l.params)
                .launch(cfg)
                .map_err(driver(l.kernel.name()))?;
        }
        Ok(())
    }

    fn upload_input(&mut self, input: &Tensor<f32>) -> Result<(), CudaError> {
        if self.program.frame_fed() {
            return Err(CudaError::Failed(
                "this network gathers its input from the frame path's NV12 frame: it runs on \
                 device frames only"
                    .into(),
            ));
        }
        let p = self.program.input;
        if input.data.len() as u64 != p.elements {
            return Err(CudaError::Failed(format!(
                "input of {} values, the network takes {}",
                input.data.len(),
                p.elements
            )));
        }
        // an fp16 input (`Fusions::half_input`) rounded as the device rounds it
        let bytes = stored_bytes(&input.data, p.half, &mut self.input_halves);
        // SAFETY: the input buffer holds `elements` values of its storage in the arena; the
        // host bytes are as long and outlive the synchronisation that ends every frame (the
        // halves live in `self` until the next upload).
        unsafe {
            copy_h2d(self.stream.cu_stream(), bytes.as_ptr(), p.addr, bytes.len())
                .map_err(driver("input upload"))?;
        }
        self.upload_control()
    }

    /// The control block of the coming frame (smoothing, statistics reset).
    fn upload_control(&mut self) -> Result<(), CudaError> {
        self.host_control.smoothing = self.smoothing;
        self.host_control.reset = self.reset_pending as i32;
        // SAFETY: the control block NnControl is in the static block; the boxed host copy
        // outlives the synchronisation that ends every frame.
        unsafe {
            copy_h2d(
                self.stream.cu_stream(),
                bytemuck::bytes_of(&*self.host_control).as_ptr(),
                self.program.control,
                std::mem::size_of::<NnControl>(),
            )
            .map_err(driver("control upload"))?;
        }
        Ok(())
    }

    fn download_output(&mut self, output: &mut Tensor<f32>) -> Result<(), CudaError> {
        self.queue_output_download(output)?;
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        self.land_output(output);
        Ok(())
    }

    /// Queues the copy of the network's output into `output` (an fp16 output into the
    /// staging halves, which [`land_output`](Self::land_output) converts once the stream is
    /// synchronised); `output` must not be read before then.
    fn queue_output_download(&mut self, output: &mut Tensor<f32>) -> Result<(), CudaError> {
        let p = self.program.output;
        if output.data.len() as u64 != p.elements {
            return Err(CudaError::Failed(format!(
                "output of {} values, the network makes {}",
                output.data.len(),
                p.elements
            )));
        }
        let (dst, bytes) = if p.half {
            self.output_halves.resize(output.data.len(), 0);
            (
                self.output_halves.as_mut_ptr() as *mut u8,
                output.data.len() * 2,
            )
        } else {
            self.output_halves.clear();
            (output.data.as_mut_ptr() as *mut u8, output.data.len() * 4)
        };
        // SAFETY: the output buffer holds `elements` values of its storage; the host buffer
        // is as long and is not read before the synchronisation.
        unsafe {
            copy_d2h(self.stream.cu_stream(), p.addr, dst, bytes).map_err(driver("output download"))
        }
    }

    /// An fp16 output's staged halves into `output` (after the synchronisation).
    fn land_output(&mut self, output: &mut Tensor<f32>) {
        if self.program.output.half {
            widen_halves(&self.output_halves, &mut output.data);
        }
    }

    /// Runs one frame: `input` (the network's input tensor, f32) up, the launches (eager,
    /// captured or replayed), the output down into `output` (its shape must be the network's).
    pub fn run(&mut self, input: &Tensor<f32>, output: &mut Tensor<f32>) -> Result<(), CudaError> {
        guard("running the network", || {
            self.timed_frame(
                output,
                |gpu, _| gpu.upload_input(input),
                |gpu, _| gpu.run_launches_keyed(0, None),
                |gpu, output| gpu.queue_output_download(output),
            )?;
            self.land_output(output);
            Ok(())
        })
    }

    /// Runs one frame whose input and output `io` keeps on the device: its upload, its
    /// `before` kernels, the network and its `after` kernels (one CUDA graph per shape, apart
    /// from [`run`](Self::run)'s), its download, one synchronisation.
    pub fn run_device(&mut self, io: &mut dyn DeviceFrameIo) -> Result<(), CudaError> {
        guard("running the network on a device frame", || {
            self.timed_frame(
                io,
                |gpu, io| {
                    gpu.upload_control()?;
                    io.upload(&gpu.stream)
                },
                |gpu, io| gpu.run_launches_keyed(1, Some(&*io)),
                |gpu, io| io.download(&gpu.stream),
            )?;
            self.stats.launches += io.launches();
            Ok(())
        })
    }

    /// One frame: `up`, the launches (`launches` says whether a graph ran), `down`, each with
    /// `with` and between events, then one synchronisation; the frame's figures.
    fn timed_frame<W: ?Sized>(
        &mut self,
        with: &mut W,
        up: impl FnOnce(&mut Self, &mut W) -> Result<(), CudaError>,
        launches: impl FnOnce(&mut Self, &mut W) -> Result<bool, CudaError>,
        down: impl FnOnce(&mut Self, &mut W) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let start = Instant::now();
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        self.record_event(0)?;
        up(self, with)?;
        self.record_event(1)?;
        let replayed = launches(self, with)?;
        self.record_event(2)?;
        down(self, with)?;
        self.record_event(3)?;
        self.synchronize()?;
        self.reset_pending = false;
        let us =
            |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map(|v| v as f64 * 1e3).unwrap_or(0.0);
        let [e0, e1, e2, e3] = &self.events;
        let (upload, gpu, download) = (us(e0, e1), us(e1, e2), us(e2, e3));
        self.stats = GpuFrameStats {
            gpu_time_us: gpu,
            transfer_time_us: upload + download,
            upload_time_us: upload,
            download_time_us: download,
            launches: self.launches_per_frame(),
            graph_replayed: replayed,
            arena_bytes: self.device_bytes(),
            peak_live_bytes: self.program.arena.peak_live_bytes,
            host_time_us: start.elapsed().as_secs_f64() * 1e6,
            ..GpuFrameStats::default()
        };
        Ok(())
    }

    fn record_event(&self, index: usize) -> Result<(), CudaError> {
        self.events[index]
            .record(&self.stream)
            .map_err(driver("cuEventRecord"))
    }

    /// The context the network lives in (a frame path allocates there).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream the network runs on (a frame path enqueues its eager work there).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The overlap path: the control block of the coming frame (smoothing, statistics reset)
    /// and its device address, for the caller to copy from its own page-locked slot.
    pub(crate) fn next_control(&mut self) -> (NnControl, u64) {
        self.host_control.smoothing = self.smoothing;
        self.host_control.reset = self.reset_pending as i32;
        (*self.host_control, self.program.control)
    }

    /// The overlap path: the frame with the last [`next_control`](Self::next_control) is
    /// queued (its reset is on its way).
    pub(crate) fn control_queued(&mut self) {
        self.reset_pending = false;
    }

    /// The overlap path: enqueues a device frame's kernels on the stream without copies or
    /// waiting, in three graphs: `io`'s input kernels; after `input_read` is recorded (the
    /// frame path's input planes may take the next frame from then on) the network (where
    /// it gathers its input from the planes, `input_read` follows its last launch that does:
    /// the network then runs as two graphs, before and after it); after
    /// the stream waited for `gate.free` (the previous frame's download from the output
    /// planes) `io`'s output kernels. `gate`'s other two events are recorded around that wait,
    /// so the frame's GPU time can leave it out. Returns whether graphs ran.
    pub(crate) fn enqueue_device_frame(
        &mut self,
        io: &dyn DeviceFrameIo,
        input_read: &CudaEvent,
        gate: OutputGate<'_>,
    ) -> Result<bool, CudaError> {
        self.check_frame()?;
        let before = io.launches_before();
        let after = io.launches() - before;
        let input = self.run_graph(GraphPart::Input, 2, before, |gpu| io.before(&gpu.stream))?;
        // the input planes are read until the input kernels ran, or, where the network
        // gathers its input from them, until its last launch that does (then the network
        // runs as two graphs)
        let (n, reading) = (
            self.program.launches.len(),
            self.program.frame_reading_launches(),
        );
        let head = if reading > 0 {
            self.run_graph(GraphPart::Frame, 3, reading as u32, |gpu| {
                gpu.enqueue_range(0, reading)
            })?
        } else {
            true
        };
        input_read
            .record(&self.stream)
            .map_err(driver("cuEventRecord"))?;
        let part = if reading > 0 {
            GraphPart::FrameTail
        } else {
            GraphPart::Frame
        };
        let tail = if reading < n {
            self.run_graph(part, 3, (n - reading) as u32, |gpu| {
                gpu.enqueue_range(reading, n)
            })?
        } else {
            true
        };
        let network = head && tail;
        gate.before_wait
            .record(&self.stream)
            .map_err(driver("cuEventRecord"))?;
        if let Some(free) = gate.free {
            self.stream
                .wait(free)
                .map_err(driver("cuStreamWaitEvent"))?;
        }
        gate.after_wait
            .record(&self.stream)
            .map_err(driver("cuEventRecord"))?;
        let output = self.run_graph(GraphPart::Output, 4, after, |gpu| io.after(&gpu.stream))?;
        Ok(input && network && output)
    }

    /// Runs the launches of a frame without any copy (for timing): returns whether a graph ran.
    pub fn run_launches(&mut self) -> Result<bool, CudaError> {
        self.run_launches_keyed(0, None)
    }

    fn enqueue_frame(&self, io: Option<&dyn DeviceFrameIo>) -> Result<(), CudaError> {
        if let Some(io) = io {
            io.before(&self.stream)?;
        }
        self.enqueue_range(0, self.program.launches.len())?;
        io.map_or(Ok(()), |io| io.after(&self.stream))
    }

    /// The network's launches, with `io`'s kernels around them when given (graph `key`).
    fn run_launches_keyed(
        &mut self,
        key: u32,
        io: Option<&dyn DeviceFrameIo>,
    ) -> Result<bool, CudaError> {
        self.check_frame()?;
        let launches = self.launches_per_frame() + io.map_or(0, |io| io.launches());
        self.run_graph(GraphPart::Frame, key, launches, |gpu| gpu.enqueue_frame(io))
    }

    fn graph_cache(&mut self, part: GraphPart) -> &mut GraphCache<u32, OwnedGraph> {
        match part {
            GraphPart::Frame => &mut self.cache,
            GraphPart::Input => &mut self.part_caches[0],
            GraphPart::Output => &mut self.part_caches[1],
            GraphPart::FrameTail => &mut self.part_caches[2],
        }
    }

    /// Runs what `enqueue` puts on the stream as graph `key` of `part`'s cache (eagerly
    /// without graphs, while it warms up or after its capture failed); returns whether a graph
    /// ran.
    fn run_graph(
        &mut self,
        part: GraphPart,
        key: u32,
        launches: u32,
        enqueue: impl Fn(&NeuralGpu) -> Result<(), CudaError>,
    ) -> Result<bool, CudaError> {
        if !self.use_graph {
            enqueue(self)?;
            return Ok(false);
        }
        // the cache is taken out while `enqueue` borrows the network
        let mut cache = std::mem::replace(self.graph_cache(part), GraphCache::new(1, 0));
        let ran = cache.run(&key, &self.stream, || enqueue(self));
        *self.graph_cache(part) = cache;
        Ok(match ran? {
            Ran::Eager => false,
            Ran::Replayed => true,
            Ran::Captured { capture_us, .. } => {
                self.log.push(NeuralGpuEvent::GraphCaptured {
                    launches,
                    capture_us,
                });
                true
            }
            Ran::CaptureFailed { reason } => {
                self.log.push(NeuralGpuEvent::GraphCaptureFailed {
                    reason: reason.to_string(),
                });
                false
            }
        })
    }

    /// Waits for the stream (after [`run_launches`](Self::run_launches) for timing).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }

    /// Runs one frame eagerly with the CPU engine's stats hook: after each normalize stage its
    /// statistics come to the host, `hook(index, mean, var)` may change them, and they go back
    /// before the next stage reads them. The device smoother is off for this frame.
    pub fn run_with_hook(
        &mut self,
        input: &Tensor<f32>,
        output: &mut Tensor<f32>,
        hook: StatsHook<'_>,
    ) -> Result<(), CudaError> {
        guard("running the network with a stats hook", || {
            self.ctx
                .bind_to_thread()
                .map_err(driver("binding the context"))?;
            let keep = self.smoothing;
            self.smoothing = 0.0;
            let up = self.upload_input(input);
            self.smoothing = keep;
            up?;
            let mut from = 0;
            let this: &Self = self;
            for (k, sp) in this.program.stats.iter().enumerate() {
                let to = this
                    .program
                    .launches
                    .iter()
                    .position(|l| {
                        l.stage == sp.stage
                            && (l.kernel == Kernel::Moments || l.kernel.finishes_gram())
                    })
                    .map_or(from, |p| p + 1);
                this.enqueue_range(from, to)?;
                from = to;
                let [mean, var] = sp.places();
                let (mut mean, mut var) = (this.read_place(mean)?, this.read_place(var)?);
                hook(k, &mut mean, &mut var);
                // SAFETY: mean and var hold `channels` f32 each in the static block, the host
                // vectors as many; synchronised (below) before they are dropped.
                unsafe {
                    let s = this.stream.cu_stream();
                    copy_h2d(s, mean.as_ptr() as *const u8, sp.mean, 4 * sp.channels)
                        .map_err(driver("statistics upload"))?;
                    copy_h2d(s, var.as_ptr() as *const u8, sp.var, 4 * sp.channels)
                        .map_err(driver("statistics upload"))?;
                }
                // the chains a Gram launch that ran computed over the statistics before the
                // hook (`program::stat_chains`) run again over the changed ones, those whose
                // stage is still to come: their outputs are live and unread (their buffers are
                // held from the Gram's stage to their last reader); an earlier chain's readers
                // have run and its buffer may hold another tensor by now
                let ran = &this.program.launches[..from];
                let done = ran.last().map(|l| l.stage);
                for (gram, chain) in &this.program.stat_chains {
                    if done.is_some_and(|d| chain.stage > d)
                        && ran
                            .iter()
                            .any(|l| l.kernel.finishes_gram() && l.stage == *gram)
                    {
                        this.enqueue(chain)?;
                    }
                }
                this.synchronize()?;
            }
            self.enqueue_range(from, self.program.launches.len())?;
            self.download_output(output)?;
            self.reset_pending = false;
            Ok(())
        })
    }
}

/// Sees each stage's outputs (f32 values) after the stage ran: `(stage, values)`.
pub type OutputObserver<'a> = &'a mut dyn FnMut(usize, &[f32]);
/// Sees each normalization's statistics: `(index, mean, var)`.
pub type StatsObserver<'a> = &'a mut dyn FnMut(usize, &[f32], &[f32]);
/// Sees each stage output's magnitudes after the stage ran: `(stage, range)`.
pub type RangeObserver<'a> = &'a mut dyn FnMut(usize, &OutputRange);

impl NeuralGpu {
    fn read_place(&self, p: program::Place) -> Result<Vec<f32>, CudaError> {
        let mut values = vec![0.0f32; p.elements as usize];
        // SAFETY: the place holds `elements` values of its storage in this executor's memory.
        unsafe {
            download_values(
                &self.stream,
                p.addr,
                p.half,
                &mut values,
                "stage output download",
            )?
        };
        // observers see NCHW, as the CPU reference holds it
        Ok(match p.channels_last {
            Some(c) => program::channels_first(&values, c as usize),
            None => values,
        })
    }

    /// Runs one frame eagerly, stage by stage, showing every stage's outputs and every
    /// normalization's statistics to the observers (every output comes to the host: slow;
    /// calibration takes [`run_calibration`](Self::run_calibration)'s summaries instead).
    pub fn run_observed(
        &mut self,
        input: &Tensor<f32>,
        output: &mut Tensor<f32>,
        outputs: OutputObserver<'_>,
        stats: StatsObserver<'_>,
    ) -> Result<(), CudaError> {
        guard("running the network stage by stage", || {
            self.run_staged(input, output, stats, &mut |g, stage, p| {
                let v = g.read_place(p)?;
                outputs(stage, &v);
                Ok(())
            })
        })
    }

    /// Runs one frame eagerly for calibration: each stage output's magnitudes, reduced on the
    /// device (`nn_range`: a 40-byte block a stage comes back, not the tensor; the real tiny's stage
    /// outputs at 1080p are 1.5 GB in fp32, hayao_class's 4.8 GB), and every normalization's
    /// statistics go to the observers.
    pub fn run_calibration(
        &mut self,
        input: &Tensor<f32>,
        output: &mut Tensor<f32>,
        ranges: RangeObserver<'_>,
        stats: StatsObserver<'_>,
    ) -> Result<(), CudaError> {
        guard("running the network for calibration", || {
            let block = allocate(
                &self.ctx,
                std::mem::size_of::<program::NnRange>() as u64,
                "the calibration's range block",
            )?;
            self.run_staged(input, output, stats, &mut |g, stage, p| {
                let r = g.output_range(&block, p)?;
                ranges(stage, &r);
                Ok(())
            })
        })
    }

    /// The magnitudes of the values at `p` (`nn_range` into `block`, then the block down).
    fn output_range(
        &self,
        block: &DeviceBlock,
        p: program::Place,
    ) -> Result<OutputRange, CudaError> {
        let mut params = program::NnRange {
            x: p.addr,
            n: p.elements,
            sum_squares: 0.0,
            absmax_bits: 0,
            non_finite: 0,
            half: p.half as i32,
            pad: 0,
        };
        let bytes = std::mem::size_of::<program::NnRange>();
        let s = self.stream.cu_stream();
        // SAFETY: the block holds one NnRange; `params` is pageable host memory, so the upload
        // is staged before the call returns, and it is read back only after the synchronize.
        unsafe {
            copy_h2d(s, &params as *const _ as *const u8, block.ptr, bytes)
                .map_err(driver("range block upload"))?;
        }
        let blocks = p
            .elements
            .div_ceil(program::RANGE_THREADS as u64)
            .clamp(1, program::RANGE_MAX_BLOCKS as u64) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (program::RANGE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let at = block.ptr;
        // SAFETY: nn_range reads `elements` values of the place's storage in this executor's
        // arena or static block and adds into the NnRange at `at`, which outlives the launch
        // (synchronized below).
        unsafe {
            self.stream
                .launch_builder(self.kernels.get(Kernel::Range))
                .arg(&at)
                .launch(cfg)
                .map_err(driver(Kernel::Range.name()))?;
            copy_d2h(s, block.ptr, &mut params as *mut _ as *mut u8, bytes)
                .map_err(driver("range block download"))?;
        }
        self.synchronize()?;
        Ok(OutputRange {
            absmax: f32::from_bits(params.absmax_bits),
            sum_squares: params.sum_squares,
            count: p.elements,
            non_finite: u64::from(params.non_finite),
        })
    }

    /// One frame eagerly, stage by stage: after each stage `observe` sees each of its outputs'
    /// place, and the statistics it computed go to `stats`.
    fn run_staged(
        &mut self,
        input: &Tensor<f32>,
        output: &mut Tensor<f32>,
        stats: StatsObserver<'_>,
        observe: &mut dyn FnMut(&Self, usize, program::Place) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        self.upload_input(input)?;
        let stages = self.program.stage_outputs.len();
        let mut from = 0;
        for stage in 0..stages {
            let to = from
                + self.program.launches[from..]
                    .iter()
                    .take_while(|l| l.stage == stage)
                    .count();
            self.enqueue_range(from, to)?;
            from = to;
            let this: &Self = self;
            for &p in &this.program.stage_outputs[stage] {
                observe(this, stage, p)?;
            }
            for (k, sp) in this.program.stats.iter().enumerate() {
                if sp.stage == stage {
                    let [mean, var] = sp.places();
                    stats(k, &this.read_place(mean)?, &this.read_place(var)?);
                }
            }
        }
        self.download_output(output)?;
        self.reset_pending = false;
        Ok(())
    }
}

/// fp16 storage for every stage (`precision=fp16` until calibration decides per stage) or
/// fp32 everywhere.
pub fn uniform_storage(spec: &Specialised, half: bool) -> Storage {
    Storage::uniform(spec.stage_count(), half)
}

/// The compute capability the tensor-core kernels need (mma.sync m16n8k16: sm_80).
const TENSOR_CORE_MAJOR: i32 = 8;

/// Whether CUDA device `device_id` runs the tensor-core kernels.
pub fn has_tensor_cores(device_id: usize) -> Result<bool, NeuralGpuError> {
    let ctx = context(device_id)?;
    let (_, (major, _)) = describe(&ctx)?;
    Ok(major >= TENSOR_CORE_MAJOR)
}

/// How much smaller (per thousand) the fp16 arena must get for the stem to be recomputed.
pub const RECOMPUTE_MIN_SAVING_PERMILLE: u64 = 100;

/// `spec` with its stem computed again for its last reader ([`Specialised::recomputed_stem`])
/// where that makes the fp16 program's arena at least [`RECOMPUTE_MIN_SAVING_PERMILLE`]
/// smaller, with the two arenas' bytes (before, after). `frame_input`: the program gathers its
/// input from the frame path's NV12 frame where it can (`Storage::frame_input`), so that the
/// copy reads the frame, not an input tensor kept alive for it (the tiny layout's 16-channel
/// stem pays only then; the Hayao-class layout's 32-channel one either way). `tensor_cores`:
/// the device runs the tensor-core kernels ([`has_tensor_cores`]; without them the frame is
/// never gathered and the plan is another). `None`: keep `spec` (also when
/// `TOONFLOW_NEURAL_RECOMPUTE=0`, or when either program cannot be built).
pub fn with_recomputed_stem(
    spec: &Specialised,
    frame_input: bool,
    tensor_cores: bool,
) -> Option<(Specialised, u64, u64)> {
    if std::env::var("TOONFLOW_NEURAL_RECOMPUTE").is_ok_and(|v| v == "0") {
        return None;
    }
    let recomputed = spec.recomputed_stem()?;
    let arena = |s: &Specialised| {
        let storage = uniform_storage(s, true).with_frame_input(frame_input);
        let storage = Storage {
            tensor_cores: storage.tensor_cores && tensor_cores,
            ..storage
        };
        program::build(s, &storage, 0, 0)
            .ok()
            .map(|p| p.arena.arena_bytes)
    };
    let (before, after) = (arena(spec)?, arena(&recomputed)?);
    (after * 1000 <= before * (1000 - RECOMPUTE_MIN_SAVING_PERMILLE))
        .then_some((recomputed, before, after))
}
