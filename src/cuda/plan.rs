//! The memory plan: every device buffer of a frame with its size and lifetime over the stages,
//! laid into one arena so that buffers whose lifetimes do not overlap share space.
//!
//! Pure Rust, no CUDA: the element can compute and report a plan without a device.

use super::CudaError;
use crate::pipeline::params::{HIST_BINS, MAX_HISTORY, THUMB_H, THUMB_W};
use crate::pipeline::{Precision, Shape, ToonParams};

/// Offsets are multiples of this.
pub const ALIGN: u64 = 256;
/// Where the per-frame control block sits inside the parameter buffer.
pub const CONTROL_OFFSET: u64 = 512;
/// Bytes of the per-frame control block (`TfControl`).
pub const CONTROL_BYTES: u64 = 16;
/// Bytes of the per-frame decision block (`TfFrame`).
pub const FRAME_BLOCK_BYTES: u64 = 64;
/// Bytes of the persistent state (`TfState`).
pub const STATE_BYTES: u64 = 16 + 4 * (THUMB_W * THUMB_H) as u64;
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

/// A buffer to place: `bytes` live from stage `first` to stage `last`, both included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferRequest {
    pub name: &'static str,
    pub bytes: u64,
    pub first: u32,
    pub last: u32,
}

/// A placed buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedBuffer {
    pub name: &'static str,
    pub bytes: u64,
    pub first_stage: u32,
    pub last_stage: u32,
    pub offset: u64,
}

impl PlannedBuffer {
    fn aligned(&self) -> u64 {
        self.bytes.div_ceil(ALIGN) * ALIGN
    }
    fn overlaps_in_time(&self, first: u32, last: u32) -> bool {
        self.first_stage <= last && first <= self.last_stage
    }
}

/// Stage numbers of a frame for a given number of bilateral iterations. The temporal filter has
/// no stage of its own: it runs in place on the feature planes and the ring, which are live for
/// the whole frame, between two bilateral iterations.
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

/// Buffers laid into one arena.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub buffers: Vec<PlannedBuffer>,
    pub arena_bytes: u64,
    pub peak_live_bytes: u64,
    pub peak_stage: u32,
    pub stage_names: Vec<String>,
    /// What the plan is for, e.g. "1920x1080 fp16 history 4 iterations 3".
    pub label: String,
}

impl MemoryPlan {
    /// Greedy placement: largest first, each at the lowest aligned offset where it does not
    /// overlap (in space) a placed buffer whose lifetime overlaps its own.
    pub fn layout(requests: &[BufferRequest], stage_names: Vec<String>, label: String) -> Self {
        let mut order: Vec<usize> = (0..requests.len()).collect();
        order.sort_by(|&a, &b| requests[b].bytes.cmp(&requests[a].bytes).then(a.cmp(&b)));
        let mut placed: Vec<PlannedBuffer> = Vec::with_capacity(requests.len());
        let mut index: Vec<usize> = Vec::with_capacity(requests.len());
        for i in order {
            let r = &requests[i];
            let mut buf = PlannedBuffer {
                name: r.name,
                bytes: r.bytes,
                first_stage: r.first,
                last_stage: r.last,
                offset: 0,
            };
            let size = buf.aligned();
            let conflicts: Vec<&PlannedBuffer> = placed
                .iter()
                .filter(|p| p.overlaps_in_time(r.first, r.last))
                .collect();
            let mut candidates: Vec<u64> = std::iter::once(0)
                .chain(conflicts.iter().map(|c| c.offset + c.aligned()))
                .collect();
            candidates.sort_unstable();
            buf.offset = candidates
                .into_iter()
                .find(|&off| {
                    conflicts
                        .iter()
                        .all(|c| off + size <= c.offset || c.offset + c.aligned() <= off)
                })
                .expect("the end of the last conflicting buffer is always free");
            placed.push(buf);
            index.push(i);
        }
        // report in request order
        let mut pairs: Vec<(usize, PlannedBuffer)> = index.into_iter().zip(placed).collect();
        pairs.sort_by_key(|(i, _)| *i);
        let buffers: Vec<PlannedBuffer> = pairs.into_iter().map(|(_, b)| b).collect();
        let arena_bytes = buffers
            .iter()
            .map(|b| b.offset + b.aligned())
            .max()
            .unwrap_or(0);
        let last = buffers.iter().map(|b| b.last_stage).max().unwrap_or(0);
        let (mut peak_live_bytes, mut peak_stage) = (0, 0);
        for s in 0..=last {
            let live: u64 = buffers
                .iter()
                .filter(|b| b.overlaps_in_time(s, s))
                .map(|b| b.aligned())
                .sum();
            if live > peak_live_bytes {
                peak_live_bytes = live;
                peak_stage = s;
            }
        }
        MemoryPlan {
            buffers,
            arena_bytes,
            peak_live_bytes,
            peak_stage,
            stage_names,
            label,
        }
    }

