//! Frame statistics: the luma thumbnail and scene-cut score, and the luma histogram with the
//! black/white points for auto-levels. Integer sums, so every backend gets the same numbers.

use super::params::{AUTO_LEVELS_CLIP, AUTO_LEVELS_MIN_SPREAD, HIST_BINS, THUMB_H, THUMB_W};

/// Luma block sums and histogram of one frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameStatistics {
    pub thumb_w: usize,
    pub thumb_h: usize,
    /// Sum of Y codes per thumbnail block, row-major, `thumb_w × thumb_h` used.
    pub thumb_sums: [u32; THUMB_W * THUMB_H],
    pub histogram: [u32; HIST_BINS],
}

/// First luma column/row of thumbnail block `b` of `blocks` over `size` pixels.
pub fn block_start(b: usize, blocks: usize, size: usize) -> usize {
    b * size / blocks
}

impl FrameStatistics {
    pub fn new(thumb_w: usize, thumb_h: usize) -> Self {
        FrameStatistics {
            thumb_w,
            thumb_h,
            thumb_sums: [0; THUMB_W * THUMB_H],
            histogram: [0; HIST_BINS],
        }
    }

    /// Gathers the statistics of a Y plane.
    pub fn gather(&mut self, y: &[u8], stride: usize, width: usize, height: usize) {
        self.thumb_sums.fill(0);
        self.histogram.fill(0);
        for by in 0..self.thumb_h {
            let (y0, y1) = (
                block_start(by, self.thumb_h, height),
                block_start(by + 1, self.thumb_h, height),
            );
            for bx in 0..self.thumb_w {
                let (x0, x1) = (
                    block_start(bx, self.thumb_w, width),
                    block_start(bx + 1, self.thumb_w, width),
                );
                let mut sum = 0u32;
                for row in y0..y1 {
                    for &v in &y[row * stride + x0..row * stride + x1] {
                        sum += v as u32;
                        self.histogram[v as usize] += 1;
                    }
                }
                self.thumb_sums[by * THUMB_W + bx] = sum;
            }
        }
    }

    /// Thumbnail block means in L units (0–100).
    pub fn thumbnail(&self, width: usize, height: usize) -> Vec<f32> {
        thumbnail_means(&self.thumb_sums, self.thumb_w, self.thumb_h, width, height)
    }

    /// Black and white points in L units: the codes below which and above which
    /// `AUTO_LEVELS_CLIP` of the pixels lie. `None` when the frame is (nearly) flat.
    pub fn levels(&self) -> Option<(f32, f32)> {
        levels_from_histogram(&self.histogram)
    }
}

/// Block means of thumbnail sums, in L units.
pub fn thumbnail_means(
    sums: &[u32],
    tw: usize,
    th: usize,
    width: usize,
    height: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(tw * th);
    thumbnail_means_into(sums, tw, th, width, height, &mut out);
    out
}

/// [`thumbnail_means`] into `out` (cleared first; no allocation once it has the capacity).
pub fn thumbnail_means_into(
    sums: &[u32],
    tw: usize,
    th: usize,
    width: usize,
    height: usize,
    out: &mut Vec<f32>,
) {
    out.clear();
    for by in 0..th {
        let rows = block_start(by + 1, th, height) - block_start(by, th, height);
        for bx in 0..tw {
            let cols = block_start(bx + 1, tw, width) - block_start(bx, tw, width);
            let count = (rows * cols) as f32;
            out.push(100.0 * sums[by * THUMB_W + bx] as f32 / (255.0 * count));
        }
    }
}

/// Black/white points of a luma histogram in L units, `None` for a flat frame.
pub fn levels_from_histogram(histogram: &[u32; HIST_BINS]) -> Option<(f32, f32)> {
    let total: u64 = histogram.iter().map(|&c| c as u64).sum();
    let clip = (AUTO_LEVELS_CLIP as f64 * total as f64) as u64;
    let mut acc = 0u64;
    let mut lo = 0usize;
    for (code, &count) in histogram.iter().enumerate() {
        acc += count as u64;
        if acc > clip {
            lo = code;
            break;
        }
    }
    acc = 0;
    let mut hi = HIST_BINS - 1;
    for (code, &count) in histogram.iter().enumerate().rev() {
        acc += count as u64;
        if acc > clip {
            hi = code;
            break;
        }
    }
    (hi > lo + AUTO_LEVELS_MIN_SPREAD)
        .then(|| (100.0 * lo as f32 / 255.0, 100.0 * hi as f32 / 255.0))
}

/// Stretches `l` so that `[black, white]` spans 0–100.
pub fn apply_levels(l: f32, black: f32, white: f32) -> f32 {
    ((l - black) * (100.0 / (white - black))).clamp(0.0, 100.0)
}

/// Scene-cut score: mean absolute change of the thumbnail against the previous frame.
#[derive(Debug, Default)]
pub struct SceneCutDetector {
    previous: Vec<f32>,
    current: Vec<f32>,
    has_previous: bool,
}

