//! The classic pipeline's memory plan: every device buffer of a frame with its size and
//! lifetime over the stages, laid by the generic arena planner ([`crate::memplan`]) into one
//! arena so that buffers whose lifetimes do not overlap share space.
//!
//! Pure Rust, no CUDA: the element can compute and report a plan without a device.

use super::abi::{TfControl, TfFrame, TfState};
use super::error::CudaError;
use crate::pipeline::params::{HIST_BINS, MAX_HISTORY, MAX_ITERATIONS, THUMB_H, THUMB_W};
use crate::pipeline::{Precision, Shape, ToonParams};

pub use super::abi::CONTROL_OFFSET;
pub use crate::memplan::{ALIGN, ArenaPlan, BufferRequest, PlannedBuffer, mib};
/// Bytes of the per-frame control block (`TfControl`).
pub const CONTROL_BYTES: u64 = std::mem::size_of::<TfControl>() as u64;
/// Bytes of the per-frame decision block (`TfFrame`).
pub const FRAME_BLOCK_BYTES: u64 = std::mem::size_of::<TfFrame>() as u64;
/// Bytes of the persistent state (`TfState`).
pub const STATE_BYTES: u64 = std::mem::size_of::<TfState>() as u64;
/// Bytes of the statistics gathered by unpack: thumbnail block sums then the histogram.
pub const STATS_BYTES: u64 = 4 * (THUMB_W * THUMB_H + HIST_BINS) as u64;

/// Buffer names used by the backend.
pub mod names {
    pub const PARAMS: &str = "params";
    pub const STATE: &str = "state";
    pub const FRAME: &str = "frame";
    pub const STATS: &str = "stats";
    pub const NV12_IN: &str = "nv12-in";
    pub const FEAT_L: &str = "feature-luma";
    pub const FEAT_UV: &str = "feature-chroma";
    pub const TMP_L: &str = "tmp-luma";
    pub const TMP_UV: &str = "tmp-chroma";
    pub const DOG1: &str = "dog-x-1";
    pub const DOG2: &str = "dog-x-2";
    pub const RING: &str = "ring";
    pub const NV12_OUT: &str = "nv12-out";
}

/// Stage numbers of a frame for a given number of bilateral iterations. The temporal filter has
/// no stage of its own: it works on the feature planes and the ring, which are live for the whole
/// frame, in the y pass that ends the edge iteration (or in place before the first iteration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stages {
    pub iterations: u32,
}

impl Stages {
    pub const UNPACK: u32 = 0;
    pub const ANALYZE: u32 = 1;
    pub const FIRST_BILATERAL: u32 = 2;
    /// The stand-alone DoG x pass (used only when the edges come from the last iteration).
    pub fn dog(&self) -> u32 {
        2 + 2 * self.iterations
    }
    pub fn final_(&self) -> u32 {
        self.dog() + 1
    }
    pub fn download(&self) -> u32 {
        self.final_() + 1
    }
    pub fn names(&self) -> Vec<String> {
        let mut v = vec!["upload+unpack".to_string(), "analyze".to_string()];
        for i in 1..=self.iterations {
            v.push(format!("bilateral-x{i}"));
            v.push(format!("bilateral-y{i}"));
        }
        v.push("dog-x".into());
        v.push("final".into());
        v.push("download".into());
        v
    }
}

/// The classic pipeline's plan is an arena plan.
pub type MemoryPlan = ArenaPlan;

