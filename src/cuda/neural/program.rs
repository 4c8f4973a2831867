//! The lowered stages of a specialised network turned into GPU launches: which kernel, which
//! parameter block, which grid. Pure Rust (no device): the executor allocates what
//! [`Program::arena`] and [`Program::static_bytes`] ask for and builds the program again with
//! the real base addresses, so every address in the parameter blocks is final and a captured
//! graph replays them as they are.
//!
//! Device memory of a program: one **arena** for the activations the stages exchange, laid out
//! by the project's planner (`memplan::ArenaPlan`, per-buffer element sizes: fp16 or fp32
//! storage), and one **static** block: the control block (smoothing, reset), the statistics
//! smoother's state, the moments scratch, the statistics, the weights (fp32), constants, resize
//! taps and the parameter blocks.

use std::collections::HashMap;

use crate::kernel_abi::{Define, KernelStruct, c_header, kernel_struct};
use crate::memplan::{ALIGN, ArenaPlan, BufferRequest, Growth};
use crate::neural::engine::Specialised;
use crate::neural::lower::{Lowered, Stage, StageKind, activation};
use crate::neural::onnx::NodeProto;
use crate::neural::ops::elementwise::Activation;
use crate::neural::precision::{PrecisionPlan, Reason, StoragePrecision};
use crate::neural::{NeuralError, Value};

/// Output channels one conv thread computes (the weights of one tap are contiguous).
pub const CONV_OCB: usize = 8;
/// Conv thread block (x along the output row, y down the rows).
pub const CONV_BLOCK: (u32, u32) = (32, 4);
/// Tensor-core conv: a block computes TC_ROWS output rows (one warp each) of TC_COLS pixels
/// and up to MMA_NT 8-channel tiles; its input tile (halves, TC_PIX per pixel) must fit in
/// TC_TILE_HALVES of shared memory, else the stage takes the CUDA-core path.
pub const TC_ROWS: u32 = 4;
/// Output rows (warps) of a 7x7 tensor-core block (`MmaGather::tall`), where
/// `Fusions::tall_7x7` allows: the tile's six halo rows are gathered once for eight rows of
/// outputs, not for four.
pub const TC_TALL_ROWS: u32 = 8;
/// Output rows a warp of the paired output convolution and of the 7x7 stem
/// (`MmaGather::rows_per_warp`).
pub const TC_PAIRED_ROWS: u32 = 2;
pub const TC_STEM_ROWS: u32 = 2;
pub const TC_COLS: u32 = 32;
pub const MMA_NT: u32 = 8;
/// Blocks below which a tensor-core launch splits its output channels over more blocks (about
/// four per SM of a large GPU).
pub const TC_MIN_BLOCKS: u32 = 512;
const TC_PIX: usize = 24;
pub const TC_TILE_HALVES: usize = 14336;
pub const MOMENTS_THREADS: u32 = 256;
/// Gram moments: threads and most blocks of a launch (a row of blocks for each pair of
/// 16-channel tiles), most channels, the channels of a tile (the mma's 16 rows), the sums a
/// block writes (its pair's 16x16 products, then a tile's 16 channel sums), the pairs of
/// tiles at most, and the sums the last block finishes (C x C products, C channel sums).
pub const GRAM_THREADS: u32 = 512;
pub const GRAM_MAX_BLOCKS: u32 = 128;
pub const GRAM_CHANNELS: usize = 32;
pub const GRAM_TILE: usize = 16;
pub const GRAM_SUMS: usize = GRAM_TILE * GRAM_TILE + GRAM_TILE;
pub const GRAM_MAX_PAIRS: usize = gram_pairs(GRAM_CHANNELS);
pub const GRAM_TOTAL: usize = GRAM_CHANNELS * GRAM_CHANNELS + GRAM_CHANNELS;
/// Warp steps of a Gram moments round (their loads in flight together).
pub const GRAM_UNROLL: usize = 4;
/// Elementwise chains over its statistics a Gram launch may finish (`stat_chains`), and the
/// most values such a chain may write (its last block computes them).
pub const GRAM_TAILS: usize = 2;
pub const GRAM_TAIL_MAX_VALUES: usize = 1024;
// a warp's channels-last staging (GRAM_UNROLL steps of 16 pixels x 32 bytes) reuses its sums'
// shared memory (`nn_moments_gram`)
const _: () = assert!(GRAM_UNROLL * 16 * 32 <= GRAM_SUMS * 8);
// an off-diagonal pair loads its two tiles in half the slots each; the kernel names the
// pairs of up to two tiles
const _: () = assert!(GRAM_UNROLL.is_multiple_of(2) && GRAM_CHANNELS <= 2 * GRAM_TILE);

/// The pairs of 16-channel tiles (a <= b) whose products the Gram moments of `c` channels sum.
pub const fn gram_pairs(c: usize) -> usize {
    let tiles = c.div_ceil(GRAM_TILE);
    tiles * (tiles + 1) / 2
}
/// Wide Gram moments (`nn_gram_wide` and its reduce and finish launches) for
/// `GRAM_CHANNELS < C <= GRAM_WIDE_MAX` (taken in whole tiles: [`gram_takes`]): threads a block, channels a tile (the 64x64 block of
/// products a block sums), the sums a block writes (those products, then a tile's channel
/// sums), the blocks a launch aims at (chunks of the pixels times pairs of tiles), and the
/// 1x1 convolution's outputs a finishing block computes.
pub const GRAM_WIDE_THREADS: u32 = 256;
pub const GRAM_WIDE_TILE: usize = 64;
pub const GRAM_WIDE_MAX: usize = 256;
pub const GRAM_WIDE_SUMS: usize = GRAM_WIDE_TILE * GRAM_WIDE_TILE + GRAM_WIDE_TILE;
pub const GRAM_WIDE_BLOCKS: u64 = 256;
pub const GRAM_WIDE_OUTS: usize = 4;
/// Entries of the Gram matrix one reducing block sums (a lane each, its warps splitting the
/// chunks).
pub const GRAM_WIDE_REDUCE_ENTRIES: u32 = 32;
/// Pixels a wide Gram block stages at a time.
const GRAM_WIDE_STEP: u64 = 64;
// nn_gram_wide lays its eight warps over the 64x64 block (rows 16 (w & 3), columns 32 (w >> 2))
// and stages 64 pixels x 64 channels in two cp.async rounds of its 256 threads; the finishing
// kernel's shared weights hold GRAM_WIDE_MAX input channels
const _: () = assert!(
    GRAM_WIDE_THREADS == 256
        && GRAM_WIDE_TILE == 64
        && GRAM_WIDE_STEP == 64
        && GRAM_WIDE_MAX <= 256
        // nn_gram_wide_reduce: a lane an entry
        && GRAM_WIDE_REDUCE_ENTRIES == 32
);

/// The pairs of 64-channel tiles (a <= b) of wide Gram moments over `c` channels.
pub const fn gram_wide_pairs(c: usize) -> usize {
    let tiles = c.div_ceil(GRAM_WIDE_TILE);
    tiles * (tiles + 1) / 2
}

/// The chunks of `hw` pixels a wide Gram launch over `c` channels splits each pair's sums
/// into: about [`GRAM_WIDE_BLOCKS`] blocks in all, at least one 64-pixel step each.
pub fn gram_wide_chunks(hw: u64, c: usize) -> u32 {
    let pairs = gram_wide_pairs(c) as u64;
    GRAM_WIDE_BLOCKS
        .div_ceil(pairs)
        .clamp(1, hw.div_ceil(GRAM_WIDE_STEP).max(1)) as u32
}

/// Whether Gram moments take an fp16 tensor of `c` channels and `hw` pixels: up to
/// [`GRAM_CHANNELS`] in one launch; up to [`GRAM_WIDE_MAX`] in the wide launches when `wide`,
/// in whole 64-channel tiles (the kernels also sum a part tile of a multiple of 16 channels,
/// but that path has not yet run on a GPU), `hw` a multiple of 8 so that an NCHW channel's
/// 8-pixel chunks stay 16-byte aligned.
pub fn gram_takes(c: usize, hw: usize, wide: bool) -> bool {
    c <= GRAM_CHANNELS
        || (wide && c <= GRAM_WIDE_MAX && c.is_multiple_of(GRAM_WIDE_TILE) && hw.is_multiple_of(8))
}
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Ops and operands one fused elementwise launch carries.
pub const EW_MAX_OPS: usize = 16;
pub const EW_MAX_OPERANDS: usize = 8;
/// Elements one elementwise thread computes along the last axis (when it divides that axis).
pub const EW_VEC: usize = 8;
/// Elements one thread of an affine chain computes (when it divides the last axis): its
/// coefficients are worked out once for all of them.
pub const EW_AFFINE_VEC: usize = 32;
/// The most values along the last axis of the per-last-axis affine path (its coefficients in
/// shared memory).
pub const EW_LAST_MAX: usize = 256;
/// Input channels of a tensor-core convolution that folds an affine chain into its gather at
/// most (`prologue_chain`: the coefficients of all of them in shared memory, after the table).
pub const PRE_MAX: usize = 64;
/// The shared memory those coefficients take (a and b per channel, f32).
const PRE_BYTES: u32 = (2 * PRE_MAX * 4) as u32;
/// Blocks of a per-last-axis affine launch at most (about eight resident a multiprocessor on
/// the large cards; each block pays for its coefficients once, then loops).
pub const EW_LAST_BLOCKS: u32 = 1024;

// Elementwise opcodes (binary first, then unary from NN_EW_FIRST_UNARY).
const EW_ADD: i32 = 1;
const EW_SUB: i32 = 2;
const EW_MUL: i32 = 3;
const EW_DIV: i32 = 4;
const EW_POW: i32 = 5;
const EW_MIN: i32 = 6;
const EW_MAX: i32 = 7;
const EW_PRELU: i32 = 8;
const EW_FIRST_UNARY: i32 = 20;
const EW_RELU: i32 = 20;
const EW_LEAKY: i32 = 21;
const EW_SIGMOID: i32 = 22;
const EW_TANH: i32 = 23;
const EW_SQRT: i32 = 24;
const EW_RECIP: i32 = 25;
const EW_NEG: i32 = 26;
const EW_ABS: i32 = 27;
const EW_EXP: i32 = 28;
const EW_LOG: i32 = 29;
const EW_FLOOR: i32 = 30;
const EW_CEIL: i32 = 31;
const EW_CLIP: i32 = 32;
const EW_IDENTITY: i32 = 33;

kernel_struct! {
/// One convolution stage: [Pad] + Conv (+ bias) [+ activation].
pub struct NnConv {
    pub x: u64,
    pub y: u64,
    /// fp32 weights, [oc block][ic within the group][ky][kx][CONV_OCB].
    pub w: u64,
    /// fp32 bias per output channel, or 0.
    pub b: u64,
    /// Tensor-core path: fp16 weights in B-fragment order (`mma_weights`), else 0.
    pub wh: u64,
    /// A Resize folded into the input gather: its taps (as `NnResize::taps`, for the resized
    /// h x w_in) and `x` is the Resize's input of rs_h x rs_w per channel; 0: no Resize.
    pub rs_taps: u64,
    /// Tensor-core path: a residual Add folded into the epilogue: the other addend, read at
    /// the output's own index (the output may be written over it), or 0.
    pub res: u64,
    /// Tensor-core path, channels-last gathers: the parameter block (`NnEltwise`) of a
    /// per-channel affine chain folded into the gather (`prologue_chain`): each gathered value
    /// is x's, taken through the chain as `nn_eltwise` would, then rounded to fp16; or 0.
    pub pre: u64,
    /// Tap-packed path, a 3-channel fp16 network input: the frame path's `NfFrame`; the gather
    /// reads the input's values from its NV12 planes (`nf_pixel_rgb`, the conversion's own
    /// arithmetic) instead of `x`. 0: read `x`. Set when the frame path attaches
    /// (`Program::frame_fields`).
    pub frame: u64,
    /// Tensor-core path: cin rounded up to 16, output channel tiles of 8.
    pub cin_pad: i32,
    pub n_tiles: i32,
    pub cin: i32,
    pub h: i32,
    pub w_in: i32,
    pub cout: i32,
    pub oh: i32,
    pub ow: i32,
    pub kh: i32,
    pub kw: i32,
    pub sh: i32,
    pub sw: i32,
    pub dh: i32,
    pub dw: i32,
    pub groups: i32,
    /// The Pad's begin pads and the padded size (the convolution's input).
    pub pad_t: i32,
    pub pad_l: i32,
    pub hp: i32,
    pub wp: i32,
    /// The convolution's own (zero) begin pads.
    pub conv_pt: i32,
    pub conv_pl: i32,
    /// 0 constant, 1 reflect, 2 edge.
    pub pad_mode: i32,
    pub pad_value: f32,
    pub act: i32,
    pub act_a: f32,
    pub act_b: f32,
    pub rs_h: i32,
    pub rs_w: i32,
    /// Tensor-core path: element strides of the input per channel, row and pixel (NCHW, or
    /// NHWC when the input Transpose is folded), and whether it is fp32: 1 rounded to fp16,
    /// 2 split into fp16 high and low halves, a second pass over the chunks (planar gather,
    /// `Storage::split`).
    pub x_cs: i32,
    pub x_rs: i32,
    pub x_ps: i32,
    pub x_f32: i32,
    /// Tensor-core path: element strides of the output (NHWC when the output Transpose is
    /// folded), and whether to round to fp16 before storing (the folded stage's storage).
    pub y_cs: i32,
    pub y_rs: i32,
    pub y_ps: i32,
    pub y_round: i32,
    /// Whether `res` is fp16.
    pub res_half: i32,
    /// Tensor-core path: horizontal taps packed side by side into one 16-wide K chunk (a
    /// layer of few input channels, `tap_pack`), 1 when not packed; `wh` is laid out for
    /// ceil(kw / pack) virtual taps of pack * cin channels.
    pub pack: i32,
    /// Tensor-core path: the first output row of this launch (a banded convolution runs as
    /// several launches of consecutive row bands, `Band`), else 0.
    pub row0: i32,
    /// Fixed-shape channels-last kernels with a folded Resize: the source pixels a block may
    /// stage in shared memory (`resize_patch`), 0: the gather reads through the taps.
    pub rs_patch: i32,
    /// Fixed-shape channels-last kernels with a direct gather: 2 when the block double-buffers
    /// its chunks (`pipelined`: the next chunk's tile and B fragments copied with `cp.async`
    /// while this chunk's products run), else 1.
    pub stages: i32,
    /// Tensor-core path: the activation after a folded residual Add (the Add's stage ends in
    /// one, `Folds::residual`), as `act`: applied to the sum; 0 none.
    pub res_act: i32,
    pub res_act_a: f32,
    pub res_act_b: f32,
}
}

kernel_struct! {
/// Host → device before every frame.
pub struct NnControl {
    /// model-stat-smoothing (0: each frame's own statistics).
    pub smoothing: f32,
    /// Non-zero: forget the smoothed statistics (scene cut, flush, caps).
    pub reset: i32,
    pub pad: [i32; 2],
}
}

kernel_struct! {
/// One normalize stage's statistics.
pub struct NnMoments {
    pub x: u64,
    pub mean: u64,
    pub var: u64,
    /// double [channels][blocks][2] scratch.
    pub partial: u64,
    /// u32 per channel, zero between launches.
    pub counter: u64,
    pub state_mean: u64,
    pub state_var: u64,
    pub state_primed: u64,
    pub control: u64,
    pub hw: i32,
    pub x_half: i32,
    /// Channels of a channels-last fp16 x (grid y: channel groups of 8), or 0: NCHW (grid y:
    /// channels).
    pub x_cl: i32,
    pub align: i32,
}
}

kernel_struct! {
/// Gram moments (`nn_moments_gram`): an fp16 tensor's statistics and those of a 1x1
/// convolution of it that only its statistics read (`gram_moments`).
pub struct NnMomentsGram {
    pub x: u64,
    /// double [pairs][blocks][GRAM_SUMS] scratch.
    pub partial: u64,
    /// One u32, zero between launches.
    pub counter: u64,
    pub control: u64,
    /// x's own statistics and smoother state (`mean` 0: x has none).
    pub mean: u64,
    pub var: u64,
    pub state_mean: u64,
    pub state_var: u64,
    pub state_primed: u64,
    /// The convolution: weights f32 [cout][c], bias f32 [cout] or 0.
    pub w: u64,
    pub b: u64,
    /// Its output's statistics and smoother state.
    pub y_mean: u64,
    pub y_var: u64,
    pub y_state_mean: u64,
    pub y_state_var: u64,
    pub y_state_primed: u64,
    /// Elementwise chains (`NnEltwise` blocks, 0 for none) over these statistics and
    /// constants, run in order by the last block once the statistics are stored.
    pub tail: [u64; GRAM_TAILS],
    /// Wide launches only: double [c][c] E[x x^T], then [c] E[x] (`nn_gram_wide_reduce`).
    pub gram: u64,
    pub hw: i64,
    pub c: i32,
    pub cout: i32,
    /// Non-zero: x is channels-last (`c` a multiple of 16: 2c bytes a pixel).
    pub cl: i32,
    /// Wide launches only: the pixel chunks of each pair (`gram_wide_chunks`).
    pub chunks: i32,
}
}

kernel_struct! {
/// InstanceNormalization's application (after its statistics).
pub struct NnNormApply {
    pub x: u64,
    pub y: u64,
    pub mean: u64,
    pub var: u64,
    pub scale: u64,
    pub bias: u64,
    pub c: i32,
    pub hw: i32,
    pub x_half: i32,
    pub y_half: i32,
    pub eps: f32,
    pub act: i32,
    pub act_a: f32,
    pub act_b: f32,
    /// Channels of a channels-last y, or 0: y NCHW.
    pub y_cl: i32,
    /// Channels of a channels-last x, or 0: x NCHW.
    pub x_cl: i32,
}
}

kernel_struct! {
/// A fused elementwise chain over a 4-D output.
pub struct NnEltwise {
    pub y: u64,
    pub operand: [u64; EW_MAX_OPERANDS],
    pub dims: [i32; 4],
    pub strides: [i32; 4 * EW_MAX_OPERANDS],
    pub operand_half: [i32; EW_MAX_OPERANDS],
    pub op_code: [i32; EW_MAX_OPS],
    pub op_a: [i32; EW_MAX_OPS],
    pub op_b: [i32; EW_MAX_OPS],
    pub op_p0: [f32; EW_MAX_OPS],
    pub op_p1: [f32; EW_MAX_OPS],
    pub n_ops: i32,
    pub y_half: i32,
    /// The affine path (`affine_chain`): the operand the chain is affine in, or -1; and the
    /// ops of the affine part (the rest are unary).
    pub affine_x: i32,
    pub affine_ops: i32,
    /// Non-zero: the affine part's constants vary along the last axis only, which holds at
    /// most EW_LAST_MAX values (a per-channel chain over a channels-last tensor, its dims
    /// ordered N, H, W, C; `affine_chain_last`).
    pub affine_last: i32,
    pub align: i32,
}
}

kernel_struct! {
/// A strided 4-D copy with conversion.
pub struct NnCopy {
    pub src: u64,
    pub dst: u64,
    pub dims: [i32; 4],
    pub src_strides: [i32; 4],
    pub dst_strides: [i32; 4],
    pub src_offset: i32,
    pub dst_offset: i32,
    pub src_half: i32,
    pub dst_half: i32,
}
}

kernel_struct! {
/// Resize of the last two axes from taps tables.
pub struct NnResize {
    pub x: u64,
    pub y: u64,
    /// (i0, i1, w0 bits, w1 bits) per output row, then per output column.
    pub taps: u64,
    pub planes: i32,
    pub in_h: i32,
    pub in_w: i32,
    pub out_h: i32,
    pub out_w: i32,
    pub x_half: i32,
    pub y_half: i32,
    pub pad: i32,
}
}

kernel_struct! {
/// Softmax over rows.
pub struct NnSoftmax {
    pub x: u64,
    pub y: u64,
    pub len: i32,
    pub x_half: i32,
    pub y_half: i32,
    pub pad: i32,
}
}

kernel_struct! {
/// Calibration: the magnitudes of one stage output of `n` values (fp16 with `half`, else f32,
/// in any layout) at `x`, as `precision::Range` records them on the host. `nn_range` adds to
/// the result fields, which start at zero: the finite values' sum of squares and largest
/// magnitude (its f32 bits: non-negative floats order as their bits), and how many values are
/// not finite.
pub struct NnRange {
    pub x: u64,
    pub n: u64,
    pub sum_squares: f64,
    pub absmax_bits: u32,
    pub non_finite: u32,
    pub half: i32,
    pub pad: i32,
}
}

/// Threads of an `nn_range` block, and its most blocks (a grid-stride loop covers the rest).
pub const RANGE_THREADS: u32 = 256;
pub const RANGE_MAX_BLOCKS: u32 = 1024;

/// The C text the kernels are compiled with (prepended to kernels/neural.cu).
pub fn header() -> String {
    let defines = [
        Define::int("NN_CONV_OCB", CONV_OCB as i64),
        Define::int("NN_TC_ROWS", TC_ROWS as i64),
        Define::int("NN_TC_TALL_ROWS", TC_TALL_ROWS as i64),
        Define::int("NN_TC_PAIRED_ROWS", TC_PAIRED_ROWS as i64),
        Define::int("NN_TC_STEM_ROWS", TC_STEM_ROWS as i64),
        Define::int("NN_TC_COLS", TC_COLS as i64),
        Define::int("NN_EW_VEC", EW_VEC as i64),
        Define::int("NN_GRAM_THREADS", GRAM_THREADS as i64),
        Define::int("NN_GRAM_SUMS", GRAM_SUMS as i64),
        Define::int("NN_GRAM_CHANNELS", GRAM_CHANNELS as i64),
        Define::int("NN_GRAM_TOTAL", GRAM_TOTAL as i64),
        Define::int("NN_GRAM_UNROLL", GRAM_UNROLL as i64),
        Define::int("NN_GRAM_TAILS", GRAM_TAILS as i64),
        Define::int("NN_GRAM_WIDE_THREADS", GRAM_WIDE_THREADS as i64),
        Define::int("NN_GRAM_WIDE_MAX", GRAM_WIDE_MAX as i64),
        Define::int("NN_GRAM_WIDE_SUMS", GRAM_WIDE_SUMS as i64),
        Define::int("NN_GRAM_WIDE_OUTS", GRAM_WIDE_OUTS as i64),
        Define::int(
            "NN_GRAM_WIDE_REDUCE_ENTRIES",
            GRAM_WIDE_REDUCE_ENTRIES as i64,
        ),
        Define::int("NN_EW_AFFINE_VEC", EW_AFFINE_VEC as i64),
        Define::int("NN_EW_LAST_MAX", EW_LAST_MAX as i64),
        Define::int("NN_PRE_MAX", PRE_MAX as i64),
        Define::int("NN_EW_ADD", EW_ADD),
        Define::int("NN_EW_SUB", EW_SUB),
        Define::int("NN_EW_MUL", EW_MUL),
        Define::int("NN_EW_DIV", EW_DIV),
        Define::int("NN_EW_POW", EW_POW),
        Define::int("NN_EW_MIN", EW_MIN),
        Define::int("NN_EW_MAX", EW_MAX),
        Define::int("NN_EW_PRELU", EW_PRELU),
        Define::int("NN_EW_FIRST_UNARY", EW_FIRST_UNARY),
        Define::int("NN_EW_RELU", EW_RELU),
        Define::int("NN_EW_LEAKY", EW_LEAKY),
        Define::int("NN_EW_SIGMOID", EW_SIGMOID),
        Define::int("NN_EW_TANH", EW_TANH),
        Define::int("NN_EW_SQRT", EW_SQRT),
        Define::int("NN_EW_RECIP", EW_RECIP),
        Define::int("NN_EW_NEG", EW_NEG),
        Define::int("NN_EW_ABS", EW_ABS),
        Define::int("NN_EW_EXP", EW_EXP),
        Define::int("NN_EW_LOG", EW_LOG),
        Define::int("NN_EW_FLOOR", EW_FLOOR),
        Define::int("NN_EW_CEIL", EW_CEIL),
        Define::int("NN_EW_CLIP", EW_CLIP),
        Define::int("NN_EW_IDENTITY", EW_IDENTITY),
    ];
    c_header(
        "toonflow neural ABI",
        &defines,
        &[
            NnConv::c_declaration(),
            NnControl::c_declaration(),
            NnMoments::c_declaration(),
            NnMomentsGram::c_declaration(),
            NnNormApply::c_declaration(),
            NnEltwise::c_declaration(),
            NnCopy::c_declaration(),
            NnResize::c_declaration(),
            NnSoftmax::c_declaration(),
            NnRange::c_declaration(),
            // the frame path's block, which the stem's NV12 gather reads (NnConv::frame)
            crate::cuda::neural_frame::NfFrame::c_declaration(),
        ],
    )
}

