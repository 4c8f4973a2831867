//! The classic pipeline's host↔kernel ABI: the blocks the kernels share with the host
//! ([`ToonParams`], [`TfControl`], [`TfState`], [`TfFrame`]), the launch block sizes and the
//! shared constants. Each is written here (or in `pipeline::params`) once; [`header`] is the C
//! text NVRTC gets in front of `kernels/toonflow.cu`.

use crate::kernel_abi::{Define, KernelStruct, c_header, kernel_struct};
use crate::pipeline::ToonParams;
use crate::pipeline::params::{
    AUTO_LEVELS_CLIP, AUTO_LEVELS_MIN_SPREAD, HIST_BINS, MAX_HISTORY, MAX_RADIUS, THUMB_H, THUMB_W,
};

/// Block of `tf_unpack`, `tf_temporal` and `tf_final`: one thread per chroma sample, so a block
/// covers a (2·x)×(2·y) luma tile; `tf_unpack` sizes its shared thumbnail tile from it.
pub const TILE_BLOCK: (u32, u32) = (32, 8);
/// Block of `tf_bilateral_x` and `tf_dog_x`: [`BILATERAL_X_COLS`] outputs per thread along its
/// row, a row tile per thread row (a block covers 256 columns × 4 rows).
pub const BILATERAL_BLOCK: (u32, u32) = (64, 4);
pub const BILATERAL_X_COLS: u32 = 4;
/// Block of `tf_bilateral_y`: each thread takes [`BILATERAL_Y_ROWS`] outputs down its column, so
/// a block covers 32 columns × 32 rows from one shared column tile (its halo shared by 32 rows).
pub const BILATERAL_Y_BLOCK: (u32, u32) = (32, 8);
pub const BILATERAL_Y_ROWS: u32 = 4;
/// Threads of the single `tf_analyze` block (a power of two: the kernel reduces by halving). Its
/// thumbnail loop waits on memory, so more threads mean fewer trips (2304 cells: 3 per thread).
pub const ANALYZE_THREADS: u32 = 1024;

/// Where [`TfControl`] sits inside the parameter buffer, after [`ToonParams`].
pub const CONTROL_OFFSET: u64 = 512;

const _: () = assert!(std::mem::size_of::<ToonParams>() as u64 <= CONTROL_OFFSET);
const _: () = assert!(ANALYZE_THREADS.is_power_of_two());

kernel_struct! {
/// Host → device every frame, at [`CONTROL_OFFSET`] in the parameter buffer.
#[derive(Debug, PartialEq)]
pub struct TfControl {
    /// Non-zero: empty the temporal ring and forget the previous thumbnail.
    pub reset: i32,
    pub pad: [i32; 3],
}
}

kernel_struct! {
/// Persistent device state: the scene detector's memory and the ring cursor.
pub struct TfState {
    pub has_prev: i32,
    pub ring_next: i32,
    pub ring_len: i32,
    pub pad: i32,
    pub prev_thumb: [f32; THUMB_W * THUMB_H],
}
}

kernel_struct! {
/// Per-frame decisions, written by the analysis (`tf_analysis`), read by the temporal filter
/// and `tf_final`, copied back to the host. The analysis also works out `tf_final`'s per-frame
/// constants once, so no thread of it divides.
#[derive(Debug, PartialEq)]
pub struct TfFrame {
    pub scene_cut: i32,
    pub scene_score: f32,
    pub history_used: i32,
    pub push_slot: i32,
    pub levels_valid: i32,
    pub black: f32,
    pub white: f32,
    /// 100 / (white − black) with valid auto-levels, else 1.
    pub levels_stretch: f32,
    pub recent_slot: [i32; MAX_HISTORY as usize],
    /// The quantizer's bin Δq = 100 / levels and its reciprocal levels / 100.
    pub level_step: f32,
    pub level_inv_step: f32,
    /// 1 / (the weight sum of each DoG Gaussian over −edge_radius ..= edge_radius).
    pub edge_inv1: f32,
    pub edge_inv2: f32,
}
}

