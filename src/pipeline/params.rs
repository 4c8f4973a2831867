//! Stage parameters shared by both backends.
//!
//! [`StageParams`] is what the user sets (element properties). [`ToonParams`] is the flat,
//! `#[repr(C)]` block derived from it once per change: the CPU reference reads it, and the CUDA
//! backend copies it into device memory before each frame. It is declared once, with
//! `kernel_struct!`, which also gives the kernels its C declaration (see `cuda::abi`).
//!
//! Spatial weight tables are computed here, on the host, so both backends use bit-identical
//! weights.

use crate::kernel_abi::kernel_struct;

/// Largest filter radius any table may hold (in pixels of the plane it is applied to).
pub const MAX_RADIUS: usize = 24;
/// Thumbnail used for scene-cut detection: at most this many block means across and down.
pub const THUMB_W: usize = 64;
pub const THUMB_H: usize = 36;
/// Luma histogram bins (one per 8-bit code).
pub const HIST_BINS: usize = 256;
/// Fraction of pixels clipped at each end by auto-levels.
pub const AUTO_LEVELS_CLIP: f32 = 0.005;
/// Auto-levels applies only when the white point lies more than this many codes above the black
/// point (a nearly flat frame is left alone).
pub const AUTO_LEVELS_MIN_SPREAD: usize = 8;
/// Largest supported temporal history.
pub const MAX_HISTORY: u32 = 8;
/// Largest bilateral iteration count.
pub const MAX_ITERATIONS: u32 = 8;

/// Storage precision of features and intermediates (math is always fp32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    #[default]
    Fp16,
    Fp32,
}

impl Precision {
    pub fn bytes(self) -> usize {
        match self {
            Precision::Fp16 => 2,
            Precision::Fp32 => 4,
        }
    }
}

/// User-facing stylisation settings (the element's properties that shape the picture).
#[derive(Debug, Clone, PartialEq)]
pub struct StageParams {
    pub bilateral_iterations: u32,
    pub edge_iterations: u32,
    pub spatial_sigma: f32,
    pub range_sigma: f32,
    pub edge_sigma: f32,
    pub edge_tau: f32,
    pub edge_sharpness: f32,
    pub edge_strength: f32,
    pub levels: u32,
    pub level_sharpness: f32,
    pub saturation: f32,
    pub auto_levels: bool,
    pub temporal_history: u32,
    pub temporal_strength: f32,
    pub motion_sigma: f32,
    pub scene_cut_threshold: f32,
}

impl Default for StageParams {
    fn default() -> Self {
        StageParams {
            bilateral_iterations: 3,
            edge_iterations: 1,
            spatial_sigma: 3.0,
            range_sigma: 4.25,
            edge_sigma: 1.0,
            edge_tau: 0.98,
            edge_sharpness: 2.0,
            edge_strength: 1.0,
            levels: 8,
            level_sharpness: 3.4,
            saturation: 1.25,
            auto_levels: false,
            temporal_history: 4,
            temporal_strength: 0.6,
            motion_sigma: 3.0,
            scene_cut_threshold: 12.0,
        }
    }
}

/// Everything that fixes the amount of work and memory of a frame: a change of shape needs a new
/// memory plan and a new CUDA graph; any other change is a parameter-block update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    pub width: u32,
    pub height: u32,
    pub bilateral_iterations: u32,
    pub temporal_history: u32,
    pub precision: Precision,
    pub auto_levels: bool,
}

/// Filter radius for a Gaussian of standard deviation `sigma`, `⌈2σ⌉`, capped to the tables.
pub fn radius_for(sigma: f32, extent: f32) -> usize {
    ((extent * sigma).ceil().max(1.0) as usize).min(MAX_RADIUS)
}

/// Fills `table[0..=radius]` with `exp(−j²/(2σ²))` and zeros beyond.
fn gaussian_table(sigma: f32, radius: usize) -> [f32; MAX_RADIUS + 1] {
    let mut table = [0.0f32; MAX_RADIUS + 1];
    let denom = 2.0 * sigma * sigma;
    for (j, w) in table.iter_mut().enumerate().take(radius + 1) {
        let jf = j as f32;
        *w = (-(jf * jf) / denom).exp();
    }
    table
}