/// How a tensor-core convolution gathers its input tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MmaGather {
    /// Any layout by strides (NCHW, the network's NHWC input, a folded Resize), 16 channels
    /// of a pixel per K chunk.
    Planar,
    /// A channels-last fp16 input (`channels_last_values`): 16-byte loads.
    ChannelsLast,
    /// Several horizontal taps of a few-channel input per K chunk (`tap_pack`).
    TapPacked,
    /// Channels-last, the horizontal taps paired in N (a 7x7 stride-1 layer of ≤ 4 output
    /// channels, `paired_weights`): one output channel tile, 31 outputs a warp; the shape
    /// compiled in as `ChannelsLast3x3`'s.
    ChannelsLastPaired,
    /// Channels-last, a 3x3 convolution of stride 1 and dilation 1 with fp16 output: the tile's
    /// shape compiled in, the tap loop unrolled, a chunk's B fragments staged in shared memory
    /// (`b_stage_bytes`), a separable source table.
    ChannelsLast3x3,
    /// As `ChannelsLast3x3` for stride 2 (1 or 2 channel tiles: at 8, within 48 KiB with its
    /// separable table, it measured no faster than the general gather on the H200).
    ChannelsLast3x3S2,
    /// As `ChannelsLast3x3` through a folded Resize: the block stages the source pixels its
    /// taps reach once a chunk (`NnConv::rs_patch`, `resize_patch`) instead of loading four
    /// for every tile pixel.
    ChannelsLast3x3Resize,
    /// As `ChannelsLast3x3` (two channel tiles, one stage) with a folded fp16 residual Add into
    /// a channels-last fp16 output of even channels: the epilogue reads the addend and writes
    /// the sum a channel pair at a time (`fixed_shape_matches`).
    ChannelsLast3x3Residual,
    /// A stride-1 1x1 over a channels-last input at eight channel tiles, double-buffered with
    /// the fixed shapes' staging: each chunk's B fragments are copied with its tile instead of
    /// loaded once a chunk with nothing to hide the load behind. `Fusions::fixed_1x1`.
    ChannelsLast1x1,
    /// Tap-packed as `TapPacked`, a 7x7 convolution of stride 1 and dilation 1 over at most 4
    /// channels (the stem: 4 taps a virtual tap), its shape compiled in as `ChannelsLast3x3`'s.
    TapPacked7x7,
}

impl MmaGather {
    /// The taps a fixed-shape kernel unrolls and stages B fragments for (0: the shape is read
    /// from the parameter block).
    pub const fn fixed_taps(self) -> u32 {
        match self {
            MmaGather::ChannelsLast3x3
            | MmaGather::ChannelsLast3x3S2
            | MmaGather::ChannelsLast3x3Resize
            | MmaGather::ChannelsLast3x3Residual => 9,
            MmaGather::ChannelsLast1x1 => 1,
            MmaGather::TapPacked7x7 => 7 * 2,
            MmaGather::ChannelsLastPaired => 7 * 4,
            _ => 0,
        }
    }

    /// Output rows each warp computes: the paired output convolution's warps take
    /// `TC_PAIRED_ROWS` consecutive rows and the stem's `TC_STEM_ROWS`, loading each tile row's
    /// A fragments once for all of them (a 7x7 kernel loads each tile row for seven output
    /// rows); the others one.
    pub const fn rows_per_warp(self) -> u32 {
        match self {
            MmaGather::ChannelsLastPaired => TC_PAIRED_ROWS,
            MmaGather::TapPacked7x7 => TC_STEM_ROWS,
            _ => 1,
        }
    }

    /// Whether the kernel takes its block's output rows from the launch (`TC_TALL_ROWS`), not
    /// compiled in (`TC_ROWS`): the 7x7 ones, whose tiles have six halo rows.
    pub const fn tall(self) -> bool {
        matches!(
            self,
            MmaGather::TapPacked7x7 | MmaGather::ChannelsLastPaired
        )
    }
}

/// The kernels a program launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Convolution with (input half, output half).
    Conv(bool, bool),
    /// Tensor-core convolution (fp16 input) with output half, 8-channel tiles per block (1, 2,
    /// 4 or 8: the accumulators a thread holds) and its gather (each a kernel of its own, so
    /// one gather's registers do not cost another occupancy).
    ConvMma(bool, u8, MmaGather),
    Moments,
    MomentsGram,
    /// Wide Gram moments: the partial sums, their reduction, the finishing.
    GramWide,
    GramWideReduce,
    GramWideFinish,
    NormApply,
    Eltwise,
    Copy,
    Resize,
    Softmax,
    /// Calibration only, not in a program: a stage output's magnitudes (`NnRange`).
    Range,
}

impl Kernel {
    /// How many kernels kernels/neural.cu defines.
    pub const COUNT: usize = 50;

    /// Every kernel: the tensor-core variants (output fp32/fp16 x 1, 2, 4, 8 channel tiles x
    /// planar/channels-last gather, and the tap-packed fp16 ones), then the rest.
    pub const ALL: [Kernel; Kernel::COUNT] = {
        const TILES: [u8; 4] = [1, 2, 4, 8];
        let mut all = [Kernel::Moments; Kernel::COUNT];
        let mut n = 0;
        let mut g = 0;
        while g < 2 {
            let gather = [MmaGather::Planar, MmaGather::ChannelsLast][g];
            let mut half = 0;
            while half < 2 {
                let mut t = 0;
                while t < TILES.len() {
                    all[n] = Kernel::ConvMma(half == 1, TILES[t], gather);
                    n += 1;
                    t += 1;
                }
                half += 1;
            }
            g += 1;
        }
        let mut t = 0;
        while t < TILES.len() {
            all[n] = Kernel::ConvMma(true, TILES[t], MmaGather::TapPacked);
            n += 1;
            t += 1;
        }
        // the fixed 3x3 shapes at the tile counts where they beat the general gather
        // (`fixed_shape_matches`)
        all[n] = Kernel::ConvMma(true, 1, MmaGather::ChannelsLast3x3);
        all[n + 1] = Kernel::ConvMma(true, 2, MmaGather::ChannelsLast3x3);
        all[n + 2] = Kernel::ConvMma(true, 8, MmaGather::ChannelsLast3x3);
        all[n + 3] = Kernel::ConvMma(true, 8, MmaGather::ChannelsLast3x3Resize);
        all[n + 4] = Kernel::ConvMma(true, 1, MmaGather::ChannelsLast3x3S2);
        all[n + 5] = Kernel::ConvMma(true, 2, MmaGather::ChannelsLast3x3S2);
        all[n + 6] = Kernel::ConvMma(true, 4, MmaGather::ChannelsLast3x3);
        all[n + 7] = Kernel::ConvMma(true, 4, MmaGather::ChannelsLast3x3Resize);
        all[n + 8] = Kernel::ConvMma(true, 2, MmaGather::ChannelsLast3x3Residual);
        all[n + 9] = Kernel::ConvMma(true, 8, MmaGather::ChannelsLast1x1);
        n += 10;
        let mut t = 0;
        while t < 3 {
            all[n] = Kernel::ConvMma(true, TILES[t], MmaGather::TapPacked7x7);
            n += 1;
            t += 1;
        }
        all[n] = Kernel::ConvMma(false, 1, MmaGather::ChannelsLastPaired);
        all[n + 1] = Kernel::ConvMma(true, 1, MmaGather::ChannelsLastPaired);
        n += 2;
        let rest = [
            Kernel::Conv(false, false),
            Kernel::Conv(false, true),
            Kernel::Conv(true, false),
            Kernel::Conv(true, true),
            Kernel::Moments,
            Kernel::MomentsGram,
            Kernel::GramWide,
            Kernel::GramWideReduce,
            Kernel::GramWideFinish,
            Kernel::NormApply,
            Kernel::Eltwise,
            Kernel::Copy,
            Kernel::Resize,
            Kernel::Softmax,
            Kernel::Range,
        ];
        let mut r = 0;
        while r < rest.len() {
            all[n] = rest[r];
            n += 1;
            r += 1;
        }
        assert!(n == Kernel::COUNT, "Kernel::COUNT is the number of kernels");
        all
    };

    /// The launch that stores Gram moments' statistics and runs their chains.
    pub const fn finishes_gram(self) -> bool {
        matches!(self, Kernel::MomentsGram | Kernel::GramWideFinish)
    }

    pub const fn name(self) -> &'static str {
        match self {
            Kernel::Conv(false, false) => "nn_conv_ff",
            Kernel::Conv(false, true) => "nn_conv_fh",
            Kernel::Conv(true, false) => "nn_conv_hf",
            Kernel::Conv(true, true) => "nn_conv_hh",
            Kernel::ConvMma(false, 1, MmaGather::Planar) => "nn_conv_mma_hf_1",
            Kernel::ConvMma(false, 1, MmaGather::ChannelsLast) => "nn_conv_mma_hf_1_cl",
            Kernel::ConvMma(false, 2, MmaGather::Planar) => "nn_conv_mma_hf_2",
            Kernel::ConvMma(false, 2, MmaGather::ChannelsLast) => "nn_conv_mma_hf_2_cl",
            Kernel::ConvMma(false, 4, MmaGather::Planar) => "nn_conv_mma_hf_4",
            Kernel::ConvMma(false, 4, MmaGather::ChannelsLast) => "nn_conv_mma_hf_4_cl",
            Kernel::ConvMma(false, _, MmaGather::Planar) => "nn_conv_mma_hf_8",
            Kernel::ConvMma(false, _, MmaGather::ChannelsLast) => "nn_conv_mma_hf_8_cl",
            Kernel::ConvMma(true, 1, MmaGather::Planar) => "nn_conv_mma_hh_1",
            Kernel::ConvMma(true, 1, MmaGather::ChannelsLast) => "nn_conv_mma_hh_1_cl",
            Kernel::ConvMma(true, 2, MmaGather::Planar) => "nn_conv_mma_hh_2",
            Kernel::ConvMma(true, 2, MmaGather::ChannelsLast) => "nn_conv_mma_hh_2_cl",
            Kernel::ConvMma(true, 4, MmaGather::Planar) => "nn_conv_mma_hh_4",
            Kernel::ConvMma(true, 4, MmaGather::ChannelsLast) => "nn_conv_mma_hh_4_cl",
            Kernel::ConvMma(true, _, MmaGather::Planar) => "nn_conv_mma_hh_8",
            Kernel::ConvMma(true, _, MmaGather::ChannelsLast) => "nn_conv_mma_hh_8_cl",
            Kernel::ConvMma(_, 1, MmaGather::TapPacked) => "nn_conv_mma_hh_1_tp",
            Kernel::ConvMma(_, 2, MmaGather::TapPacked) => "nn_conv_mma_hh_2_tp",
            Kernel::ConvMma(_, 4, MmaGather::TapPacked) => "nn_conv_mma_hh_4_tp",
            Kernel::ConvMma(_, _, MmaGather::TapPacked) => "nn_conv_mma_hh_8_tp",
            Kernel::ConvMma(_, 1, MmaGather::ChannelsLast3x3) => "nn_conv_mma_hh_1_c3",
            Kernel::ConvMma(_, 2, MmaGather::ChannelsLast3x3) => "nn_conv_mma_hh_2_c3",
            Kernel::ConvMma(_, 4, MmaGather::ChannelsLast3x3) => "nn_conv_mma_hh_4_c3",
            Kernel::ConvMma(_, _, MmaGather::ChannelsLast3x3) => "nn_conv_mma_hh_8_c3",
            Kernel::ConvMma(_, _, MmaGather::ChannelsLast3x3Residual) => "nn_conv_mma_hh_2_c3p",
            Kernel::ConvMma(_, _, MmaGather::ChannelsLast1x1) => "nn_conv_mma_hh_8_c1",
            Kernel::ConvMma(_, 4, MmaGather::ChannelsLast3x3Resize) => "nn_conv_mma_hh_4_c3r",
            Kernel::ConvMma(_, _, MmaGather::ChannelsLast3x3Resize) => "nn_conv_mma_hh_8_c3r",
            Kernel::ConvMma(_, 1, MmaGather::ChannelsLast3x3S2) => "nn_conv_mma_hh_1_c3s2",
            Kernel::ConvMma(_, _, MmaGather::ChannelsLast3x3S2) => "nn_conv_mma_hh_2_c3s2",
            Kernel::ConvMma(_, 1, MmaGather::TapPacked7x7) => "nn_conv_mma_hh_1_t7",
            Kernel::ConvMma(_, 2, MmaGather::TapPacked7x7) => "nn_conv_mma_hh_2_t7",
            Kernel::ConvMma(_, _, MmaGather::TapPacked7x7) => "nn_conv_mma_hh_4_t7",
            Kernel::ConvMma(false, _, MmaGather::ChannelsLastPaired) => "nn_conv_mma_hf_1_cp",
            Kernel::ConvMma(true, _, MmaGather::ChannelsLastPaired) => "nn_conv_mma_hh_1_cp",
            Kernel::Moments => "nn_moments",
            Kernel::MomentsGram => "nn_moments_gram",
            Kernel::GramWide => "nn_gram_wide",
            Kernel::GramWideReduce => "nn_gram_wide_reduce",
            Kernel::GramWideFinish => "nn_gram_wide_finish",
            Kernel::NormApply => "nn_norm_apply",
            Kernel::Eltwise => "nn_eltwise",
            Kernel::Copy => "nn_copy",
            Kernel::Resize => "nn_resize",
            Kernel::Softmax => "nn_softmax",
            Kernel::Range => "nn_range",
        }
    }
}

/// Every kernel of kernels/neural.cu, by name (derived from [`Kernel::ALL`] and
/// [`Kernel::name`], the one list of them).
pub const KERNEL_NAMES: [&str; Kernel::COUNT] = {
    let mut names = [""; Kernel::COUNT];
    let mut i = 0;
    while i < Kernel::COUNT {
        names[i] = Kernel::ALL[i].name();
        i += 1;
    }
    names
};

/// One kernel launch: its parameter block sits at `params` (an absolute device address).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Launch {
    pub kernel: Kernel,
    pub params: u64,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Dynamic shared memory bytes.
    pub shared: u32,
    /// The stage it belongs to.
    pub stage: usize,
}

/// Where a value lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub addr: u64,
    pub half: bool,
    pub elements: u64,
    /// `Some(c)`: stored channels-last (NHWC, c channels), a value that only tensor-core
    /// convolutions write and read (`channels_last_values`); `None`: NCHW.
    pub channels_last: Option<u32>,
}

impl Place {
    /// The bytes it takes, from its address.
    pub fn span(&self) -> std::ops::Range<u64> {
        self.addr..self.addr + self.elements * if self.half { 2 } else { 4 }
    }
}

/// A normalize stage's statistics, for the host hook (fp32, `channels` each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatsPlace {
    pub stage: usize,
    pub mean: u64,
    pub var: u64,
    pub channels: usize,
}

impl StatsPlace {
    /// The mean and the variance as places (fp32, `channels` values each).
    pub fn places(&self) -> [Place; 2] {
        [self.mean, self.var].map(|addr| Place {
            addr,
            half: false,
            elements: self.channels as u64,
            channels_last: None,
        })
    }
}

/// Tensor cores for fp16 convolutions unless `TOONFLOW_NEURAL_MMA=0` (the executor uses them
/// on sm_80+ only; tests/neural_cuda.rs checks both paths).
pub fn tensor_cores_default() -> bool {
    switch("TOONFLOW_NEURAL_MMA", true)
}

/// An environment switch for comparisons: on by default unless set to `0`, or off by default
/// unless set to `1`.
fn switch(name: &str, default: bool) -> bool {
    match std::env::var(name) {
        Ok(v) if default => v != "0",
        Ok(v) => v == "1",
        Err(_) => default,
    }
}

/// The fusions a plan may use. `Fusions::from_env()` (what `Storage` takes by default) turns
/// each off or on through an environment variable, for comparisons (`tools/h200.sh neural-ab`);
/// tests set them directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fusions {
    /// Gram moments for the modulated normalization (`gram_moments`): the 1x1 convolution and
    /// both statistics passes do not run. `TOONFLOW_NEURAL_GRAM=0` turns it off.
    pub gram: bool,
    /// Gram moments also for 64 to 256 channels in whole 64-channel tiles (`gram_takes`: three
    /// launches, `nn_gram_wide`). `TOONFLOW_NEURAL_GRAM_WIDE=0` turns it off.
    pub gram_wide: bool,
    /// Paired horizontal taps for narrow channels-last convolutions
    /// (`MmaGather::ChannelsLastPaired`). `TOONFLOW_NEURAL_PAIRED=0` turns it off.
    pub paired: bool,
    /// The compiled-shape kernels (`fixed_shape_matches`). `TOONFLOW_NEURAL_3X3=0` turns them
    /// off.
    pub fixed_shapes: bool,
    /// Per-channel affine chains taken into the next convolution's gather (`prologue_chain`).
    /// `TOONFLOW_NEURAL_PROLOGUE=0` turns it off.
    pub prologue: bool,
    /// A folded Resize's source patch staged once a chunk by the fixed-shape kernels
    /// (`resize_patch`). `TOONFLOW_NEURAL_PATCH=0` turns it off.
    pub resize_patch: bool,
    /// The fixed stride-1 3x3 kernels double-buffer their chunks where the gather is a direct
    /// copy of at least two chunks (`NnConv::stages`, `pipelined`). `TOONFLOW_NEURAL_PIPELINE=0` turns it off.
    pub pipelined: bool,
    /// The general channels-last kernels double-buffer their tiles likewise
    /// (`pipelined_general`). `TOONFLOW_NEURAL_PIPELINE_CL=0` turns it off.
    pub pipelined_general: bool,
    /// The staged Resize patch double-buffered too (`pipelined_patch`).
    /// `TOONFLOW_NEURAL_PIPELINE_PATCH=0` turns it off.
    pub pipelined_patch: bool,
    /// The staged Resize patch at four channel tiles too, where it can be double-buffered
    /// (`fixed_shape_matches`). `TOONFLOW_NEURAL_NARROW_PATCH=0` turns it off.
    pub narrow_patch: bool,
    /// A residual Add folded into the convolution before it also when its stage ends in an
    /// activation (`FoldedAdd::act`). `TOONFLOW_NEURAL_RESIDUAL_ACT=0` turns it off.
    pub residual_act: bool,
    /// The fixed two-tile 3x3 with a folded fp16 residual reads and writes it a channel pair
    /// at a time (`MmaGather::ChannelsLast3x3Residual`). `TOONFLOW_NEURAL_RESIDUAL_PAIRS=0`
    /// turns it off.
    pub residual_pairs: bool,
    /// The 7x7 kernels (stem, paired output convolution) run `TC_TALL_ROWS` rows a block
    /// (`MmaGather::tall`). `TOONFLOW_NEURAL_TALL=0` turns it off.
    pub tall_7x7: bool,
    /// The eight-tile fixed 3x3 (`MmaGather::ChannelsLast3x3`) runs `TC_TALL_ROWS` rows a block:
    /// a chunk's B fragments (18 KiB) and the tile's two halo rows are staged once for eight
    /// output rows, not four. `TOONFLOW_NEURAL_TALL3=1` turns it on.
    pub tall_3x3: bool,
    /// The network's input stored in fp16 where its only reader is a tensor-core convolution
    /// that takes it through the NHWC gather (`half_input`): that convolution rounds it to
    /// fp16 as it stages it anyway. `TOONFLOW_NEURAL_HALF_INPUT=0` turns it off.
    pub half_input: bool,
    /// Elementwise chains over the Gram moments' statistics alone (e.g. sqrt(var + eps))
    /// computed by the Gram launch's last block instead of a launch each (`stat_chains`).
    /// `TOONFLOW_NEURAL_STAT_CHAINS=0` turns it off.
    pub stat_chains: bool,
    /// The double-buffered stride-1 1x1 over channels-last inputs at eight channel tiles takes
    /// the fixed shapes' staging (`MmaGather::ChannelsLast1x1`). `TOONFLOW_NEURAL_1X1=0` turns
    /// it off.
    pub fixed_1x1: bool,
    /// An instance normalization reads a channels-last input (its statistics 8 channels a
    /// pixel, its application across the pixel), so the tensors before it may stay
    /// channels-last. `TOONFLOW_NEURAL_INSTANCE_CL=0` turns it off.
    pub instance_cl: bool,
}

impl Fusions {
    pub const ALL: Fusions = Fusions {
        gram: true,
        gram_wide: true,
        paired: true,
        fixed_shapes: true,
        prologue: true,
        resize_patch: true,
        pipelined: true,
        pipelined_general: true,
        pipelined_patch: true,
        narrow_patch: true,
        residual_act: true,
        residual_pairs: true,
        tall_7x7: true,
        tall_3x3: true,
        half_input: true,
        stat_chains: true,
        fixed_1x1: true,
        instance_cl: true,
    };
    pub const NONE: Fusions = Fusions {
        gram: false,
        gram_wide: false,
        paired: false,
        fixed_shapes: false,
        prologue: false,
        resize_patch: false,
        pipelined: false,
        pipelined_general: false,
        pipelined_patch: false,
        narrow_patch: false,
        residual_act: false,
        residual_pairs: false,
        tall_7x7: false,
        tall_3x3: false,
        half_input: false,
        stat_chains: false,
        fixed_1x1: false,
        instance_cl: false,
    };

    /// These fusions with every double-buffered gather single-buffered (a card whose
    /// multiprocessor holds fewer than three such blocks: `PIPELINE_MIN_SHARED_PER_SM`).
    pub fn single_buffered(self) -> Self {
        Fusions {
            pipelined: false,
            pipelined_general: false,
            pipelined_patch: false,
            narrow_patch: false,
            ..self
        }
    }

    pub fn from_env() -> Self {
        Fusions {
            gram: switch("TOONFLOW_NEURAL_GRAM", true),
            gram_wide: switch("TOONFLOW_NEURAL_GRAM_WIDE", true),
            paired: switch("TOONFLOW_NEURAL_PAIRED", true),
            fixed_shapes: switch("TOONFLOW_NEURAL_3X3", true),
            prologue: switch("TOONFLOW_NEURAL_PROLOGUE", true),
            resize_patch: switch("TOONFLOW_NEURAL_PATCH", true),
            pipelined: switch("TOONFLOW_NEURAL_PIPELINE", true),
            pipelined_general: switch("TOONFLOW_NEURAL_PIPELINE_CL", true),
            pipelined_patch: switch("TOONFLOW_NEURAL_PIPELINE_PATCH", true),
            narrow_patch: switch("TOONFLOW_NEURAL_NARROW_PATCH", true),
            residual_act: switch("TOONFLOW_NEURAL_RESIDUAL_ACT", true),
            residual_pairs: switch("TOONFLOW_NEURAL_RESIDUAL_PAIRS", true),
            tall_7x7: switch("TOONFLOW_NEURAL_TALL", true),
            tall_3x3: switch("TOONFLOW_NEURAL_TALL3", false),
            half_input: switch("TOONFLOW_NEURAL_HALF_INPUT", true),
            stat_chains: switch("TOONFLOW_NEURAL_STAT_CHAINS", true),
            fixed_1x1: switch("TOONFLOW_NEURAL_1X1", true),
            instance_cl: switch("TOONFLOW_NEURAL_INSTANCE_CL", true),
        }
    }
}

/// Storage of each stage's outputs: fp16 (`true`) or fp32, and whether convolutions reading
/// fp16 may use tensor cores (sm_80+).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Storage {
    pub half: Vec<bool>,
    pub tensor_cores: bool,
    pub fusions: Fusions,
    /// fp32 stages whose values fit fp16's range (calibration kept them fp32 for their
    /// variance, not their magnitude): a tensor-core convolution may read them as two fp16
    /// halves, x = fp16(x) + fp16(x - fp16(x)), good to 22 bits instead of 11, where it would
    /// otherwise run on CUDA cores (`NnConv::x_f32` 2). Empty: none.
    pub split: Vec<bool>,
    /// The network's input is the frame path's NV12 frame (`DeviceFrames`, model-scale 1):
    /// where every reader of the input is a tap-packed stem, it gathers the values from the
    /// NV12 planes itself and the input tensor is neither planned nor written
    /// (`Program::frame_fields`). `TOONFLOW_NEURAL_NV12_STEM=0` turns it off.
    pub frame_input: bool,
}