/// The plan of a frame of `shape`.
pub fn classic_plan(shape: &Shape) -> MemoryPlan {
    use names::*;
    let (w, h) = (shape.width as u64, shape.height as u64);
    let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
    let e = shape.precision.bytes() as u64;
    let n = shape.bilateral_iterations.min(MAX_ITERATIONS);
    let cap = shape.temporal_history.min(MAX_HISTORY) as u64;
    let st = Stages { iterations: n };
    let last = st.download();
    let luma = w * h * e;
    let chroma = 2 * cw * ch * e;
    let nv12 = w * h + 2 * cw * ch;
    let mut r = vec![
        BufferRequest {
            name: PARAMS.into(),
            bytes: CONTROL_OFFSET + CONTROL_BYTES,
            first: 0,
            last,
            grow: None,
        },
        BufferRequest {
            name: STATE.into(),
            bytes: STATE_BYTES,
            first: 0,
            last,
            grow: None,
        },
        BufferRequest {
            name: FRAME.into(),
            bytes: FRAME_BLOCK_BYTES,
            first: 0,
            last,
            grow: None,
        },
        // Gathered by unpack, read by the analysis (by default in an extra block of the first
        // bilateral x pass, beside tiles that write the bilateral and DoG planes), which leaves
        // them zero for the next frame: live for the whole frame, so they share no space.
        BufferRequest {
            name: STATS.into(),
            bytes: STATS_BYTES,
            first: 0,
            last,
            grow: None,
        },
        BufferRequest {
            name: NV12_IN.into(),
            bytes: nv12,
            first: Stages::UNPACK,
            last: Stages::UNPACK,
            grow: None,
        },
        BufferRequest {
            name: FEAT_L.into(),
            bytes: luma,
            first: Stages::UNPACK,
            last: st.final_(),
            grow: None,
        },
        BufferRequest {
            name: FEAT_UV.into(),
            bytes: chroma,
            first: Stages::UNPACK,
            last: st.final_(),
            grow: None,
        },
    ];
    if n > 0 {
        let (a, b) = (Stages::FIRST_BILATERAL, Stages::FIRST_BILATERAL + 2 * n - 1);
        r.push(BufferRequest {
            name: TMP_L.into(),
            bytes: luma,
            first: a,
            last: b,
            grow: None,
        });
        r.push(BufferRequest {
            name: TMP_UV.into(),
            bytes: chroma,
            first: a,
            last: b,
            grow: None,
        });
    }
    // The DoG x pass is fused into the bilateral x pass after the edge iteration, so the
    // DoG planes are live from the first bilateral stage on (or from the stand-alone pass).
    let dog_first = if n > 0 {
        Stages::FIRST_BILATERAL
    } else {
        st.dog()
    };
    r.push(BufferRequest {
        name: DOG1.into(),
        bytes: w * h * 4,
        first: dog_first,
        last: st.final_(),
        grow: None,
    });
    r.push(BufferRequest {
        name: DOG2.into(),
        bytes: w * h * 4,
        first: dog_first,
        last: st.final_(),
        grow: None,
    });
    if cap > 0 {
        r.push(BufferRequest {
            name: RING.into(),
            bytes: cap * (luma + chroma),
            first: 0,
            last,
            grow: None,
        });
    }
    r.push(BufferRequest {
        name: NV12_OUT.into(),
        bytes: nv12,
        first: st.final_(),
        last,
        grow: None,
    });
    let label = format!(
        "{}x{} {} history {} iterations {}",
        shape.width,
        shape.height,
        match shape.precision {
            Precision::Fp16 => "fp16",
            Precision::Fp32 => "fp32",
        },
        cap,
        n
    );
    ArenaPlan::layout(&r, st.names(), label)
}

/// Checks `plan` against `max-device-memory` (0 = no cap).
pub fn check_cap(plan: &MemoryPlan, max_device_memory: u64) -> Result<(), CudaError> {
    if max_device_memory != 0 && plan.arena_bytes > max_device_memory {
        return Err(CudaError::out_of_memory(format!(
            "the memory plan for {} needs {} bytes ({:.1} MiB) of device memory, more than \
             max-device-memory allows ({} bytes, {:.1} MiB); raise max-device-memory or lower \
             the resolution, temporal-history or precision",
            plan.label,
            plan.arena_bytes,
            mib(plan.arena_bytes),
            max_device_memory,
            mib(max_device_memory)
        )));
    }
    Ok(())
}

