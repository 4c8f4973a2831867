//! The arena planner: any list of buffers with a size and a lifetime over numbered stages, laid
//! into one arena so that buffers whose lifetimes do not overlap share space.
//!
//! Pure Rust, no device: both engines (the classic pipeline's `cuda::plan` and the neural
//! stage's activation ledger) describe their buffers here and allocate the arena once.

/// Offsets are multiples of this.
pub const ALIGN: u64 = 256;

/// A buffer to place: `bytes` live from stage `first` to stage `last`, both included, and
/// `grow` more bytes right after them from a later stage on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferRequest {
    pub name: String,
    pub bytes: u64,
    pub first: u32,
    pub last: u32,
    pub grow: Option<Growth>,
}

/// Bytes a buffer takes on past its end from stage `from` on (a banded convolution's lag rows
/// after the input it overwrites: before that stage other buffers may use them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growth {
    pub from: u32,
    pub bytes: u64,
}

/// A placed buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedBuffer {
    pub name: String,
    pub bytes: u64,
    pub first_stage: u32,
    pub last_stage: u32,
    pub offset: u64,
    pub grow: Option<Growth>,
}

impl PlannedBuffer {
    /// Bytes taken at its largest (grown, if it grows).
    fn aligned(&self) -> u64 {
        self.extent(self.last_stage)
    }
    /// Bytes taken at stages up to `last` (its growth counts once `last` reaches it).
    fn extent(&self, last: u32) -> u64 {
        let grown = self.grow.filter(|g| g.from <= last).map_or(0, |g| g.bytes);
        (self.bytes + grown).div_ceil(ALIGN) * ALIGN
    }
    fn overlaps_in_time(&self, first: u32, last: u32) -> bool {
        self.first_stage <= last && first <= self.last_stage
    }
    /// Bytes taken while it and a buffer live from `first` to `last` both live (the last
    /// stage of both bounds the growth).
    fn extent_beside(&self, first: u32, last: u32) -> u64 {
        debug_assert!(self.overlaps_in_time(first, last));
        self.extent(self.last_stage.min(last))
    }
}

/// Buffers laid into one arena.
#[derive(Debug, Clone, PartialEq)]
pub struct ArenaPlan {
    pub buffers: Vec<PlannedBuffer>,
    pub arena_bytes: u64,
    pub peak_live_bytes: u64,
    pub peak_stage: u32,
    pub stage_names: Vec<String>,
    /// What the plan is for, e.g. "1920x1080 fp16 history 4 iterations 3".
    pub label: String,
}

impl ArenaPlan {
    /// Greedy placement: largest first, each at the lowest aligned offset where it does not
    /// overlap (in space) a placed buffer whose lifetime overlaps its own.
    pub fn layout(requests: &[BufferRequest], stage_names: Vec<String>, label: String) -> Self {
        let mut order: Vec<usize> = (0..requests.len()).collect();
        order.sort_by(|&a, &b| requests[b].bytes.cmp(&requests[a].bytes).then(a.cmp(&b)));
        Self::layout_in_order(requests, &order, stage_names, label)
    }

    /// The smallest of the greedy placements in three orders: largest first (`layout`), longest
    /// lived first, earliest first (each then largest first). Long-lived buffers placed first
    /// leave fewer holes when some live across most of the network (skip tensors, outputs
    /// written in place over an input).
    pub fn layout_best(
        requests: &[BufferRequest],
        stage_names: Vec<String>,
        label: String,
    ) -> Self {
        let by_size = |a: &usize, b: &usize| requests[*b].bytes.cmp(&requests[*a].bytes);
        let span = |i: usize| requests[i].last - requests[i].first;
        let mut orders: Vec<Vec<usize>> = vec![(0..requests.len()).collect(); 3];
        orders[0].sort_by(|a, b| by_size(a, b).then(a.cmp(b)));
        orders[1].sort_by(|a, b| span(*b).cmp(&span(*a)).then(by_size(a, b)).then(a.cmp(b)));
        orders[2].sort_by(|a, b| {
            let first = |i: usize| requests[i].first;
            first(*a).cmp(&first(*b)).then(by_size(a, b)).then(a.cmp(b))
        });
        orders
            .iter()
            .map(|o| Self::layout_in_order(requests, o, stage_names.clone(), label.clone()))
            .min_by_key(|p| p.arena_bytes)
            .expect("three orders")
    }