impl Storage {
    pub fn uniform(stages: usize, half: bool) -> Self {
        Storage {
            half: vec![half; stages],
            tensor_cores: tensor_cores_default(),
            fusions: Fusions::from_env(),
            split: Vec::new(),
            frame_input: false,
        }
    }

    /// This storage with the input from the frame path's NV12 frame where `on` (and
    /// `TOONFLOW_NEURAL_NV12_STEM` is not 0).
    pub fn with_frame_input(self, on: bool) -> Self {
        Storage {
            frame_input: on && switch("TOONFLOW_NEURAL_NV12_STEM", true),
            ..self
        }
    }

    /// The calibrated decision per stage (src/neural/precision.rs); its fp32 stages of
    /// `Reason::Variance` split in two for the tensor cores unless `TOONFLOW_NEURAL_SPLIT=0`.
    pub fn from_plan(plan: &PrecisionPlan) -> Self {
        let split = switch("TOONFLOW_NEURAL_SPLIT", true);
        Storage {
            half: (0..plan.len())
                .map(|i| plan.stage(i) == StoragePrecision::Fp16)
                .collect(),
            tensor_cores: tensor_cores_default(),
            fusions: Fusions::from_env(),
            split: plan
                .decisions
                .iter()
                .map(|d| {
                    split && d.precision == StoragePrecision::Fp32 && d.reason == Reason::Variance
                })
                .collect(),
            frame_input: false,
        }
    }

    /// Whether stage `i`'s fp32 outputs may be read split in two (`split`).
    pub fn splits(&self, i: usize) -> bool {
        self.split.get(i) == Some(&true) && self.half.get(i) == Some(&false)
    }
}

/// A specialised network as launches, with every address resolved against the two bases.
#[derive(Debug, Clone)]
pub struct Program {
    pub arena: ArenaPlan,
    pub static_bytes: u64,
    /// The static block's initial bytes (weights, taps, parameter blocks; zeros elsewhere).
    pub static_init: Vec<u8>,
    pub launches: Vec<Launch>,
    pub input: Place,
    pub output: Place,
    pub control: u64,
    pub stats: Vec<StatsPlace>,
    /// Each stage's outputs (for calibration readback).
    pub stage_outputs: Vec<Vec<Place>>,
    /// Bytes of weights and constants in the static block.
    pub weight_bytes: u64,
    /// Stages with no launch of their own: Resizes and layout Transposes folded into the
    /// neighbouring stage's tensor-core convolution.
    pub folded_stages: Vec<usize>,
    /// A 1x1 convolution and its output's normalization that the Gram moments of its input
    /// stand for (`gram_moments`: no launch, no stored output).
    pub gram_stages: Vec<usize>,
    /// Elementwise chains over statistics that a Gram launch's last block computes
    /// (`stat_chains`: no launch in `launches`; their outputs are stored as before): the stage
    /// of the Gram launch that runs each, and the chain as a launch of its own, for a run that
    /// changes the statistics after that launch (`NeuralGpu::run_with_hook`).
    pub stat_chains: Vec<(usize, Launch)>,
    /// Where the input comes from the frame path's NV12 frame (`Storage::frame_input`): the
    /// static-block addresses of the `NnConv::frame` fields of the launches that gather it
    /// (the stem, and its recomputed copy), to be pointed at the frame path's `NfFrame`
    /// before they run; the input (`input`, address 0) is not planned. Empty: the input is a
    /// tensor in the arena.
    pub frame_fields: Vec<u64>,
    /// The launches that read the network's input (convolutions gathering it).
    pub input_launches: Vec<usize>,
}

impl Program {
    /// Whether the input comes from the frame path's NV12 frame ([`Program::frame_fields`]).
    pub fn frame_fed(&self) -> bool {
        !self.frame_fields.is_empty()
    }

    /// The launches up to the last that reads the frame's NV12 planes (0: none): the frame
    /// path may overwrite the planes once they ran.
    pub fn frame_reading_launches(&self) -> usize {
        // the frame fields are the input launches' (in launch order) where the program is fed
        match self.input_launches.last() {
            Some(&last) if self.frame_fed() => last + 1,
            _ => 0,
        }
    }

    /// The stages of the chains a Gram launch computes (`stat_chains`).
    pub fn stat_chain_stages(&self) -> Vec<usize> {
        self.stat_chains.iter().map(|c| c.1.stage).collect()
    }
}

fn aligned(b: u64) -> u64 {
    b.div_ceil(ALIGN) * ALIGN
}

fn unsupported(stage: usize, s: &Stage, what: impl AsRef<str>) -> NeuralError {
    NeuralError::Unsupported(format!(
        "{} (stage {stage} {} '{}', on the GPU; backend=cpu runs it)",
        what.as_ref(),
        s.kind.label(),
        s.name
    ))
}

/// A launch before its parameter block is placed: (kernel, block bytes, grid, block, stage).
type Pending = (Kernel, Vec<u8>, (u32, u32, u32), (u32, u32, u32), usize);
/// A statistics chain for a Gram launch's tail: (the Gram's stage, the chain's stage, its
/// parameter block, its grid as a launch of its own).
type StatChainTail = (usize, usize, Vec<u8>, (u32, u32, u32));

/// The static block as it is written.
struct Statics {
    bytes: Vec<u8>,
    base: u64,
}

impl Statics {
    fn reserve(&mut self, bytes: u64) -> u64 {
        let at = aligned(self.bytes.len() as u64);
        self.bytes.resize((at + bytes) as usize, 0);
        self.base + at
    }
    fn put(&mut self, data: &[u8]) -> u64 {
        let at = self.reserve(data.len() as u64);
        let off = (at - self.base) as usize;
        self.bytes[off..off + data.len()].copy_from_slice(data);
        at
    }
    fn floats(&mut self, v: &[f32]) -> u64 {
        self.put(bytemuck::cast_slice(v))
    }
}

fn const_floats<'a>(l: &'a Lowered, name: &str) -> Option<&'a crate::neural::Tensor<f32>> {
    match l.consts.get(name) {
        Some(Value::Float(t)) => Some(t),
        _ => None,
    }
}

fn const_ints(l: &Lowered, name: &str) -> Option<Vec<i64>> {
    match l.consts.get(name) {
        Some(Value::Int(t)) => Some(t.data.clone()),
        Some(Value::Float(t)) => Some(t.data.iter().map(|&v| v as i64).collect()),
        None => None,
    }
}

fn act_code(a: Activation) -> (i32, f32, f32) {
    match a {
        Activation::None => (0, 0.0, 0.0),
        Activation::Relu => (1, 0.0, 0.0),
        Activation::LeakyRelu(al) => (2, al, 0.0),
        Activation::Sigmoid => (3, 0.0, 0.0),
        Activation::Tanh => (4, 0.0, 0.0),
        Activation::Clip(lo, hi) => (5, lo, hi),
    }
}

/// Clip's bounds from its attributes (opset < 11) or constant inputs.
fn clip_bounds(l: &Lowered, n: &NodeProto) -> Option<(f32, f32)> {
    let bound = |i: usize, attr: &str, default: f32| -> Option<f32> {
        match n.input.get(i).filter(|s| !s.is_empty()) {
            Some(name) => const_floats(l, name).and_then(|t| t.data.first().copied()),
            None => Some(n.attr(attr).map_or(default, |a| a.f)),
        }
    };
    Some((
        bound(1, "min", f32::NEG_INFINITY)?,
        bound(2, "max", f32::INFINITY)?,
    ))
}

fn grid_1d(total: u64, threads: u32) -> (u32, u32, u32) {
    let blocks = total.div_ceil(threads as u64).clamp(1, 1 << 20);
    (blocks as u32, 1, 1)
}

/// 4-D shape (leading 1s) of a shape of rank ≤ 4.
fn dims4(shape: &[usize]) -> Option<[usize; 4]> {
    if shape.len() > 4 {
        return None;
    }
    let mut d = [1usize; 4];
    d[4 - shape.len()..].copy_from_slice(shape);
    Some(d)
}

fn contiguous_strides(d: &[usize; 4]) -> [i64; 4] {
    [
        (d[1] * d[2] * d[3]) as i64,
        (d[2] * d[3]) as i64,
        d[3] as i64,
        1,
    ]
}

/// Whether a convolution's input tile (TC_ROWS x TC_COLS outputs and the halo its taps read)
/// fits the tensor-core kernel's shared memory.
fn tc_tile_fits(k: (usize, usize), stride: (i64, i64), dil: (i64, i64)) -> bool {
    tc_tile_halves(k, stride, dil) <= TC_TILE_HALVES
}

/// Rows and columns of a tensor-core convolution block's input tile (its outputs and the halo
/// its taps read).
fn tc_tile(k: (usize, usize), stride: (i64, i64), dil: (i64, i64)) -> (usize, usize) {
    tc_tile_of(TC_ROWS, k, stride, dil)
}

/// `tc_tile` for a block of `block_rows` output rows.
fn tc_tile_of(
    block_rows: u32,
    k: (usize, usize),
    stride: (i64, i64),
    dil: (i64, i64),
) -> (usize, usize) {
    let rows = (block_rows as usize - 1) * stride.0 as usize + (k.0 - 1) * dil.0 as usize + 1;
    let cols = (TC_COLS as usize - 1) * stride.1 as usize + (k.1 - 1) * dil.1 as usize + 1;
    (rows, cols)
}

fn tc_tile_pixels(k: (usize, usize), stride: (i64, i64), dil: (i64, i64)) -> usize {
    let (rows, cols) = tc_tile(k, stride, dil);
    rows * cols
}

/// Halves of shared memory a tensor-core convolution block stages.
fn tc_tile_halves(k: (usize, usize), stride: (i64, i64), dil: (i64, i64)) -> usize {
    tc_tile_pixels(k, stride, dil) * TC_PIX
}

/// A tensor-core convolution launch's dynamic shared memory: the tile, then the table of where
/// each tile pixel comes from (two i32 each). Small tiles let more blocks share an SM. With
/// `pack` taps packed per chunk the tile is that of ceil(kw / pack) taps pack * dw apart, and
/// the table reaches pack - 1 taps further right.
fn tc_shared_bytes(
    block_rows: u32,
    k: (usize, usize),
    stride: (i64, i64),
    dil: (i64, i64),
    pack: usize,
    cin: usize,
) -> u32 {
    let (k, dil_v) = ((k.0, k.1.div_ceil(pack)), (dil.0, dil.1 * pack as i64));
    let (rows, cols) = tc_tile_of(block_rows, k, stride, dil_v);
    let table_cols = cols + (pack - 1) * dil.1 as usize;
    // tap-packed: the table's pixels staged as tap_slot halves each, 16-byte aligned
    let staged = if pack > 1 {
        (rows * table_cols).next_multiple_of(2) * tap_slot(cin) * 2
    } else {
        0
    };
    (rows * cols * TC_PIX * 2 + rows * table_cols * 8 + staged) as u32
}

/// Dynamic shared memory of a tensor-core convolution launch: the tile and its source table
/// (`tc_shared_bytes`), and for a fixed shape its B fragments; a fixed shape that is not
/// tap-packed keeps a separable table instead (rows + columns entries of 4 bytes, then as many
/// 16-byte Resize tap copies), which lets more blocks share a multiprocessor.
pub fn conv_shared_bytes(gather: MmaGather, nt: u8, p: &NnConv) -> u32 {
    conv_shared_bytes_rows(gather, nt, p, TC_ROWS * gather.rows_per_warp())
}

/// `conv_shared_bytes` for a block of `block_rows` output rows (a tall 7x7 launch).
pub fn conv_shared_bytes_rows(gather: MmaGather, nt: u8, p: &NnConv, block_rows: u32) -> u32 {
    let (k, stride, dil) = (
        (p.kh as usize, p.kw as usize),
        (p.sh as i64, p.sw as i64),
        (p.dh as i64, p.dw as i64),
    );
    let taps = gather.fixed_taps();
    // a folded prologue chain's coefficients after the table
    let pre = if p.pre != 0 { PRE_BYTES } else { 0 };
    let full = tc_shared_bytes(block_rows, k, stride, dil, p.pack as usize, p.cin as usize) + pre;
    if taps == 0 || gather == MmaGather::TapPacked7x7 {
        // the packed gather stages its pixels after the full table; a double-buffered general
        // gather (`NnConv::stages`) holds a second tile
        let second = if p.stages == 2 && taps == 0 {
            tc_tile_halves(k, stride, dil) as u32 * 2
        } else {
            0
        };
        return full + second + b_stage_bytes(taps, nt);
    }
    // the paired layout's tile is that of kw / 2 taps two pixels apart: the same columns
    let (rows, cols) = tc_tile_of(block_rows, k, stride, dil);
    let entries = rows + cols;
    let axis = 16 * (entries.div_ceil(4) + entries);
    // a folded Resize's patch where a prologue chain's coefficients would be (one or the other)
    let patch = 32 * p.rs_patch.max(0) as u32;
    // a double-buffered block (`NnConv::stages`) holds two tiles and two B stages, or with a
    // staged Resize patch one tile, two B stages and two patches
    let (tiles, b_stages, patches) = match (p.stages == 2, gather) {
        (true, MmaGather::ChannelsLast3x3Resize) => (1, 2, 2),
        (true, _) => (2, 2, 1),
        _ => (1, 1, 1),
    };
    let tile = (rows * cols * TC_PIX * 2) as u32;
    tiles * tile + b_stages * b_stage_bytes(taps, nt) + axis as u32 + pre.max(patches * patch)
}

/// Dynamic shared memory a tensor-core convolution block may take (the kernels are opted in
/// to it when loaded; every sm_80+ card allows about 99 KiB a block). Plans that were measured
/// at 48 KiB (the Resize patch, the general gathers' tiles) keep that bound; the
/// double-buffered fixed 3x3 and the prologue's coefficients after it use this one.
pub const TC_SHARED_OPT_IN: u32 = 96 * 1024;

/// Shared memory a multiprocessor needs for the double-buffered gathers (`Fusions::pipelined`,
/// `pipelined_general`) to be used: three of the largest blocks (about 60 KiB each) with their
/// reserve. The H100 / H200 (228 KiB), where they were measured, have it; the A100 (164 KiB)
/// would fit two, sm_86, sm_89 and sm_120 (100 KiB) one, so those keep the single-buffered
/// gathers.
pub const PIPELINE_MIN_SHARED_PER_SM: u32 = 3 * (60 + 1) * 1024;

/// The elementwise chain a tensor-core convolution (stage `conv`, its input `x_name`, its output at `y`)
/// takes into its channels-last gather, so that the chain's output (a normalized activation)
/// is never written: the last pending launch, of the stage right before it, is a per-channel
/// affine chain over channels-last fp16 (`affine_chain_last`) that writes over its own X and
/// whose output only this convolution reads, with at most `PRE_MAX` channels and nothing after
/// its affine part but a Relu or LeakyRelu. The convolution
/// then reads X from the same buffer and takes each value through the chain (the same
/// coefficients and rounding as `nn_eltwise`'s). Pads apply to the chain's output, as before:
/// a reflected pixel is transformed, a constant fill or zero padding is not.
#[allow(clippy::too_many_arguments)]
fn prologue_chain(
    l: &Lowered,
    blocks: &[Pending],
    conv: usize,
    gather: MmaGather,
    x_name: &str,
    places: &HashMap<String, Place>,
    y: &Place,
    in_arena: &dyn Fn(&str) -> bool,
) -> Option<NnEltwise> {
    let x = places.get(x_name)?;
    let gathers_channels_last = matches!(
        gather,
        MmaGather::ChannelsLast
            | MmaGather::ChannelsLast3x3
            | MmaGather::ChannelsLast3x3S2
            | MmaGather::ChannelsLast1x1
            | MmaGather::ChannelsLastPaired
    );
    if !gathers_channels_last
        || x.channels_last.is_none_or(|c| c as usize > PRE_MAX)
        || !x.half
        || x_name == l.output
        || only_reader(l, x_name) != Some(conv)
    {
        return None;
    }
    let (Kernel::Eltwise, bytes, _, _, stage) = blocks.last()? else {
        return None;
    };
    let chain: NnEltwise = bytemuck::pod_read_unaligned(bytes);
    // the gather applies the affine part, then at most a Relu or LeakyRelu (nn_pre_value)
    let tail = (chain.affine_ops..chain.n_ops).map(|o| chain.op_code[o as usize]);
    if tail.len() > 1 || tail.clone().any(|c| c != EW_RELU && c != EW_LEAKY) {
        return None;
    }
    let writes_x = l.stages[*stage].outputs.first().map(String::as_str) == Some(x_name);
    // every block reads the other operands for its coefficients while others write the output
    // (build() keeps them alive until the convolution; this makes sure of it). Only operands in
    // the arena can lie under the output: statistics live in the static block, whose addresses
    // are not comparable with the arena's (both start at 0 in a plan built at base 0).
    let out = y.span();
    let clear_of_output = l.stages[*stage]
        .inputs
        .iter()
        .filter(|v| l.shapes.get(*v) != l.shapes.get(x_name) && in_arena(v))
        .filter_map(|v| places.get(v))
        .all(|p| p.span().end <= out.start || p.span().start >= out.end);
    (*stage + 1 == conv
        && clear_of_output
        && writes_x
        && chain.affine_last != 0
        && chain.affine_x >= 0
        && chain.y == x.addr
        && chain.operand[chain.affine_x as usize] == chain.y)
        .then_some(chain)
}

/// Whether a launch's parameters have the shape its fixed-shape kernel compiles in (always true
/// for the general kernels): kernel/stride/dilation/pack as `NnFixedShape` in neural.cu, at the
/// tile counts where the fixed kernel is the faster one. Measured with ncu on the H200
/// (2026-12-05, tiny and hayao_class at 1080p): the 3x3 shapes beat the general gather at 1,
/// 2 and 8 tiles (8: 245-550 µs against 310-675) and lose at 4 (5-10 % slower on every
/// layer); the staged Resize patch wins at 8 tiles (3-4 %) and loses at 2 and 4 (up to 27 %),
/// but double-buffered it wins at 4 (ncu, H100, 2026-12-05: 86 → 73, 69 → 61, 827 → 754 µs)
/// and still loses at 2 (70 → 78 µs).
pub fn fixed_shape_matches(gather: MmaGather, p: &NnConv, nt: u8) -> bool {
    let shape = (p.kh, p.kw, p.sh, p.sw, p.dh, p.dw, p.pack);
    match gather {
        // at four tiles the single-buffered kernel lost to the general gather (ncu, H200);
        // double-buffered it wins
        MmaGather::ChannelsLast3x3 => shape == (3, 3, 1, 1, 1, 1, 1) && (nt != 4 || p.stages == 2),
        MmaGather::ChannelsLast3x3S2 => shape == (3, 3, 2, 2, 1, 1, 1) && nt <= 2,
        MmaGather::ChannelsLast1x1 => shape == (1, 1, 1, 1, 1, 1, 1) && nt == 8 && p.stages == 2,
        // ncu, H100: the real tiny's Resize convolutions at two tiles 177 -> 158 and 70 -> 66 µs
        MmaGather::ChannelsLast3x3Residual => {
            shape == (3, 3, 1, 1, 1, 1, 1)
                && nt == 2
                && p.stages == 1
                && p.res != 0
                && p.res_half != 0
                && p.y_cs == 1
                && p.cout % 2 == 0
        }
        MmaGather::ChannelsLast3x3Resize => {
            // the patch sits where a prologue chain's coefficients would: never both; at four
            // tiles single-buffered it lost
            shape == (3, 3, 1, 1, 1, 1, 1)
                && (nt == 8 || (nt == 4 && p.stages == 2))
                && p.rs_taps != 0
                && p.rs_patch > 0
                && p.pre == 0
        }
        MmaGather::TapPacked7x7 => {
            shape == (7, 7, 1, 1, 1, 1, 4) && tap_slot(p.cin as usize) == 4 && p.n_tiles <= 4
        }
        MmaGather::ChannelsLastPaired => shape == (7, 7, 1, 1, 1, 1, 1) && p.n_tiles == 1,
        _ => true,
    }
}

/// The double-buffered variant of a fixed stride-1 launch of gather `g` (the 3x3, or the 1x1
/// that is only ever double-buffered) (`NnConv::stages`): a direct
/// channels-last gather (no folded Resize) of at least two 16-channel chunks (with one there is
/// nothing to overlap, and the second tile only costs occupancy: ncu, H200), whose two tiles
/// and B stages fit `TC_SHARED_OPT_IN` with a prologue chain's coefficients.
/// The 1x1 kernel also answers to `fixed_1x1` and `pipelined_general` (the general gather it
/// replaces is double-buffered under that switch).
fn pipelined(p: &NnConv, nt: u8, fusions: &Fusions, g: MmaGather) -> Option<NnConv> {
    let piped = NnConv { stages: 2, ..*p };
    let switched_on =
        g != MmaGather::ChannelsLast1x1 || (fusions.fixed_1x1 && fusions.pipelined_general);
    (fusions.pipelined
        && switched_on
        && p.rs_taps == 0
        && p.cin_pad >= 32
        && fixed_shape_matches(g, &piped, nt)
        && conv_shared_bytes(g, nt, &piped) + PRE_BYTES <= TC_SHARED_OPT_IN)
        .then_some(piped)
}

/// Whether a staged-patch Resize convolution (`NnConv::stages` already 2) double-buffers its
/// patch and B fragments: at least two chunks, within `TC_SHARED_OPT_IN`.
fn pipelined_patch(piped: &NnConv, nt: u8, fusions: &Fusions) -> bool {
    fusions.pipelined_patch
        && piped.cin_pad >= 32
        && conv_shared_bytes(MmaGather::ChannelsLast3x3Resize, nt, piped) <= TC_SHARED_OPT_IN
}

/// The double-buffered variant of a general channels-last launch (`NnConv::stages`; its B
/// fragments stay per-tap loads): a direct gather of at least two chunks whose two tiles, table
/// and a prologue chain's coefficients fit `TC_SHARED_OPT_IN`.
fn pipelined_general(p: &NnConv, nt: u8, fusions: &Fusions) -> Option<NnConv> {
    let piped = NnConv { stages: 2, ..*p };
    let g = MmaGather::ChannelsLast;
    (fusions.pipelined_general
        && p.rs_taps == 0
        && p.pack == 1
        && p.cin_pad >= 32
        && conv_shared_bytes(g, nt, &piped) + PRE_BYTES <= TC_SHARED_OPT_IN)
        .then_some(piped)
}

/// Source pixels of a folded Resize that a fixed-shape block stages (`NnConv::rs_patch`): the
/// most rows times the most columns of the Resize's input that one block's taps reach (`taps`:
/// the rows' then the columns' entries of 4 ints, as `resize_taps`), worked out as neural.cu
/// does from its axis tables: the tile's rows and columns of the padded input, their sources
/// after the pad, the two taps of each. The kernel checks its own block against it.
pub fn resize_patch(p: &NnConv, taps: &[i32]) -> u32 {
    use crate::neural::ops::pad::{PadMode, source_index};
    let mode = match p.pad_mode {
        1 => PadMode::Reflect,
        2 => PadMode::Edge,
        _ => PadMode::Constant,
    };
    let (rows, cols) = tc_tile(
        (p.kh as usize, p.kw as usize),
        (p.sh as i64, p.sw as i64),
        (p.dh as i64, p.dw as i64),
    );
    // one axis: blocks of `outputs` outputs, the tile's `len` padded coordinates from
    // block * outputs * stride - conv_pad; its table entries from `table`
    let extent = |n_out: i32,
                  outputs: u32,
                  stride: i32,
                  conv_pad: i32,
                  len: usize,
                  padded: i32,
                  pad: i32,
                  n: i32,
                  table: &[i32]| {
        let mut most = 0;
        for block in 0..(n_out.max(0) as u32).div_ceil(outputs) {
            let start = (block * outputs) as i32 * stride - conv_pad;
            let (mut lo, mut hi) = (i32::MAX, -1);
            for i in (start..start + len as i32).filter(|i| (0..padded).contains(i)) {
                let Some(s) = source_index((i - pad) as i64, n as usize, mode) else {
                    continue;
                };
                let (t0, t1) = (table[4 * s], table[4 * s + 1]);
                lo = lo.min(t0.min(t1));
                hi = hi.max(t0.max(t1));
            }
            if hi >= lo {
                most = most.max((hi - lo + 1) as u32);
            }
        }
        most
    };
    let (row_table, col_table) = taps.split_at(4 * p.h as usize);
    let most_rows = extent(
        p.oh, TC_ROWS, p.sh, p.conv_pt, rows, p.hp, p.pad_t, p.h, row_table,
    );
    let most_cols = extent(
        p.ow, TC_COLS, p.sw, p.conv_pl, cols, p.wp, p.pad_l, p.w_in, col_table,
    );
    most_rows * most_cols
}

