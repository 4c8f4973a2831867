//! The neural element's frame path on the device (kernels/neural_frame.cu): NV12 in, the
//! scene-cut gate, NV12 → the network's input, the network's output → the temporal output
//! filter → NV12, all on the device around [`NeuralGpu`]'s launches and captured with them in
//! its CUDA graph. The NV12 frames come and go in host memory or in device memory of the
//! network's context (GstCudaMemory of nvcodec's elements: a copy on the device, no PCIe).
//! At model-scale below 1 the input is area-averaged down and the filtered
//! output upscaled bilinearly, with the CPU converter's own tap lists
//! ([`crate::neural::frame::scaling_taps`]); the ring then holds the network's content size. Per frame the host copies the NV12 planes (at page-locked speed when the
//! element registered them, src/toonflow/hostmem.rs), a 56-byte control block up and a 32-byte
//! verdict (scene cut, score, ring entries used) back.
//!
//! [`DeviceFrames`] owns the device side: the NV12 planes, the ring of recent raw outputs
//! (8-bit codes, the network's content size), the thumbnail reference and the parameter block. The
//! CPU reference of every step is src/neural/frame.rs and src/neural/temporal.rs.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, result};
use cudarc::nvrtc::Ptx;
use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::alloc::{DeviceBlock, allocate};
use super::context::{describe, guard};
use super::copy::{Rows, copy_d2h, copy_h2d, download_values, upload_values};
use super::error::{CudaError, driver};
use super::kernels::compile_cached;
use super::neural::DeviceFrameIo;
use super::neural::program::{NnControl, Program};
use super::pipeline::{FrameSource, FrameTarget, check_host_frame, copy_nv12};
use crate::kernel_abi::{Define, KernelStruct, c_float_table, c_header, kernel_struct};
use crate::neural::frame::{
    ConverterConfig, SampleTaps, TensorLayout, scaled_dimension, scaling_taps,
};
use crate::neural::temporal::{OutputFilter, SceneCut, ring_value};
use crate::pipeline::FrameGeometry;
use crate::pipeline::params::{THUMB_H, THUMB_W};

pub const KERNEL_SOURCE: &str = include_str!("../../kernels/neural_frame.cu");
pub const KERNEL_FILE: &str = "neural_frame.cu";
pub const KERNEL_NAMES: [&str; 6] = [
    "nf_thumb_sums",
    "nf_scene",
    "nf_nv12_to_tensor",
    "nf_tensor_to_nv12",
    "nf_filter_scaled",
    "nf_upscale_to_nv12",
];
/// Kernel launches per frame at model-scale 1 (thumbnail, scene, input, output).
pub const LAUNCHES_UNSCALED: u32 = 4;
/// Kernel launches per frame below model-scale 1 (the output side filters, then upscales).
pub const LAUNCHES_SCALED: u32 = 5;
/// Of those, the kernels before the network (thumbnail, scene, input).
const LAUNCHES_BEFORE: u32 = 3;
/// Most taps of one resampled sample (an area average at model-scale 0.25 covers 5).
const MAX_TAPS: usize = 6;

kernel_struct! {
/// One stream's frame conversions (device addresses absolute; written once per shape and
/// again when the network or the ring moves).
pub struct NfFrame {
    /// Packed NV12 (Y rows of `width`, then the UV rows).
    pub nv12_in: u64,
    pub nv12_out: u64,
    /// The network's input (fp32, or fp16 with `in_half`) and output (fp32, or fp16 with
    /// `out_half`).
    pub tensor_in: u64,
    pub tensor_out: u64,
    /// fp16 raw outputs, [capacity][3][height][width], nominal RGB.
    pub ring: u64,
    pub control: u64,
    pub state: u64,
    /// The network's NnControl: a scene cut sets its statistics reset.
    pub net_control: u64,
    /// u32 luma sums per thumbnail block, rows NF_THUMB_STRIDE apart.
    pub thumb_sums: u64,
    /// The previous frame's thumbnail means (L units), thumb_w x thumb_h.
    pub thumb_previous: u64,
    /// Below model-scale 1: the filtered output, fp32 [3][scaled_h][scaled_w] (else 0).
    pub scaled_rgb: u64,
    /// Below model-scale 1: NfTaps per output sample of the four resamplings (else 0).
    pub down_x: u64,
    pub down_y: u64,
    pub up_x: u64,
    pub up_y: u64,
    pub width: i32,
    pub height: i32,
    /// The network's content size (the frame's at model-scale 1); the ring's size.
    pub scaled_w: i32,
    pub scaled_h: i32,
    pub net_w: i32,
    pub net_h: i32,
    pub nchw: i32,
    pub thumb_w: i32,
    pub thumb_h: i32,
    pub y_offset: f32,
    pub y_scale: f32,
    pub c_scale: f32,
    pub kr: f32,
    pub kb: f32,
    /// `v = x·v_scale + v_offset` for nominal RGB x.
    pub v_scale: f32,
    pub v_offset: f32,
    pub luma_units: f32,
    pub chroma_units: f32,
    /// Non-zero: the network's output is stored in fp16 (its calibrated precision).
    pub out_half: i32,
    /// Non-zero: the network's input is stored in fp16 (`program::Fusions::half_input`).
    pub in_half: i32,
}
}