kernel_struct! {
/// The flat parameter block both backends read; the kernels get its C declaration.
#[derive(Debug, PartialEq)]
pub struct ToonParams {
    pub width: i32,
    pub height: i32,
    pub chroma_width: i32,
    pub chroma_height: i32,
    pub thumb_w: i32,
    pub thumb_h: i32,
    pub bilateral_iterations: i32,
    /// Bilateral iteration whose luma feeds the edges (0 = unsmoothed luma).
    pub edge_iteration: i32,
    pub levels: i32,
    pub history: i32,
    pub auto_levels: i32,
    pub luma_radius: i32,
    pub chroma_radius: i32,
    pub edge_radius: i32,
    /// −1/(2σ_r²), applied to squared range distances in L units.
    pub range_coeff: f32,
    pub edge_tau: f32,
    pub edge_sharpness: f32,
    pub edge_strength: f32,
    pub level_sharpness: f32,
    pub saturation: f32,
    pub temporal_strength: f32,
    /// −1/(2σ_t²) for the motion guard.
    pub motion_coeff: f32,
    pub scene_cut_threshold: f32,
    pub luma_spatial: [f32; MAX_RADIUS + 1],
    pub chroma_spatial: [f32; MAX_RADIUS + 1],
    /// Gaussian σ_e and 1.6σ_e for the DoG, both over `edge_radius`.
    pub edge_gauss1: [f32; MAX_RADIUS + 1],
    pub edge_gauss2: [f32; MAX_RADIUS + 1],
}
}

impl ToonParams {
    /// Derives the flat block for a frame of `width`×`height` luma pixels.
    pub fn new(params: &StageParams, width: u32, height: u32) -> ToonParams {
        let chroma_width = width.div_ceil(2);
        let chroma_height = height.div_ceil(2);
        let sd = params.spatial_sigma.max(0.1);
        let luma_radius = radius_for(sd, 2.0);
        let chroma_radius = radius_for(sd / 2.0, 2.0);
        let se1 = params.edge_sigma.max(0.1);
        let se2 = 1.6 * se1;
        let edge_radius = radius_for(se2, 2.0);
        let rs = params.range_sigma.max(0.01);
        let ms = params.motion_sigma.max(0.01);
        ToonParams {
            width: width as i32,
            height: height as i32,
            chroma_width: chroma_width as i32,
            chroma_height: chroma_height as i32,
            thumb_w: (width as usize).min(THUMB_W) as i32,
            thumb_h: (height as usize).min(THUMB_H) as i32,
            bilateral_iterations: params.bilateral_iterations.min(MAX_ITERATIONS) as i32,
            edge_iteration: params.edge_iterations.min(params.bilateral_iterations) as i32,
            levels: params.levels.max(2) as i32,
            history: params.temporal_history.min(MAX_HISTORY) as i32,
            auto_levels: params.auto_levels as i32,
            luma_radius: luma_radius as i32,
            chroma_radius: chroma_radius as i32,
            edge_radius: edge_radius as i32,
            range_coeff: -1.0 / (2.0 * rs * rs),
            edge_tau: params.edge_tau,
            edge_sharpness: params.edge_sharpness,
            edge_strength: params.edge_strength.clamp(0.0, 1.0),
            level_sharpness: params.level_sharpness,
            saturation: params.saturation,
            temporal_strength: params.temporal_strength.clamp(0.0, 1.0),
            motion_coeff: -1.0 / (2.0 * ms * ms),
            scene_cut_threshold: params.scene_cut_threshold,
            luma_spatial: gaussian_table(sd, luma_radius),
            chroma_spatial: gaussian_table(sd / 2.0, chroma_radius),
            edge_gauss1: gaussian_table(se1, edge_radius),
            edge_gauss2: gaussian_table(se2, edge_radius),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_has_no_padding() {
        // 14 ints + 9 floats + 4 tables of MAX_RADIUS+1 floats (Pod refuses padding anyway).
        assert_eq!(
            std::mem::size_of::<ToonParams>(),
            4 * (14 + 9 + 4 * (MAX_RADIUS + 1))
        );
    }

    #[test]
    fn defaults_give_the_documented_radii() {
        let p = ToonParams::new(&StageParams::default(), 1920, 1080);
        assert_eq!(p.luma_radius, 6);
        assert_eq!(p.chroma_radius, 3);
        assert_eq!(p.edge_radius, 4);
        assert_eq!(p.chroma_width, 960);
        assert_eq!(p.luma_spatial[0], 1.0);
        assert!((p.luma_spatial[3] - (-0.5f32).exp()).abs() < 1e-6);
        assert_eq!(p.luma_spatial[7], 0.0);
        assert_eq!((p.thumb_w, p.thumb_h), (64, 36));
    }

    #[test]
    fn edge_iteration_never_exceeds_bilateral_iterations() {
        let s = StageParams {
            bilateral_iterations: 1,
            edge_iterations: 3,
            ..Default::default()
        };
        assert_eq!(ToonParams::new(&s, 64, 64).edge_iteration, 1);
    }

    #[test]
    fn small_frames_get_a_smaller_thumbnail() {
        let p = ToonParams::new(&StageParams::default(), 16, 16);
        assert_eq!((p.thumb_w, p.thumb_h), (16, 16));
    }
}