/// Shared memory a fixed-shape block (`MmaGather::fixed_taps`) stages its chunk's B fragments
/// in, before its tile: taps x `nt` channel tiles x 32 lanes x 4 halves.
pub fn b_stage_bytes(taps: u32, nt: u8) -> u32 {
    taps * nt as u32 * 32 * 8
}

/// Horizontal taps a tensor-core convolution packs into one 16-wide K chunk: with few input
/// channels (a 3-channel stem pads 3 to 16, 13/16 of its tensor work multiplies zeros), as
/// many as fit, spread evenly over the virtual taps (3 channels, 7 taps: 2 virtual taps of 4);
/// 1 when packing saves nothing.
pub fn tap_pack(cin: usize, kw: usize) -> usize {
    if cin == 0 || cin > 8 || kw < 2 {
        return 1;
    }
    let virtual_taps = kw.div_ceil(16 / tap_slot(cin));
    kw.div_ceil(virtual_taps)
}

/// Halves a packed tap takes in its K chunk: its cin channels, then zeros to 4 or 8, so that
/// the gather stages each source pixel as one 8- or 16-byte word and assembles a chunk from
/// whole words (`nn_tc_gather_packed` computes the same from cin).
pub fn tap_slot(cin: usize) -> usize {
    if cin <= 4 { 4 } else { 8 }
}

/// Weights of a tap-packed convolution ([cout][cin][kh][kw]) as those of the virtual one it
/// runs: [cout][pack * slot][kh][ceil(kw / pack)], virtual channel j * slot + c of virtual tap
/// g being tap g * pack + j of channel c (`tap_slot`; zero past kw and for c ≥ cin).
pub fn packed_weights(
    w: &[f32],
    cout: usize,
    cin: usize,
    kh: usize,
    kw: usize,
    pack: usize,
) -> Vec<f32> {
    let kw_v = kw.div_ceil(pack);
    let slot = tap_slot(cin);
    let cin_v = pack * slot;
    let mut out = vec![0.0; cout * cin_v * kh * kw_v];
    for oc in 0..cout {
        for j in 0..pack {
            for c in 0..cin {
                for ky in 0..kh {
                    for g in 0..kw_v {
                        let kx = g * pack + j;
                        if kx < kw {
                            out[((oc * cin_v + j * slot + c) * kh + ky) * kw_v + g] =
                                w[((oc * cin + c) * kh + ky) * kw + kx];
                        }
                    }
                }
            }
        }
    }
    out
}

/// Weights of a convolution of ≤ 4 output channels with its horizontal taps paired in N
/// (`MmaGather::ChannelsLastPaired`), as those of the virtual one it runs: [8][cin][kh]
/// [ceil(kw / 2)], virtual output channel c (< 4) of virtual tap g being tap 2g of channel c
/// (toward the output at the A row's pixel), 4 + c tap 2g + 1 (toward the pixel before it);
/// zero past kw and cout.
pub fn paired_weights(w: &[f32], cout: usize, cin: usize, kh: usize, kw: usize) -> Vec<f32> {
    let kw_v = kw.div_ceil(2);
    let mut out = vec![0.0; 8 * cin * kh * kw_v];
    for n in 0..8 {
        let (oc, odd) = (n % 4, n / 4);
        if oc >= cout {
            continue;
        }
        for c in 0..cin {
            for ky in 0..kh {
                for g in 0..kw_v {
                    let kx = 2 * g + odd;
                    if kx < kw {
                        out[((n * cin + c) * kh + ky) * kw_v + g] =
                            w[((oc * cin + c) * kh + ky) * kw + kx];
                    }
                }
            }
        }
    }
    out
}

/// 8-channel tiles per tensor-core block: the fewest power of two that covers `n_tiles` (at most
/// MMA_NT), halved while the launch would have fewer than TC_MIN_BLOCKS blocks (small, deep
/// layers: more blocks, each gathering the same input tile for fewer output channels, beat a
/// few blocks that leave most SMs idle).
pub fn tc_channel_tiles(n_tiles: u32, pixel_blocks: u32) -> u32 {
    let mut nt = n_tiles.next_power_of_two().min(MMA_NT);
    while nt > 1 && pixel_blocks * n_tiles.div_ceil(nt) < TC_MIN_BLOCKS {
        nt /= 2;
    }
    nt
}

/// The Conv node of a conv stage and its (kernel, strides, dilations, groups), when its weights
/// are constant.
type ConvGeometry = ((usize, usize), (i64, i64), (i64, i64), usize);

fn conv_geometry(l: &Lowered, s: &Stage) -> Option<ConvGeometry> {
    let conv = s.nodes.iter().find(|n| n.op_type == "Conv")?;
    let wt = const_floats(l, conv.input.get(1)?)?;
    let ints = |name: &str| conv.attr(name).map_or(vec![1, 1], |a| a.ints.clone());
    let (st, dil) = (ints("strides"), ints("dilations"));
    if wt.shape.len() != 4 || st.len() != 2 || dil.len() != 2 {
        return None;
    }
    let groups = conv.attr("group").map_or(1, |a| a.i.max(1) as usize);
    Some((
        (wt.shape[2], wt.shape[3]),
        (st[0], st[1]),
        (dil[0], dil[1]),
        groups,
    ))
}

/// Whether a stage is a convolution the tensor-core kernel can run (one group, a tile that
/// fits), whatever its input's storage.
fn tensor_core_shape(l: &Lowered, s: &Stage) -> bool {
    s.kind == StageKind::Conv
        && conv_geometry(l, s)
            .is_some_and(|(k, st, dil, groups)| groups == 1 && tc_tile_fits(k, st, dil))
}

/// Whether stage `i` runs on the tensor-core kernel: a shape it can run, reading fp16 or
/// gathering through a folded stage. K is padded to 16 channels (a 3-channel stem packs taps
/// instead, `tap_pack`). `build` launches by it and the channels-last plan follows it.
fn on_tensor_cores(
    l: &Lowered,
    storage: &Storage,
    half_of: &HashMap<String, bool>,
    folds: &Folds,
    i: usize,
) -> bool {
    let s = &l.stages[i];
    storage.tensor_cores
        && tensor_core_shape(l, s)
        && (folds.input.contains_key(&i)
            || s.nodes
                .first()
                .and_then(|n| n.input.first())
                .is_some_and(|x| half_of.get(x) == Some(&true) || split_input(l, storage, x)))
}

/// Whether value `x` is an fp32 stage output the tensor cores read split in two
/// (`Storage::split`).
fn split_input(l: &Lowered, storage: &Storage, x: &str) -> bool {
    l.stage_writing(x).is_some_and(|k| storage.splits(k))
}

/// What a tensor-core convolution's input gather folds in from the stage right before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gather {
    /// A Resize: the tile is read through its taps.
    Resize,
    /// The input's NHWC → NCHW Transpose: the tile is read from the NHWC tensor by strides.
    Nhwc,
}

/// Stages folded into their neighbour convolution (no launch, no stored output).
#[derive(Debug, Default)]
struct Folds {
    /// conv stage → (the stage before it, folded into its input gather, and how).
    input: HashMap<usize, (usize, Gather)>,
    /// conv stage → the NCHW → NHWC Transpose after it, folded into its epilogue.
    output: HashMap<usize, usize>,
    /// conv stage → the residual Add stage after it, folded into its epilogue.
    residual: HashMap<usize, FoldedAdd>,
}

/// Whether the network's input may be stored in fp16 without changing a bit: its readers
/// are NHWC → NCHW Transposes folded into tensor-core convolutions' gathers
/// (`Gather::Nhwc`), which rounds each value to fp16 (round to nearest even) as it stages it,
/// as the writer of an fp16 input does (the frame path's conversion, the host's upload).
fn half_input(l: &Lowered, storage: &Storage, folds: &Folds) -> bool {
    if !storage.fusions.half_input || !storage.tensor_cores {
        return false;
    }
    let readers: Vec<usize> = l
        .stages
        .iter()
        .enumerate()
        .filter(|(_, s)| s.inputs.contains(&l.input))
        .map(|(i, _)| i)
        .collect();
    // one reader, or several where its stem is recomputed (`recompute`)
    !readers.is_empty()
        && readers.iter().all(|&reader| {
            folds
                .input
                .values()
                .any(|&(stage, gather)| stage == reader && gather == Gather::Nhwc)
        })
}

/// A residual Add folded into the epilogue of the convolution before it.
#[derive(Debug)]
struct FoldedAdd {
    /// The Add's stage.
    stage: usize,
    /// The Add's other addend.
    skip: String,
    /// The activation that ends the Add's stage (Add, then Relu, LeakyRelu, ...: a residual
    /// block's output), applied to the sum; `Activation::None` when the Add stands alone.
    act: Activation,
}

impl Folds {
    fn folded(&self, stage: usize) -> bool {
        self.input.values().any(|&(r, _)| r == stage)
            || self.output.values().any(|&t| t == stage)
            || self.residual.values().any(|r| r.stage == stage)
    }
}

/// The one stage of `l` reading `value`, when exactly one does.
fn only_reader(l: &Lowered, value: &str) -> Option<usize> {
    let mut readers = l
        .stages
        .iter()
        .enumerate()
        .filter(|(_, r)| r.inputs.iter().any(|v| v == value));
    let first = readers.next()?.0;
    readers.next().is_none().then_some(first)
}

/// A single-node Transpose stage with this permutation.
fn is_transpose(s: &Stage, perm: &[i64]) -> bool {
    s.kind == StageKind::Op
        && s.nodes.len() == 1
        && s.nodes[0].op_type == "Transpose"
        && s.nodes[0].attr("perm").is_some_and(|a| a.ints == perm)
}

/// The stages folded into tensor-core convolutions. Into a convolution's input gather: the
/// stage right before it, when that stage is a Resize or the NHWC → NCHW Transpose, its output's
/// one reader is the convolution (as its input, before its Pad) and that output is stored fp16
/// (a Resize's input too); the folded tensor is then never written. Into its epilogue: the
/// NCHW → NHWC Transpose right after it that is its output's one reader (the network's output
/// Transpose); the convolution writes the transposed tensor, rounded to fp16 first when its
/// own output was to be stored fp16, so the values are those of the unfolded stages.
fn folds(l: &Lowered, storage: &Storage, half_of: &HashMap<String, bool>) -> Folds {
    let mut f = Folds::default();
    if !storage.tensor_cores {
        return f;
    }
    let on_tensor_cores = |s: &Stage| tensor_core_shape(l, s);
    let half = |v: &str| half_of.get(v) == Some(&true);
    for (i, s) in l.stages.iter().enumerate() {
        let (Some(out), Some(next)) = (s.outputs.first(), l.stages.get(i + 1)) else {
            continue;
        };
        if s.outputs.len() != 1 || *out == l.output || only_reader(l, out) != Some(i + 1) {
            continue;
        }
        let conv_input = next.nodes.first().and_then(|n| n.input.first());
        if conv_input != Some(out) || !on_tensor_cores(next) || !half(out) {
            continue;
        }
        let resize = s.kind == StageKind::Op
            && s.nodes.len() == 1
            && matches!(s.nodes[0].op_type.as_str(), "Resize" | "Upsample");
        if resize && half(&s.nodes[0].input[0]) {
            f.input.insert(i + 1, (i, Gather::Resize));
        } else if is_transpose(s, &[0, 3, 1, 2]) && s.nodes[0].input[0] == l.input {
            f.input.insert(i + 1, (i, Gather::Nhwc));
        }
    }
    for (i, s) in l.stages.iter().enumerate() {
        let (Some(out), Some(next)) = (s.outputs.first(), l.stages.get(i + 1)) else {
            continue;
        };
        // the convolution reads fp16 (or folds its input): it is on the tensor cores
        let reads_half = s
            .nodes
            .first()
            .and_then(|n| n.input.first())
            .is_some_and(|x| half(x) || f.input.contains_key(&i));
        if on_tensor_cores(s)
            && reads_half
            && s.outputs.len() == 1
            && only_reader(l, out) == Some(i + 1)
            && is_transpose(next, &[0, 2, 3, 1])
            && next.outputs.first() == Some(&l.output)
        {
            f.output.insert(i, i + 1);
            continue;
        }
        // a residual Add of the convolution's output and a tensor of the same shape, neither
        // the convolution's input nor the source of its folded gather (so the Add's output
        // may be written over the addend while other blocks still gather)
        // (alone, or followed by an activation of its sum that ends the stage)
        let (add, post) = match next.nodes.as_slice() {
            [add] => (add, Activation::None),
            [add, act]
                if storage.fusions.residual_act
                    && act.input.first() == add.output.first()
                    && act.output.first() == next.outputs.first() =>
            {
                match node_activation(l, act) {
                    Ok(Some(a)) => (add, a),
                    _ => continue,
                }
            }
            _ => continue,
        };
        let source = f
            .input
            .get(&i)
            .map(|&(r, _)| &l.stages[r].nodes[0].input[0]);
        let x = s.nodes.first().map(|n| &n.input[0]);
        let skip = match add.input.as_slice() {
            [a, b] if a == out && b != out => b,
            [a, b] if b == out && a != out => a,
            _ => continue,
        };
        if on_tensor_cores(s)
            && reads_half
            && s.outputs.len() == 1
            && only_reader(l, out) == Some(i + 1)
            && next.kind == StageKind::Elementwise
            && add.op_type == "Add"
            && next.outputs.len() == 1
            && next.outputs[0] != l.output
            && l.shapes
                .get(skip)
                .is_some_and(|sh| Some(sh) == l.shapes.get(out))
            && half_of.contains_key(skip)
            && Some(skip) != x
            && Some(skip) != source
        {
            f.residual.insert(
                i,
                FoldedAdd {
                    stage: i + 1,
                    skip: skip.clone(),
                    act: post,
                },
            );
        }
    }
    f
}

/// Activation node `n` as a convolution's epilogue applies it (`lower::activation`; Clip's
/// bounds from its constant inputs or attributes): `Ok(None)` for a Clip whose bounds are
/// computed, an error for an operator that is no activation.
fn node_activation(l: &Lowered, n: &NodeProto) -> Result<Option<Activation>, NeuralError> {
    if n.op_type == "Clip" {
        return Ok(clip_bounds(l, n).map(|(lo, hi)| Activation::Clip(lo, hi)));
    }
    activation(Some(n)).map(Some)
}

/// A 1x1 convolution whose output only a normalization's statistics read, of an fp16 NCHW
/// tensor x of at most [`GRAM_CHANNELS`] channels that has statistics of its own (the
/// self-modulated normalization of AnimeGANv3: x normalized by its own statistics, re-scaled
/// by those of a 1x1 convolution of x). `nn_moments_gram` finishes both at x's normalize
/// stage from x's Gram matrix (the convolution's output statistics are a linear and a
/// quadratic form of x's mean and covariance); the convolution and the pass over its output
/// do not run, and its output is not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Gram {
    /// x's normalize stage (the launch's place).
    own: usize,
    /// The convolution stage and its output's normalize stage (no launch of their own).
    conv: usize,
    norm: usize,
}

fn gram_moments(l: &Lowered, storage: &Storage, half_of: &HashMap<String, bool>) -> Vec<Gram> {
    let mut grams = Vec::new();
    if !storage.tensor_cores || !storage.fusions.gram {
        return grams;
    }
    let plain_stats_of = |v: &str| {
        l.stages.iter().position(|r| {
            r.kind == StageKind::Normalize
                && r.stats
                    .as_ref()
                    .is_some_and(|st| st.input == v && st.instance.is_none())
        })
    };
    for (conv, s) in l.stages.iter().enumerate() {
        // [Pad] Conv, no activation after it, one output
        let [.., c] = s.nodes.as_slice() else {
            continue;
        };
        if s.kind != StageKind::Conv
            || c.op_type != "Conv"
            || s.nodes.len() > 2
            || s.outputs.len() != 1
        {
            continue;
        }
        let (Some((k, stride, _, 1)), Some(w)) =
            (conv_geometry(l, s), const_floats(l, &c.input[1]))
        else {
            continue;
        };
        let x = &s.nodes[0].input[0];
        let v = &s.outputs[0];
        let (Some(xs), Some(vs)) = (l.shapes.get(x), l.shapes.get(v)) else {
            continue;
        };
        // a 1x1, stride-1 convolution that keeps the size pads nothing
        let biased = c.input.get(2).is_some_and(|b| !b.is_empty());
        if k != (1, 1)
            || stride != (1, 1)
            || xs.len() != 4
            || xs[0] != 1
            || !gram_takes(xs[1], xs[2..].iter().product(), storage.fusions.gram_wide)
            || vs.len() != 4
            || xs[2..] != vs[2..]
            || w.shape[1] != xs[1]
            || (biased && const_floats(l, &c.input[2]).is_none())
            || half_of.get(x) != Some(&true)
            || *v == l.output
        {
            continue;
        }
        let (Some(norm), Some(own)) = (only_reader(l, v), plain_stats_of(x)) else {
            continue;
        };
        if plain_stats_of(v) == Some(norm) && own < norm {
            grams.push(Gram { own, conv, norm });
        }
    }
    grams
}

/// Elementwise chains whose operands are a Gram launch's statistics (x's or the
/// convolution's mean and variance) and constants alone, writing at most
/// `GRAM_TAIL_MAX_VALUES` values (AnimeGANv3's sqrt(var + eps)): the launch's last block runs
/// them once it has stored the statistics, `GRAM_TAILS` at most a launch. (chain stage, the
/// Gram's `own` stage), in stage order.
fn stat_chains(l: &Lowered, storage: &Storage, grams: &[Gram]) -> Vec<(usize, usize)> {
    let mut chains: Vec<(usize, usize)> = Vec::new();
    if !storage.fusions.stat_chains {
        return chains;
    }
    let stat_outputs = |g: &Gram| -> Vec<&str> {
        [g.own, g.norm]
            .iter()
            .flat_map(|&k| l.stages[k].outputs.iter().map(|o| o.as_str()))
            .collect()
    };
    for (i, s) in l.stages.iter().enumerate() {
        let [out] = s.outputs.as_slice() else {
            continue;
        };
        if s.kind != StageKind::Elementwise
            || *out == l.output
            || l.shapes.get(out).is_none_or(|sh| {
                sh.len() > 4 || sh.iter().product::<usize>() > GRAM_TAIL_MAX_VALUES
            })
        {
            continue;
        }
        let within: Vec<&str> = s
            .nodes
            .iter()
            .flat_map(|n| n.output.iter().map(|o| o.as_str()))
            .collect();
        let inputs: Vec<&str> = s
            .nodes
            .iter()
            .flat_map(|n| n.input.iter().map(|v| v.as_str()))
            .filter(|v| !v.is_empty() && !within.contains(v))
            .collect();
        for g in grams {
            let stats = stat_outputs(g);
            let reads_stats = inputs.iter().any(|v| stats.contains(v));
            let rest_constant = inputs
                .iter()
                .all(|v| stats.contains(v) || const_floats(l, v).is_some());
            if i > g.own
                && reads_stats
                && rest_constant
                && chains.iter().filter(|c| c.1 == g.own).count() < GRAM_TAILS
            {
                chains.push((i, g.own));
                break;
            }
        }
    }
    chains
}

/// Blocks of a Gram moments launch over `hw` pixels: about 16 warp steps of 32 pixels a warp.
pub fn gram_blocks(hw: u64) -> u32 {
    hw.div_ceil(32 * 16 * (GRAM_THREADS as u64 / 32))
        .clamp(1, GRAM_MAX_BLOCKS as u64) as u32
}

/// Values stored channels-last (NHWC): fp16 activations with a channel count that keeps a
/// pixel's 16-channel chunks whole, written by a tensor-core epilogue (its own output, or a
/// residual Add folded into it), an elementwise chain or an instance normalization's
/// application, and read only by kernels that read NHWC: tensor-core gathers (directly,
/// through a folded Resize, or the other addend of a folded residual Add), the statistics and
/// Gram moments kernels, and elementwise chains whose output is channels-last too (they run in
/// its N, H, W, C order, so one may write over its input). A fixed point drops values until
/// every reader of a kept one qualifies. A folded Add's addend and output share the epilogue's
/// index, so they are channels-last together or not at all.
fn channels_last_values(
    l: &Lowered,
    storage: &Storage,
    half_of: &HashMap<String, bool>,
    folds: &Folds,
    grams: &[Gram],
) -> HashMap<String, u32> {
    let mut out = HashMap::new();
    if !storage.tensor_cores {
        return out;
    }
    let first_input = |s: &Stage| s.nodes.first().and_then(|n| n.input.first()).cloned();
    let on_tensor_cores = |i: usize| on_tensor_cores(l, storage, half_of, folds, i);
    // stage i reads `v` only where a tensor-core convolution's kernel does
    let tensor_core_reader = |i: usize, v: &str| {
        let s = &l.stages[i];
        if s.inputs.iter().filter(|x| *x == v).count() != 1 {
            return false;
        }
        if s.kind == StageKind::Conv {
            return first_input(s).as_deref() == Some(v)
                && on_tensor_cores(i)
                && !folds.input.contains_key(&i);
        }
        let resize_folded = folds
            .input
            .get(&(i + 1))
            .is_some_and(|&(r, g)| r == i && g == Gather::Resize);
        let addend_folded = folds
            .residual
            .values()
            .any(|r| r.stage == i && r.skip == *v);
        (resize_folded && first_input(s).as_deref() == Some(v)) || addend_folded
    };
    // what tensor-core epilogues write
    let mut written = Vec::new();
    for (i, s) in l.stages.iter().enumerate() {
        if !on_tensor_cores(i) || folds.output.contains_key(&i) || s.outputs.len() != 1 {
            continue;
        }
        written.push(match folds.residual.get(&i) {
            Some(r) => l.stages[r.stage].outputs[0].clone(),
            None => s.outputs[0].clone(),
        });
    }
    // elementwise chains run over a channels-last output in its own order (`nn_eltwise`)
    let elementwise = |i: usize| l.stages[i].kind == StageKind::Elementwise && !folds.folded(i);
    // and an instance normalization's application writes either layout (from either)
    let instance = |s: &Stage| s.stats.as_ref().is_some_and(|st| st.instance.is_some());
    for (i, s) in l.stages.iter().enumerate() {
        if (elementwise(i) || instance(s)) && s.outputs.len() == 1 {
            written.push(s.outputs[0].clone());
        }
    }
    for v in written {
        let Some(&[1, c, _, _]) = l.shapes.get(&v).map(Vec::as_slice) else {
            continue;
        };
        if v == l.output || half_of.get(&v) != Some(&true) || c % 16 != 0 || c > EW_LAST_MAX {
            continue;
        }
        out.insert(v, c as u32);
    }
    let readers = |v: &str| -> Vec<usize> {
        (0..l.stages.len())
            .filter(|&j| l.stages[j].inputs.iter().any(|x| x == v))
            .collect()
    };
    // drop values until every reader of a kept one reads channels-last
    loop {
        let mut dropped = Vec::new();
        for (v, &c) in &out {
            let reader_ok = |j: usize| {
                let s = &l.stages[j];
                tensor_core_reader(j, v)
                    // the Gram moments read a pixel's 16-channel chunks (the wide ones its
                    // 64-channel tiles' 8-channel chunks); their 1x1 convolution does not run
                    || ((c as usize).is_multiple_of(GRAM_TILE)
                        && grams.iter().any(|g| g.own == j || g.conv == j))
                    // the statistics kernel reads 8 channels a pixel, an instance
                    // normalization's application either layout
                    || (s.kind == StageKind::Normalize
                        && c % 8 == 0
                        && s.stats.as_ref().is_some_and(|st| {
                            st.input == *v
                                && (st.instance.is_none() || storage.fusions.instance_cl)
                        }))
                    || (elementwise(j)
                        && s.outputs.len() == 1
                        && out.contains_key(&s.outputs[0])
                        && l.shapes.get(&s.outputs[0]) == l.shapes.get(v))
            };
            let rs = readers(v);
            // an elementwise output reads its full-size inputs in its own order: they
            // are channels-last too (one may hold the output in place)
            let inputs_ok = l.stages.iter().enumerate().all(|(i, s)| {
                !(elementwise(i) && s.outputs.first() == Some(v))
                    || s.inputs
                        .iter()
                        .all(|x| l.shapes.get(x) != l.shapes.get(v) || out.contains_key(x))
            });
            if rs.is_empty() || !rs.iter().all(|&j| reader_ok(j)) || !inputs_ok {
                dropped.push(v.clone());
            }
        }
        // a folded Add's addend and output: both or neither
        for FoldedAdd { stage, skip, .. } in folds.residual.values() {
            let sum = &l.stages[*stage].outputs[0];
            if out.contains_key(sum) != out.contains_key(skip) {
                dropped.push(sum.clone());
                dropped.push(skip.clone());
            }
        }
        if dropped.is_empty() {
            break;
        }
        for v in dropped {
            out.remove(&v);
        }
    }
    out
}

