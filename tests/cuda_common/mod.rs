//! Helpers of the CUDA integration tests: fixtures decoded to NV12 through GStreamer, a moving
//! clip made from them, and frame comparisons (decoding through tests/common).
#![allow(dead_code)]

use gsttoonflow::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, StageParams, ToonParams};

pub const PHOTOS: [&str; 4] = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"];

/// The CUDA device to test, or `None` after printing why the test is skipped.
pub fn cuda_or_skip() -> Option<String> {
    match gsttoonflow::cuda::probe(0) {
        Ok(name) => Some(name),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

pub fn data_path(name: &str) -> std::path::PathBuf {
    crate::common::fixture(name)
}

/// A tightly packed NV12 frame.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    pub geometry: FrameGeometry,
    pub data: Vec<u8>,
}

impl Frame {
    pub fn new(w: usize, h: usize) -> Frame {
        let geometry = FrameGeometry::new(w, h).unwrap();
        Frame {
            geometry,
            data: vec![0; geometry.nv12_bytes()],
        }
    }
    pub fn view(&self) -> Nv12Frame<'_> {
        Nv12Frame::packed(self.geometry, &self.data).unwrap()
    }
    pub fn view_mut(&mut self) -> Nv12FrameMut<'_> {
        Nv12FrameMut::packed(self.geometry, &mut self.data).unwrap()
    }
    pub fn luma(&self) -> &[u8] {
        &self.data[..self.geometry.luma_pixels()]
    }
    pub fn chroma(&self) -> &[u8] {
        &self.data[self.geometry.luma_pixels()..]
    }
}

/// Decodes `name` from tests/data, scaled to `w`×`h` NV12 (through tests/common).
pub fn load_photo(name: &str, w: usize, h: usize) -> Frame {
    Frame {
        geometry: FrameGeometry::new(w, h).unwrap(),
        data: crate::common::photo(name, w, h).data,
    }
}

/// Deterministic xorshift PRNG.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// Crop of `src` at (x0, y0) of size (cw, ch) in source pixels, resampled (nearest) to
/// `w`×`h`, with luma noise of ±`noise` codes.
#[allow(clippy::too_many_arguments)]
pub fn crop(
    src: &Frame,
    x0: f32,
    y0: f32,
    cw: f32,
    ch: f32,
    w: usize,
    h: usize,
    rng: &mut Rng,
    noise: i32,
) -> Frame {
    let (sw, sh) = (src.geometry.width, src.geometry.height);
    let mut f = Frame::new(w, h);
    for y in 0..h {
        let sy = ((y0 + (y as f32 + 0.5) * ch / h as f32) as usize).min(sh - 1);
        for x in 0..w {
            let sx = ((x0 + (x as f32 + 0.5) * cw / w as f32) as usize).min(sw - 1);
            let v = src.data[sy * sw + sx] as i32;
            let n = if noise > 0 {
                (rng.next() % (2 * noise as u64 + 1)) as i32 - noise
            } else {
                0
            };
            f.data[y * w + x] = (v + n).clamp(0, 255) as u8;
        }
    }
    for y in 0..h / 2 {
        let sy = ((y0 / 2.0 + (y as f32 + 0.5) * ch / h as f32) as usize).min(sh / 2 - 1);
        for x in 0..w / 2 {
            let sx = ((x0 / 2.0 + (x as f32 + 0.5) * cw / w as f32) as usize).min(sw / 2 - 1);
            f.data[w * h + y * w + 2 * x] = src.data[sw * sh + sy * sw + 2 * sx];
            f.data[w * h + y * w + 2 * x + 1] = src.data[sw * sh + sy * sw + 2 * sx + 1];
        }
    }
    f
}

/// A 60-frame moving clip of `w`×`h`: pan and zoom over photo A, then (frame 30) a cut to a pan
/// over photo B, with per-frame luma noise.
pub fn moving_clip(w: usize, h: usize) -> Vec<Frame> {
    let a = load_photo("astronaut.png", 2 * w, 2 * h);
    let b = load_photo("coffee.png", 2 * w, 2 * h);
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut out = Vec::new();
    for i in 0..60 {
        let t = i as f32;
        let f = if i < 30 {
            let zoom = 1.6 - 0.01 * t;
            let (cw, ch) = (w as f32 * zoom, h as f32 * zoom);
            crop(&a, 2.0 * t, 1.5 * t, cw, ch, w, h, &mut rng, 3)
        } else {
            let t = t - 30.0;
            crop(
                &b,
                3.0 * t,
                0.5 * t,
                w as f32 * 1.5,
                h as f32 * 1.5,
                w,
                h,
                &mut rng,
                3,
            )
        };
        out.push(f);
    }
    out
}

pub fn params(w: usize, h: usize) -> ToonParams {
    ToonParams::new(&StageParams::default(), w as u32, h as u32)
}

/// (max |a−b|, fraction of bytes with |a−b| ≤ 1).
pub fn diff_stats(a: &[u8], b: &[u8]) -> (u8, f64) {
    assert_eq!(a.len(), b.len());
    let mut max = 0u8;
    let mut ok = 0usize;
    for (x, y) in a.iter().zip(b) {
        let d = x.abs_diff(*y);
        max = max.max(d);
        ok += (d <= 1) as usize;
    }
    (max, ok as f64 / a.len() as f64)
}

/// max |a−b| over two equally long f32 slices (0 for empty ones).
/// Asserts that two outputs hold the same bits (`what`: the change that must not alter them).
pub fn assert_same_bits(
    a: &gsttoonflow::neural::Tensor<f32>,
    b: &gsttoonflow::neural::Tensor<f32>,
    what: &str,
) {
    assert_eq!(a.shape, b.shape);
    assert!(
        a.data
            .iter()
            .zip(&b.data)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "{what} changed the output (max {:.3e})",
        max_abs_diff_f32(&a.data, &b.data)
    );
}

pub fn max_abs_diff_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let mse: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| {
            let d = *x as f64 - *y as f64;
            d * d
        })
        .sum::<f64>()
        / a.len() as f64;
    if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (255.0f64 * 255.0 / mse).log10()
    }
}