kernel_struct! {
/// One output sample of a resampling: `Σ weights[t]·input[first + t]`, t < count.
pub struct NfTaps {
    pub first: i32,
    pub count: i32,
    pub weights: [f32; MAX_TAPS],
}
}

kernel_struct! {
/// Host → device before every frame: the output filter's ring and settings.
pub struct NfControl {
    /// Ring slots of the k-th most recent entries, k = 1..=used.
    pub recent: [i32; 8],
    pub used: i32,
    /// The slot this frame's raw output goes to; −1: not recorded (temporal-history 0).
    pub write_slot: i32,
    /// Non-zero: no scene reference (FLUSH, DISCONT, caps, first frame).
    pub reset: i32,
    pub strength: f32,
    /// −1/(2σ²).
    pub motion_coeff: f32,
    /// scene-cut-threshold.
    pub threshold: f32,
}
}

kernel_struct! {
/// Device → host after every frame (`cut`, `score`, `used`), and the gate's own state.
pub struct NfState {
    pub cut: i32,
    pub score: f32,
    pub has_previous: i32,
    /// Ring entries written since the last cut or reset (at most `NF_MAX_HISTORY`).
    pub kept: i32,
    /// Ring entries the filter read this frame: the plan's `used`, trimmed to `kept`.
    pub used: i32,
    pub pad: [i32; 3],
}
}

/// The translation unit NVRTC sees: the generated ABI, then neural_frame.cu.
pub fn full_source() -> String {
    let header = c_header(
        "toonflow neural frame ABI",
        &[
            Define::int("NF_THUMB_STRIDE", THUMB_W as i64),
            Define::int("NF_MAX_HISTORY", OutputFilter::MAX_HISTORY as i64),
        ],
        &[
            NnControl::c_declaration(),
            NfTaps::c_declaration(),
            NfFrame::c_declaration(),
            NfControl::c_declaration(),
            NfState::c_declaration(),
        ],
    );
    // a ring entry's code → its value, exactly the CPU filter's `ring_value` (a division
    // per channel and entry otherwise)
    let values: Vec<f32> = (0..=255u8).map(ring_value).collect();
    let table = c_float_table("NF_CODE_VALUE", &values);
    format!(
        "{header}\n{table}\n{}",
        crate::cuda::kernels::with_neural_helpers(KERNEL_FILE, KERNEL_SOURCE)
    )
}

static PTX_CACHE: Lazy<Mutex<HashMap<String, String>>> = Lazy::new(|| Mutex::new(HashMap::new()));
static MODULES: Lazy<Mutex<HashMap<usize, Arc<FrameKernels>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// Compiles kernels/neural_frame.cu to PTX for `arch` without FMA contraction (the CPU
/// reference's rounding); needs NVRTC, not a device. Returns the PTX and NVRTC's milliseconds.
pub fn compile(arch: &str) -> Result<(String, f64), CudaError> {
    compile_cached(
        &PTX_CACHE,
        arch.to_string(),
        KERNEL_FILE,
        arch,
        full_source,
        false,
    )
}

struct FrameKernels {
    functions: Vec<CudaFunction>,
}