/// A channels-last (NHWC) tensor of `channels` channels as NCHW.
pub fn channels_first(values: &[f32], channels: usize) -> Vec<f32> {
    let pixels = values.len() / channels.max(1);
    let mut out = vec![0.0; values.len()];
    for (p, pixel) in values.chunks_exact(channels).enumerate() {
        for (c, &v) in pixel.iter().enumerate() {
            out[c * pixels + p] = v;
        }
    }
    out
}

/// Elementwise stages that write their output over an input of theirs (output → that input):
/// an input of the same shape and storage whose last reader is this stage. Each thread of
/// `nn_eltwise` reads all its operands' elements before it writes the same elements of the
/// output, so the input's buffer can take the output (a full-resolution residual add or
/// normalization then needs two buffers live instead of three).
fn in_place_outputs(
    l: &Lowered,
    half_of: &HashMap<String, bool>,
    stored: &dyn Fn(&str) -> bool,
    last: &dyn Fn(&str, u32) -> u32,
) -> HashMap<String, String> {
    let mut hosts = HashMap::new();
    for (i, s) in l.stages.iter().enumerate() {
        let [o] = s.outputs.as_slice() else {
            continue;
        };
        if s.kind != StageKind::Elementwise || *o == l.output || !stored(o) {
            continue;
        }
        let host = s.inputs.iter().find(|v| {
            **v != l.input
                && **v != l.output
                && stored(v)
                && l.shapes.contains_key(*v)
                && l.shapes.get(*v) == l.shapes.get(o)
                && half_of.get(*v) == half_of.get(o)
                && last(v, 0) == i as u32
        });
        if let Some(v) = host {
            hosts.insert(o.clone(), v.clone());
        }
    }
    hosts
}

/// Whether an elementwise chain is affine in one operand X: X full-size and contiguous like the
/// output, every other operand constant along the last axis; Add and Sub of anything, Mul with
/// one side free of X, Div by something free of X, unary ops of X-free values, up to the first
/// unary op of an X-dependent value, after which only unary ops of the chain's value follow.
/// Returns (X, ops of the affine part); `nn_eltwise` then folds each thread's constants into
/// a * X + b once instead of interpreting the chain per value.
pub fn affine_chain(p: &NnEltwise, operands: usize) -> Option<(usize, usize)> {
    affine_chain_along(p, operands, &[3])
}

/// `affine_chain` with the other operands constant along every axis but the last (they vary
/// per channel of a channels-last tensor whose dims are ordered N, H, W, C).
pub fn affine_chain_last(p: &NnEltwise, operands: usize) -> Option<(usize, usize)> {
    affine_chain_along(p, operands, &[0, 1, 2])
}

/// `affine_chain` with the operands other than X constant along `axes`.
fn affine_chain_along(p: &NnEltwise, operands: usize, axes: &[usize]) -> Option<(usize, usize)> {
    let strides = |r: usize| &p.strides[4 * r..4 * r + 4];
    let dims = p.dims.map(|d| d as usize);
    let out = contiguous_strides(&dims).map(|s| s as i32);
    let full = |r: usize| (0..4).all(|a| dims[a] == 1 || strides(r)[a] == out[a]);
    let mut xs = (0..operands).filter(|&r| full(r));
    let x = xs.next()?;
    let varies = |r: usize| axes.iter().any(|&a| strides(r)[a] != 0 && dims[a] != 1);
    if xs.next().is_some() || (0..operands).any(|r| r != x && varies(r)) {
        return None;
    }
    let n_ops = p.n_ops as usize;
    // whether the chain's value so far depends on X
    let mut cur = false;
    for o in 0..n_ops {
        let dep = |r: i32| if r < 0 { cur } else { r as usize == x };
        let (a, b) = (dep(p.op_a[o]), dep(p.op_b[o]));
        let code = p.op_code[o];
        if code >= EW_FIRST_UNARY {
            if !a {
                cur = false;
                continue;
            }
            // the affine part ends: only unary ops of the chain's value may follow
            let tail = (o..n_ops).all(|k| p.op_code[k] >= EW_FIRST_UNARY && p.op_a[k] < 0);
            return (o > 0 && p.op_a[o] < 0 && tail).then_some((x, o));
        }
        cur = match code {
            EW_ADD | EW_SUB => a || b,
            EW_MUL if !(a && b) => a || b,
            EW_DIV if !b => a,
            _ => return None,
        };
    }
    cur.then_some((x, n_ops))
}

/// Threads of a softmax block (one block a row): 1024 for a few long rows, which would
/// otherwise leave the GPU to one 256-thread block (hayao_class's attention: one row of 32400
/// values took 74 µs on an H100), else 256.
pub fn softmax_threads(rows: usize, len: usize) -> u32 {
    if rows < 64 && len >= 4096 { 1024 } else { 256 }
}

/// Row bands a banded convolution runs in, at most: `BANDS`, or twice as many where the lag
/// rows sit at the arena's peak and the smaller lag shrinks it (`BAND_COUNTS`, tried in order).
pub const BANDS: usize = 6;
pub const BAND_COUNTS: [usize; 2] = [BANDS, 2 * BANDS];

/// A stride-1 tensor-core convolution whose channels-last input dies at it, run as `count`
/// launches of `rows` output rows each, bottom to top, writing its output over its input's
/// buffer: the input at the buffer's start, the output `lag` rows further on. A band's output
/// rows then land only on input rows that no later band reads, and the two tensors need one
/// full-size buffer and `lag` rows instead of two (`band_geometry`); the lag rows are taken
/// only from the band's stage on (`Growth`), so until then other buffers may use them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Band {
    stage: usize,
    x: String,
    y: String,
    rows: u32,
    count: u32,
    lag_bytes: u64,
}

/// Bands over `height` output rows of a stride-1 convolution of `kh` taps `dh` apart:
/// (rows a band, bands, lag rows); rows are a multiple of TC_ROWS (a block's rows) and at
/// least the kernel's reach, so reflected border rows stay inside the first and last bands'
/// reads. Band k writes output rows [k·rows, (k+1)·rows) over input rows [k·rows + lag,
/// (k+1)·rows + lag), all below what band k and the bands above it read (up to
/// (k+1)·rows + reach); the bands run bottom first.
pub fn band_geometry(
    height: usize,
    kh: usize,
    dh: usize,
    bands: usize,
) -> Option<(usize, usize, usize)> {
    let reach = (kh.max(1) - 1) * dh;
    let rows = height.div_ceil(bands.max(1)).div_ceil(TC_ROWS as usize) * TC_ROWS as usize;
    let count = height.div_ceil(rows.max(1));
    (count > 1 && rows > reach).then_some((rows, count, rows + reach))
}

/// Convolutions that could run in bands (`Band`): stride 1, one group, on tensor cores reading
/// a channels-last input that no later stage reads and writing a channels-last output of the
/// same shape, with nothing folded into the gather or the epilogue.
fn band_candidates(
    l: &Lowered,
    channels_last: &HashMap<String, u32>,
    last: &dyn Fn(&str, u32) -> u32,
    stored: &dyn Fn(&str) -> bool,
) -> Vec<Band> {
    let mut out = Vec::new();
    for (i, s) in l.stages.iter().enumerate() {
        let (Some(first), [y]) = (s.nodes.first(), s.outputs.as_slice()) else {
            continue;
        };
        let Some(x) = first.input.first() else {
            continue;
        };
        if s.kind != StageKind::Conv
            || *x == l.input
            || *y == l.output
            || !stored(y)
            || last(x, 0) != i as u32
        {
            continue;
        }
        let (Some(cx), Some(cy)) = (channels_last.get(x), channels_last.get(y)) else {
            continue;
        };
        let Some(((kh, _), (1, 1), (dh, _), 1)) = conv_geometry(l, s) else {
            continue;
        };
        let (Some(xs), Some(ys)) = (l.shapes.get(x), l.shapes.get(y)) else {
            continue;
        };
        if cx != cy || xs != ys || xs.len() != 4 || dh < 1 {
            continue;
        }
        // each stage's band counts in turn (the same geometry twice only once)
        let mut seen = Vec::new();
        for bands in BAND_COUNTS {
            let Some((rows, count, lag)) = band_geometry(xs[2], kh, dh as usize, bands) else {
                continue;
            };
            if seen.contains(&count) {
                continue;
            }
            seen.push(count);
            out.push(Band {
                stage: i,
                x: x.clone(),
                y: y.clone(),
                rows: rows as u32,
                count: count as u32,
                // fp16, channels-last: a row is W x C halves
                lag_bytes: (lag * xs[3] * xs[1] * 2) as u64,
            });
        }
    }
    out
}

/// `NnConv::frame` of a launch that is to read the frame path's NV12 frame, until `build`
/// records the field (`Program::frame_fields`) and clears it.
const FRAME_PENDING: u64 = 1;

/// Builds the program of `spec` with `storage`, at the given bases (0, 0 to size it).
/// With `Storage::frame_input`, the input comes from the frame path's NV12 frame where every
/// launch reading it is a tap-packed convolution of the 3-channel fp16 input (the stem):
/// decided on the program built without it, so that the choice of kernels stays the plan's.
pub fn build(
    spec: &Specialised,
    storage: &Storage,
    arena_base: u64,
    static_base: u64,
) -> Result<Program, NeuralError> {
    let plain = build_program(spec, storage, arena_base, static_base, false)?;
    if !storage.frame_input || !stem_reads_the_input(&plain, static_base) {
        return Ok(plain);
    }
    let fed = build_program(spec, storage, arena_base, static_base, true)?;
    // (the same kernels as the plain program's, checked again: a reader of the input that
    // does not gather the frame would read address 0)
    Ok(
        if fed.frame_fed() && stem_reads_the_input(&fed, static_base) {
            fed
        } else {
            plain
        },
    )
}

/// Whether every launch that reads `p`'s input is a tap-packed convolution of a 3-channel
/// fp16 input (the narrow staging the NV12 gather fills), and there is one. (An fp16 input is
/// read by tensor-core convolutions only: `half_input`.)
fn stem_reads_the_input(p: &Program, static_base: u64) -> bool {
    p.input.half
        && !p.input_launches.is_empty()
        && p.input_launches.iter().all(|&i| {
            let l = &p.launches[i];
            let at = (l.params - static_base) as usize;
            let c: NnConv = bytemuck::pod_read_unaligned(
                &p.static_init[at..at + std::mem::size_of::<NnConv>()],
            );
            matches!(
                l.kernel,
                Kernel::ConvMma(_, _, MmaGather::TapPacked | MmaGather::TapPacked7x7)
            ) && c.cin == 3
                && c.x_f32 == 0
        })
}