impl SceneCutDetector {
    /// A detector whose buffers already hold `blocks` thumbnail blocks (no allocation later).
    pub fn with_capacity(blocks: usize) -> Self {
        SceneCutDetector {
            previous: Vec::with_capacity(blocks),
            current: Vec::with_capacity(blocks),
            has_previous: false,
        }
    }

    /// Feeds a frame's thumbnail; returns its score (0 for the first frame after a reset).
    pub fn score(&mut self, thumbnail: Vec<f32>) -> f32 {
        self.current = thumbnail;
        self.score_current()
    }

    /// [`score`](Self::score) of the thumbnail of `statistics`, computed into buffers the
    /// detector keeps: no allocation after the first frame.
    pub fn score_statistics(
        &mut self,
        statistics: &FrameStatistics,
        width: usize,
        height: usize,
    ) -> f32 {
        thumbnail_means_into(
            &statistics.thumb_sums,
            statistics.thumb_w,
            statistics.thumb_h,
            width,
            height,
            &mut self.current,
        );
        self.score_current()
    }

    fn score_current(&mut self) -> f32 {
        let (prev, cur) = (&self.previous, &self.current);
        let score = if self.has_previous && prev.len() == cur.len() && !cur.is_empty() {
            let sum: f32 = prev.iter().zip(cur).map(|(a, b)| (a - b).abs()).sum();
            sum / cur.len() as f32
        } else {
            0.0
        };
        std::mem::swap(&mut self.previous, &mut self.current);
        self.has_previous = true;
        score
    }

    pub fn reset(&mut self) {
        self.has_previous = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plane(w: usize, h: usize, f: impl Fn(usize, usize) -> u8) -> Vec<u8> {
        (0..h)
            .flat_map(|y| (0..w).map(move |x| (x, y)))
            .map(|(x, y)| f(x, y))
            .collect()
    }

    #[test]
    fn thumbnail_blocks_cover_the_frame() {
        let (w, h) = (130, 74);
        let y = plane(w, h, |_, _| 255);
        let mut s = FrameStatistics::new(64, 36);
        s.gather(&y, w, w, h);
        let t = s.thumbnail(w, h);
        assert!(t.iter().all(|&v| (v - 100.0).abs() < 1e-4));
        assert_eq!(s.histogram[255] as usize, w * h);
    }

    #[test]
    fn identical_frames_score_zero_and_a_cut_scores_high() {
        let (w, h) = (128, 72);
        let dark = plane(w, h, |x, _| (x / 2) as u8);
        let bright = plane(w, h, |x, _| 255 - (x / 2) as u8);
        let mut s = FrameStatistics::new(64, 36);
        let mut d = SceneCutDetector::default();
        s.gather(&dark, w, w, h);
        assert_eq!(d.score(s.thumbnail(w, h)), 0.0);
        assert_eq!(d.score(s.thumbnail(w, h)), 0.0);
        s.gather(&bright, w, w, h);
        let cut = d.score(s.thumbnail(w, h));
        assert!(cut > 50.0, "score {cut}");
        d.reset();
        assert_eq!(d.score(s.thumbnail(w, h)), 0.0);
    }

    #[test]
    fn scoring_statistics_in_place_matches_scoring_thumbnails() {
        let (w, h) = (130, 74);
        let frames: Vec<Vec<u8>> = (0..4u8)
            .map(|k| plane(w, h, |x, y| (x * 3 + y * (k as usize + 1)) as u8 ^ (k * 40)))
            .collect();
        let mut s = FrameStatistics::new(64, 36);
        let (mut by_vec, mut in_place) = (SceneCutDetector::default(), SceneCutDetector::default());
        for (i, f) in frames.iter().enumerate() {
            if i == 2 {
                by_vec.reset();
                in_place.reset();
            }
            s.gather(f, w, w, h);
            let a = by_vec.score(s.thumbnail(w, h));
            let b = in_place.score_statistics(&s, w, h);
            assert_eq!(a.to_bits(), b.to_bits(), "frame {i}");
            assert_eq!(a == 0.0, i == 0 || i == 2, "frame {i}: {a}");
        }
    }

    #[test]
    fn levels_ignore_outliers_and_refuse_flat_frames() {
        let mut h = [0u32; HIST_BINS];
        h[0] = 1; // one outlier below the clip
        h[50] = 1000;
        h[200] = 1000;
        h[255] = 1;
        let (lo, hi) = levels_from_histogram(&h).unwrap();
        assert!((lo - 100.0 * 50.0 / 255.0).abs() < 1e-4);
        assert!((hi - 100.0 * 200.0 / 255.0).abs() < 1e-4);
        let mut flat = [0u32; HIST_BINS];
        flat[128] = 5000;
        assert_eq!(levels_from_histogram(&flat), None);
        assert_eq!(apply_levels(lo, lo, hi), 0.0);
        assert_eq!(apply_levels(hi, lo, hi), 100.0);
    }
}