/// The kernels loaded into `ctx`, in [`KERNEL_NAMES`] order (compiled once per process).
fn kernels(ctx: &Arc<CudaContext>) -> Result<Arc<FrameKernels>, CudaError> {
    let mut modules = MODULES.lock();
    if let Some(k) = modules.get(&ctx.ordinal()) {
        return Ok(k.clone());
    }
    let (_, (major, minor)) = describe(ctx)?;
    let (ptx, _) = compile(&format!("sm_{major}{minor}"))?;
    let k = guard("loading the neural frame kernels", || {
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(driver("cuModuleLoadData (neural_frame.cu)"))?;
        let functions = KERNEL_NAMES
            .iter()
            .map(|name| {
                module
                    .load_function(name)
                    .map_err(driver(format!("kernel {name}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Arc::new(FrameKernels { functions }))
    })?;
    modules.insert(ctx.ordinal(), k.clone());
    Ok(k)
}

/// The output filter and scene gate settings (the element's temporal properties).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FilterSettings {
    pub history: usize,
    pub strength: f32,
    pub motion_sigma: f32,
    pub scene_cut_threshold: f32,
}

const BLOCK_2D: u32 = 16;
const NF_BLOCK: u32 = 256;

/// Byte offsets of the fixed buffers in the one block.
struct Layout {
    nv12: u64,
    frame: u64,
    control: u64,
    state: u64,
    sums: u64,
    previous: u64,
    /// The tap lists (below model-scale 1), then the filtered output.
    taps: u64,
    scaled_rgb: u64,
    total: u64,
}

impl Layout {
    fn new(nv12_bytes: u64, taps_bytes: u64, scaled_rgb_bytes: u64) -> Layout {
        let align = |b: u64| b.next_multiple_of(256);
        let nv12 = align(nv12_bytes);
        let frame = 2 * nv12;
        let control = frame + align(std::mem::size_of::<NfFrame>() as u64);
        let state = control + align(std::mem::size_of::<NfControl>() as u64);
        let sums = state + align(std::mem::size_of::<NfState>() as u64);
        let previous = sums + align(4 * (THUMB_W * THUMB_H) as u64);
        let taps = previous + align(4 * (THUMB_W * THUMB_H) as u64);
        let scaled_rgb = taps + align(taps_bytes);
        let total = scaled_rgb + align(scaled_rgb_bytes);
        Layout {
            nv12,
            frame,
            control,
            state,
            sums,
            previous,
            taps,
            scaled_rgb,
            total,
        }
    }
}

/// The parameter block for `config` around a network of `net_size` (height, width): sizes,
/// colour and value constants; every device address 0 (the frame path fills them).
pub fn frame_params(config: &ConverterConfig, net_size: (usize, usize)) -> NfFrame {
    let (w, h) = (config.width, config.height);
    let (net_h, net_w) = net_size;
    let (kr, kb) = config.matrix.kr_kb();
    let (y_offset, y_scale, c_scale) = config.range.code_scales();
    let (v_scale, v_offset) = config.value_range.scale_offset();
    NfFrame {
        width: w as i32,
        height: h as i32,
        scaled_w: scaled_dimension(w, config.scale) as i32,
        scaled_h: scaled_dimension(h, config.scale) as i32,
        net_w: net_w as i32,
        net_h: net_h as i32,
        nchw: (config.layout == TensorLayout::Nchw) as i32,
        thumb_w: w.min(THUMB_W) as i32,
        thumb_h: h.min(THUMB_H) as i32,
        y_offset,
        y_scale,
        c_scale,
        kr,
        kb,
        v_scale,
        v_offset,
        luma_units: 100.0 * y_scale / 255.0,
        chroma_units: 100.0 * c_scale / 255.0,
        ..bytemuck::Zeroable::zeroed()
    }
}

/// The tap lists of [`scaling_taps`] as the kernels read them, one after the other; `None`
/// when a sample has more than [`MAX_TAPS`] taps.
pub fn device_taps(axes: &[Vec<SampleTaps>; 4]) -> Option<Vec<NfTaps>> {
    let mut out = Vec::with_capacity(axes.iter().map(Vec::len).sum());
    for sample in axes.iter().flatten() {
        if sample.weights.len() > MAX_TAPS {
            return None;
        }
        let mut weights = [0.0; MAX_TAPS];
        weights[..sample.weights.len()].copy_from_slice(&sample.weights);
        out.push(NfTaps {
            first: sample.first as i32,
            count: sample.weights.len() as i32,
            weights,
        });
    }
    Some(out)
}

/// One stream's frame path on the device (see the module documentation).
pub struct DeviceFrames {
    // Field order is drop order: the ring and the block outlive nothing that addresses them
    // (the network's graphs are dropped by their owner first, and each frame synchronises).
    ring: DeviceBlock,
    block: DeviceBlock,
    kernels: Arc<FrameKernels>,
    ctx: Arc<CudaContext>,
    params: NfFrame,
    control: Box<NfControl>,
    verdict: Box<NfState>,
    layout: Layout,
    width: usize,
    height: usize,
    /// The network's content size (the ring's).
    scaled: (usize, usize),
    settings: FilterSettings,
    slots: RingSlots,
    reset_pending: bool,
    /// Bytes of the last frame that crossed PCIe up and down (0 for a device frame).
    transferred: (u64, u64),
    /// The attached network gathers its input from `nv12_in` (`Program::frame_fed`): no
    /// input conversion runs.
    input_gathered: bool,
}

impl std::fmt::Debug for DeviceFrames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFrames")
            .field("size", &(self.width, self.height))
            .field("scaled", &self.scaled)
            .field("ring_capacity", &self.slots.capacity())
            .field("device_bytes", &self.device_bytes())
            .finish()
    }
}

/// Whether the network may gather its input from the frame path's NV12 planes for `config`
/// (`Storage::frame_input`): at the frame's own size (no resampling below model-scale 1).
pub fn input_gatherable(config: &ConverterConfig) -> bool {
    scaled_dimension(config.width, config.scale) == config.width
        && scaled_dimension(config.height, config.scale) == config.height
}

impl DeviceFrames {
    /// The frame path for `config` in `ctx` around `program` (its input and output must have
    /// the converter's shape, in fp32 or fp16), with a ring for `settings.history` outputs.
    pub fn new(
        ctx: &Arc<CudaContext>,
        config: &ConverterConfig,
        program: &Program,
        net_size: (usize, usize),
        settings: FilterSettings,
    ) -> Result<DeviceFrames, CudaError> {
        let (w, h) = (config.width, config.height);
        let (sw, sh) = (
            scaled_dimension(w, config.scale),
            scaled_dimension(h, config.scale),
        );
        let resampled = (sw, sh) != (w, h);
        let taps = if resampled {
            device_taps(&scaling_taps(w, h, sw, sh)).ok_or_else(|| {
                CudaError::Failed(format!(
                    "model-scale {} resamples {w}x{h} with more than {MAX_TAPS} taps a sample",
                    config.scale
                ))
            })?
        } else {
            Vec::new()
        };
        let kernels = kernels(ctx)?;
        let taps_bytes: &[u8] = bytemuck::cast_slice(&taps);
        let layout = Layout::new(
            FrameGeometry {
                width: w,
                height: h,
            }
            .nv12_bytes() as u64,
            taps_bytes.len() as u64,
            if resampled { 4 * 3 * sw * sh } else { 0 } as u64,
        );
        let block = allocate(ctx, layout.total, "the neural frame buffers")?;
        let capacity = settings.history.min(OutputFilter::MAX_HISTORY);
        let ring = allocate(ctx, ring_bytes(sw, sh, capacity), "the neural output ring")?;
        // the gate's state starts cleared (no previous thumbnail, no cut); the tap lists
        // SAFETY: the block holds `bytes` bytes, the tap lists fit at `layout.taps`; the
        // context is current (allocate bound it); `attach` below synchronises the context
        // before anything reads the block or `taps` is dropped.
        unsafe {
            result::memset_d8_async(block.ptr, 0, block.bytes as usize, std::ptr::null_mut())
                .map_err(driver("cuMemsetD8Async"))?;
            if resampled {
                copy_h2d(
                    std::ptr::null_mut(),
                    taps_bytes.as_ptr(),
                    block.ptr + layout.taps,
                    taps_bytes.len(),
                )
                .map_err(driver("resampling taps upload"))?;
            }
        }
        let base = block.ptr;
        // the four tap lists one after the other: down x, down y, up x, up y
        let tap_list = |before: usize| {
            if resampled {
                base + layout.taps + (before * std::mem::size_of::<NfTaps>()) as u64
            } else {
                0
            }
        };
        let params = NfFrame {
            nv12_in: base,
            nv12_out: base + layout.nv12,
            ring: ring.ptr,
            control: base + layout.control,
            state: base + layout.state,
            thumb_sums: base + layout.sums,
            thumb_previous: base + layout.previous,
            scaled_rgb: if resampled {
                base + layout.scaled_rgb
            } else {
                0
            },
            down_x: tap_list(0),
            down_y: tap_list(sw),
            up_x: tap_list(sw + sh),
            up_y: tap_list(sw + sh + w),
            // the network's tensors and control: `attach`
            ..frame_params(config, net_size)
        };
        let mut frames = DeviceFrames {
            ring,
            block,
            kernels,
            ctx: ctx.clone(),
            params,
            control: Box::new(bytemuck::Zeroable::zeroed()),
            verdict: Box::new(bytemuck::Zeroable::zeroed()),
            layout,
            width: w,
            height: h,
            scaled: (sw, sh),
            settings,
            slots: RingSlots::new(capacity),
            reset_pending: true,
            transferred: (0, 0),
            input_gathered: false,
        };
        frames.attach(program)?;
        Ok(frames)
    }

    /// Points the conversions at `program`'s input, output and control block (after the
    /// network was rebuilt) and writes the parameter block.
    ///
    /// A network that gathers its input from the NV12 planes (`Program::frame_fed`) needs no
    /// input conversion: the frame path then leaves `nf_nv12_to_tensor` out, and the network
    /// reads this block ([`frame_block`](Self::frame_block), `NeuralGpu::attach_frame`).
    pub fn attach(&mut self, program: &Program) -> Result<(), CudaError> {
        let (n_in, n_out) = (program.input, program.output);
        self.input_gathered = program.frame_fed();
        if self.input_gathered && self.scaled != (self.width, self.height) {
            return Err(CudaError::Failed(format!(
                "the network gathers its input from the NV12 frame, which model-scale {}x{} \
                 of {}x{} resamples first",
                self.scaled.0, self.scaled.1, self.width, self.height
            )));
        }
        let want = (self.params.net_w * self.params.net_h * 3) as u64;
        let packed = n_in.channels_last.is_none() && n_out.channels_last.is_none();
        if !packed || n_in.elements != want || n_out.elements != want {
            return Err(CudaError::Failed(format!(
                "the network's input/output ({} / {} values, tiled layout {}) are not the \
                 {}x{}x3 tensors in the converter's layout the frame path writes and reads",
                n_in.elements, n_out.elements, !packed, self.params.net_w, self.params.net_h
            )));
        }
        // (0: gathered from the planes)
        self.params.tensor_in = n_in.addr;
        self.params.tensor_out = n_out.addr;
        self.params.in_half = n_in.half as i32;
        self.params.out_half = n_out.half as i32;
        self.params.net_control = program.control;
        self.write_params()
    }

    fn write_params(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        // SAFETY: the block holds an NfFrame at `layout.frame`; a null stream copy from
        // pageable memory returns when the bytes are on their way, the synchronisation below
        // ends it before any kernel reads them.
        unsafe {
            copy_h2d(
                std::ptr::null_mut(),
                bytemuck::bytes_of(&self.params).as_ptr(),
                self.block.ptr + self.layout.frame,
                std::mem::size_of::<NfFrame>(),
            )
            .map_err(driver("neural frame parameters upload"))?;
        }
        self.ctx.synchronize().map_err(driver("cuCtxSynchronize"))
    }

    /// The network's input as the conversion wrote it, into `out` (f32, the network's input
    /// size), on `stream`, synchronised (the calibration frame's host copy).
    pub fn read_input(&self, stream: &CudaStream, out: &mut [f32]) -> Result<(), CudaError> {
        if self.input_gathered {
            return Err(CudaError::Failed(
                "the network gathers its input from the NV12 frame: there is no input tensor \
                 to read"
                    .into(),
            ));
        }
        self.read_tensor(stream, self.params.tensor_in, self.params.in_half != 0, out)
    }

    fn read_tensor(
        &self,
        stream: &CudaStream,
        tensor: u64,
        half: bool,
        out: &mut [f32],
    ) -> Result<(), CudaError> {
        self.check_tensor(out.len())?;
        // SAFETY: the network's input and output hold `out.len()` values of their storage
        // (checked against their shape) in the network's context.
        unsafe { download_values(stream, tensor, half, out, "network tensor download") }
    }

    /// The network's output of the last frame into `out` (f32), on `stream`, synchronised.
    pub fn read_output(&self, stream: &CudaStream, out: &mut [f32]) -> Result<(), CudaError> {
        self.read_tensor(stream, self.params.tensor_out, self.out_half(), out)
    }

    /// `values` into the network's output (the calibration frame's result, computed eagerly
    /// by the network before it was rebuilt; rounded to fp16 for an fp16 output), on
    /// `stream`, synchronised.
    pub fn write_output(&self, stream: &CudaStream, values: &[f32]) -> Result<(), CudaError> {
        self.check_tensor(values.len())?;
        // SAFETY: the network's output holds `values.len()` values of its storage (checked);
        // no frame runs while the calibration frame's result is written.
        unsafe {
            upload_values(
                stream,
                values,
                self.params.tensor_out,
                self.out_half(),
                "network output upload",
            )
        }
    }

    fn out_half(&self) -> bool {
        self.params.out_half != 0
    }

    fn check_tensor(&self, len: usize) -> Result<(), CudaError> {
        let want = (self.params.net_w * self.params.net_h * 3) as usize;
        if len != want {
            return Err(CudaError::Failed(format!(
                "a tensor of {len} values, the network's input and output hold {want}"
            )));
        }
        Ok(())
    }

    /// Bytes of one NV12 frame (what a frame in host memory copies each way).
    pub fn frame_bytes(&self) -> u64 {
        let (width, height) = (self.width, self.height);
        FrameGeometry { width, height }.nv12_bytes() as u64
    }

    /// Bytes of the last frame that crossed PCIe (host → device, device → host): a frame's
    /// size for a side in host memory, 0 for a side in device memory.
    pub fn transferred_bytes(&self) -> (u64, u64) {
        self.transferred
    }

    /// Kernel launches per frame.
    pub fn launches(&self) -> u32 {
        if self.scaled == (self.width, self.height) {
            LAUNCHES_UNSCALED - self.input_gathered as u32
        } else {
            LAUNCHES_SCALED
        }
    }

    /// Of those, the kernels before the network.
    fn launches_before(&self) -> u32 {
        LAUNCHES_BEFORE - self.input_gathered as u32
    }

    /// The device address of the parameter block (`NfFrame`) the kernels read: a network
    /// that gathers its input from the NV12 planes reads it too (`NeuralGpu::attach_frame`).
    pub fn frame_block(&self) -> u64 {
        self.block.ptr + self.layout.frame
    }

    /// Device bytes held (NV12 planes, ring, thumbnails, tap lists, blocks).
    pub fn device_bytes(&self) -> u64 {
        self.block.bytes + self.ring.bytes
    }

    /// Follows the temporal properties; a history beyond the ring's capacity reallocates the
    /// ring (empty), as the CPU filter does. When that fails the settings still apply, with
    /// the history clamped to the ring's capacity.
    pub fn set_settings(&mut self, settings: FilterSettings) -> Result<(), CudaError> {
        self.settings = settings;
        let history = settings.history.min(OutputFilter::MAX_HISTORY);
        if self.ring_grows(history) {
            // the old ring goes before the larger one is allocated; until that succeeds
            // the ring holds nothing
            let (w, h) = self.scaled;
            self.ring = allocate(&self.ctx, 1, "the neural output ring")?;
            self.slots = RingSlots::new(0);
            let grown = allocate(
                &self.ctx,
                ring_bytes(w, h, history),
                "the neural output ring",
            )
            .map(|ring| {
                self.ring = ring;
                self.slots = RingSlots::new(history);
            });
            self.params.ring = self.ring.ptr;
            self.write_params()?;
            grown?;
        }
        Ok(())
    }

    /// Whether [`set_settings`](Self::set_settings) with `history` reallocates the ring.
    pub fn ring_grows(&self, history: usize) -> bool {
        history.min(OutputFilter::MAX_HISTORY) > self.slots.capacity()
    }

    /// Forgets the ring and the scene reference (FLUSH, DISCONT, caps).
    pub fn reset(&mut self) {
        self.slots.clear();
        self.reset_pending = true;
    }

    fn launch(
        &self,
        stream: &CudaStream,
        kernel: usize,
        grid: (u32, u32),
        block: (u32, u32),
    ) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (block.0, block.1, 1),
            shared_mem_bytes: 0,
        };
        let params = self.block.ptr + self.layout.frame;
        // SAFETY: every kernel of neural_frame.cu takes one pointer to the NfFrame written by
        // `write_params`, whose addresses (this block, the ring, the network's input, output
        // and control) outlive the launches and the graph captured from them; the kernels
        // bound-check their index spaces against it.
        unsafe {
            stream
                .launch_builder(&self.kernels.functions[kernel])
                .arg(&params)
                .launch(cfg)
                .map_err(driver(KERNEL_NAMES[kernel]))?;
        }
        Ok(())
    }

    /// The control block of the coming frame (ring slots, settings, reset).
    fn prepare_control(&mut self) {
        let (recent, used, write_slot) = self.slots.plan(self.settings.history);
        let sigma = self.settings.motion_sigma.max(0.01);
        *self.control = NfControl {
            recent,
            used: used as i32,
            write_slot: write_slot.map_or(-1, |s| s as i32),
            reset: self.reset_pending as i32,
            strength: self.settings.strength.clamp(0.0, 1.0),
            motion_coeff: -1.0 / (2.0 * sigma * sigma),
            threshold: self.settings.scene_cut_threshold,
        };
    }

    /// After the frame's synchronisation: its verdict and the ring entries the filter used.
    fn conclude(&mut self) -> (SceneCut, usize) {
        self.frame_queued();
        verdict_of(&self.verdict)
    }

    /// The frame planned by the last [`job`](Self::job) is queued: its slot is taken (the
    /// device trims later plans after a cut itself, so this needs no verdict) and a reset is
    /// on its way.
    pub(crate) fn frame_queued(&mut self) {
        self.slots.commit(self.control.write_slot >= 0);
        self.reset_pending = false;
    }

    /// The parameter block (the device addresses of the planes, control and verdict).
    pub(crate) fn params(&self) -> &NfFrame {
        &self.params
    }

    /// A frame's work: `input` up (or copied on the device), the conversions around the
    /// network, the result down into `output` (or copied on the device).
    pub fn job<'j, 'a, 'b>(
        &'j mut self,
        input: FrameSource<'j, 'a>,
        output: FrameTarget<'j, 'b>,
    ) -> FrameJob<'j, 'a, 'b> {
        self.prepare_control();
        FrameJob {
            frames: self,
            input,
            output,
        }
    }
}