fn build_program(
    spec: &Specialised,
    storage: &Storage,
    arena_base: u64,
    static_base: u64,
    frame_fed: bool,
) -> Result<Program, NeuralError> {
    let l = spec.lowered();
    let n_stages = l.stages.len();
    if storage.half.len() != n_stages {
        return Err(NeuralError::Graph(format!(
            "storage plan for {} stages, the network has {n_stages}",
            storage.half.len()
        )));
    }
    let elements =
        |v: &str| -> u64 { l.shapes.get(v).map_or(0, |s| s.iter().product::<usize>()) as u64 };
    // which values are statistics (static, fp32)
    let mut stat_values: HashMap<String, ()> = HashMap::new();
    for s in &l.stages {
        if let Some(st) = &s.stats
            && st.instance.is_none()
        {
            for v in [&st.mean, &st.var].into_iter().flatten() {
                stat_values.insert(v.clone(), ());
            }
        }
    }
    // storage of each activation: the input fp32, stage outputs per plan (the network's
    // output too: its readers, the frame path's output kernels and the host's downloads,
    // take either)
    let mut half_of: HashMap<String, bool> = HashMap::new();
    half_of.insert(l.input.clone(), false);
    for (i, s) in l.stages.iter().enumerate() {
        for o in &s.outputs {
            half_of.insert(o.clone(), storage.half[i]);
        }
    }
    // lifetimes, as Specialised::plan counts them
    let mut last_use: HashMap<&str, u32> = HashMap::new();
    for (i, s) in l.stages.iter().enumerate() {
        for v in &s.inputs {
            last_use.insert(v.as_str(), i as u32);
        }
    }
    let last_stage = n_stages.saturating_sub(1) as u32;
    last_use.insert(l.output.as_str(), last_stage);
    // a folded stage's input lives until its convolution reads it, the convolution writes
    // the output of a Transpose folded into its epilogue; the folded tensors are not stored
    let folds = folds(l, storage, &half_of);
    if half_input(l, storage, &folds) {
        half_of.insert(l.input.clone(), true);
    }
    let mut not_stored: HashMap<&str, ()> = HashMap::new();
    let mut written_by: HashMap<&str, u32> = HashMap::new();
    for (&conv, &(stage, _)) in &folds.input {
        let r = &l.stages[stage];
        let input = r.nodes[0].input[0].as_str();
        let until = last_use
            .get(input)
            .map_or(conv as u32, |&x| x.max(conv as u32));
        last_use.insert(input, until);
        not_stored.insert(r.outputs[0].as_str(), ());
    }
    for (&conv, &t) in &folds.output {
        not_stored.insert(l.stages[conv].outputs[0].as_str(), ());
        written_by.insert(l.stages[t].outputs[0].as_str(), conv as u32);
    }
    for (&conv, r) in &folds.residual {
        not_stored.insert(l.stages[conv].outputs[0].as_str(), ());
        written_by.insert(l.stages[r.stage].outputs[0].as_str(), conv as u32);
    }
    // a chain that the next convolution may take into its gather (`prologue_chain`) is read by
    // each of that convolution's blocks for its coefficients: its per-channel operands live
    // until the convolution, so that its output is never placed over them (the full-size X the
    // chain writes over already lives that long)
    if storage.fusions.prologue {
        for (i, s) in l.stages.iter().enumerate() {
            let [o] = s.outputs.as_slice() else {
                continue;
            };
            let conv = i + 1;
            if s.kind != StageKind::Elementwise
                || l.stages.get(conv).map(|c| c.kind) != Some(StageKind::Conv)
                || only_reader(l, o) != Some(conv)
            {
                continue;
            }
            for v in &s.inputs {
                if l.shapes.get(v) != l.shapes.get(o)
                    && last_use.get(v.as_str()) == Some(&(i as u32))
                {
                    last_use.insert(v.as_str(), conv as u32);
                }
            }
        }
    }
    let grams = gram_moments(l, storage, &half_of);
    let chains = stat_chains(l, storage, &grams);
    for &(i, own) in &chains {
        // written by the Gram launch at its own stage: the buffer is taken from there on
        written_by.insert(l.stages[i].outputs[0].as_str(), own as u32);
    }
    for g in &grams {
        not_stored.insert(l.stages[g.conv].outputs[0].as_str(), ());
    }
    let bytes_of = |v: &str| elements(v) * if half_of.get(v) == Some(&true) { 2 } else { 4 };
    let last = |v: &str, first: u32| {
        last_use
            .get(v)
            .map_or(first, |&x| x.max(first))
            .min(last_stage)
    };
    let stored = |v: &str| !stat_values.contains_key(v) && !not_stored.contains_key(v);
    let in_place = in_place_outputs(l, &half_of, &stored, &last);
    let channels_last = channels_last_values(l, storage, &half_of, &folds, &grams);
    // the buffer requests, with the banded convolutions' outputs sharing their inputs'
    // buffers (`Band`); (requests, the request of each stored value)
    let plan_requests = |bands: &[Band]| {
        // (an input gathered from the frame's NV12 planes takes no buffer)
        let mut requests = Vec::new();
        if !frame_fed {
            requests.push(BufferRequest {
                name: l.input.clone(),
                bytes: bytes_of(&l.input),
                first: 0,
                last: last(&l.input, 0),
                grow: None,
            });
        }
        let mut request_of: HashMap<&str, usize> = HashMap::new();
        for (i, s) in l.stages.iter().enumerate() {
            for o in &s.outputs {
                if !stored(o) {
                    continue;
                }
                // an output over its input's buffer: an in-place elementwise output, or a
                // banded convolution's, which needs `lag` more rows there
                let host = in_place
                    .get(o.as_str())
                    .map(|h| (h.as_str(), 0))
                    .or_else(|| {
                        bands
                            .iter()
                            .find(|b| b.stage == i)
                            .map(|b| (b.x.as_str(), b.lag_bytes))
                    });
                if let Some((r, extra)) = host.and_then(|(h, e)| Some((*request_of.get(h)?, e))) {
                    requests[r].last = requests[r].last.max(last(o, i as u32));
                    if extra > 0 {
                        // the lag rows after the input, taken from the band's stage on
                        requests[r].grow = Some(Growth {
                            from: i as u32,
                            bytes: extra,
                        });
                    }
                    request_of.insert(o.as_str(), r);
                    continue;
                }
                let first = written_by.get(o.as_str()).copied().unwrap_or(i as u32);
                request_of.insert(o.as_str(), requests.len());
                requests.push(BufferRequest {
                    name: o.clone(),
                    bytes: bytes_of(o),
                    first,
                    last: last(o, i as u32),
                    grow: None,
                });
            }
        }
        (requests, request_of)
    };
    let names: Vec<String> = l
        .stages
        .iter()
        .enumerate()
        .map(|(i, s)| format!("{i} {} {}", s.kind.label(), s.name))
        .collect();
    let halves = storage.half.iter().filter(|&&h| h).count();
    let label = format!(
        "{:?} GPU ({halves} of {n_stages} stages fp16)",
        spec.input_shape()
    );
    let layout = |bands: &[Band]| {
        let (requests, request_of) = plan_requests(bands);
        let arena = ArenaPlan::layout_best(&requests, names.clone(), label.clone());
        (arena, requests, request_of)
    };
    // a convolution runs in bands where that makes the arena smaller (one band a buffer); the
    // layout kept is the last one that shrank it
    let mut bands: Vec<Band> = Vec::new();
    let mut kept = layout(&bands);
    // (a stage's second count replaces its first where that shrinks the arena further)
    for band in band_candidates(l, &channels_last, &last, &stored) {
        let buffer = |v: &str| kept.2.get(v).copied();
        let same = bands.iter().position(|b| b.stage == band.stage);
        if same.is_none() && bands.iter().any(|b| buffer(&b.x) == buffer(&band.x)) {
            continue;
        }
        let replaced = match same {
            Some(k) => Some((k, std::mem::replace(&mut bands[k], band))),
            None => {
                bands.push(band);
                None
            }
        };
        let candidate = layout(&bands);
        if candidate.0.arena_bytes < kept.0.arena_bytes {
            kept = candidate;
        } else if let Some((k, previous)) = replaced {
            bands[k] = previous;
        } else {
            bands.pop();
        }
    }
    let (arena, requests, request_of) = kept;
    let mut places: HashMap<String, Place> = HashMap::new();
    for b in &arena.buffers {
        places.insert(
            b.name.clone(),
            Place {
                addr: arena_base + b.offset,
                half: half_of.get(&b.name) == Some(&true),
                elements: elements(&b.name),
                channels_last: channels_last.get(&b.name).copied(),
            },
        );
    }
    if frame_fed {
        // read by no kernel: the gathers that would read it take the frame instead
        places.insert(
            l.input.clone(),
            Place {
                addr: 0,
                half: half_of.get(&l.input) == Some(&true),
                elements: elements(&l.input),
                channels_last: None,
            },
        );
    }
    // a banded convolution's input (and whatever shares its place) at its buffer's start,
    // the output `lag` rows further, in the rows the buffer grows by at the band's stage
    for band in &bands {
        let root = &requests[request_of[band.x.as_str()]].name;
        let start = places[root.as_str()].addr;
        places.insert(
            band.y.clone(),
            Place {
                addr: start + band.lag_bytes,
                half: true,
                elements: elements(&band.y),
                channels_last: channels_last.get(&band.y).copied(),
            },
        );
    }
    // in stage order, so a chain of in-place outputs finds its buffer
    for s in &l.stages {
        for o in &s.outputs {
            if let Some(host) = in_place.get(o.as_str()) {
                let p = places[host.as_str()];
                places.insert(o.clone(), p);
            }
        }
    }

    let mut st = Statics {
        bytes: Vec::new(),
        base: static_base,
    };
    let control = st.reserve(std::mem::size_of::<NnControl>() as u64);
    // moments scratch, sized for the widest normalization
    let max_c = l.normalize_channels.iter().copied().max().unwrap_or(0) as u64;
    let blocks_for = |hw: u64| hw.div_ceil(8192).clamp(1, 128);
    let mut max_blocks = 1;
    for s in &l.stages {
        if let Some(x) = s.stats.as_ref().map(|x| &x.input) {
            let shape = &l.shapes[x];
            max_blocks = max_blocks.max(blocks_for(shape[2..].iter().product::<usize>() as u64));
        }
    }
    let counter = st.reserve(4 * max_c.max(1));
    let mut gram_partial = if grams.is_empty() {
        0
    } else {
        8 * GRAM_SUMS as u64 * GRAM_MAX_BLOCKS as u64 * GRAM_MAX_PAIRS as u64
    };
    // the wide launches' partial sums and their reduction (E[x x^T], E[x]), in double
    let mut gram_wide_bytes = 0;
    for g in &grams {
        let xs = &l.shapes[&l.stages[g.own].stats.as_ref().expect("a Gram stage").input];
        let (c, hw) = (xs[1], xs[2..].iter().product::<usize>() as u64);
        if c > GRAM_CHANNELS {
            let sums = GRAM_WIDE_SUMS as u64 * gram_wide_pairs(c) as u64;
            gram_partial = gram_partial.max(8 * sums * gram_wide_chunks(hw, c) as u64);
            gram_wide_bytes = gram_wide_bytes.max(8 * (c * c + c) as u64);
        }
    }
    let partial = st.reserve((16 * max_c.max(1) * max_blocks).max(gram_partial));
    let gram_wide = if gram_wide_bytes > 0 {
        st.reserve(gram_wide_bytes)
    } else {
        0
    };
    let mut stats = Vec::new();
    let mut stats_of: HashMap<usize, (u64, u64, u64, u64, u64)> = HashMap::new();
    for (i, s) in l.stages.iter().enumerate() {
        if let Some(x) = &s.stats {
            let c = l.normalize_channels[x.index] as u64;
            let mean = st.reserve(4 * c);
            let var = st.reserve(4 * c);
            let sm = st.reserve(4 * c);
            let sv = st.reserve(4 * c);
            let sp = st.reserve(4 * c);
            stats_of.insert(i, (mean, var, sm, sv, sp));
            stats.push(StatsPlace {
                stage: i,
                mean,
                var,
                channels: c as usize,
            });
            for (name, addr) in [(&x.mean, mean), (&x.var, var)] {
                if let Some(name) = name {
                    places.insert(
                        name.clone(),
                        Place {
                            addr,
                            half: false,
                            elements: c,
                            channels_last: None,
                        },
                    );
                }
            }
        }
    }
    let weights_start = st.bytes.len() as u64;

    // launches, with their parameter blocks collected first and placed after the weights
    let mut blocks: Vec<Pending> = Vec::new();
    // elementwise stages folded into the next convolution's gather (`prologue_chain`)
    let mut prologue_stages: Vec<usize> = Vec::new();
    // the statistics chains' parameter blocks, with the `own` stage of the Gram launch that
    // runs each (`stat_chains`)
    let mut tails: Vec<StatChainTail> = Vec::new();
    for (i, s) in l.stages.iter().enumerate() {
        let place = |places: &HashMap<String, Place>,
                     st: &mut Statics,
                     v: &str|
         -> Result<Place, NeuralError> {
            if let Some(p) = places.get(v) {
                return Ok(*p);
            }
            if let Some(t) = const_floats(l, v) {
                let addr = st.floats(&t.data);
                return Ok(Place {
                    addr,
                    half: false,
                    elements: t.data.len() as u64,
                    channels_last: None,
                });
            }
            Err(unsupported(
                i,
                s,
                format!("value '{v}' is neither an activation nor a float constant"),
            ))
        };
        match s.kind {
            StageKind::Conv | StageKind::Normalize
                if grams.iter().any(|g| g.conv == i || g.norm == i) =>
            {
                // a 1x1 convolution and its output's statistics: the Gram moments at its
                // input's normalize stage stand for both
            }
            StageKind::Normalize if grams.iter().any(|g| g.own == i) => {
                let g = grams.iter().find(|g| g.own == i).expect("a Gram stage");
                let stx = s.stats.as_ref().expect("normalize stage has statistics");
                let x = place(&places, &mut st, &stx.input)?;
                let xs = &l.shapes[&stx.input];
                let hw = xs[2] * xs[3];
                let conv = l.stages[g.conv]
                    .nodes
                    .last()
                    .expect("a Gram convolution stage ends in its Conv");
                let constant = |v: &str| {
                    const_floats(l, v).ok_or_else(|| {
                        unsupported(g.conv, &l.stages[g.conv], "computed 1x1 weights or bias")
                    })
                };
                let w = st.floats(&constant(&conv.input[1])?.data);
                let b = match conv.input.get(2).filter(|b| !b.is_empty()) {
                    Some(b) => st.floats(&constant(b)?.data),
                    None => 0,
                };
                let (mean, var, state_mean, state_var, state_primed) = stats_of[&i];
                let (y_mean, y_var, y_state_mean, y_state_var, y_state_primed) = stats_of[&g.norm];
                let p = NnMomentsGram {
                    x: x.addr,
                    partial,
                    counter,
                    control,
                    mean,
                    var,
                    state_mean,
                    state_var,
                    state_primed,
                    w,
                    b,
                    y_mean,
                    y_var,
                    y_state_mean,
                    y_state_var,
                    y_state_primed,
                    tail: [0; GRAM_TAILS],
                    gram: 0,
                    hw: hw as i64,
                    c: xs[1] as i32,
                    cout: l.shapes[&l.stages[g.conv].outputs[0]][1] as i32,
                    cl: x.channels_last.is_some() as i32,
                    chunks: 0,
                };
                if xs[1] <= GRAM_CHANNELS {
                    blocks.push((
                        Kernel::MomentsGram,
                        bytemuck::bytes_of(&p).to_vec(),
                        (gram_blocks(hw as u64), gram_pairs(xs[1]) as u32, 1),
                        (GRAM_THREADS, 1, 1),
                        i,
                    ));
                } else {
                    // the partial sums, their reduction, the finishing (and the chains)
                    let chunks = gram_wide_chunks(hw as u64, xs[1]);
                    let pairs = gram_wide_pairs(xs[1]) as u32;
                    let p = NnMomentsGram {
                        gram: gram_wide,
                        chunks: chunks as i32,
                        ..p
                    };
                    let bytes = bytemuck::bytes_of(&p).to_vec();
                    let entries = pairs * GRAM_WIDE_SUMS as u32;
                    let finishing = (p.cout as u32).div_ceil(GRAM_WIDE_OUTS as u32);
                    for (kernel, grid) in [
                        (Kernel::GramWide, (chunks, pairs, 1)),
                        (
                            Kernel::GramWideReduce,
                            (entries.div_ceil(GRAM_WIDE_REDUCE_ENTRIES), 1, 1),
                        ),
                        (Kernel::GramWideFinish, (finishing, 1, 1)),
                    ] {
                        blocks.push((kernel, bytes.clone(), grid, (GRAM_WIDE_THREADS, 1, 1), i));
                    }
                }
            }
            StageKind::Conv => {
                let conv_at = s
                    .nodes
                    .iter()
                    .position(|n| n.op_type == "Conv")
                    .ok_or_else(|| unsupported(i, s, "conv stage without a Conv"))?;
                let conv = &s.nodes[conv_at];
                let pad = (conv_at > 0).then(|| &s.nodes[0]);
                let act_node = s.nodes.get(conv_at + 1);
                let x_name = pad.map_or(&conv.input[0], |p| &p.input[0]);
                let xs = l.shapes.get(x_name).cloned().unwrap_or_default();
                // a folded stage before it: its input read through the Resize's taps, or the
                // network's NHWC input read by strides
                let reads_input = match folds.input.get(&i) {
                    Some(&(r, Gather::Nhwc)) => l.stages[r].nodes[0].input[0] == l.input,
                    Some(_) => false,
                    None => *x_name == l.input,
                };
                let (x, resize, nhwc) = match folds.input.get(&i) {
                    Some(&(r, Gather::Resize)) => {
                        let rn = &l.stages[r].nodes[0];
                        let rs = l.shapes[&rn.input[0]].clone();
                        let taps =
                            resize_taps(l, rn, &rs, &xs).map_err(|m| unsupported(r, s, m))?;
                        (
                            place(&places, &mut st, &rn.input[0])?,
                            Some((st.put(bytemuck::cast_slice(&taps)), rs, taps)),
                            false,
                        )
                    }
                    Some(&(r, Gather::Nhwc)) => {
                        let input = &l.stages[r].nodes[0].input[0];
                        (place(&places, &mut st, input)?, None, true)
                    }
                    None => (place(&places, &mut st, x_name)?, None, false),
                };
                let out = s
                    .outputs
                    .first()
                    .ok_or_else(|| unsupported(i, s, "no output"))?;
                // a Transpose or residual Add folded into the epilogue: the convolution writes
                // its output
                let residual = folds.residual.get(&i);
                let (y, y_nhwc) = match (folds.output.get(&i), residual) {
                    (Some(&t), _) => (places[&l.stages[t].outputs[0]], true),
                    (None, Some(r)) => (places[&l.stages[r.stage].outputs[0]], false),
                    (None, None) => (
                        *places
                            .get(out)
                            .ok_or_else(|| unsupported(i, s, "output not planned"))?,
                        false,
                    ),
                };
                let res = match residual {
                    Some(r) => Some(place(&places, &mut st, &r.skip)?),
                    None => None,
                };
                let (res_act, res_act_a, res_act_b) =
                    act_code(residual.map_or(Activation::None, |r| r.act));
                // the convolution's value as its own fp16 storage would hold it, before the
                // folded stage (unless the store rounds anyway)
                let y_round = half_of.get(out.as_str()) == Some(&true)
                    && ((y_nhwc && !y.half) || res.is_some());
                let ys = l.shapes[out].clone();
                if xs.len() != 4 || ys.len() != 4 || xs[0] != 1 {
                    return Err(unsupported(i, s, format!("convolution of shape {xs:?}")));
                }
                let wt = const_floats(l, &conv.input[1])
                    .ok_or_else(|| unsupported(i, s, "computed convolution weights"))?;
                let (cout, cin_g, kh, kw) = (wt.shape[0], wt.shape[1], wt.shape[2], wt.shape[3]);
                let groups = conv.attr("group").map_or(1, |a| a.i.max(1) as usize);
                let ints = |name: &str, d: Vec<i64>| conv.attr(name).map_or(d, |a| a.ints.clone());
                let strides = ints("strides", vec![1, 1]);
                let dil = ints("dilations", vec![1, 1]);
                // the Pad
                let (mut pad_t, mut pad_l, mut pad_b, mut pad_r, mut mode, mut value) =
                    (0, 0, 0, 0, 1, 0.0f32);
                if let Some(p) = pad {
                    let pads = match p.input.get(1).filter(|s| !s.is_empty()) {
                        Some(n) => {
                            const_ints(l, n).ok_or_else(|| unsupported(i, s, "computed pads"))?
                        }
                        None => p.attr("pads").map(|a| a.ints.clone()).unwrap_or_default(),
                    };
                    if pads.len() != 8
                        || pads[0] != 0
                        || pads[1] != 0
                        || pads[4] != 0
                        || pads[5] != 0
                        || pads.iter().any(|&v| v < 0)
                    {
                        return Err(unsupported(
                            i,
                            s,
                            format!("Pad {pads:?} (only non-negative H/W pads)"),
                        ));
                    }
                    (pad_t, pad_l, pad_b, pad_r) = (pads[2], pads[3], pads[6], pads[7]);
                    let m = p.attr("mode").map_or("constant".to_string(), |a| {
                        String::from_utf8_lossy(&a.s).into_owned()
                    });
                    mode = match m.as_str() {
                        "constant" => 0,
                        "reflect" => 1,
                        "edge" => 2,
                        other => return Err(unsupported(i, s, format!("Pad mode '{other}'"))),
                    };
                    value = match p.input.get(2).filter(|s| !s.is_empty()) {
                        Some(n) => const_floats(l, n)
                            .and_then(|t| t.data.first().copied())
                            .ok_or_else(|| unsupported(i, s, "computed pad value"))?,
                        None => p.attr("value").map_or(0.0, |a| a.f),
                    };
                    if mode == 1
                        && (pad_t.max(pad_b) as usize >= xs[2]
                            || pad_l.max(pad_r) as usize >= xs[3])
                        && (xs[2] > 1 && xs[3] > 1)
                    {
                        // folds back and forth: the kernel's index math handles it
                    }
                }
                let hp = xs[2] as i64 + pad_t + pad_b;
                let wp = xs[3] as i64 + pad_l + pad_r;
                let (sh, sw, dh, dw) = (strides[0], strides[1], dil[0], dil[1]);
                let auto = conv.attr("auto_pad").map_or("NOTSET".to_string(), |a| {
                    String::from_utf8_lossy(&a.s).into_owned()
                });
                let (cpt, cpl) = match auto.as_str() {
                    "NOTSET" | "" => {
                        let p = ints("pads", vec![0, 0, 0, 0]);
                        (p[0], p[1])
                    }
                    "VALID" => (0, 0),
                    "SAME_UPPER" | "SAME_LOWER" => {
                        let total = |o: i64, s: i64, k: i64, d: i64, n: i64| {
                            ((o - 1) * s + (k - 1) * d + 1 - n).max(0)
                        };
                        let th = total(ys[2] as i64, sh, kh as i64, dh, hp);
                        let tw = total(ys[3] as i64, sw, kw as i64, dw, wp);
                        if auto == "SAME_UPPER" {
                            (th / 2, tw / 2)
                        } else {
                            (th - th / 2, tw - tw / 2)
                        }
                    }
                    other => return Err(unsupported(i, s, format!("auto_pad {other}"))),
                };
                let cin = xs[1];
                if cin_g * groups != cin || cout % groups != 0 || ys[1] != cout {
                    return Err(unsupported(
                        i,
                        s,
                        format!("weights {:?} for input {xs:?}, group {groups}", wt.shape),
                    ));
                }
                let mma = on_tensor_cores(l, storage, &half_of, &folds, i);
                // the CUDA-core kernel's weights → [oc block][ic][ky][kx][CONV_OCB]; a
                // tensor-core convolution reads only its fp16 B fragments (below), so the fp32
                // copy is not put in the static block (hayao_class: 8.5 MB)
                let ocb = cout.div_ceil(CONV_OCB);
                let w_addr = if mma {
                    0
                } else {
                    let taps = cin_g * kh * kw;
                    let mut w = vec![0.0f32; ocb * taps * CONV_OCB];
                    for oc in 0..cout {
                        for t in 0..taps {
                            w[((oc / CONV_OCB) * taps + t) * CONV_OCB + oc % CONV_OCB] =
                                wt.data[oc * taps + t];
                        }
                    }
                    st.floats(&w)
                };
                let b_addr = match conv.input.get(2).filter(|s| !s.is_empty()) {
                    Some(n) => st.floats(
                        &const_floats(l, n)
                            .ok_or_else(|| unsupported(i, s, "computed bias"))?
                            .data,
                    ),
                    None => 0,
                };
                let act = match act_node {
                    Some(n) => node_activation(l, n)?
                        .ok_or_else(|| unsupported(i, s, "computed Clip bounds"))?,
                    None => Activation::None,
                };
                let (act, act_a, act_b) = act_code(act);
                debug_assert!(
                    mma || (resize.is_none() && !nhwc && !y_nhwc && res.is_none()),
                    "a folded stage needs tensor cores"
                );
                debug_assert!(
                    mma || (x.channels_last.is_none() && y.channels_last.is_none()),
                    "a channels-last value needs tensor cores"
                );
                // the strides of what the gather reads: the input, or a folded Resize's input
                let (h, w) = match &resize {
                    Some((_, rs, _)) => (rs[2] as i32, rs[3] as i32),
                    None => (xs[2] as i32, xs[3] as i32),
                };
                // (channel, row, pixel) strides of an NHWC or NCHW tensor
                let strides_of = |h: i32, w: i32, c: i32, nhwc: bool| {
                    if nhwc { (1, w * c, c) } else { (h * w, w, 1) }
                };
                let (x_cs, x_rs, x_ps) =
                    strides_of(h, w, cin as i32, nhwc || x.channels_last.is_some());
                let (y_cs, y_rs, y_ps) = strides_of(
                    ys[2] as i32,
                    ys[3] as i32,
                    cout as i32,
                    y_nhwc || y.channels_last.is_some(),
                );
                // an fp32 input read as two fp16 halves (`Storage::split`): the planar gather
                // only (its second pass over the chunks)
                let split = mma
                    && resize.is_none()
                    && !nhwc
                    && split_input(l, storage, &s.nodes[0].input[0]);
                // a few-channel input (the stem) packs several horizontal taps into a chunk,
                // gathered by the general path's loads (not a folded Resize, fp16 output, not
                // split)
                let pack =
                    if mma && resize.is_none() && y.half && x.channels_last.is_none() && !split {
                        tap_pack(cin, kw)
                    } else {
                        1
                    };
                // a narrow channels-last layer (the output convolution) pairs its taps in N
                let paired = mma
                    && pack == 1
                    && x.channels_last.is_some()
                    && resize.is_none()
                    && res.is_none()
                    && cout <= 4
                    && (kh, kw, sh, sw, dh, dw) == (7, 7, 1, 1, 1, 1)
                    && storage.fusions.paired;
                let cin_pad = if pack > 1 {
                    (tap_slot(cin) * pack).div_ceil(16) * 16
                } else {
                    cin.div_ceil(16) * 16
                };
                let n_tiles = if paired { 1 } else { cout.div_ceil(8) };
                let wh = if paired {
                    let weights = paired_weights(&wt.data, cout, cin, kh, kw);
                    st.put(bytemuck::cast_slice(&mma_weights(
                        &weights,
                        8,
                        cin,
                        kh * kw.div_ceil(2),
                    )))
                } else if mma {
                    // a tap-packed convolution runs as one of slot * pack channels and fewer taps
                    let packed;
                    let (weights, k_cin, k_taps) = if pack > 1 {
                        packed = packed_weights(&wt.data, cout, cin, kh, kw, pack);
                        (&packed[..], tap_slot(cin) * pack, kh * kw.div_ceil(pack))
                    } else {
                        (&wt.data[..], cin, kh * kw)
                    };
                    st.put(bytemuck::cast_slice(&mma_weights(
                        weights, cout, k_cin, k_taps,
                    )))
                } else {
                    0
                };
                let p = NnConv {
                    x: x.addr,
                    y: y.addr,
                    w: w_addr,
                    b: b_addr,
                    wh,
                    rs_taps: resize.as_ref().map_or(0, |r| r.0),
                    res: res.map_or(0, |r| r.addr),
                    pre: 0,
                    // marks a reader of the input until the launches are placed
                    frame: if reads_input { FRAME_PENDING } else { 0 },
                    cin_pad: cin_pad as i32,
                    n_tiles: n_tiles as i32,
                    cin: cin as i32,
                    h: xs[2] as i32,
                    w_in: xs[3] as i32,
                    cout: cout as i32,
                    oh: ys[2] as i32,
                    ow: ys[3] as i32,
                    kh: kh as i32,
                    kw: kw as i32,
                    sh: sh as i32,
                    sw: sw as i32,
                    dh: dh as i32,
                    dw: dw as i32,
                    groups: groups as i32,
                    pad_t: pad_t as i32,
                    pad_l: pad_l as i32,
                    hp: hp as i32,
                    wp: wp as i32,
                    conv_pt: cpt as i32,
                    conv_pl: cpl as i32,
                    pad_mode: mode,
                    pad_value: value,
                    act,
                    act_a,
                    act_b,
                    rs_h: resize.as_ref().map_or(0, |r| r.1[2] as i32),
                    rs_w: resize.as_ref().map_or(0, |r| r.1[3] as i32),
                    x_cs,
                    x_rs,
                    x_ps,
                    x_f32: if x.half {
                        0
                    } else if split {
                        2
                    } else {
                        1
                    },
                    y_cs,
                    y_rs,
                    y_ps,
                    y_round: y_round as i32,
                    res_half: res.is_some_and(|r| r.half) as i32,
                    pack: pack as i32,
                    row0: 0,
                    rs_patch: 0,
                    stages: 1,
                    res_act,
                    res_act_a,
                    res_act_b,
                };
                if mma {
                    // a paired block row gives TC_COLS - 1 outputs (a warp's last A row only
                    // feeds the one before it)
                    let cols = if paired { TC_COLS - 1 } else { TC_COLS };
                    let (gx, gy) = (
                        (ys[3] as u32).div_ceil(cols),
                        (ys[2] as u32).div_ceil(TC_ROWS),
                    );
                    let nt = tc_channel_tiles(n_tiles as u32, gx * gy);
                    let general = if pack > 1 {
                        MmaGather::TapPacked
                    } else if paired {
                        MmaGather::ChannelsLastPaired
                    } else if x.channels_last.is_some() {
                        MmaGather::ChannelsLast
                    } else {
                        MmaGather::Planar
                    };
                    // the general gather's fixed-shape kernel, where the layer has its shape
                    // (`fixed_shape_matches`, the one statement of those shapes)
                    let fixed: &[MmaGather] = match general {
                        MmaGather::TapPacked => &[MmaGather::TapPacked7x7],
                        MmaGather::ChannelsLast if y.half => &[
                            MmaGather::ChannelsLast3x3,
                            MmaGather::ChannelsLast3x3S2,
                            MmaGather::ChannelsLast1x1,
                        ],
                        _ => &[],
                    };
                    // the fixed stride-1 3x3 double-buffered where it can be (at four tiles
                    // only so)
                    let piped =
                        pipelined(&p, nt as u8, &storage.fusions, MmaGather::ChannelsLast3x3);
                    // the 1x1 kernel only double-buffered
                    let piped_1x1 =
                        pipelined(&p, nt as u8, &storage.fusions, MmaGather::ChannelsLast1x1);
                    let gather = fixed
                        .iter()
                        .copied()
                        .find(|&f| {
                            let q = match (f, &piped, &piped_1x1) {
                                (MmaGather::ChannelsLast3x3, Some(q), _) => q,
                                (MmaGather::ChannelsLast1x1, _, Some(q)) => q,
                                (MmaGather::ChannelsLast1x1, _, None) => return false,
                                _ => &p,
                            };
                            storage.fusions.fixed_shapes && fixed_shape_matches(f, q, nt as u8)
                        })
                        .unwrap_or(general);
                    let p = match (piped, piped_1x1) {
                        (_, Some(q)) if gather == MmaGather::ChannelsLast1x1 => q,
                        (Some(q), _) if gather == MmaGather::ChannelsLast3x3 => q,
                        _ if gather == MmaGather::ChannelsLast => {
                            pipelined_general(&p, nt as u8, &storage.fusions).unwrap_or(p)
                        }
                        _ => p,
                    };
                    // a stride-1 3x3 over a folded Resize (the fixed kernel, or at four tiles the
                    // general one) stages the source pixels its taps reach, where they fit and
                    // are fewer than the tile's pixels
                    let stride1_3x3 = gather == MmaGather::ChannelsLast3x3
                        || (fixed.contains(&MmaGather::ChannelsLast3x3)
                            && fixed_shape_matches(
                                MmaGather::ChannelsLast3x3,
                                &NnConv { stages: 2, ..p },
                                nt as u8,
                            ));
                    let (gather, p) = match &resize {
                        Some((_, _, taps)) if storage.fusions.resize_patch && stride1_3x3 => {
                            let staged = NnConv {
                                rs_patch: resize_patch(&p, taps) as i32,
                                ..p
                            };
                            let g = MmaGather::ChannelsLast3x3Resize;
                            let (rows, cols) = tc_tile((3, 3), (1, 1), (1, 1));
                            // double-buffered where a chunk follows (`pipelined_patch`); at four
                            // tiles only so
                            let piped = NnConv {
                                stages: 2,
                                ..staged
                            };
                            let fits = conv_shared_bytes(g, nt as u8, &staged) <= 48 * 1024
                                && (staged.rs_patch as usize) < rows * cols;
                            if fits
                                && (nt == 8 || storage.fusions.narrow_patch)
                                && fixed_shape_matches(g, &piped, nt as u8)
                                && pipelined_patch(&piped, nt as u8, &storage.fusions)
                            {
                                (g, piped)
                            } else if fits && fixed_shape_matches(g, &staged, nt as u8) {
                                (g, staged)
                            } else {
                                (gather, p)
                            }
                        }
                        _ => (gather, p),
                    };
                    // a folded fp16 residual read and written a channel pair at a time
                    let gather = match gather {
                        MmaGather::ChannelsLast3x3
                            if y.half
                                && storage.fusions.residual_pairs
                                && fixed_shape_matches(
                                    MmaGather::ChannelsLast3x3Residual,
                                    &p,
                                    nt as u8,
                                ) =>
                        {
                            MmaGather::ChannelsLast3x3Residual
                        }
                        g => g,
                    };
                    let kernel = Kernel::ConvMma(y.half, nt as u8, gather);
                    let gz = (n_tiles as u32).div_ceil(nt);
                    // the affine chain right before it, taken into the gather (the chain's own
                    // launch, the last pending one, does not run)
                    let p = match kernel {
                        Kernel::ConvMma(_, nt, gather)
                            if storage.fusions.prologue
                                && resize.is_none()
                                && conv_shared_bytes(gather, nt, &p) + PRE_BYTES
                                    <= if p.stages == 2 {
                                        TC_SHARED_OPT_IN
                                    } else {
                                        48 * 1024
                                    } =>
                        {
                            match prologue_chain(
                                l, &blocks, i, gather, x_name, &places, &y, &stored,
                            ) {
                                Some(chain) => {
                                    blocks.pop();
                                    prologue_stages.push(i - 1);
                                    NnConv {
                                        pre: st.put(bytemuck::bytes_of(&chain)),
                                        ..p
                                    }
                                }
                                None => p,
                            }
                        }
                        _ => p,
                    };
                    // one launch, or one a band (its first row in `row0`)
                    let (rows, count) = match bands.iter().find(|b| b.stage == i) {
                        Some(b) => (b.rows, b.count),
                        None => (ys[2] as u32, 1),
                    };
                    // a 7x7 kernel's tall blocks, where unbanded (a band's rows are a multiple of
                    // TC_ROWS only) and within the shared memory the kernels are opted in to;
                    // a block's output rows are its warps' (the paired convolution's warps take
                    // several each: it never runs in bands, its output has fewer channels than
                    // its input)
                    let per_warp = match kernel {
                        Kernel::ConvMma(_, _, g) => g.rows_per_warp(),
                        _ => 1,
                    };
                    let tall_allowed = |g: MmaGather, nt: u8| {
                        if g.tall() {
                            storage.fusions.tall_7x7
                        } else {
                            g == MmaGather::ChannelsLast3x3 && nt == 8 && storage.fusions.tall_3x3
                        }
                    };
                    let warps = match kernel {
                        Kernel::ConvMma(_, nt, g)
                            if tall_allowed(g, nt)
                                && count == 1
                                && conv_shared_bytes_rows(g, nt, &p, TC_TALL_ROWS * per_warp)
                                    <= TC_SHARED_OPT_IN =>
                        {
                            TC_TALL_ROWS
                        }
                        _ => TC_ROWS,
                    };
                    if count > 1 && !rows.is_multiple_of(warps * per_warp) {
                        // a band's rows not whole blocks: the last block of a band would
                        // compute rows of the next one while it reads them
                        return Err(unsupported(
                            i,
                            s,
                            "a banded convolution whose bands are not whole blocks",
                        ));
                    }
                    let block_rows = warps * per_warp;
                    // bottom band first: each band's output rows (lag rows down) land only on
                    // input rows that it and the bands above it have read
                    for k in (0..count).rev() {
                        let row0 = k * rows;
                        let band_rows = rows.min(ys[2] as u32 - row0);
                        let p = NnConv {
                            row0: row0 as i32,
                            ..p
                        };
                        blocks.push((
                            kernel,
                            bytemuck::bytes_of(&p).to_vec(),
                            (gx, band_rows.div_ceil(block_rows), gz),
                            (32 * warps, 1, 1),
                            i,
                        ));
                    }
                } else {
                    let grid = (
                        (ys[3] as u32).div_ceil(CONV_BLOCK.0),
                        (ys[2] as u32).div_ceil(CONV_BLOCK.1),
                        ocb as u32,
                    );
                    blocks.push((
                        Kernel::Conv(x.half, y.half),
                        bytemuck::bytes_of(&p).to_vec(),
                        grid,
                        (CONV_BLOCK.0, CONV_BLOCK.1, 1),
                        i,
                    ));
                }
            }
            StageKind::Normalize => {
                let stx = s.stats.as_ref().expect("normalize stage has statistics");
                let x = place(&places, &mut st, &stx.input)?;
                let xs = &l.shapes[&stx.input];
                if xs.len() < 3 || xs[0] != 1 {
                    return Err(unsupported(i, s, format!("statistics of shape {xs:?}")));
                }
                let c = xs[1];
                let hw: usize = xs[2..].iter().product();
                let (mean, var, sm, sv, sp) = stats_of[&i];
                let p = NnMoments {
                    x: x.addr,
                    mean,
                    var,
                    partial,
                    counter,
                    state_mean: sm,
                    state_var: sv,
                    state_primed: sp,
                    control,
                    hw: hw as i32,
                    x_half: x.half as i32,
                    x_cl: x.channels_last.map_or(0, |c| c as i32),
                    align: 0,
                };
                let groups = if x.channels_last.is_some() { c / 8 } else { c };
                blocks.push((
                    Kernel::Moments,
                    bytemuck::bytes_of(&p).to_vec(),
                    (blocks_for(hw as u64) as u32, groups as u32, 1),
                    (MOMENTS_THREADS, 1, 1),
                    i,
                ));
                if let Some((inst, act_node)) = &stx.instance {
                    let out = s
                        .outputs
                        .first()
                        .ok_or_else(|| unsupported(i, s, "no output"))?;
                    let y = places[out];
                    let mut get = |k: usize| -> Result<u64, NeuralError> {
                        Ok(match inst.input.get(k).filter(|s| !s.is_empty()) {
                            Some(n) => {
                                let t = const_floats(l, n).ok_or_else(|| {
                                    unsupported(
                                        i,
                                        s,
                                        "computed InstanceNormalization scale or bias",
                                    )
                                })?;
                                st.floats(&t.data)
                            }
                            None => 0,
                        })
                    };
                    let (scale, bias) = (get(1)?, get(2)?);
                    let (act, act_a, act_b) = act_code(activation(act_node.as_ref())?);
                    let p = NnNormApply {
                        x: x.addr,
                        y: y.addr,
                        mean,
                        var,
                        scale,
                        bias,
                        c: c as i32,
                        hw: hw as i32,
                        x_half: x.half as i32,
                        y_half: y.half as i32,
                        eps: inst.attr("epsilon").map_or(1e-5, |a| a.f),
                        act,
                        act_a,
                        act_b,
                        y_cl: y.channels_last.map_or(0, |c| c as i32),
                        x_cl: x.channels_last.map_or(0, |c| c as i32),
                    };
                    blocks.push((
                        Kernel::NormApply,
                        bytemuck::bytes_of(&p).to_vec(),
                        grid_1d((c * hw) as u64, ELEMENTWISE_THREADS),
                        (ELEMENTWISE_THREADS, 1, 1),
                        i,
                    ));
                }
            }
            StageKind::Elementwise if folds.folded(i) => {
                // a residual Add folded into the convolution before it
            }
            StageKind::Elementwise => {
                let out = s
                    .outputs
                    .first()
                    .ok_or_else(|| unsupported(i, s, "no output"))?;
                if s.outputs.len() != 1 {
                    return Err(unsupported(
                        i,
                        s,
                        "an elementwise chain with several outputs",
                    ));
                }
                let y = *places
                    .get(out)
                    .ok_or_else(|| unsupported(i, s, "output not planned"))?;
                let od = dims4(&l.shapes[out]).ok_or_else(|| unsupported(i, s, "rank above 4"))?;
                let mut p: NnEltwise = bytemuck::Zeroable::zeroed();
                p.y = y.addr;
                p.y_half = y.half as i32;
                p.dims = od.map(|d| d as i32);
                let mut operands: Vec<String> = Vec::new();
                let mut prev: Option<&str> = None;
                if s.nodes.len() > EW_MAX_OPS {
                    return Err(unsupported(
                        i,
                        s,
                        format!("{} fused operators (at most {EW_MAX_OPS})", s.nodes.len()),
                    ));
                }
                for (k, n) in s.nodes.iter().enumerate() {
                    let (code, binary) = match n.op_type.as_str() {
                        "Add" => (EW_ADD, true),
                        "Sub" => (EW_SUB, true),
                        "Mul" => (EW_MUL, true),
                        "Div" => (EW_DIV, true),
                        "Pow" => (EW_POW, true),
                        "Min" => (EW_MIN, true),
                        "Max" => (EW_MAX, true),
                        "PRelu" => (EW_PRELU, true),
                        "Relu" => (EW_RELU, false),
                        "LeakyRelu" => (EW_LEAKY, false),
                        "Sigmoid" => (EW_SIGMOID, false),
                        "Tanh" => (EW_TANH, false),
                        "Sqrt" => (EW_SQRT, false),
                        "Reciprocal" => (EW_RECIP, false),
                        "Neg" => (EW_NEG, false),
                        "Abs" => (EW_ABS, false),
                        "Exp" => (EW_EXP, false),
                        "Log" => (EW_LOG, false),
                        "Floor" => (EW_FLOOR, false),
                        "Ceil" => (EW_CEIL, false),
                        "Clip" => (EW_CLIP, false),
                        "Identity" => (EW_IDENTITY, false),
                        other => return Err(unsupported(i, s, format!("elementwise {other}"))),
                    };
                    if binary && n.input.len() != 2 {
                        return Err(unsupported(
                            i,
                            s,
                            format!("{} with {} inputs", n.op_type, n.input.len()),
                        ));
                    }
                    let mut refs = [-1i32; 2];
                    let count = if binary { 2 } else { 1 };
                    for (r, name) in n.input.iter().take(count).enumerate() {
                        if Some(name.as_str()) == prev {
                            refs[r] = -1;
                            continue;
                        }
                        let idx = match operands.iter().position(|o| o == name) {
                            Some(x) => x,
                            None => {
                                if operands.len() == EW_MAX_OPERANDS {
                                    return Err(unsupported(
                                        i,
                                        s,
                                        format!("more than {EW_MAX_OPERANDS} operands"),
                                    ));
                                }
                                let pl = place(&places, &mut st, name)?;
                                let shape = match l.shapes.get(name) {
                                    Some(sh) => sh.clone(),
                                    None => const_floats(l, name)
                                        .map(|t| t.shape.clone())
                                        .unwrap_or_default(),
                                };
                                if shape.len() > 4 || shape.len() > l.shapes[out].len() {
                                    return Err(unsupported(
                                        i,
                                        s,
                                        format!("operand '{name}' of shape {shape:?}"),
                                    ));
                                }
                                let sd = dims4(&shape).expect("rank checked");
                                let cs = match pl.channels_last {
                                    // NHWC storage, its strides in NCHW order
                                    Some(_) => {
                                        let [_, c, h, w] = sd.map(|d| d as i64);
                                        [h * w * c, 1, w * c, c]
                                    }
                                    None => contiguous_strides(&sd),
                                };
                                let o = operands.len();
                                for a in 0..4 {
                                    if sd[a] != od[a] && sd[a] != 1 {
                                        return Err(unsupported(
                                            i,
                                            s,
                                            format!(
                                                "operand '{name}' {shape:?} does not broadcast to {od:?}"
                                            ),
                                        ));
                                    }
                                    p.strides[4 * o + a] = if sd[a] == 1 && od[a] != 1 {
                                        0
                                    } else {
                                        cs[a] as i32
                                    };
                                }
                                p.operand[o] = pl.addr;
                                p.operand_half[o] = pl.half as i32;
                                operands.push(name.clone());
                                o
                            }
                        };
                        refs[r] = idx as i32;
                    }
                    let (p0, p1) = match code {
                        EW_LEAKY => (n.attr("alpha").map_or(0.01, |a| a.f), 0.0),
                        EW_CLIP => clip_bounds(l, n)
                            .ok_or_else(|| unsupported(i, s, "computed Clip bounds"))?,
                        _ => (0.0, 0.0),
                    };
                    p.op_code[k] = code;
                    p.op_a[k] = refs[0];
                    p.op_b[k] = refs[1];
                    p.op_p0[k] = p0;
                    p.op_p1[k] = p1;
                    prev = Some(n.output[0].as_str());
                }
                p.n_ops = s.nodes.len() as i32;
                // a channels-last output: the chain runs over its dims ordered N, H, W, C (the
                // operands' strides reordered alike), so the output is written contiguously
                let od = match y.channels_last {
                    Some(_) => {
                        const NHWC: [usize; 4] = [0, 2, 3, 1];
                        p.dims = NHWC.map(|a| od[a] as i32);
                        for o in 0..operands.len() {
                            let st: [i32; 4] = p.strides[4 * o..4 * o + 4].try_into().expect("4");
                            for (k, &a) in NHWC.iter().enumerate() {
                                p.strides[4 * o + k] = st[a];
                            }
                        }
                        NHWC.map(|a| od[a])
                    }
                    None => od,
                };
                let vec = od[3] % EW_VEC == 0;
                let last =
                    y.channels_last.is_some() && y.half && od[3] % 8 == 0 && od[3] <= EW_LAST_MAX;
                let chain = if last {
                    affine_chain_last(&p, operands.len()).filter(|&(x, _)| p.operand_half[x] != 0)
                } else {
                    affine_chain(&p, operands.len())
                };
                (p.affine_x, p.affine_ops) = match chain {
                    Some((x, ops)) if vec => (x as i32, ops as i32),
                    _ => (-1, 0),
                };
                p.affine_last = (last && p.affine_x >= 0) as i32;
                // as nn_eltwise picks its path
                let per_thread = if p.affine_last != 0 {
                    8
                } else if p.affine_x >= 0 && od[3] % EW_AFFINE_VEC == 0 {
                    EW_AFFINE_VEC
                } else if vec {
                    EW_VEC
                } else {
                    1
                };
                let total = (od.iter().product::<usize>() / per_thread) as u64;
                let mut grid = grid_1d(total, ELEMENTWISE_THREADS);
                if p.affine_last != 0 {
                    // each block works out its coefficients first: fewer blocks, each looping
                    grid.0 = grid.0.min(EW_LAST_BLOCKS);
                }
                match chains.iter().find(|c| c.0 == i) {
                    // the Gram launch of stage `own` runs it (its last block, through the
                    // plain interpreter: a chain the affine paths would take launches on its
                    // own, its buffer merely taken earlier)
                    Some(&(_, own)) if p.affine_x < 0 && p.affine_last == 0 => {
                        tails.push((own, i, bytemuck::bytes_of(&p).to_vec(), grid))
                    }
                    _ => blocks.push((
                        Kernel::Eltwise,
                        bytemuck::bytes_of(&p).to_vec(),
                        grid,
                        (ELEMENTWISE_THREADS, 1, 1),
                        i,
                    )),
                }
            }
            StageKind::Op if folds.folded(i) => {
                // folded into the neighbouring stage's convolution
            }
            StageKind::Op => {
                let n = &s.nodes[0];
                let out = n.output[0].clone();
                let y = *places.get(&out).ok_or_else(|| {
                    unsupported(i, s, format!("{} output not planned", n.op_type))
                })?;
                let ys = l.shapes[&out].clone();
                let copy = |src: Place,
                            dst: Place,
                            dims: [usize; 4],
                            ss: [i64; 4],
                            ds: [i64; 4],
                            doff: i64| {
                    let total = dims.iter().product::<usize>() as u64;
                    let p = NnCopy {
                        src: src.addr,
                        dst: dst.addr,
                        dims: dims.map(|d| d as i32),
                        src_strides: ss.map(|d| d as i32),
                        dst_strides: ds.map(|d| d as i32),
                        src_offset: 0,
                        dst_offset: doff as i32,
                        src_half: src.half as i32,
                        dst_half: dst.half as i32,
                    };
                    (
                        Kernel::Copy,
                        bytemuck::bytes_of(&p).to_vec(),
                        grid_1d(total, ELEMENTWISE_THREADS),
                        (ELEMENTWISE_THREADS, 1, 1),
                        i,
                    )
                };
                match n.op_type.as_str() {
                    "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Identity" => {
                        let x = place(&places, &mut st, &n.input[0])?;
                        let total = ys.iter().product::<usize>();
                        let d = [1, 1, 1, total];
                        blocks.push(copy(x, y, d, [0, 0, 0, 1], [0, 0, 0, 1], 0));
                    }
                    "Transpose" => {
                        let x = place(&places, &mut st, &n.input[0])?;
                        let xs = l.shapes.get(&n.input[0]).cloned().unwrap_or_default();
                        let rank = xs.len();
                        if rank > 4 {
                            return Err(unsupported(i, s, "Transpose of rank above 4"));
                        }
                        let perm: Vec<usize> = n.attr("perm").map_or_else(
                            || (0..rank).rev().collect(),
                            |a| a.ints.iter().map(|&v| v as usize).collect(),
                        );
                        // input strides (rank-sized), then the output's index space
                        let mut in_strides = vec![1i64; rank];
                        for a in (0..rank.saturating_sub(1)).rev() {
                            in_strides[a] = in_strides[a + 1] * xs[a + 1] as i64;
                        }
                        let off = 4 - rank;
                        let mut ss = [0i64; 4];
                        for k in 0..rank {
                            ss[off + k] = in_strides[perm[k]];
                        }
                        let od = dims4(&ys).expect("rank checked");
                        blocks.push(copy(x, y, od, ss, contiguous_strides(&od), 0));
                    }
                    "Concat" => {
                        let rank = ys.len();
                        if rank > 4 {
                            return Err(unsupported(i, s, "Concat of rank above 4"));
                        }
                        let axis = n.attr("axis").map_or(0, |a| a.i);
                        let axis = if axis < 0 { axis + rank as i64 } else { axis } as usize;
                        let od = dims4(&ys).expect("rank checked");
                        let ds = contiguous_strides(&od);
                        let a4 = axis + 4 - rank;
                        let mut at = 0i64;
                        for name in &n.input {
                            let x = place(&places, &mut st, name)?;
                            let xs = l
                                .shapes
                                .get(name)
                                .cloned()
                                .or_else(|| const_floats(l, name).map(|t| t.shape.clone()))
                                .unwrap_or_default();
                            let xd = dims4(&xs)
                                .ok_or_else(|| unsupported(i, s, "Concat input of rank above 4"))?;
                            blocks.push(copy(x, y, xd, contiguous_strides(&xd), ds, at * ds[a4]));
                            at += xd[a4] as i64;
                        }
                    }
                    "Softmax" => {
                        let x = place(&places, &mut st, &n.input[0])?;
                        let rank = ys.len().max(1);
                        let legacy = l.opset < 13;
                        let axis = n.attr("axis").map_or(if legacy { 1 } else { -1 }, |a| a.i);
                        let axis = if axis < 0 { axis + rank as i64 } else { axis } as usize;
                        let len: usize = ys[axis..].iter().product();
                        if !legacy
                            && axis + 1 != ys.len()
                            && ys[axis + 1..].iter().product::<usize>() != 1
                        {
                            return Err(unsupported(i, s, "Softmax over an inner axis"));
                        }
                        let rows = ys.iter().product::<usize>() / len.max(1);
                        let p = NnSoftmax {
                            x: x.addr,
                            y: y.addr,
                            len: len as i32,
                            x_half: x.half as i32,
                            y_half: y.half as i32,
                            pad: 0,
                        };
                        blocks.push((
                            Kernel::Softmax,
                            bytemuck::bytes_of(&p).to_vec(),
                            (rows.max(1) as u32, 1, 1),
                            (softmax_threads(rows, len), 1, 1),
                            i,
                        ));
                    }
                    "Resize" | "Upsample" => {
                        let x = place(&places, &mut st, &n.input[0])?;
                        let xs = l.shapes[&n.input[0]].clone();
                        if xs.len() != 4 || xs[0] != ys[0] || xs[1] != ys[1] {
                            return Err(unsupported(
                                i,
                                s,
                                format!("Resize {xs:?} → {ys:?} (only the last two axes)"),
                            ));
                        }
                        let taps = resize_taps(l, n, &xs, &ys).map_err(|m| unsupported(i, s, m))?;
                        let taps_addr = st.put(bytemuck::cast_slice(&taps));
                        let p = NnResize {
                            x: x.addr,
                            y: y.addr,
                            taps: taps_addr,
                            planes: (xs[0] * xs[1]) as i32,
                            in_h: xs[2] as i32,
                            in_w: xs[3] as i32,
                            out_h: ys[2] as i32,
                            out_w: ys[3] as i32,
                            x_half: x.half as i32,
                            y_half: y.half as i32,
                            pad: 0,
                        };
                        blocks.push((
                            Kernel::Resize,
                            bytemuck::bytes_of(&p).to_vec(),
                            grid_1d(ys.iter().product::<usize>() as u64, ELEMENTWISE_THREADS),
                            (ELEMENTWISE_THREADS, 1, 1),
                            i,
                        ));
                    }
                    other => {
                        return Err(unsupported(
                            i,
                            s,
                            format!("operator {other} has no GPU kernel"),
                        ));
                    }
                }
            }
        }
    }
    let weight_bytes = st.bytes.len() as u64 - weights_start;
    let mut stat_chains = Vec::with_capacity(tails.len());
    for (own, stage, bytes, grid) in tails {
        let addr = st.put(&bytes);
        stat_chains.push((
            own,
            Launch {
                kernel: Kernel::Eltwise,
                params: addr,
                grid,
                block: (ELEMENTWISE_THREADS, 1, 1),
                shared: 0,
                stage,
            },
        ));
        let gram = blocks
            .iter_mut()
            .find(|b| b.0.finishes_gram() && b.4 == own)
            .expect("a statistics chain's Gram launch");
        let mut g: NnMomentsGram = bytemuck::pod_read_unaligned(&gram.1);
        let slot = g
            .tail
            .iter()
            .position(|&t| t == 0)
            .expect("GRAM_TAILS chains at most");
        g.tail[slot] = addr;
        gram.1 = bytemuck::bytes_of(&g).to_vec();
    }
    let mut launches = Vec::with_capacity(blocks.len());
    let (mut frame_fields, mut input_launches) = (Vec::new(), Vec::new());
    for (kernel, mut bytes, grid, block, stage) in blocks {
        if let Kernel::ConvMma(..) | Kernel::Conv(..) = kernel {
            let mut p: NnConv = bytemuck::pod_read_unaligned(&bytes);
            if p.frame == FRAME_PENDING {
                p.frame = 0;
                bytes = bytemuck::bytes_of(&p).to_vec();
                input_launches.push(launches.len());
            }
        }
        let params = st.put(&bytes);
        if frame_fed && input_launches.last() == Some(&launches.len()) {
            frame_fields.push(params + std::mem::offset_of!(NnConv, frame) as u64);
        }
        let shared = match kernel {
            Kernel::ConvMma(_, nt, gather) => {
                let p: NnConv = bytemuck::pod_read_unaligned(&bytes);
                debug_assert!(
                    fixed_shape_matches(gather, &p, nt),
                    "{kernel:?} launched for a shape it does not compile in"
                );
                conv_shared_bytes_rows(gather, nt, &p, block.0 / 32 * gather.rows_per_warp())
            }
            _ => 0,
        };
        launches.push(Launch {
            kernel,
            params,
            grid,
            block,
            shared,
            stage,
        });
    }
    let static_bytes = aligned(st.bytes.len() as u64).max(ALIGN);
    st.bytes.resize(static_bytes as usize, 0);
    let input = *places
        .get(&l.input)
        .ok_or_else(|| NeuralError::Graph("the input is not planned".into()))?;
    let output = *places
        .get(&l.output)
        .ok_or_else(|| NeuralError::Unsupported("the output is a constant (on the GPU)".into()))?;
    let stage_outputs = l
        .stages
        .iter()
        .map(|s| {
            s.outputs
                .iter()
                .filter_map(|o| places.get(o).copied())
                .collect()
        })
        .collect();
    let mut folded_stages: Vec<usize> = (0..n_stages).filter(|&i| folds.folded(i)).collect();
    folded_stages.extend(prologue_stages);
    folded_stages.sort_unstable();
    let mut gram_stages: Vec<usize> = grams.iter().flat_map(|g| [g.conv, g.norm]).collect();
    gram_stages.sort_unstable();
    Ok(Program {
        folded_stages,
        gram_stages,
        stat_chains,
        stage_outputs,
        arena,
        static_bytes,
        static_init: st.bytes,
        launches,
        input,
        output,
        control,
        stats,
        weight_bytes,
        frame_fields,
        input_launches,
    })
}

