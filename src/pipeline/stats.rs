//! Running per-frame statistics: counters and a fixed window of processing times for
//! percentiles. No allocation after construction.

/// Processing times of the most recent frames, in microseconds.
#[derive(Debug, Clone)]
pub struct TimeWindow {
    samples: Vec<f64>,
    next: usize,
    filled: usize,
    total: f64,
    count: u64,
    scratch: Vec<f64>,
}

impl TimeWindow {
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        TimeWindow {
            samples: vec![0.0; capacity],
            next: 0,
            filled: 0,
            total: 0.0,
            count: 0,
            scratch: Vec::with_capacity(capacity),
        }
    }

    pub fn push(&mut self, us: f64) {
        self.samples[self.next] = us;
        self.next = (self.next + 1) % self.samples.len();
        self.filled = (self.filled + 1).min(self.samples.len());
        self.total += us;
        self.count += 1;
    }

    /// Mean over every frame since the last reset.
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.total / self.count as f64
        }
    }

    /// Percentiles (0–100) of the window, nearest-rank.
    pub fn percentiles<const N: usize>(&mut self, ps: [f64; N]) -> [f64; N] {
        let mut out = [0.0; N];
        if self.filled == 0 {
            return out;
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.samples[..self.filled]);
        self.scratch.sort_by(|a, b| a.total_cmp(b));
        for (o, p) in out.iter_mut().zip(ps) {
            *o = percentile_of_sorted(&self.scratch, p);
        }
        out
    }

    pub fn reset(&mut self) {
        self.next = 0;
        self.filled = 0;
        self.total = 0.0;
        self.count = 0;
    }
}

/// Nearest-rank percentile `p` (0–100) of ascending `sorted` values; 0 when there are none.
pub fn percentile_of_sorted(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles_of_a_sorted_slice() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile_of_sorted(&v, 0.0), 1.0);
        assert_eq!(percentile_of_sorted(&v, 25.0), 1.0);
        assert_eq!(percentile_of_sorted(&v, 26.0), 2.0);
        assert_eq!(percentile_of_sorted(&v, 50.0), 2.0);
        assert_eq!(percentile_of_sorted(&v, 99.0), 4.0);
        assert_eq!(percentile_of_sorted(&v, 100.0), 4.0);
        assert_eq!(percentile_of_sorted(&[], 50.0), 0.0);
    }

    #[test]
    fn percentiles_of_a_known_series() {
        let mut w = TimeWindow::new(100);
        for v in 1..=100 {
            w.push(v as f64);
        }
        assert_eq!(w.percentiles([50.0, 99.0, 100.0]), [50.0, 99.0, 100.0]);
        assert_eq!(w.mean(), 50.5);
    }

    #[test]
    fn window_keeps_only_recent_samples_but_mean_counts_all() {
        let mut w = TimeWindow::new(4);
        for v in [100.0, 100.0, 1.0, 2.0, 3.0, 4.0] {
            w.push(v);
        }
        assert_eq!(w.percentiles([100.0]), [4.0]);
        assert!((w.mean() - 210.0 / 6.0).abs() < 1e-9);
        w.reset();
        assert_eq!(w.mean(), 0.0);
        assert_eq!(w.percentiles([50.0]), [0.0]);
    }
}