/// One frame through [`DeviceFrames`] (a [`DeviceFrameIo`] for [`NeuralGpu::run_device`]).
///
/// [`NeuralGpu::run_device`]: super::neural::NeuralGpu::run_device
pub struct FrameJob<'j, 'a, 'b> {
    frames: &'j mut DeviceFrames,
    input: FrameSource<'j, 'a>,
    output: FrameTarget<'j, 'b>,
}

impl FrameJob<'_, '_, '_> {
    /// The verdict after the frame ran (see [`DeviceFrames::conclude`]).
    pub fn conclude(self) -> (SceneCut, usize) {
        self.frames.conclude()
    }

    /// The control block planned for this frame.
    pub(crate) fn control(&self) -> NfControl {
        *self.frames.control
    }

    /// The frame path's parameter block.
    pub(crate) fn params(&self) -> &NfFrame {
        &self.frames.params
    }

    fn nv12_rows(&self, at: u64) -> [Rows; 2] {
        let f = &self.frames;
        let rows = Rows::device(at, f.width);
        [rows, rows.offset(f.width * f.height)]
    }
}

impl DeviceFrameIo for FrameJob<'_, '_, '_> {
    fn upload(&mut self, stream: &CudaStream) -> Result<(), CudaError> {
        let f = &self.frames;
        let (w, h) = (f.width, f.height);
        let (source, bytes) = match &self.input {
            FrameSource::Host(i) => {
                check_host_frame(i.geometry, i.check(), (w, h), "input")?;
                let planes = host_planes(
                    i.y.as_ptr() as *mut u8,
                    i.y_stride,
                    i.uv.as_ptr() as *mut u8,
                    i.uv_stride,
                );
                (planes, f.frame_bytes())
            }
            FrameSource::Device(d) => {
                d.check(w, "input")?;
                (d.rows(), 0)
            }
        };
        let s = stream.cu_stream();
        // SAFETY: an `Nv12Frame` holds `h` (`h/2`) rows of `w` bytes `y_stride` (`uv_stride`)
        // apart, a device frame was mapped for this geometry in the network's context (rows
        // of at least `w` bytes, checked); the block holds packed NV12 of w×h at `nv12_in`;
        // the input outlives the frame's synchronisation. The control block is in the block
        // at `control` and the boxed host copy lives in `self.frames` past that
        // synchronisation.
        unsafe {
            copy_nv12(s, source, self.nv12_rows(f.params.nv12_in), w, h, "upload")?;
            copy_h2d(
                s,
                bytemuck::bytes_of(&*f.control).as_ptr(),
                f.params.control,
                std::mem::size_of::<NfControl>(),
            )
            .map_err(driver("neural frame control upload"))?;
        }
        self.frames.transferred.0 = bytes;
        Ok(())
    }

    fn before(&self, stream: &CudaStream) -> Result<(), CudaError> {
        let f = &self.frames;
        let p = &f.params;
        f.launch(
            stream,
            0,
            (p.thumb_w as u32, p.thumb_h as u32),
            (NF_BLOCK, 1),
        )?;
        f.launch(stream, 1, (1, 1), (NF_BLOCK, 1))?;
        if f.input_gathered {
            return Ok(());
        }
        let grid = (
            (p.net_w as u32).div_ceil(BLOCK_2D),
            (p.net_h as u32).div_ceil(BLOCK_2D),
        );
        f.launch(stream, 2, grid, (BLOCK_2D, BLOCK_2D))
    }

    fn after(&self, stream: &CudaStream) -> Result<(), CudaError> {
        let f = &self.frames;
        let over =
            |w: usize, h: usize| ((w as u32).div_ceil(BLOCK_2D), (h as u32).div_ceil(BLOCK_2D));
        let blocks = over(f.width / 2, f.height / 2);
        if f.scaled == (f.width, f.height) {
            return f.launch(stream, 3, blocks, (BLOCK_2D, BLOCK_2D));
        }
        f.launch(
            stream,
            4,
            over(f.scaled.0, f.scaled.1),
            (BLOCK_2D, BLOCK_2D),
        )?;
        f.launch(stream, 5, blocks, (BLOCK_2D, BLOCK_2D))
    }

    fn launches(&self) -> u32 {
        self.frames.launches()
    }

    fn launches_before(&self) -> u32 {
        self.frames.launches_before()
    }

    fn download(&mut self, stream: &CudaStream) -> Result<(), CudaError> {
        let (w, h) = (self.frames.width, self.frames.height);
        let (target, bytes) = match &mut self.output {
            FrameTarget::Host(o) => {
                check_host_frame(o.geometry, o.check(), (w, h), "output")?;
                let planes =
                    host_planes(o.y.as_mut_ptr(), o.y_stride, o.uv.as_mut_ptr(), o.uv_stride);
                (planes, self.frames.frame_bytes())
            }
            FrameTarget::Device(d) => {
                d.check(w, "output")?;
                (d.rows(), 0)
            }
        };
        let s = stream.cu_stream();
        let source = self.nv12_rows(self.frames.params.nv12_out);
        let state = self.frames.params.state;
        // SAFETY: as for the upload, the other way: the output planes (host, or device memory
        // mapped writable) are not read before the frame's synchronisation; the verdict box
        // holds an NfState and lives in `self.frames`.
        unsafe {
            copy_nv12(s, source, target, w, h, "download")?;
            copy_d2h(
                s,
                state,
                bytemuck::bytes_of_mut(&mut *self.frames.verdict).as_mut_ptr(),
                std::mem::size_of::<NfState>(),
            )
            .map_err(driver("scene verdict download"))?;
        }
        self.frames.transferred.1 = bytes;
        Ok(())
    }
}