/// The taps of a Resize over the last two axes: (i0, i1, w0 bits, w1 bits) per output row, then
/// per output column, as `ops::resize` computes them.
fn resize_taps(l: &Lowered, n: &NodeProto, xs: &[usize], ys: &[usize]) -> Result<Vec<i32>, String> {
    let upsample = n.op_type == "Upsample";
    let legacy = upsample || l.opset < 11;
    let sattr = |name: &str, d: &str| {
        n.attr(name).map_or(d.to_string(), |a| {
            String::from_utf8_lossy(&a.s).into_owned()
        })
    };
    let mode = sattr("mode", "nearest");
    let nearest = sattr("nearest_mode", "round_prefer_floor");
    let coord = if legacy {
        "asymmetric".to_string()
    } else {
        sattr("coordinate_transformation_mode", "half_pixel")
    };
    if n.attr("antialias").is_some_and(|a| a.i != 0) {
        return Err("Resize antialias=1".into());
    }
    // scales as the CPU reference uses them: given scales, else out / in
    let scales: Option<Vec<f32>> = if upsample && l.opset < 9 {
        n.attr("scales").map(|a| a.floats.clone())
    } else {
        let k = if legacy { 1 } else { 2 };
        n.input
            .get(k)
            .filter(|s| !s.is_empty())
            .and_then(|s| const_floats(l, s))
            .map(|t| t.data.clone())
            .filter(|v| !v.is_empty())
    };
    if n.attr("axes").is_some() {
        return Err("Resize with axes".into());
    }
    let scale = |a: usize| -> f32 {
        match &scales {
            Some(s) if s.len() == 4 => s[a],
            _ => ys[a] as f32 / xs[a] as f32,
        }
    };
    let mut out = Vec::new();
    for a in [2usize, 3] {
        let (in_len, out_len, sc) = (xs[a], ys[a], scale(a));
        let last = in_len as i64 - 1;
        for o in 0..out_len {
            if in_len == out_len && sc == 1.0 {
                out.extend_from_slice(&[o as i32, o as i32, 1.0f32.to_bits() as i32, 0]);
                continue;
            }
            let x = o as f32;
            let src = match coord.as_str() {
                "half_pixel" => (x + 0.5) / sc - 0.5,
                "pytorch_half_pixel" if out_len > 1 => (x + 0.5) / sc - 0.5,
                "pytorch_half_pixel" => 0.0,
                "align_corners" if out_len == 1 => 0.0,
                "align_corners" => x * (in_len as f32 - 1.0) / (out_len as f32 - 1.0),
                "asymmetric" => x / sc,
                "tf_half_pixel_for_nn" => (x + 0.5) / sc,
                other => return Err(format!("coordinate_transformation_mode '{other}'")),
            };
            let (i0, i1, w0, w1) = match mode.as_str() {
                "nearest" => {
                    let f = src.floor();
                    let v = if legacy {
                        if sc < 1.0 { src.ceil() } else { src.trunc() }
                    } else {
                        match nearest.as_str() {
                            "round_prefer_floor" if src - f == 0.5 => f,
                            "round_prefer_ceil" if src - f == 0.5 => f + 1.0,
                            "round_prefer_floor" | "round_prefer_ceil" => src.round(),
                            "floor" => f,
                            "ceil" => src.ceil(),
                            other => return Err(format!("nearest_mode '{other}'")),
                        }
                    };
                    let i = (v as i64).clamp(0, last) as i32;
                    (i, i, 1.0f32, 0.0f32)
                }
                "linear" | "bilinear" => {
                    let s = src.clamp(0.0, last as f32);
                    let i0 = (s as i64).min(last);
                    let i1 = (i0 + 1).min(last);
                    if i0 == i1 {
                        (i0 as i32, i1 as i32, 1.0, 0.0)
                    } else {
                        let w1 = s - i0 as f32;
                        (i0 as i32, i1 as i32, 1.0 - w1, w1)
                    }
                }
                other => return Err(format!("Resize mode '{other}'")),
            };
            out.extend_from_slice(&[i0, i1, w0.to_bits() as i32, w1.to_bits() as i32]);
        }
    }
    Ok(out)
}