/// The constants the kernels share with the host.
pub fn defines() -> Vec<Define> {
    vec![
        Define::int("TF_MAX_RADIUS", MAX_RADIUS as i64),
        Define::int("TF_THUMB_W", THUMB_W as i64),
        Define::int("TF_THUMB_H", THUMB_H as i64),
        Define::int("TF_HIST_BINS", HIST_BINS as i64),
        Define::int("TF_MAX_HISTORY", MAX_HISTORY),
        Define::float("TF_AUTO_LEVELS_CLIP", AUTO_LEVELS_CLIP),
        Define::int("TF_AUTO_LEVELS_MIN_SPREAD", AUTO_LEVELS_MIN_SPREAD as i64),
        Define::int("TF_TILE_BX", TILE_BLOCK.0),
        Define::int("TF_TILE_BY", TILE_BLOCK.1),
        Define::int("TF_BIL_BX", BILATERAL_BLOCK.0),
        Define::int("TF_BIL_BY", BILATERAL_BLOCK.1),
        Define::int("TF_BIL_COLS", BILATERAL_X_COLS),
        Define::int("TF_BILY_BX", BILATERAL_Y_BLOCK.0),
        Define::int("TF_BILY_BY", BILATERAL_Y_BLOCK.1),
        Define::int("TF_BILY_ROWS", BILATERAL_Y_ROWS),
        Define::int("TF_ANALYZE_THREADS", ANALYZE_THREADS),
    ]
}

/// The C declarations of the shared blocks, in the order the kernels need them.
pub fn struct_declarations() -> Vec<String> {
    vec![
        ToonParams::c_declaration(),
        TfControl::c_declaration(),
        TfState::c_declaration(),
        TfFrame::c_declaration(),
    ]
}

/// The C text prepended to `kernels/toonflow.cu`: the constants, then the blocks.
pub fn header() -> String {
    c_header(
        "toonflow kernel ABI: constants and blocks shared with the host (src/cuda/abi.rs)",
        &defines(),
        &struct_declarations(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_abi::{CCheck, StructLayout, c_compiler_check};

    #[test]
    fn block_sizes_are_the_planned_ones() {
        assert_eq!(std::mem::size_of::<TfControl>(), 16);
        assert_eq!(std::mem::size_of::<TfFrame>(), 80);
        assert_eq!(std::mem::size_of::<TfState>(), 16 + 4 * THUMB_W * THUMB_H);
    }

    /// Every field's offset and size, every block's size and every constant, as the host C
    /// compiler reads the generated header, against the Rust side.
    #[test]
    fn a_c_compiler_agrees_with_the_rust_layout() {
        let layouts = [
            StructLayout::of::<ToonParams>(),
            StructLayout::of::<TfControl>(),
            StructLayout::of::<TfState>(),
            StructLayout::of::<TfFrame>(),
        ];
        match c_compiler_check(&header(), &layouts, &defines()) {
            Ok(CCheck::Agreed { compiler, checked }) => {
                println!("{compiler} agrees on {checked} sizes, offsets and constants")
            }
            Ok(CCheck::NoCompiler) => {
                println!("skipped: no C compiler found ($CC, cc, gcc or clang)")
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn the_header_declares_every_block_and_constant() {
        let h = header();
        for name in ["ToonParams", "TfControl", "TfState", "TfFrame"] {
            assert!(
                h.contains(&format!("typedef struct {name} {{")),
                "{name}\n{h}"
            );
        }
        assert!(h.contains("#define TF_AUTO_LEVELS_CLIP 0.005f\n"), "{h}");
        assert!(h.contains("#define TF_TILE_BX 32\n"), "{h}");
        assert!(h.contains("    float luma_spatial[25];\n"), "{h}");
        assert!(h.contains("    int recent_slot[8];\n"), "{h}");
    }
}
