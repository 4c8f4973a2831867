//! The classic pipeline's launches: the device addresses of the planned buffers and the
//! sequence of a frame (its kernels), enqueued on one stream. Nothing here reads
//! from the device or allocates, so the sequence can be captured into a graph.

use cudarc::driver::{CudaStream, LaunchArgs, LaunchConfig, PushKernelArg, sys};

use super::abi::{
    ANALYZE_THREADS, BILATERAL_BLOCK, BILATERAL_X_COLS, BILATERAL_Y_BLOCK, BILATERAL_Y_ROWS,
    CONTROL_OFFSET, TILE_BLOCK,
};
use super::error::{CudaError, driver};
use super::graph::GraphKey;
use super::kernels::Kernels;
use super::plan::{MemoryPlan, STATS_BYTES, names};
use crate::pipeline::params::{THUMB_H, THUMB_W};

/// Device addresses of the planned buffers (0 for a buffer the plan does not have).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DevicePtrs {
    pub params: u64,
    pub control: u64,
    pub state: u64,
    pub frame: u64,
    pub thumb: u64,
    pub hist: u64,
    pub nv12_in: u64,
    pub feat_l: u64,
    pub feat_uv: u64,
    pub tmp_l: u64,
    pub tmp_uv: u64,
    pub dog1: u64,
    pub dog2: u64,
    pub ring: u64,
    pub nv12_out: u64,
}

impl DevicePtrs {
    /// The addresses of `plan`'s buffers in an arena at `base`.
    pub fn new(plan: &MemoryPlan, base: u64) -> Self {
        let at = |n: &str| plan.offset(n).map_or(0, |o| base + o);
        let stats = at(names::STATS);
        DevicePtrs {
            params: at(names::PARAMS),
            control: at(names::PARAMS) + CONTROL_OFFSET,
            state: at(names::STATE),
            frame: at(names::FRAME),
            // The statistics buffer holds the thumbnail block sums, then the histogram.
            thumb: stats,
            hist: stats + 4 * (THUMB_W * THUMB_H) as u64,
            nv12_in: at(names::NV12_IN),
            feat_l: at(names::FEAT_L),
            feat_uv: at(names::FEAT_UV),
            tmp_l: at(names::TMP_L),
            tmp_uv: at(names::TMP_UV),
            dog1: at(names::DOG1),
            dog2: at(names::DOG2),
            ring: at(names::RING),
            nv12_out: at(names::NV12_OUT),
        }
    }
}

/// Blocks of `block` threads covering `width`×`height` threads (at least one block each way).
fn grid(width: u32, height: u32, block: (u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            width.div_ceil(block.0).max(1),
            height.div_ceil(block.1).max(1),
            1,
        ),
        block_dim: (block.0, block.1, 1),
        shared_mem_bytes: 0,
    }
}

/// The grid of a bilateral pass over a `width`×`height` frame with blocks of `block` threads,
/// each thread taking `(cols, rows)` outputs (along its row, down its column): the luma rows'
/// blocks, then the chroma rows' blocks (x as for luma, the chroma blocks past the chroma width
/// exit at once). Also returns the number of luma block rows, the kernel's `luma_blocks_y`.
fn bilateral_grid(
    width: u32,
    height: u32,
    block: (u32, u32),
    (cols, rows): (u32, u32),
) -> (LaunchConfig, i32) {
    let block_rows = block.1 * rows;
    let luma = height.div_ceil(block_rows);
    let chroma = height.div_ceil(2).div_ceil(block_rows);
    let mut cfg = grid(width.div_ceil(cols), 1, block);
    cfg.grid_dim.1 = luma + chroma;
    (cfg, luma as i32)
}

/// The arguments `tf_analysis` takes after the parameter block (`tf_analyze`'s and the tail of
/// the x pass's): control, thumbnail sums, histogram, state, frame, ring capacity.
fn analysis_args<'a, 'b>(
    b: &'b mut LaunchArgs<'a>,
    p: &'a DevicePtrs,
    capacity: &'a i32,
) -> &'b mut LaunchArgs<'a> {
    b.arg(&p.control)
        .arg(&p.thumb)
        .arg(&p.hist)
        .arg(&p.state)
        .arg(&p.frame)
        .arg(capacity)
}