/// IEEE half bits of `v`, rounded to nearest even (overflow to infinity).
/// Convolution weights `[cout][cin][taps]` (f32) as fp16 B fragments of mma.m16n8k16 in the
/// order the tensor-core kernel reads them: `[tap][16-channel chunk][8-channel tile][lane][4]`,
/// lane = 4·n + t holding (k 2t, 2t+1) then (k 2t+8, 2t+9) of output channel n; zero past cin
/// and cout.
pub fn mma_weights(w: &[f32], cout: usize, cin: usize, taps: usize) -> Vec<u16> {
    let (chunks, n_tiles) = (cin.div_ceil(16), cout.div_ceil(8));
    let mut h = vec![0u16; taps * chunks * n_tiles * 32 * 4];
    for tap in 0..taps {
        for kc in 0..chunks {
            for nt in 0..n_tiles {
                for lane in 0..32 {
                    let (n, t) = (lane / 4, lane % 4);
                    let oc = nt * 8 + n;
                    for (j, k) in [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]
                        .into_iter()
                        .enumerate()
                    {
                        let ic = kc * 16 + k;
                        if oc < cout && ic < cin {
                            h[(((tap * chunks + kc) * n_tiles + nt) * 32 + lane) * 4 + j] =
                                f32_to_f16_bits(w[(oc * cin + ic) * taps + tap]);
                        }
                    }
                }
            }
        }
    }
    h
}

pub fn f32_to_f16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let mant = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if mant != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        // subnormal: shift the full mantissa (with its implicit 1) into place, round to even
        let m = mant | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rest = m & ((1u32 << shift) - 1);
        let mut h = m >> shift;
        if rest > half || (rest == half && h & 1 == 1) {
            h += 1;
        }
        return sign | h as u16;
    }
    let mut h = ((e as u32) << 10) | (mant >> 13);
    let rest = mant & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && h & 1 == 1) {
        h += 1; // may carry into the exponent, which is still correct (up to infinity)
    }
    sign | h as u16
}

/// Launches a frame of `program` takes.
pub fn launches_per_frame(program: &Program) -> u32 {
    program.launches.len() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_taps_compute_the_same_convolution() {
        assert_eq!(tap_pack(3, 7), 4); // 2 virtual taps of 4 (12 of 16 K values used)
        assert_eq!(tap_pack(3, 3), 3);
        assert_eq!(tap_pack(16, 3), 1);
        assert_eq!(tap_pack(3, 1), 1);
        // one output row of a 3-channel 2x7 kernel, real against virtual, on pseudo-random data
        let (cout, cin, kh, kw, width) = (2, 3, 2, 7, 12);
        let value = |i: usize| ((i * 7919 % 101) as f32 - 50.0) / 25.0;
        let w: Vec<f32> = (0..cout * cin * kh * kw).map(value).collect();
        let x: Vec<f32> = (0..cin * kh * width).map(|i| value(i + 13)).collect();
        let at = |c: usize, y: usize, xx: usize| {
            if xx < width {
                x[(c * kh + y) * width + xx]
            } else {
                0.5
            }
        };
        let pack = tap_pack(cin, kw);
        let slot = tap_slot(cin);
        let (kw_v, cin_v) = (kw.div_ceil(pack), slot * pack);
        let wv = packed_weights(&w, cout, cin, kh, kw, pack);
        for oc in 0..cout {
            for ox in 0..width - kw + 1 {
                let mut real = 0.0f32;
                let mut virt = 0.0f32;
                for ky in 0..kh {
                    for c in 0..cin {
                        for kx in 0..kw {
                            real += w[((oc * cin + c) * kh + ky) * kw + kx] * at(c, ky, ox + kx);
                        }
                    }
                    for g in 0..kw_v {
                        for k in 0..cin_v {
                            let (j, c) = (k / slot, k % slot);
                            let weight = wv[((oc * cin_v + k) * kh + ky) * kw_v + g];
                            if c >= cin {
                                assert_eq!(weight, 0.0, "a slot's padding carries a weight");
                                continue;
                            }
                            virt += weight * at(c, ky, ox + g * pack + j);
                        }
                    }
                }
                assert!((real - virt).abs() < 1e-4, "{oc} {ox}: {real} vs {virt}");
            }
        }
    }

    /// The paired layout computes the convolution: output q as the even taps of A row q
    /// (columns 0-3) plus the odd taps of A row q + 1 (columns 4-7), for odd and even widths.
    #[test]
    fn paired_taps_compute_the_same_convolution() {
        for (cout, cin, kh, kw) in [(3, 16, 2, 7), (4, 5, 1, 4), (1, 3, 3, 3)] {
            let width = 14;
            let value = |i: usize| ((i * 7919 % 101) as f32 - 50.0) / 25.0;
            let w: Vec<f32> = (0..cout * cin * kh * kw).map(value).collect();
            let x: Vec<f32> = (0..cin * kh * (width + 1)).map(|i| value(i + 13)).collect();
            let at = |c: usize, y: usize, xx: usize| x[(c * kh + y) * (width + 1) + xx];
            let kw_v = kw.div_ceil(2);
            let wv = paired_weights(&w, cout, cin, kh, kw);
            assert_eq!(wv.len(), 8 * cin * kh * kw_v);
            let virt_w =
                |n: usize, c: usize, ky: usize, g: usize| wv[((n * cin + c) * kh + ky) * kw_v + g];
            for oc in 0..cout {
                for q in 0..width - kw {
                    let (mut real, mut virt) = (0.0f32, 0.0f32);
                    for ky in 0..kh {
                        for c in 0..cin {
                            for kx in 0..kw {
                                real += w[((oc * cin + c) * kh + ky) * kw + kx] * at(c, ky, q + kx);
                            }
                            for g in 0..kw_v {
                                virt += virt_w(oc, c, ky, g) * at(c, ky, q + 2 * g);
                                virt += virt_w(4 + oc, c, ky, g) * at(c, ky, q + 1 + 2 * g);
                            }
                        }
                    }
                    assert!(
                        (real - virt).abs() < 1e-4,
                        "{kw} {oc} {q}: {real} vs {virt}"
                    );
                }
            }
            // the columns past cout carry nothing
            for n in (cout..4).chain(4 + cout..8) {
                assert!((0..cin * kh * kw_v).all(|k| wv[n * cin * kh * kw_v + k] == 0.0));
            }
        }
    }

    /// The paired kernel's epilogue as neural.cu writes it, on the m16n8k16 accumulator layout
    /// (lane g * 4 + t holds rows g and g + 8, columns 2t and 2t + 1 of each m-tile): the
    /// shuffle from lane ((g + 1) & 7) * 4 + (t | 2) and the choice among its values give every
    /// output q < 31 and channel c < 4 exactly E[q][c] + O[q + 1][4 + c].
    #[test]
    fn the_paired_epilogue_adds_the_next_rows_odd_taps() {
        // acc[lane][m][k], as the accumulator cell's index (row * 8 + column of the warp's 32 x 8)
        let acc = |lane: usize, m: usize, k: usize| {
            let (g, t) = (lane / 4, lane % 4);
            ((m * 16 + g + 8 * (k / 2)) * 8 + 2 * t + k % 2) as u64
        };
        let mut seen = 0;
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            let src = (((g + 1) & 7) << 2) | (t | 2);
            let o = |m: usize, k: usize| acc(src, m, k);
            if t >= 2 {
                continue;
            }
            for m in 0..2 {
                for r in 0..2 {
                    let q = m * 16 + g + 8 * r;
                    if q == 31 {
                        continue;
                    }
                    for j in 0..2 {
                        let e = acc(lane, m, 2 * r + j);
                        let on = if g < 7 {
                            o(m, 2 * r + j)
                        } else if r == 0 {
                            o(m, 2 + j)
                        } else {
                            o(1, j)
                        };
                        let c = 2 * t + j;
                        assert_eq!(e, q as u64 * 8 + c as u64, "lane {lane}: E of output {q}");
                        assert_eq!(
                            on,
                            (q as u64 + 1) * 8 + 4 + c as u64,
                            "lane {lane}: O for output {q} channel {c}"
                        );
                        seen += 1;
                    }
                }
            }
        }
        // 31 outputs x 4 channels (distinct (lane, m, r, j) give distinct (q, c))
        assert_eq!(seen, 31 * 4);
    }

    #[test]
    fn kernel_names_are_the_kernels_neural_cu_defines() {
        let defined: Vec<&str> = super::super::KERNEL_SOURCE
            .lines()
            .filter_map(|line| line.strip_prefix("extern \"C\" __global__ void "))
            // a declaration may carry __launch_bounds__(...) or a macro of it before the name
            .map(|rest| {
                match [
                    "__launch_bounds__(",
                    "NN_TC_BOUNDS(",
                    "NN_TC_TALL_BOUNDS(",
                    "NN_TC_STEM_BOUNDS(",
                ]
                .iter()
                .find_map(|b| rest.strip_prefix(b))
                {
                    Some(bounded) => bounded.split_once(')').unwrap().1,
                    None => rest,
                }
            })
            .map(|rest| rest.split('(').next().unwrap().trim())
            .collect();
        let mut names = KERNEL_NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Kernel::COUNT, "a kernel name is given twice");
        for name in &defined {
            assert!(KERNEL_NAMES.contains(name), "{name} is not a Kernel");
        }
        for name in KERNEL_NAMES {
            assert!(defined.contains(&name), "neural.cu defines no {name}");
        }
    }

    #[test]
    fn channels_first_undoes_channels_last() {
        // 2 pixels x 3 channels, NHWC → NCHW
        let nhwc = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(channels_first(&nhwc, 3), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        assert_eq!(channels_first(&nhwc, 1), nhwc);
    }

    #[test]
    fn channel_tiles_cover_cout_and_split_small_launches() {
        // a large layer keeps the widest block that covers its channels
        assert_eq!(tc_channel_tiles(2, 16320), 2);
        assert_eq!(tc_channel_tiles(3, 16320), 4);
        assert_eq!(tc_channel_tiles(32, 4050), 8);
        // 68 pixel blocks of a 128-channel layer (16 tiles): split until >= TC_MIN_BLOCKS
        let nt = tc_channel_tiles(16, 68);
        assert_eq!(nt, 2);
        assert!(68 * 16u32.div_ceil(nt) >= TC_MIN_BLOCKS);
        // never below one tile per block, even when the launch stays small
        assert_eq!(tc_channel_tiles(1, 4), 1);
        assert_eq!(tc_channel_tiles(8, 1), 1);
    }

    /// A chain over a [1, 16, 4, 8] output: operand 0 full-size, the others per channel.
    fn chain(ops: &[(i32, i32, i32)], operands: usize) -> NnEltwise {
        let mut p: NnEltwise = bytemuck::Zeroable::zeroed();
        p.dims = [1, 16, 4, 8];
        p.strides[..4].copy_from_slice(&[512, 32, 8, 1]);
        for r in 1..operands {
            p.strides[4 * r..4 * r + 4].copy_from_slice(&[16, 1, 0, 0]);
        }
        for (k, &(code, a, b)) in ops.iter().enumerate() {
            (p.op_code[k], p.op_a[k], p.op_b[k]) = (code, a, b);
        }
        p.n_ops = ops.len() as i32;
        p
    }

    #[test]
    fn affine_chains_are_recognised() {
        // ((x - m) / s) * t + u, then LeakyRelu: affine in operand 0 for 4 ops
        let norm = [
            (EW_SUB, 0, 1),
            (EW_DIV, -1, 2),
            (EW_MUL, -1, 3),
            (EW_ADD, -1, 4),
            (EW_LEAKY, -1, -1),
        ];
        assert_eq!(affine_chain(&chain(&norm, 5), 5), Some((0, 4)));
        assert_eq!(affine_chain(&chain(&norm[..4], 5), 5), Some((0, 4)));
        // a constant's square root on the way is fine: s * sqrt(t) - x
        let c = [(EW_SQRT, 2, -1), (EW_MUL, 1, -1), (EW_SUB, -1, 0)];
        assert_eq!(affine_chain(&chain(&c, 3), 3), Some((0, 3)));
        // x * x, division by x, x under a unary op first, a binary op after the unary tail
        assert_eq!(affine_chain(&chain(&[(EW_MUL, 0, 0)], 1), 1), None);
        assert_eq!(affine_chain(&chain(&[(EW_DIV, 1, 0)], 2), 2), None);
        assert_eq!(affine_chain(&chain(&[(EW_RELU, 0, -1)], 1), 1), None);
        let tail = [(EW_ADD, 0, 1), (EW_RELU, -1, -1), (EW_ADD, -1, 1)];
        assert_eq!(affine_chain(&chain(&tail, 2), 2), None);
        // an operand that varies along the last axis, or two full-size operands
        let mut p = chain(&[(EW_ADD, 0, 1)], 2);
        p.strides[4..8].copy_from_slice(&[0, 0, 0, 1]);
        assert_eq!(affine_chain(&p, 2), None);
        let mut p = chain(&[(EW_ADD, 0, 1)], 2);
        p.strides[4..8].copy_from_slice(&[512, 32, 8, 1]);
        assert_eq!(affine_chain(&p, 2), None);
    }

    #[test]
    fn per_channel_chains_over_channels_last_are_affine_along_the_last_axis() {
        // dims N, H, W, C = 1, 4, 8, 16: X contiguous, the statistics per channel (last axis)
        let norm = [(EW_SUB, 0, 1), (EW_DIV, -1, 2), (EW_LEAKY, -1, -1)];
        let mut p = chain(&norm, 3);
        p.dims = [1, 4, 8, 16];
        p.strides[..4].copy_from_slice(&[512, 128, 16, 1]);
        for r in 1..3 {
            p.strides[4 * r..4 * r + 4].copy_from_slice(&[0, 0, 0, 1]);
        }
        assert_eq!(affine_chain_last(&p, 3), Some((0, 2)));
        // the NCHW path wants constants along the last axis: not these
        assert_eq!(affine_chain(&p, 3), None);
        // a constant that varies along W (axis 2) is not per channel
        p.strides[4..8].copy_from_slice(&[0, 0, 1, 0]);
        assert_eq!(affine_chain_last(&p, 3), None);
    }

    /// Runs the bands of `band_geometry` bottom first on a model of the shared buffer (row r
    /// holds input row r, the output's row r lands on row r + lag) and checks that every input
    /// row a band reads, through the reflected border, is still the input when it is read, and
    /// that the output ends whole in the last `height` rows.
    #[test]
    fn bands_never_overwrite_rows_still_to_be_read() {
        #[derive(Clone, Copy, PartialEq, Debug)]
        enum Row {
            Free,
            In(usize),
            Out(usize),
        }
        let reflect = |r: i64, h: i64| -> usize {
            let r = if r < 0 { -r } else { r };
            (if r >= h { 2 * (h - 1) - r } else { r }) as usize
        };
        for height in [16usize, 80, 192, 544, 1088, 2176, 1081] {
            for (kh, dh) in [(1usize, 1usize), (3, 1), (3, 2), (7, 1)] {
                for bands in BAND_COUNTS {
                    let Some((rows, count, lag)) = band_geometry(height, kh, dh, bands) else {
                        assert!(height <= 16 * bands / BANDS, "{height} {kh} {dh}: no bands");
                        continue;
                    };
                    assert!(count > 1 && count <= bands && rows * count >= height);
                    assert!(rows * (count - 1) < height, "an empty band");
                    let reach = (kh - 1) * dh;
                    // any top pad from 0 to the kernel's reach keeps the size
                    for pad_top in 0..=reach {
                        let mut buffer = vec![Row::Free; height + lag];
                        for (r, slot) in buffer.iter_mut().enumerate().take(height) {
                            *slot = Row::In(r);
                        }
                        for k in (0..count).rev() {
                            let (s, e) = (k * rows, ((k + 1) * rows).min(height));
                            for o in s..e {
                                for t in 0..kh {
                                    let r = o as i64 - pad_top as i64 + (t * dh) as i64;
                                    let r = reflect(r, height as i64);
                                    assert_eq!(
                                        buffer[r],
                                        Row::In(r),
                                        "{height} {kh} {dh} band {k}"
                                    );
                                }
                            }
                            for o in s..e {
                                buffer[o + lag] = Row::Out(o);
                            }
                        }
                        for (r, slot) in buffer[lag..].iter().enumerate() {
                            assert_eq!(*slot, Row::Out(r));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn shared_memory_holds_the_tile_and_its_source_table() {
        // 3x3 stride 1: 6 rows x 34 columns, 48 bytes of tile and 8 of table per pixel
        assert_eq!(
            tc_shared_bytes(TC_ROWS, (3, 3), (1, 1), (1, 1), 1, 16),
            6 * 34 * 56
        );
        // the 3-channel 7x7 stem, 4 taps packed: 10 rows x 36 columns of tile, a table of
        // 39 columns, each table pixel staged as 4 halves
        assert_eq!(
            tc_shared_bytes(TC_ROWS, (7, 7), (1, 1), (1, 1), 4, 3),
            (10 * 36 * 48 + 10 * 39 * 8 + 390 * 8) as u32
        );
        // a compiled 3x3 block also stages a chunk's B fragments: 9 taps x 8 tiles x 256 bytes
        // at most, within 48 KiB with its tile and table
        assert_eq!(b_stage_bytes(9, 2), 9 * 2 * 32 * 8);
        assert!(
            tc_shared_bytes(TC_ROWS, (3, 3), (1, 1), (1, 1), 1, 16) + b_stage_bytes(9, 8)
                <= 48 * 1024
        );
        // stride 2: 9 rows x 65 columns, at most 4 tiles
        assert!(
            tc_shared_bytes(TC_ROWS, (3, 3), (2, 2), (1, 1), 1, 16) + b_stage_bytes(9, 4)
                <= 48 * 1024
        );
        assert!(
            tc_shared_bytes(TC_ROWS, (3, 3), (2, 2), (1, 1), 1, 16) + b_stage_bytes(9, 8)
                > 48 * 1024
        );
        // fixed shapes that are not tap-packed keep the separable table: the 16-channel 3x3
        // with 2 tiles 6 x 34 x 48 + (10 + 40) x 16 + 9 x 2 x 256 bytes; the paired 7x7 output
        // convolution in a short block (four warps of two rows) 14 x 38 x 48 + (13 + 52) x 16
        // + 28 x 256, so that six blocks fit a multiprocessor's 228 KiB with their 1 KiB
        // reserve each
        let conv = |k: i32, s: i32, pack: i32, cin: i32| NnConv {
            kh: k,
            kw: k,
            sh: s,
            sw: s,
            dh: 1,
            dw: 1,
            pack,
            cin,
            n_tiles: 1,
            ..bytemuck::Zeroable::zeroed()
        };
        let c3 = conv_shared_bytes(MmaGather::ChannelsLast3x3, 2, &conv(3, 1, 1, 16));
        assert_eq!(c3, 6 * 34 * 48 + (10 + 40) * 16 + 9 * 2 * 256);
        let cp = conv_shared_bytes(MmaGather::ChannelsLastPaired, 1, &conv(7, 1, 1, 16));
        assert_eq!(cp, 14 * 38 * 48 + (13 + 52) * 16 + 28 * 256);
        assert!(6 * (cp + 1024) <= 228 * 1024);
        // double-buffered (`NnConv::stages`): two tiles and two B stages, one table; at eight
        // tiles past 48 KiB, within the opt-in bound with a prologue chain's coefficients
        let piped = |nt: u8| {
            let p = NnConv {
                stages: 2,
                ..conv(3, 1, 1, 16)
            };
            conv_shared_bytes(MmaGather::ChannelsLast3x3, nt, &p)
        };
        assert_eq!(piped(2), 2 * (6 * 34 * 48 + 9 * 2 * 256) + (10 + 40) * 16);
        assert!(piped(8) > 48 * 1024 && piped(8) + PRE_BYTES <= TC_SHARED_OPT_IN);
        // the largest double-buffered blocks (this one, and the general stride-2 3x3 below)
        // stay within the 60 KiB `PIPELINE_MIN_SHARED_PER_SM` counts three of
        assert!(piped(8) + PRE_BYTES <= 60 * 1024);
        // a double-buffered staged Resize patch: one tile, two B stages, two patches
        let patch_piped = NnConv {
            stages: 2,
            rs_patch: 95,
            rs_taps: 1,
            ..conv(3, 1, 1, 16)
        };
        assert_eq!(
            conv_shared_bytes(MmaGather::ChannelsLast3x3Resize, 8, &patch_piped),
            6 * 34 * 48 + 2 * 9 * 8 * 256 + (10 + 40) * 16 + 2 * 95 * 32
        );
        // the general kernels: tile and full table (double-buffered: a second tile)
        assert_eq!(
            conv_shared_bytes(MmaGather::ChannelsLast, 2, &conv(3, 1, 1, 16)),
            tc_shared_bytes(TC_ROWS, (3, 3), (1, 1), (1, 1), 1, 16)
        );
        let general_piped = NnConv {
            stages: 2,
            ..conv(3, 2, 1, 16)
        };
        assert_eq!(
            conv_shared_bytes(MmaGather::ChannelsLast, 8, &general_piped),
            tc_shared_bytes(TC_ROWS, (3, 3), (2, 2), (1, 1), 1, 16) + 9 * 65 * 48
        );
        assert!(
            conv_shared_bytes(MmaGather::ChannelsLast, 8, &general_piped) + PRE_BYTES <= 60 * 1024
        );
        // the packed 7x7 stem: 14 virtual taps, at most 4 tiles, also in a tall block
        assert!(
            tc_shared_bytes(TC_ROWS, (7, 7), (1, 1), (1, 1), 4, 3) + b_stage_bytes(14, 4)
                <= 48 * 1024
        );
        let stem_tall = |nt: u8| {
            conv_shared_bytes_rows(
                MmaGather::TapPacked7x7,
                nt,
                &conv(7, 1, 4, 3),
                TC_TALL_ROWS * TC_STEM_ROWS,
            )
        };
        // (eight warps of two rows: 22 tile rows)
        assert_eq!(
            stem_tall(2),
            (22 * 36 * 48 + 22 * 39 * 8 + 858 * 8 + 14 * 2 * 256) as u32
        );
        // at one or two tiles three blocks a multiprocessor with their 1 KiB reserve
        // (NN_TC_STEM_BOUNDS; at two no more); at four past 48 KiB, within the opt-in bound,
        // two blocks
        for nt in [1, 2] {
            assert!(3 * (stem_tall(nt) + 1024) <= 228 * 1024);
        }
        assert!(4 * (stem_tall(2) + 1024) > 228 * 1024);
        assert!(stem_tall(4) > 48 * 1024 && stem_tall(4) <= TC_SHARED_OPT_IN);
        assert!(2 * (stem_tall(4) + 1024) <= 228 * 1024);
        // the paired output convolution in a tall block (eight warps of two rows): 22 tile
        // rows; four blocks (the same 64-register bound) with a prologue chain's coefficients
        // fit a multiprocessor
        let cp_tall = conv_shared_bytes_rows(
            MmaGather::ChannelsLastPaired,
            1,
            &conv(7, 1, 1, 16),
            TC_TALL_ROWS * TC_PAIRED_ROWS,
        );
        assert_eq!(cp_tall, 22 * 38 * 48 + (15 + 60) * 16 + 28 * 256);
        assert!(4 * (cp_tall + PRE_BYTES + 1024) <= 228 * 1024);
        // the largest tile that takes the tensor cores still fits 48 KiB without opt-in
        const { assert!(TC_TILE_HALVES * 2 + TC_TILE_HALVES / TC_PIX * 8 <= 48 * 1024) };
    }
}