/// A `Shape` with the element's defaults at `width`×`height`.
pub fn default_shape(width: u32, height: u32, precision: Precision) -> Shape {
    let p = ToonParams::new(&Default::default(), width, height);
    Shape {
        width,
        height,
        bilateral_iterations: p.bilateral_iterations as u32,
        temporal_history: p.history as u32,
        precision,
        auto_levels: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &'static str, bytes: u64, first: u32, last: u32) -> BufferRequest {
        BufferRequest {
            name: name.into(),
            bytes,
            first,
            last,
            grow: None,
        }
    }

    #[test]
    fn disjoint_lifetimes_share_space() {
        let p = MemoryPlan::layout(
            &[
                req("a", 1000, 0, 1),
                req("b", 1000, 2, 3),
                req("c", 10, 0, 3),
            ],
            vec![],
            "t".into(),
        );
        p.validate().unwrap();
        assert_eq!(p.buffer("a").unwrap().offset, p.buffer("b").unwrap().offset);
        assert_eq!(p.arena_bytes, 1024 + 256);
        assert_eq!(p.peak_live_bytes, 1024 + 256);
        assert_eq!(p.utilisation(), 1.0);
    }

    #[test]
    fn overlapping_lifetimes_do_not_share() {
        let p = MemoryPlan::layout(
            &[
                req("a", 300, 0, 2),
                req("b", 300, 2, 3),
                req("c", 300, 1, 1),
            ],
            vec![],
            "t".into(),
        );
        p.validate().unwrap();
        assert_eq!(p.arena_bytes, 2 * 512);
        // b and c never live together: they may share
        assert_eq!(p.buffer("b").unwrap().offset, p.buffer("c").unwrap().offset);
        assert_eq!(p.peak_live_bytes, 2 * 512);
    }

    #[test]
    fn default_1080p_fp16_meets_the_goal() {
        let p = classic_plan(&default_shape(1920, 1080, Precision::Fp16));
        p.validate().unwrap();
        assert!(p.arena_bytes <= 64_000_000, "{}", p.describe());
        assert!(p.utilisation() >= 0.95, "{}", p.describe());
    }

    #[test]
    fn plans_for_common_sizes_are_valid() {
        for (w, h) in [(16, 16), (1280, 720), (1920, 1080), (3840, 2160), (2, 2)] {
            for prec in [Precision::Fp16, Precision::Fp32] {
                for iters in [0, 1, 3, 8] {
                    for hist in [0, 1, 4, 8] {
                        let s = Shape {
                            bilateral_iterations: iters,
                            temporal_history: hist,
                            ..default_shape(w, h, prec)
                        };
                        let p = classic_plan(&s);
                        p.validate()
                            .unwrap_or_else(|e| panic!("{e}\n{}", p.describe()));
                        assert_eq!(p.buffer(names::RING).is_some(), hist > 0);
                    }
                }
            }
        }
    }

    /// The analysis reads the statistics in the first x pass (its extra block), while that
    /// pass's tiles write the bilateral and DoG planes: they must not share the statistics' space
    /// (the moving clip's frame 1 reported a false scene cut when they did).
    #[test]
    fn statistics_do_not_share_space_with_the_first_x_pass_outputs() {
        for (w, h) in [(640, 360), (1920, 1080), (16, 16)] {
            for prec in [Precision::Fp16, Precision::Fp32] {
                let p = classic_plan(&default_shape(w, h, prec));
                let stats = p.buffer(names::STATS).unwrap();
                for name in [names::TMP_L, names::TMP_UV, names::DOG1, names::DOG2] {
                    let b = p.buffer(name).unwrap();
                    let apart = stats.offset + stats.bytes <= b.offset
                        || b.offset + b.bytes <= stats.offset;
                    assert!(
                        apart,
                        "{w}x{h}: {name} overlaps the statistics\n{}",
                        p.describe()
                    );
                }
            }
        }
    }

    #[test]
    fn cap_gives_a_clear_error() {
        let p = classic_plan(&default_shape(1920, 1080, Precision::Fp16));
        assert!(check_cap(&p, 0).is_ok());
        assert!(check_cap(&p, p.arena_bytes).is_ok());
        match check_cap(&p, p.arena_bytes - 1) {
            Err(e @ CudaError::OutOfMemory(_)) => {
                let m = e.to_string();
                assert!(m.starts_with("device memory: the memory plan for"), "{m}");
                assert!(m.contains("max-device-memory"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn print_plans() {
        for (w, h) in [(1280, 720), (1920, 1080), (3840, 2160)] {
            let p = classic_plan(&default_shape(w, h, Precision::Fp16));
            println!(
                "{w}x{h} fp16: arena {} bytes, peak {} bytes, utilisation {:.1}%",
                p.arena_bytes,
                p.peak_live_bytes,
                100.0 * p.utilisation()
            );
        }
    }
}