/// Zeroes the statistics (thumbnail sums, histogram) on `stream`, for a plan just installed; after
/// that each frame's analysis leaves them zero for the next frame's unpack.
pub(crate) fn clear_statistics(stream: &CudaStream, p: &DevicePtrs) -> Result<(), CudaError> {
    // SAFETY: `p.thumb` addresses the statistics buffer of STATS_BYTES bytes in the arena, which
    // outlives the stream's work on it.
    unsafe {
        sys::cuMemsetD32Async(p.thumb, 0, (STATS_BYTES / 4) as usize, stream.cu_stream())
            .result()
            .map_err(driver("cuMemsetD32Async"))
    }
}

/// Puts a frame of `key`'s shape on `stream`: unpack (into statistics left zero), the analysis (in an
/// extra block of the first x pass, or on its own: `GraphKey::analysis_in_x_pass`), the
/// bilateral iterations with the temporal filter after `key.edge_iteration` of them (in the y
/// pass that ends that iteration; a launch of its own when it comes before the first), the
/// stand-alone DoG x pass when needed, final. Exactly `key.launches()` kernels.
pub(crate) fn enqueue_frame(
    stream: &CudaStream,
    k: &Kernels,
    p: &DevicePtrs,
    key: &GraphKey,
) -> Result<(), CudaError> {
    let s = stream;
    let (w, h) = (key.shape.width, key.shape.height);
    let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
    let n = key.iterations();
    let capacity = key.ring_capacity() as i32;
    // One thread per chroma sample.
    let tile = grid(cw, ch, TILE_BLOCK);
    // The luma rows' blocks, then the chroma rows' blocks, in one launch (x and y passes).
    let (bil_x, luma_blocks_x) = bilateral_grid(w, h, BILATERAL_BLOCK, (BILATERAL_X_COLS, 1));
    let (bil_y, luma_blocks_y) = bilateral_grid(w, h, BILATERAL_Y_BLOCK, (1, BILATERAL_Y_ROWS));
    let luma_elems = (w as i64) * (h as i64);
    let slot_elems = luma_elems + 2 * (cw as i64) * (ch as i64);

    let analysis_in_x = key.analysis_in_x_pass();
    // SAFETY (every launch below): the arguments match the kernels' signatures in
    // kernels/toonflow.cu one for one (device addresses as u64, `int` as i32, `long` as i64);
    // every address lies in the pipeline's arena, laid out by the plan for `key.shape`, which
    // outlives the launches (and any graph captured from them); the grids cover the planes the
    // kernels index and the kernels bound-check the rest.
    unsafe {
        s.launch_builder(&k.unpack)
            .arg(&p.params)
            .arg(&p.nv12_in)
            .arg(&p.feat_l)
            .arg(&p.feat_uv)
            .arg(&p.thumb)
            .arg(&p.hist)
            .launch(tile)
            .map_err(driver("tf_unpack"))?;
    }
    if !analysis_in_x {
        // SAFETY: as above.
        unsafe {
            let mut b = s.launch_builder(&k.analyze);
            b.arg(&p.params);
            analysis_args(&mut b, p, &capacity)
                .launch(grid(ANALYZE_THREADS, 1, (ANALYZE_THREADS, 1)))
                .map_err(driver("tf_analyze"))?;
        }
    }
    // The temporal filter runs on the features after `edge_iteration` iterations; the x pass
    // that follows it (or tf_dog_x) takes the DoG x pass of the filtered luma. After at least one
    // iteration, the y pass that ends iteration `edge_iteration` (index - 1) filters as it
    // writes; before the first, tf_temporal runs on its own.
    let filter_in_y = key.has_ring() && key.edge_iteration > 0;
    let temporal = || {
        if !key.has_ring() || filter_in_y {
            return Ok(());
        }
        // SAFETY: as for the launches above.
        unsafe {
            s.launch_builder(&k.temporal)
                .arg(&p.params)
                .arg(&p.frame)
                .arg(&p.feat_l)
                .arg(&p.feat_uv)
                .arg(&p.ring)
                .arg(&slot_elems)
                .arg(&luma_elems)
                .launch(tile)
                .map(|_| ())
                .map_err(driver("tf_temporal"))
        }
    };
    let iters: Vec<i32> = (0..n as i32).collect();
    for it in &iters {
        if *it as u32 == key.edge_iteration {
            temporal()?;
        }
        let filter = (filter_in_y && *it as u32 + 1 == key.edge_iteration) as i32;
        // The first x pass has an extra row of blocks, the first, for the analysis.
        let analysis = (analysis_in_x && *it == 0) as i32;
        let mut bil_x = bil_x;
        bil_x.grid_dim.1 += analysis as u32;
        // SAFETY: as for the launches above.
        unsafe {
            let mut b = s.launch_builder(&k.bilateral_x);
            b.arg(&p.params)
                .arg(&p.feat_l)
                .arg(&p.feat_uv)
                .arg(&p.tmp_l)
                .arg(&p.tmp_uv)
                .arg(&p.dog1)
                .arg(&p.dog2)
                .arg(it)
                .arg(&luma_blocks_x)
                .arg(&analysis);
            analysis_args(&mut b, p, &capacity)
                .launch(bil_x)
                .map_err(driver("tf_bilateral_x"))?;
            s.launch_builder(&k.bilateral_y)
                .arg(&p.params)
                .arg(&p.frame)
                .arg(&p.tmp_l)
                .arg(&p.tmp_uv)
                .arg(&p.feat_l)
                .arg(&p.feat_uv)
                .arg(&p.ring)
                .arg(&slot_elems)
                .arg(&luma_elems)
                .arg(&filter)
                .arg(&luma_blocks_y)
                .launch(bil_y)
                .map_err(driver("tf_bilateral_y"))?;
        }
    }
    if key.edge_at_end() {
        temporal()?;
        // SAFETY: as for the launches above.
        unsafe {
            s.launch_builder(&k.dog_x)
                .arg(&p.params)
                .arg(&p.feat_l)
                .arg(&p.dog1)
                .arg(&p.dog2)
                .launch(grid(w.div_ceil(BILATERAL_X_COLS), h, BILATERAL_BLOCK))
                .map_err(driver("tf_dog_x"))?;
        }
    }
    // SAFETY: as for the launches above.
    unsafe {
        s.launch_builder(&k.final_)
            .arg(&p.params)
            .arg(&p.frame)
            .arg(&p.feat_l)
            .arg(&p.feat_uv)
            .arg(&p.dog1)
            .arg(&p.dog2)
            .arg(&p.nv12_out)
            .launch(tile)
            .map_err(driver("tf_final"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launch shapes the kernels were written and verified for.
    #[test]
    fn grids_match_the_verified_launches() {
        for (w, h) in [(1920u32, 1080u32), (2, 2), (130, 74), (3840, 2160), (17, 9)] {
            let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
            let tile = grid(cw, ch, TILE_BLOCK);
            assert_eq!(tile.grid_dim, (cw.div_ceil(32), ch.div_ceil(8), 1));
            assert_eq!(tile.block_dim, (32, 8, 1));
            let (bil, luma_rows) = bilateral_grid(w, h, BILATERAL_BLOCK, (BILATERAL_X_COLS, 1));
            assert_eq!(
                bil.grid_dim,
                (w.div_ceil(256), h.div_ceil(4) + ch.div_ceil(4), 1)
            );
            assert_eq!(bil.block_dim, (64, 4, 1));
            assert_eq!(luma_rows as u32, h.div_ceil(4));
            let (bil_y, luma_rows_y) =
                bilateral_grid(w, h, BILATERAL_Y_BLOCK, (1, BILATERAL_Y_ROWS));
            assert_eq!(
                bil_y.grid_dim,
                (w.div_ceil(32), h.div_ceil(32) + ch.div_ceil(32), 1)
            );
            assert_eq!(bil_y.block_dim, (32, 8, 1));
            assert_eq!(luma_rows_y as u32, h.div_ceil(32));
            let dog = grid(w.div_ceil(BILATERAL_X_COLS), h, BILATERAL_BLOCK);
            assert_eq!(dog.grid_dim, (w.div_ceil(256), h.div_ceil(4), 1));
        }
        let analyze = grid(ANALYZE_THREADS, 1, (ANALYZE_THREADS, 1));
        assert_eq!(analyze.grid_dim, (1, 1, 1));
        assert_eq!(analyze.block_dim, (1024, 1, 1));
    }
}