/// A frame's scene verdict and the ring entries its filter used, from its [`NfState`].
pub(crate) fn verdict_of(state: &NfState) -> (SceneCut, usize) {
    (
        SceneCut {
            cut: state.cut != 0,
            score: state.score,
        },
        state.used.max(0) as usize,
    )
}

/// `target` for a shorter borrow (a frame's first half, before the calibration rebuilds the
/// network, then its second half).
pub fn reborrow<'s, 'b>(target: &'s mut FrameTarget<'_, 'b>) -> FrameTarget<'s, 'b> {
    match target {
        FrameTarget::Host(f) => FrameTarget::Host(f),
        FrameTarget::Device(d) => FrameTarget::Device(*d),
    }
}

/// Which ring slots a frame's output filter reads and which it writes, planned before the
/// scene verdicts of this frame and of the frames still in flight: the host plans the `used`
/// most recent slots since the last reset, the device reads as many of them as were written
/// since its last cut (none when it finds one) and writes the next slot. Plain bookkeeping,
/// the same entries as the CPU filter's ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingSlots {
    capacity: usize,
    /// The slot the next raw output goes to.
    next: usize,
    len: usize,
}

impl RingSlots {
    pub fn new(capacity: usize) -> RingSlots {
        RingSlots {
            capacity: capacity.min(OutputFilter::MAX_HISTORY),
            next: 0,
            len: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// For `history` (clamped to the capacity): the slots of the k-th most recent entries
    /// (k = 1..=used, in the first `used` places), `used`, and the slot this frame's output
    /// goes to (`None` with history 0: not recorded).
    pub fn plan(&self, history: usize) -> ([i32; 8], usize, Option<usize>) {
        let history = history.min(self.capacity);
        let used = self.len.min(history);
        let mut recent = [0i32; 8];
        for (k, slot) in recent.iter_mut().enumerate().take(used) {
            *slot = ((self.next + self.capacity - 1 - k) % self.capacity) as i32;
        }
        (recent, used, (history > 0).then_some(self.next))
    }

    /// After the frame is queued: whether it `wrote` its planned slot.
    pub fn commit(&mut self, wrote: bool) {
        if wrote && self.capacity > 0 {
            self.next = (self.next + 1) % self.capacity;
            self.len = (self.len + 1).min(self.capacity);
        }
    }
}

/// The two planes of an NV12 frame in host memory (a copy's source or target).
pub(crate) fn host_planes(y: *mut u8, y_pitch: usize, uv: *mut u8, uv_pitch: usize) -> [Rows; 2] {
    [
        Rows::Host {
            ptr: y,
            pitch: y_pitch,
        },
        Rows::Host {
            ptr: uv,
            pitch: uv_pitch,
        },
    ]
}

/// Bytes of a ring of `capacity` RGB frames of `w`×`h` in 8-bit codes (`ring_code`).
fn ring_bytes(w: usize, h: usize, capacity: usize) -> u64 {
    (3 * w * h * capacity).max(1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::Nv12Frame;
    use crate::pipeline::ring::TemporalRing;

    /// A host frame of another size, or whose planes do not hold it (the fields are public),
    /// is refused before any copy is queued.
    #[test]
    fn host_frames_of_another_size_or_short_planes_are_refused() {
        let geometry = FrameGeometry::new(64, 48).unwrap();
        let (y, uv) = (vec![0u8; 64 * 48], vec![0u8; 64 * 24]);
        let padded = vec![0u8; 80 * 47 + 64];
        let frame = |y: &[u8], y_stride, uv: &[u8], size| {
            let f = Nv12Frame {
                geometry,
                y,
                y_stride,
                uv,
                uv_stride: 64,
            };
            check_host_frame(geometry, f.check(), size, "input")
        };
        assert!(frame(&y, 64, &uv, (64, 48)).is_ok());
        assert!(frame(&padded, 80, &uv, (64, 48)).is_ok());
        let cases = [
            (frame(&y, 64, &uv, (64, 50)), "holds 64x50"),
            (frame(&y[1..], 64, &uv, (64, 48)), "Y plane"),
            (frame(&y, 64, &uv[..64 * 23], (64, 48)), "UV"),
            (frame(&y, 80, &uv, (64, 48)), "Y plane"),
            (frame(&y, 32, &uv, (64, 48)), "stride 32"),
        ];
        for (result, needle) in cases {
            let message = result.expect_err(needle).to_string();
            assert!(message.contains(needle), "{message}");
        }
    }

    #[test]
    fn device_taps_follow_the_converters_lists_in_order_and_refuse_wide_samples() {
        let axes = scaling_taps(38, 22, scaled_dimension(38, 0.4), scaled_dimension(22, 0.4));
        let flat = device_taps(&axes).unwrap();
        assert_eq!(flat.len(), 15 + 9 + 38 + 22);
        for (device, cpu) in flat.iter().zip(axes.iter().flatten()) {
            let n = cpu.weights.len();
            assert_eq!(
                (device.first as usize, device.count as usize),
                (cpu.first, n)
            );
            assert_eq!(&device.weights[..n], &cpu.weights[..]);
            assert!(device.weights[n..].iter().all(|&w| w == 0.0));
        }
        let wide = SampleTaps {
            first: 0,
            weights: vec![0.125; MAX_TAPS + 2],
        };
        assert!(device_taps(&[vec![wide], vec![], vec![], vec![]]).is_none());
        assert_eq!(std::mem::size_of::<NfTaps>(), 32);
    }

    /// Frame after frame with changing history, scene cuts, resets and reallocated rings, the
    /// slots the device reads (the host's plan trimmed to nf_scene's `kept`) hold the frames
    /// the CPU filter's ring holds, most recent first.
    #[test]
    fn ring_slots_follow_the_cpu_filters_ring_through_cuts_and_history_changes() {
        let mut capacity = 4;
        let mut slots = RingSlots::new(capacity);
        let mut device: Vec<Option<u32>> = vec![None; capacity];
        let mut cpu = TemporalRing::new(capacity, || 0u32);
        // nf_scene's count of entries since its last cut or reset (a reallocated ring does
        // not reset it: the host's plan is empty then)
        let mut kept = 0usize;
        let mut seed = 0x1234_5678u32;
        let (mut cuts, mut resets, mut grown) = (0, 0, 0);
        for frame in 0..600u32 {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            if (seed >> 4).is_multiple_of(23) && capacity < OutputFilter::MAX_HISTORY {
                // a longer history: the ring is reallocated empty on both sides
                capacity += 1;
                slots = RingSlots::new(capacity);
                device = vec![None; capacity];
                cpu = TemporalRing::new(capacity, || 0u32);
                grown += 1;
            }
            let history = (seed >> 8) as usize % (capacity + 1);
            let reset = (seed >> 20).is_multiple_of(13);
            let cut = !reset && (seed >> 16).is_multiple_of(7);
            if reset {
                // FLUSH/DISCONT: the host forgets the ring, the device its reference
                slots.clear();
                resets += 1;
            }
            // the CPU: a cut or reset empties the ring before the frame is filtered
            if cut || reset {
                cpu.clear();
            }
            cuts += usize::from(cut);
            let cpu_used = cpu.len().min(history);
            let cpu_frames: Vec<u32> = (1..=cpu_used).map(|k| *cpu.recent(k).unwrap()).collect();
            // the device: planned before the verdicts, trimmed to the entries since its last
            // cut or reset (nf_scene's `kept`)
            let (recent, planned, write) = slots.plan(history);
            if cut || reset {
                kept = 0;
            }
            let used = planned.min(kept);
            let device_frames: Vec<u32> = recent[..used]
                .iter()
                .map(|&s| device[s as usize].expect("a written slot"))
                .collect();
            assert_eq!(device_frames, cpu_frames, "frame {frame} history {history}");
            if let Some(w) = write {
                device[w] = Some(frame);
            }
            if history > 0 {
                cpu.push_with(|slot| *slot = frame);
            }
            slots.commit(write.is_some());
            kept = (kept + usize::from(write.is_some())).min(OutputFilter::MAX_HISTORY);
        }
        assert!(
            cuts > 20 && resets > 10 && grown >= 2,
            "{cuts} {resets} {grown}"
        );
        let mut off = RingSlots::new(0);
        assert_eq!(off.plan(3), ([0; 8], 0, None));
        off.commit(false);
        assert_eq!(off, RingSlots::new(0));
    }
}