    /// The plan of a frame of `shape`.
    pub fn for_shape(shape: &Shape) -> Self {
        use names::*;
        let (w, h) = (shape.width as u64, shape.height as u64);
        let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
        let e = shape.precision.bytes() as u64;
        let n = shape
            .bilateral_iterations
            .min(crate::pipeline::params::MAX_ITERATIONS);
        let cap = shape.temporal_history.min(MAX_HISTORY) as u64;
        let st = Stages { iterations: n };
        let last = st.download();
        let luma = w * h * e;
        let chroma = 2 * cw * ch * e;
        let nv12 = w * h + 2 * cw * ch;
        let mut r = vec![
            BufferRequest {
                name: PARAMS,
                bytes: CONTROL_OFFSET + CONTROL_BYTES,
                first: 0,
                last,
            },
            BufferRequest {
                name: STATE,
                bytes: STATE_BYTES,
                first: 0,
                last,
            },
            BufferRequest {
                name: FRAME,
                bytes: FRAME_BLOCK_BYTES,
                first: 0,
                last,
            },
            BufferRequest {
                name: STATS,
                bytes: STATS_BYTES,
                first: Stages::UNPACK,
                last: Stages::ANALYZE,
            },
            BufferRequest {
                name: NV12_IN,
                bytes: nv12,
                first: Stages::UNPACK,
                last: Stages::UNPACK,
            },
            BufferRequest {
                name: FEAT_L,
                bytes: luma,
                first: Stages::UNPACK,
                last: st.final_(),
            },
            BufferRequest {
                name: FEAT_UV,
                bytes: chroma,
                first: Stages::UNPACK,
                last: st.final_(),
            },
        ];
        if n > 0 {
            let (a, b) = (Stages::FIRST_BILATERAL, Stages::FIRST_BILATERAL + 2 * n - 1);
            r.push(BufferRequest {
                name: TMP_L,
                bytes: luma,
                first: a,
                last: b,
            });
            r.push(BufferRequest {
                name: TMP_UV,
                bytes: chroma,
                first: a,
                last: b,
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
            name: DOG1,
            bytes: w * h * 4,
            first: dog_first,
            last: st.final_(),
        });
        r.push(BufferRequest {
            name: DOG2,
            bytes: w * h * 4,
            first: dog_first,
            last: st.final_(),
        });
        if cap > 0 {
            r.push(BufferRequest {
                name: RING,
                bytes: cap * (luma + chroma),
                first: 0,
                last,
            });
        }
        r.push(BufferRequest {
            name: NV12_OUT,
            bytes: nv12,
            first: st.final_(),
            last,
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
        Self::layout(&r, st.names(), label)
    }

    /// Live bytes at the peak over arena bytes (1.0 = no byte of the arena idle at the peak).
    pub fn utilisation(&self) -> f64 {
        if self.arena_bytes == 0 {
            return 1.0;
        }
        self.peak_live_bytes as f64 / self.arena_bytes as f64
    }

    pub fn buffer(&self, name: &str) -> Option<&PlannedBuffer> {
        self.buffers.iter().find(|b| b.name == name)
    }

    /// Offset of `name`, or `None` when the plan has no such buffer (e.g. no ring).
    pub fn offset(&self, name: &str) -> Option<u64> {
        self.buffer(name).map(|b| b.offset)
    }

    /// Checks the plan against `max-device-memory` (0 = no cap).
    pub fn check_cap(&self, max_device_memory: u64) -> Result<(), CudaError> {
        if max_device_memory != 0 && self.arena_bytes > max_device_memory {
            return Err(CudaError::OutOfMemory(format!(
                "the memory plan for {} needs {} bytes ({:.1} MiB) of device memory, more than \
                 max-device-memory allows ({} bytes, {:.1} MiB); raise max-device-memory or lower \
                 the resolution, temporal-history or precision",
                self.label,
                self.arena_bytes,
                mib(self.arena_bytes),
                max_device_memory,
                mib(max_device_memory)
            )));
        }
        Ok(())
    }

    /// Multi-line description for the debug log.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "memory plan for {}: arena {} bytes ({:.2} MiB), peak live {} bytes at stage {} \
             ({}), utilisation {:.1}%\n",
            self.label,
            self.arena_bytes,
            mib(self.arena_bytes),
            self.peak_live_bytes,
            self.peak_stage,
            self.stage_names
                .get(self.peak_stage as usize)
                .map_or("?", |s| s.as_str()),
            100.0 * self.utilisation()
        );
        for b in &self.buffers {
            s.push_str(&format!(
                "  {:<15} {:>11} bytes at offset {:>11}, stages {}..={}\n",
                b.name, b.bytes, b.offset, b.first_stage, b.last_stage
            ));
        }
        s
    }

    /// Checks that no two buffers with overlapping lifetimes overlap in the arena.
    pub fn validate(&self) -> Result<(), String> {
        for (i, a) in self.buffers.iter().enumerate() {
            if a.offset % ALIGN != 0 {
                return Err(format!("{} is not aligned", a.name));
            }
            if a.offset + a.bytes > self.arena_bytes {
                return Err(format!("{} runs past the arena", a.name));
            }
            for b in &self.buffers[i + 1..] {
                let time = a.overlaps_in_time(b.first_stage, b.last_stage);
                let space = a.offset < b.offset + b.aligned() && b.offset < a.offset + a.aligned();
                if time && space {
                    return Err(format!("{} and {} overlap", a.name, b.name));
                }
            }
        }
        Ok(())
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
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
            name,
            bytes,
            first,
            last,
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
        let p = MemoryPlan::for_shape(&default_shape(1920, 1080, Precision::Fp16));
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
                        let p = MemoryPlan::for_shape(&s);
                        p.validate()
                            .unwrap_or_else(|e| panic!("{e}\n{}", p.describe()));
                        assert_eq!(p.buffer(names::RING).is_some(), hist > 0);
                    }
                }
            }
        }
    }

    #[test]
    fn cap_gives_a_clear_error() {
        let p = MemoryPlan::for_shape(&default_shape(1920, 1080, Precision::Fp16));
        assert!(p.check_cap(0).is_ok());
        assert!(p.check_cap(p.arena_bytes).is_ok());
        match p.check_cap(p.arena_bytes - 1) {
            Err(CudaError::OutOfMemory(m)) => assert!(m.contains("max-device-memory"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn print_plans() {
        for (w, h) in [(1280, 720), (1920, 1080), (3840, 2160)] {
            let p = MemoryPlan::for_shape(&default_shape(w, h, Precision::Fp16));
            println!(
                "{w}x{h} fp16: arena {} bytes, peak {} bytes, utilisation {:.1}%",
                p.arena_bytes,
                p.peak_live_bytes,
                100.0 * p.utilisation()
            );
        }
    }
}