    fn layout_in_order(
        requests: &[BufferRequest],
        order: &[usize],
        stage_names: Vec<String>,
        label: String,
    ) -> Self {
        let mut placed: Vec<PlannedBuffer> = Vec::with_capacity(requests.len());
        let mut index: Vec<usize> = Vec::with_capacity(requests.len());
        for &i in order {
            let r = &requests[i];
            let mut buf = PlannedBuffer {
                name: r.name.clone(),
                bytes: r.bytes,
                first_stage: r.first,
                last_stage: r.last,
                offset: 0,
                grow: r.grow,
            };
            // each conflict with the bytes both take while both live
            let conflicts: Vec<(u64, u64, u64)> = placed
                .iter()
                .filter(|p| p.overlaps_in_time(r.first, r.last))
                .map(|p| {
                    let mine = buf.extent_beside(p.first_stage, p.last_stage);
                    (p.offset, p.extent_beside(r.first, r.last), mine)
                })
                .collect();
            let mut candidates: Vec<u64> = std::iter::once(0)
                .chain(conflicts.iter().map(|&(offset, theirs, _)| offset + theirs))
                .collect();
            candidates.sort_unstable();
            buf.offset = candidates
                .into_iter()
                .find(|&off| {
                    conflicts.iter().all(|&(offset, theirs, mine)| {
                        off + mine <= offset || offset + theirs <= off
                    })
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
                .map(|b| b.extent(s))
                .sum();
            if live > peak_live_bytes {
                peak_live_bytes = live;
                peak_stage = s;
            }
        }
        ArenaPlan {
            buffers,
            arena_bytes,
            peak_live_bytes,
            peak_stage,
            stage_names,
            label,
        }
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

    /// Checks the plan against a cap in bytes (0 = no cap); the error says what needs how much.
    pub fn exceeds_cap(&self, cap: u64) -> Option<String> {
        (cap != 0 && self.arena_bytes > cap).then(|| {
            format!(
                "the memory plan for {} needs {} bytes ({:.1} MiB), more than the cap of {} bytes \
                 ({:.1} MiB)",
                self.label,
                self.arena_bytes,
                mib(self.arena_bytes),
                cap,
                mib(cap)
            )
        })
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
                "  {:<15} {:>11} bytes at offset {:>11}, stages {}..={}",
                b.name, b.bytes, b.offset, b.first_stage, b.last_stage
            ));
            if let Some(g) = b.grow {
                s.push_str(&format!(", {} bytes more from stage {}", g.bytes, g.from));
            }
            s.push('\n');
        }
        s
    }

    /// Checks that no two buffers with overlapping lifetimes overlap in the arena.
    pub fn validate(&self) -> Result<(), String> {
        for (i, a) in self.buffers.iter().enumerate() {
            if a.offset % ALIGN != 0 {
                return Err(format!("{} is not aligned", a.name));
            }
            if a.offset + a.aligned() > self.arena_bytes {
                return Err(format!("{} runs past the arena", a.name));
            }
            for b in &self.buffers[i + 1..] {
                if !a.overlaps_in_time(b.first_stage, b.last_stage) {
                    continue;
                }
                let a_end = a.offset + a.extent_beside(b.first_stage, b.last_stage);
                let b_end = b.offset + b.extent_beside(a.first_stage, a.last_stage);
                if a.offset < b_end && b.offset < a_end {
                    return Err(format!("{} and {} overlap", a.name, b.name));
                }
            }
        }
        Ok(())
    }
}

pub fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(name: &str, units: u64, first: u32, last: u32) -> BufferRequest {
        BufferRequest {
            name: name.to_string(),
            bytes: units * ALIGN,
            first,
            last,
            grow: None,
        }
    }

    #[test]
    fn a_growing_buffer_lends_its_growth_until_it_grows() {
        // a 4-unit buffer that takes 2 more units from stage 5 on; a 2-unit buffer of stages
        // 0..=4 fits in those units, one of stages 0..=5 does not
        let mut grows = request("grows", 4, 0, 9);
        grows.grow = Some(Growth {
            from: 5,
            bytes: 2 * ALIGN,
        });
        let plan = ArenaPlan::layout_best(
            &[grows.clone(), request("early", 2, 0, 4)],
            Vec::new(),
            String::new(),
        );
        plan.validate().unwrap();
        assert_eq!(plan.offset("early"), Some(4 * ALIGN));
        assert_eq!(plan.arena_bytes, 6 * ALIGN);
        assert_eq!(plan.peak_live_bytes, 6 * ALIGN);
        let plan = ArenaPlan::layout_best(
            &[grows, request("late", 2, 0, 5)],
            Vec::new(),
            String::new(),
        );
        plan.validate().unwrap();
        assert_eq!(plan.arena_bytes, 8 * ALIGN);
        // the same place for the longer-lived one is an overlap
        let mut wrong = plan.clone();
        wrong.buffers[1].offset = 4 * ALIGN;
        assert!(wrong.validate().unwrap_err().contains("overlap"));
    }

    #[test]
    fn the_best_order_is_never_worse_and_always_valid() {
        // fixed-seed pseudo-random networks of buffers
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut strictly_better = 0;
        for _ in 0..200 {
            let stages = 4 + next(20) as u32;
            let requests: Vec<BufferRequest> = (0..3 + next(12))
                .map(|k| {
                    let first = next(stages as u64) as u32;
                    let last = first + next((stages - first) as u64) as u32;
                    let mut r = request(&format!("b{k}"), 1 + next(6), first, last);
                    if last > first && next(3) == 0 {
                        r.grow = Some(Growth {
                            from: first + 1 + next((last - first) as u64) as u32,
                            bytes: (1 + next(3)) * ALIGN,
                        });
                    }
                    r
                })
                .collect();
            let greedy = ArenaPlan::layout(&requests, Vec::new(), String::new());
            let best = ArenaPlan::layout_best(&requests, Vec::new(), String::new());
            best.validate().unwrap();
            assert!(best.arena_bytes <= greedy.arena_bytes);
            assert!(best.arena_bytes >= best.peak_live_bytes);
            strictly_better += (best.arena_bytes < greedy.arena_bytes) as usize;
        }
        println!("smaller than largest-first in {strictly_better} of 200");
    }
}
