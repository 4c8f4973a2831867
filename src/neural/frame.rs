//! Conversion between NV12 frames and the network's input/output tensors.
//!
//! Way in (`to_tensor`):
//! 1. **NV12 → RGB** with the caps' matrix ([`ColorMatrix`]) and range ([`ColorRange`]).
//!    Chroma siting is **centred** (JPEG/MPEG-1 style, GStreamer's default when caps name
//!    none): each chroma sample sits in the middle of its 2x2 luma block. Upsampling is
//!    bilinear (weights 3/4 and 1/4 per axis, edge samples repeated) plus a *block correction*:
//!    each 2x2 block gets the same offset `c − B(c)`, where `B` = [1 6 1]/8 ⊗ [1 6 1]/8 is what
//!    bilinear-then-2x2-mean would leave of the samples. It is the smallest (least-squares)
//!    change to the bilinear picture that makes every 2x2 mean equal its transmitted sample, so
//!    the way back (the 2x2 mean, centred too) is its exact inverse: NV12 → RGB → NV12 returns
//!    the chroma codes, where plain bilinear blurs them by `B` on every pass (up to 14 codes
//!    on the test photos). In smooth areas the offset vanishes (`B` keeps linear ramps); at a
//!    hard chroma edge of height h it overshoots by about h/8.
//!    RGB is *not* clamped to [0, 1]: YCbCr combinations outside the RGB cube (limited-range
//!    foot/headroom, saturated chroma next to a dark pixel) pass through linearly, so the
//!    conversion is invertible and luma comes back exactly.
//! 2. **model-scale** s: the network runs at `round(s·W) × round(s·H)` (half away from zero,
//!    at least 1). Downscaling is an exact area (box) average with fractional coverage,
//!    separable: it does not alias at s = 0.25 as bilinear would. At s = 1 nothing is resampled.
//! 3. **Padding** to the model's multiple m: the scaled size rounded *up* to m, the new rows and
//!    columns at the bottom/right filled by reflection without repeating the edge (ONNX/numpy
//!    `reflect`: index n → n−2). A pad longer than the image folds back and forth (period
//!    2(n−1)), a 1-pixel image repeats its pixel ([`reflect_index`]).
//! 4. **Value range and layout**: `v = x·scale + offset` for the nominal RGB x in [0, 1]
//!    ([`ValueRange`]), written NHWC `[1,H,W,3]` or NCHW `[1,3,H,W]` ([`TensorLayout`]).
//!
//! Way out (`from_tensor`): the output is cropped to the scaled size and range-mapped back
//! ([`FrameConverter::read_output`]; the temporal output filter may work on these planes),
//! upscaled bilinearly to W×H (half-pixel centres, edges clamped; again nothing at s = 1),
//! converted to Y per pixel and to Cb/Cr as the mean of each 2x2 block, and packed as 8-bit
//! codes rounded half away from zero and clamped to 0–255 ([`FrameConverter::write_nv12`]).
//!
//! All buffers are allocated in [`FrameConverter::new`]; a frame allocates nothing (the tensor
//! passed to `to_tensor` is reshaped once, on its first use).

use super::NeuralError;
use super::tensor::Tensor;
use crate::pipeline::frame::{FrameGeometry, Nv12Frame, Nv12FrameMut};

/// The YCbCr matrix of the caps' colorimetry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ColorMatrix {
    /// ITU-R BT.601 (SD): Kr = 0.299, Kb = 0.114.
    Bt601,
    /// ITU-R BT.709 (HD): Kr = 0.2126, Kb = 0.0722.
    #[default]
    Bt709,
    /// ITU-R BT.2020 (non-constant luminance): Kr = 0.2627, Kb = 0.0593.
    Bt2020,
}

impl ColorMatrix {
    /// (Kr, Kb); Kg = 1 − Kr − Kb.
    pub fn kr_kb(self) -> (f32, f32) {
        match self {
            ColorMatrix::Bt601 => (0.299, 0.114),
            ColorMatrix::Bt709 => (0.2126, 0.0722),
            ColorMatrix::Bt2020 => (0.2627, 0.0593),
        }
    }
}

/// The quantization range of the caps' colorimetry (8-bit codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ColorRange {
    /// Y 16–235, Cb/Cr 16–240 (128 ± 112).
    #[default]
    Limited,
    /// Y 0–255, Cb/Cr 128 ± 127.5 (GStreamer's 0_255 range: offset 128, scale 255).
    Full,
}

impl ColorRange {
    /// (luma offset, luma scale, chroma scale) in codes; chroma is centred on 128.
    pub fn code_scales(self) -> (f32, f32, f32) {
        match self {
            ColorRange::Limited => (16.0, 219.0, 224.0),
            ColorRange::Full => (0.0, 255.0, 255.0),
        }
    }
}

/// Memory layout of the network's input and output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TensorLayout {
    /// `[1, H, W, 3]` (AnimeGANv3).
    #[default]
    Nhwc,
    /// `[1, 3, H, W]`.
    Nchw,
}

/// Range of the RGB values the network reads and writes (`model-range`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ValueRange {
    /// −1..1 (AnimeGANv3 in, tanh out).
    #[default]
    MinusOneToOne,
    /// 0..1.
    ZeroToOne,
    /// 0..255.
    ZeroTo255,
}

impl ValueRange {
    /// (scale, offset) with `v = x·scale + offset` for nominal RGB x in [0, 1].
    pub fn scale_offset(self) -> (f32, f32) {
        match self {
            ValueRange::MinusOneToOne => (2.0, -1.0),
            ValueRange::ZeroToOne => (1.0, 0.0),
            ValueRange::ZeroTo255 => (255.0, 0.0),
        }
    }
}

/// Everything [`FrameConverter`] needs to know, fixed for a stream (caps + properties + model).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConverterConfig {
    pub width: usize,
    pub height: usize,
    pub matrix: ColorMatrix,
    pub range: ColorRange,
    pub layout: TensorLayout,
    pub value_range: ValueRange,
    /// The network's size multiple m (8 or 16 for AnimeGANv3).
    pub multiple: usize,
    /// `model-scale` in [0.25, 1].
    pub scale: f64,
}

impl ConverterConfig {
    pub const MIN_SCALE: f64 = 0.25;
    pub const MAX_SCALE: f64 = 1.0;
    pub const MAX_MULTIPLE: usize = 256;
}

/// `round(scale·size)`, half away from zero, at least 1.
pub fn scaled_dimension(size: usize, scale: f64) -> usize {
    ((size as f64 * scale).round() as usize).max(1)
}

/// Source index of padded index `i` for an axis of `n` samples under ONNX `reflect` padding
/// (no edge repeat), folding back and forth when the pad is longer than the axis; `n == 1`
/// repeats the only sample.
#[inline]
pub fn reflect_index(i: usize, n: usize) -> usize {
    if n <= 1 {
        return 0;
    }
    let period = 2 * (n - 1);
    let j = i % period;
    if j < n { j } else { period - j }
}

/// A 1-D resampler: output sample `i` is `Σ weights[t]·input[start + t]` over its taps.
#[derive(Debug, Clone)]
struct Resampler {
    /// (first input index, first weight index, tap count) per output sample.
    taps: Vec<(usize, usize, usize)>,
    weights: Vec<f32>,
}

impl Resampler {
    /// Exact area average of `input` samples onto `output ≤ input` samples.
    fn area(input: usize, output: usize) -> Self {
        let ratio = input as f64 / output as f64;
        let mut taps = Vec::with_capacity(output);
        let mut weights = Vec::new();
        for i in 0..output {
            let (a, b) = (i as f64 * ratio, (i + 1) as f64 * ratio);
            let first = a.floor() as usize;
            let last = (b.ceil() as usize).min(input);
            let start = weights.len();
            let covered: Vec<f64> = (first..last)
                .map(|j| b.min(j as f64 + 1.0) - a.max(j as f64))
                .collect();
            let total: f64 = covered.iter().sum();
            weights.extend(covered.iter().map(|&c| (c / total) as f32));
            taps.push((first, start, last - first));
        }
        Resampler { taps, weights }
    }

    /// Bilinear interpolation of `input` samples onto `output ≥ input` samples, half-pixel
    /// centres, clamped at the edges.
    fn bilinear(input: usize, output: usize) -> Self {
        let ratio = input as f64 / output as f64;
        let mut taps = Vec::with_capacity(output);
        let mut weights = Vec::with_capacity(2 * output);
        for i in 0..output {
            let src = ((i as f64 + 0.5) * ratio - 0.5).clamp(0.0, (input - 1) as f64);
            let i0 = src.floor() as usize;
            let f = src - i0 as f64;
            let start = weights.len();
            if i0 + 1 < input && f > 0.0 {
                weights.extend([(1.0 - f) as f32, f as f32]);
                taps.push((i0, start, 2));
            } else {
                weights.push(1.0);
                taps.push((i0, start, 1));
            }
        }
        Resampler { taps, weights }
    }

    #[inline]
    fn sample(&self, i: usize, at: impl Fn(usize) -> f32) -> f32 {
        let (first, w0, n) = self.taps[i];
        let mut acc = 0.0;
        for t in 0..n {
            acc += self.weights[w0 + t] * at(first + t);
        }
        acc
    }
}

/// The taps of one output sample of a 1-D resampling: `Σ weights[t]·input[first + t]`, summed
/// from 0 in tap order.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleTaps {
    pub first: usize,
    pub weights: Vec<f32>,
}

/// The four resamplings of model-scale s below 1 for a `width`×`height` frame whose network
/// content is `scaled_w`×`scaled_h`, per output sample, exactly as [`FrameConverter`] applies
/// them (separably, along x first): down along x, down along y (area), up along x, up along y
/// (bilinear), for the device frame path (src/cuda/neural_frame.rs).
pub fn scaling_taps(
    width: usize,
    height: usize,
    scaled_w: usize,
    scaled_h: usize,
) -> [Vec<SampleTaps>; 4] {
    let listed = |r: Resampler| {
        r.taps
            .iter()
            .map(|&(first, w0, n)| SampleTaps {
                first,
                weights: r.weights[w0..w0 + n].to_vec(),
            })
            .collect()
    };
    [
        listed(Resampler::area(width, scaled_w)),
        listed(Resampler::area(height, scaled_h)),
        listed(Resampler::bilinear(scaled_w, width)),
        listed(Resampler::bilinear(scaled_h, height)),
    ]
}

/// Resamples one `sw×sh` plane into `dw×dh`: along x into `tmp` (`dw×sh`), then along y.
#[allow(clippy::too_many_arguments)]
fn resample_plane(
    src: &[f32],
    sw: usize,
    sh: usize,
    dst: &mut [f32],
    dw: usize,
    dh: usize,
    along_x: &Resampler,
    along_y: &Resampler,
    tmp: &mut [f32],
) {
    for r in 0..sh {
        let row = &src[r * sw..(r + 1) * sw];
        for (x, o) in tmp[r * dw..(r + 1) * dw].iter_mut().enumerate() {
            *o = along_x.sample(x, |j| row[j]);
        }
    }
    for y in 0..dh {
        let out = &mut dst[y * dw..(y + 1) * dw];
        let (first, w0, n) = along_y.taps[y];
        out.fill(0.0);
        for t in 0..n {
            let w = along_y.weights[w0 + t];
            let row = &tmp[(first + t) * dw..(first + t + 1) * dw];
            for (o, &v) in out.iter_mut().zip(row) {
                *o += w * v;
            }
        }
    }
}

/// Per-axis resamplers between the frame and the network's (scaled) size.
#[derive(Debug, Clone)]
struct Scaling {
    down_x: Resampler,
    down_y: Resampler,
    up_x: Resampler,
    up_y: Resampler,
}

/// NV12 ⇄ network tensor for one stream geometry; owns every scratch buffer.
#[derive(Debug, Clone)]
pub struct FrameConverter {
    config: ConverterConfig,
    geometry: FrameGeometry,
    /// Scaled (network content) size, before padding.
    scaled_w: usize,
    scaled_h: usize,
    /// Padded size the network runs at.
    padded_w: usize,
    padded_h: usize,
    kr: f32,
    kb: f32,
    y_offset: f32,
    y_scale: f32,
    c_scale: f32,
    /// `None` at scale 1 (frame size = network content size).
    scaling: Option<Scaling>,
    /// Planar RGB (3 planes) at frame size; only used when scaling.
    rgb_frame: Vec<f32>,
    /// Planar RGB (3 planes) at the scaled size: the network's content, both ways.
    rgb_net: Vec<f32>,
    /// Separable resampling scratch, one plane of the larger intermediate.
    tmp: Vec<f32>,
    /// Three chroma rows of `width` interleaved (Cb, Cr) values: vertically interpolated
    /// codes minus 128, the vertical blur, the block correction.
    chroma_rows: Vec<f32>,
}

impl FrameConverter {
    pub fn new(config: ConverterConfig) -> Result<Self, NeuralError> {
        let geometry =
            FrameGeometry::new(config.width, config.height).map_err(NeuralError::Model)?;
        if !(ConverterConfig::MIN_SCALE..=ConverterConfig::MAX_SCALE).contains(&config.scale) {
            return Err(NeuralError::Model(format!(
                "model-scale {} is outside {}..{}",
                config.scale,
                ConverterConfig::MIN_SCALE,
                ConverterConfig::MAX_SCALE
            )));
        }
        if config.multiple == 0 || config.multiple > ConverterConfig::MAX_MULTIPLE {
            return Err(NeuralError::Model(format!(
                "size multiple {} is outside 1..{}",
                config.multiple,
                ConverterConfig::MAX_MULTIPLE
            )));
        }
        let (w, h) = (config.width, config.height);
        let scaled_w = scaled_dimension(w, config.scale);
        let scaled_h = scaled_dimension(h, config.scale);
        let padded_w = scaled_w.next_multiple_of(config.multiple);
        let padded_h = scaled_h.next_multiple_of(config.multiple);
        let scaling = (scaled_w != w || scaled_h != h).then(|| Scaling {
            down_x: Resampler::area(w, scaled_w),
            down_y: Resampler::area(h, scaled_h),
            up_x: Resampler::bilinear(scaled_w, w),
            up_y: Resampler::bilinear(scaled_h, h),
        });
        let (rgb_frame, tmp) = if scaling.is_some() {
            // down: x pass gives scaled_w×h; up: x pass gives w×scaled_h.
            (
                vec![0.0; 3 * w * h],
                vec![0.0; (scaled_w * h).max(w * scaled_h)],
            )
        } else {
            (Vec::new(), Vec::new())
        };
        let (kr, kb) = config.matrix.kr_kb();
        let (y_offset, y_scale, c_scale) = config.range.code_scales();
        Ok(FrameConverter {
            config,
            geometry,
            scaled_w,
            scaled_h,
            padded_w,
            padded_h,
            kr,
            kb,
            y_offset,
            y_scale,
            c_scale,
            scaling,
            rgb_frame,
            rgb_net: vec![0.0; 3 * scaled_w * scaled_h],
            tmp,
            chroma_rows: vec![0.0; 3 * w],
        })
    }

    pub fn config(&self) -> &ConverterConfig {
        &self.config
    }

    /// (height, width) the network runs at: the scaled size padded to the multiple.
    pub fn network_size(&self) -> (usize, usize) {
        (self.padded_h, self.padded_w)
    }

    /// (height, width) of the picture inside the network's input (before padding).
    pub fn scaled_size(&self) -> (usize, usize) {
        (self.scaled_h, self.scaled_w)
    }

    /// The network's input (and expected output) shape in the configured layout.
    pub fn tensor_shape(&self) -> [usize; 4] {
        let (h, w) = self.network_size();
        match self.config.layout {
            TensorLayout::Nhwc => [1, h, w, 3],
            TensorLayout::Nchw => [1, 3, h, w],
        }
    }

    /// A tensor of [`tensor_shape`](Self::tensor_shape), to be reused frame after frame.
    pub fn new_tensor(&self) -> Tensor<f32> {
        Tensor::zeros(&self.tensor_shape())
    }

    /// Converts an NV12 frame into the network's input. `tensor` is reshaped (allocating) only
    /// when its shape differs, i.e. on its first use.
    pub fn to_tensor(
        &mut self,
        y: &[u8],
        y_stride: usize,
        uv: &[u8],
        uv_stride: usize,
        tensor: &mut Tensor<f32>,
    ) -> Result<(), String> {
        let frame = Nv12Frame::new(self.geometry, y, y_stride, uv, uv_stride)?;
        let (w, h) = (self.geometry.width, self.geometry.height);
        let plane = w * h;
        let target = if self.scaling.is_some() {
            Target::Frame
        } else {
            Target::Net
        };
        nv12_to_rgb(self, &frame, target);
        if let Some(s) = &self.scaling {
            let (sw, sh) = (self.scaled_w, self.scaled_h);
            for c in 0..3 {
                resample_plane(
                    &self.rgb_frame[c * plane..(c + 1) * plane],
                    w,
                    h,
                    &mut self.rgb_net[c * sw * sh..(c + 1) * sw * sh],
                    sw,
                    sh,
                    &s.down_x,
                    &s.down_y,
                    &mut self.tmp,
                );
            }
        }
        self.write_tensor(tensor);
        Ok(())
    }

    /// Pads, range-maps and lays out `rgb_net` into `tensor`.
    fn write_tensor(&self, tensor: &mut Tensor<f32>) {
        let shape = self.tensor_shape();
        if tensor.shape != shape {
            *tensor = Tensor::zeros(&shape);
        }
        let (ph, pw) = (self.padded_h, self.padded_w);
        let (sw, sh) = (self.scaled_w, self.scaled_h);
        let (scale, offset) = self.config.value_range.scale_offset();
        let planes = [
            &self.rgb_net[..sw * sh],
            &self.rgb_net[sw * sh..2 * sw * sh],
            &self.rgb_net[2 * sw * sh..],
        ];
        match self.config.layout {
            TensorLayout::Nhwc => {
                for (py, out_row) in tensor.data.chunks_exact_mut(3 * pw).enumerate() {
                    let row = reflect_index(py, sh) * sw;
                    for (px, out) in out_row.chunks_exact_mut(3).enumerate() {
                        let i = row + reflect_index(px, sw);
                        for c in 0..3 {
                            out[c] = planes[c][i] * scale + offset;
                        }
                    }
                }
            }
            TensorLayout::Nchw => {
                for (c, out_plane) in tensor.data.chunks_exact_mut(ph * pw).enumerate() {
                    for (py, out_row) in out_plane.chunks_exact_mut(pw).enumerate() {
                        let row = &planes[c][reflect_index(py, sh) * sw..][..sw];
                        for (px, out) in out_row.iter_mut().enumerate() {
                            *out = row[reflect_index(px, sw)] * scale + offset;
                        }
                    }
                }
            }
        }
    }

    /// Converts the network's output back into an NV12 frame of the stream's size:
    /// [`read_output`](Self::read_output) then [`write_nv12`](Self::write_nv12).
    pub fn from_tensor(
        &mut self,
        tensor: &Tensor<f32>,
        y_out: &mut [u8],
        y_stride: usize,
        uv_out: &mut [u8],
        uv_stride: usize,
    ) -> Result<(), String> {
        self.read_output(tensor)?;
        self.write_nv12(y_out, y_stride, uv_out, uv_stride)
    }

    /// Crops the network's output to the scaled size and maps it back to nominal RGB in
    /// [`network_rgb`](Self::network_rgb).
    pub fn read_output(&mut self, tensor: &Tensor<f32>) -> Result<(), String> {
        let shape = self.tensor_shape();
        if tensor.shape != shape || tensor.data.len() != shape.iter().product::<usize>() {
            return Err(format!(
                "the network's output has shape {:?}, expected {shape:?}",
                tensor.shape
            ));
        }
        let (ph, pw) = (self.padded_h, self.padded_w);
        let (sw, sh) = (self.scaled_w, self.scaled_h);
        let (scale, offset) = self.config.value_range.scale_offset();
        let inv = 1.0 / scale;
        let (r, rest) = self.rgb_net.split_at_mut(sw * sh);
        let (g, b) = rest.split_at_mut(sw * sh);
        let mut planes = [r, g, b];
        match self.config.layout {
            TensorLayout::Nhwc => {
                for py in 0..sh {
                    let row = &tensor.data[py * pw * 3..][..sw * 3];
                    for (px, v) in row.chunks_exact(3).enumerate() {
                        for c in 0..3 {
                            planes[c][py * sw + px] = (v[c] - offset) * inv;
                        }
                    }
                }
            }
            TensorLayout::Nchw => {
                for (c, plane) in planes.iter_mut().enumerate() {
                    for py in 0..sh {
                        let row = &tensor.data[(c * ph + py) * pw..][..sw];
                        for (o, &v) in plane[py * sw..(py + 1) * sw].iter_mut().zip(row) {
                            *o = (v - offset) * inv;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The picture at the network's content size: three planes (R, G, B) of
    /// `scaled_w × scaled_h`, nominal range [0, 1]. After [`to_tensor`](Self::to_tensor) it
    /// holds the input, after [`read_output`](Self::read_output) the output.
    pub fn network_rgb(&self) -> &[f32] {
        &self.rgb_net
    }

    /// Mutable access for filters between `read_output` and `write_nv12`.
    pub fn network_rgb_mut(&mut self) -> &mut [f32] {
        &mut self.rgb_net
    }

    /// Upscales [`network_rgb`](Self::network_rgb) to the frame and packs it as NV12.
    pub fn write_nv12(
        &mut self,
        y_out: &mut [u8],
        y_stride: usize,
        uv_out: &mut [u8],
        uv_stride: usize,
    ) -> Result<(), String> {
        let mut frame = Nv12FrameMut::new(self.geometry, y_out, y_stride, uv_out, uv_stride)?;
        let (w, h) = (self.geometry.width, self.geometry.height);
        let plane = w * h;
        let rgb = if let Some(s) = &self.scaling {
            let (sw, sh) = (self.scaled_w, self.scaled_h);
            for c in 0..3 {
                resample_plane(
                    &self.rgb_net[c * sw * sh..(c + 1) * sw * sh],
                    sw,
                    sh,
                    &mut self.rgb_frame[c * plane..(c + 1) * plane],
                    w,
                    h,
                    &s.up_x,
                    &s.up_y,
                    &mut self.tmp,
                );
            }
            &self.rgb_frame
        } else {
            &self.rgb_net
        };
        rgb_to_nv12(self, rgb, &mut frame);
        Ok(())
    }

    /// Nominal RGB of one (Y, Cb, Cr) code triple: the matrix alone, no clamping.
    pub fn ycbcr_to_rgb(&self, y: f32, cb: f32, cr: f32) -> [f32; 3] {
        let yn = (y - self.y_offset) / self.y_scale;
        let (pb, pr) = ((cb - 128.0) / self.c_scale, (cr - 128.0) / self.c_scale);
        ycc_to_rgb(self.kr, self.kb, yn, pb, pr)
    }

    /// Unrounded (Y, Cb, Cr) codes of a nominal RGB triple.
    pub fn rgb_to_ycbcr(&self, rgb: [f32; 3]) -> [f32; 3] {
        let (yn, pb, pr) = rgb_to_ycc(self.kr, self.kb, rgb);
        [
            self.y_offset + self.y_scale * yn,
            128.0 + self.c_scale * pb,
            128.0 + self.c_scale * pr,
        ]
    }
}

#[derive(Clone, Copy)]
enum Target {
    Frame,
    Net,
}

#[inline]
fn ycc_to_rgb(kr: f32, kb: f32, y: f32, pb: f32, pr: f32) -> [f32; 3] {
    let kg = 1.0 - kr - kb;
    let r = y + 2.0 * (1.0 - kr) * pr;
    let b = y + 2.0 * (1.0 - kb) * pb;
    let g = (y - kr * r - kb * b) / kg;
    [r, g, b]
}

#[inline]
fn rgb_to_ycc(kr: f32, kb: f32, [r, g, b]: [f32; 3]) -> (f32, f32, f32) {
    let y = kr * r + (1.0 - kr - kb) * g + kb * b;
    (
        y,
        (b - y) / (2.0 * (1.0 - kb)),
        (r - y) / (2.0 * (1.0 - kr)),
    )
}

/// 8-bit code of a value: half away from zero (`f32::round`), clamped.
#[inline]
fn to_code(v: f32) -> u8 {
    v.round().clamp(0.0, 255.0) as u8
}

/// Index of the chroma neighbour used by centred bilinear upsampling for luma index `i` of
/// an axis with `n` chroma samples: the previous sample for even `i`, the next for odd.
#[inline]
fn chroma_neighbour(i: usize, n: usize) -> usize {
    let c = i / 2;
    if i.is_multiple_of(2) {
        c.saturating_sub(1)
    } else {
        (c + 1).min(n - 1)
    }
}

fn nv12_to_rgb(conv: &mut FrameConverter, frame: &Nv12Frame, target: Target) {
    let (w, h) = (conv.geometry.width, conv.geometry.height);
    let (cw, ch) = (w / 2, h / 2);
    let (kr, kb) = (conv.kr, conv.kb);
    let (y_off, y_inv, c_inv) = (conv.y_offset, 1.0 / conv.y_scale, 1.0 / conv.c_scale);
    let dst = match target {
        Target::Frame => &mut conv.rgb_frame,
        Target::Net => &mut conv.rgb_net,
    };
    let (rp, rest) = dst.split_at_mut(w * h);
    let (gp, bp) = rest.split_at_mut(w * h);
    let (interp, rest) = conv.chroma_rows.split_at_mut(w);
    let (blur, residual) = rest.split_at_mut(w);
    let uv_row = |r: usize| &frame.uv[r * frame.uv_stride..][..w];
    for y in 0..h {
        let cy = y / 2;
        if y.is_multiple_of(2) {
            // The block correction of chroma row cy: its samples minus the [1 6 1]/8 ⊗ [1 6 1]/8
            // blur that bilinear upsampling followed by the 2x2 mean would leave of them.
            let (above, here, below) = (
                uv_row(cy.saturating_sub(1)),
                uv_row(cy),
                uv_row((cy + 1).min(ch - 1)),
            );
            for (i, o) in blur.iter_mut().enumerate() {
                *o = 0.125 * above[i] as f32 + 0.75 * here[i] as f32 + 0.125 * below[i] as f32;
            }
            for i in 0..w {
                let (c, k) = (i / 2, i % 2);
                let left = 2 * c.saturating_sub(1) + k;
                let right = 2 * (c + 1).min(cw - 1) + k;
                let b = 0.125 * blur[left] + 0.75 * blur[i] + 0.125 * blur[right];
                residual[i] = here[i] as f32 - b;
            }
        }
        // Vertical 3/4–1/4 interpolation of the chroma row pair, in codes minus 128.
        let (near, far) = (uv_row(cy), uv_row(chroma_neighbour(y, ch)));
        for ((o, &a), &b) in interp.iter_mut().zip(near).zip(far) {
            *o = 0.75 * a as f32 + 0.25 * b as f32 - 128.0;
        }
        let luma = &frame.y[y * frame.y_stride..][..w];
        let out = y * w;
        for x in 0..w {
            let (c, n) = (x / 2, chroma_neighbour(x, cw));
            let cb = 0.75 * interp[2 * c] + 0.25 * interp[2 * n] + residual[2 * c];
            let cr = 0.75 * interp[2 * c + 1] + 0.25 * interp[2 * n + 1] + residual[2 * c + 1];
            let [r, g, b] = ycc_to_rgb(
                kr,
                kb,
                (luma[x] as f32 - y_off) * y_inv,
                cb * c_inv,
                cr * c_inv,
            );
            rp[out + x] = r;
            gp[out + x] = g;
            bp[out + x] = b;
        }
    }
}

fn rgb_to_nv12(conv: &FrameConverter, rgb: &[f32], frame: &mut Nv12FrameMut) {
    let (w, h) = (conv.geometry.width, conv.geometry.height);
    let (kr, kb) = (conv.kr, conv.kb);
    let (y_off, y_scale, c_scale) = (conv.y_offset, conv.y_scale, conv.c_scale);
    let (rp, rest) = rgb.split_at(w * h);
    let (gp, bp) = rest.split_at(w * h);
    for cy in 0..h / 2 {
        for cx in 0..w / 2 {
            let (mut pb_sum, mut pr_sum) = (0.0f32, 0.0f32);
            for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let (x, y) = (2 * cx + dx, 2 * cy + dy);
                let i = y * w + x;
                let (yn, pb, pr) = rgb_to_ycc(kr, kb, [rp[i], gp[i], bp[i]]);
                frame.y[y * frame.y_stride + x] = to_code(y_off + y_scale * yn);
                pb_sum += pb;
                pr_sum += pr;
            }
            let o = cy * frame.uv_stride + 2 * cx;
            frame.uv[o] = to_code(128.0 + c_scale * 0.25 * pb_sum);
            frame.uv[o + 1] = to_code(128.0 + c_scale * 0.25 * pr_sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(w: usize, h: usize) -> ConverterConfig {
        ConverterConfig {
            width: w,
            height: h,
            matrix: ColorMatrix::Bt709,
            range: ColorRange::Limited,
            layout: TensorLayout::Nhwc,
            value_range: ValueRange::MinusOneToOne,
            multiple: 8,
            scale: 1.0,
        }
    }

    /// A deterministic NV12 frame with smooth content (in the RGB gamut).
    fn smooth_nv12(w: usize, h: usize) -> (Vec<u8>, Vec<u8>) {
        let y = (0..w * h)
            .map(|i| (40 + (i % w) * 150 / w + (i / w) * 30 / h) as u8)
            .collect();
        let uv = (0..w * h / 2)
            .map(|i| {
                let (x, r) = (i % w, i / w);
                if x % 2 == 0 {
                    (110 + x * 20 / w) as u8
                } else {
                    (120 + r * 30 / h) as u8
                }
            })
            .collect();
        (y, uv)
    }

    #[test]
    fn reflect_index_folds_like_numpy_reflect() {
        // numpy.pad(arange(4), (0, 9), 'reflect') = 0 1 2 3 2 1 0 1 2 3 2 1 0
        let got: Vec<usize> = (0..13).map(|i| reflect_index(i, 4)).collect();
        assert_eq!(got, [0, 1, 2, 3, 2, 1, 0, 1, 2, 3, 2, 1, 0]);
        assert_eq!(reflect_index(5, 1), 0);
        assert_eq!(reflect_index(3, 2), 1);
    }

    #[test]
    fn reference_values_bt709_and_bt601() {
        let mut c = config(2, 2);
        let conv = FrameConverter::new(c).unwrap();
        // Limited-range white and black.
        for (yc, want) in [(235.0, 1.0), (16.0, 0.0)] {
            let rgb = conv.ycbcr_to_rgb(yc, 128.0, 128.0);
            assert!(rgb.iter().all(|&v| (v - want).abs() < 1e-6), "{rgb:?}");
        }
        // Pure red, BT.709 limited: (63, 102, 240) (unrounded 62.56, 102.34, 240).
        let red = conv.rgb_to_ycbcr([1.0, 0.0, 0.0]);
        let want = [
            16.0 + 219.0 * 0.2126,
            128.0 - 224.0 * 0.2126 / 1.8556,
            240.0,
        ];
        for (g, w) in red.iter().zip(want) {
            assert!((g - w).abs() < 1e-3, "{red:?}");
        }
        assert_eq!(red.map(to_code), [63, 102, 240]);
        c.matrix = ColorMatrix::Bt601;
        let conv = FrameConverter::new(c).unwrap();
        assert_eq!(
            conv.rgb_to_ycbcr([1.0, 0.0, 0.0]).map(to_code),
            [81, 90, 240]
        );
        assert_eq!(
            conv.rgb_to_ycbcr([0.0, 1.0, 0.0]).map(to_code),
            [145, 54, 34]
        );
        assert_eq!(
            conv.rgb_to_ycbcr([0.0, 0.0, 1.0]).map(to_code),
            [41, 240, 110]
        );
        c.range = ColorRange::Full;
        let conv = FrameConverter::new(c).unwrap();
        assert_eq!(
            conv.rgb_to_ycbcr([1.0, 1.0, 1.0]).map(to_code),
            [255, 128, 128]
        );
        // JFIF red: Y 76.2, Cb 84.97, Cr 255.5 → clamped 255.
        assert_eq!(
            conv.rgb_to_ycbcr([1.0, 0.0, 0.0]).map(to_code),
            [76, 85, 255]
        );
    }

    #[test]
    fn a_red_frame_packs_to_the_reference_codes() {
        let mut conv = FrameConverter::new(config(4, 2)).unwrap();
        let mut t = conv.new_tensor();
        // NHWC in −1..1: red = (1, −1, −1) everywhere (padding included).
        for px in t.data.chunks_exact_mut(3) {
            px.copy_from_slice(&[1.0, -1.0, -1.0]);
        }
        let (mut y, mut uv) = (vec![0u8; 8], vec![0u8; 4]);
        conv.from_tensor(&t, &mut y, 4, &mut uv, 4).unwrap();
        assert_eq!(y, [63; 8]);
        assert_eq!(uv, [102, 240, 102, 240]);
        // And back: the tensor holds red again.
        conv.to_tensor(&y, 4, &uv, 4, &mut t).unwrap();
        let px = &t.data[..3];
        assert!(
            (px[0] - 1.0).abs() < 0.01 && (px[1] + 1.0).abs() < 0.01,
            "{px:?}"
        );
    }

    #[test]
    fn sizes_scale_round_and_pad_up() {
        let mut c = config(1920, 1080);
        c.multiple = 16;
        let conv = FrameConverter::new(c).unwrap();
        assert_eq!(conv.scaled_size(), (1080, 1920));
        assert_eq!(conv.network_size(), (1088, 1920));
        assert_eq!(conv.tensor_shape(), [1, 1088, 1920, 3]);
        c.scale = 0.5;
        c.layout = TensorLayout::Nchw;
        let conv = FrameConverter::new(c).unwrap();
        assert_eq!(conv.scaled_size(), (540, 960));
        assert_eq!(conv.network_size(), (544, 960));
        assert_eq!(conv.tensor_shape(), [1, 3, 544, 960]);
        // 0.3·1918 = 575.4 → 575, 0.3·1082 = 324.6 → 325.
        let c = ConverterConfig {
            width: 1918,
            height: 1082,
            scale: 0.3,
            multiple: 8,
            ..c
        };
        let conv = FrameConverter::new(c).unwrap();
        assert_eq!(conv.scaled_size(), (325, 575));
        assert_eq!(conv.network_size(), (328, 576));
        assert_eq!(scaled_dimension(2, 0.25), 1);
        assert_eq!(scaled_dimension(6, 0.25), 2); // 1.5 rounds away from zero
    }

    #[test]
    fn bad_configurations_are_refused() {
        let c = config(64, 64);
        for bad in [
            ConverterConfig { scale: 0.2, ..c },
            ConverterConfig { scale: 1.5, ..c },
            ConverterConfig {
                scale: f64::NAN,
                ..c
            },
            ConverterConfig { multiple: 0, ..c },
            ConverterConfig { width: 63, ..c },
            ConverterConfig { height: 0, ..c },
        ] {
            assert!(FrameConverter::new(bad).is_err(), "{bad:?}");
        }
        let mut conv = FrameConverter::new(c).unwrap();
        let (y, uv) = smooth_nv12(64, 64);
        let mut t = conv.new_tensor();
        assert!(conv.to_tensor(&y[..100], 64, &uv, 64, &mut t).is_err());
        assert!(conv.to_tensor(&y, 32, &uv, 64, &mut t).is_err());
        let wrong = Tensor::zeros(&[1, 64, 64, 4]);
        let (mut yo, mut uvo) = (y.clone(), uv.clone());
        assert!(conv.from_tensor(&wrong, &mut yo, 64, &mut uvo, 64).is_err());
        assert_eq!(yo, y, "a refused frame is not touched");
    }

    #[test]
    fn padding_reflects_rows_and_columns_nhwc_and_nchw() {
        // 20x10 frame, multiple 16 → 32x16: 12 columns and 6 rows of reflection.
        let mut c = config(20, 10);
        c.multiple = 16;
        let (y, uv) = smooth_nv12(20, 10);
        let mut nhwc = FrameConverter::new(c).unwrap();
        let mut a = Tensor::default();
        nhwc.to_tensor(&y, 20, &uv, 20, &mut a).unwrap();
        assert_eq!(a.shape, [1, 16, 32, 3]);
        let at = |t: &Tensor, yy: usize, x: usize, ch: usize| t.data[(yy * 32 + x) * 3 + ch];
        for yy in 0..16 {
            for x in 0..32 {
                let (sy, sx) = (reflect_index(yy, 10), reflect_index(x, 20));
                for ch in 0..3 {
                    assert_eq!(at(&a, yy, x, ch), at(&a, sy, sx, ch));
                }
            }
        }
        // Mirror pairs around the last row/column: row 10 = row 8, column 21 = column 17.
        assert_eq!(at(&a, 10, 3, 0), at(&a, 8, 3, 0));
        assert_eq!(at(&a, 4, 21, 2), at(&a, 4, 17, 2));
        assert_ne!(at(&a, 4, 20, 2), at(&a, 4, 19, 2), "edge not repeated");
        c.layout = TensorLayout::Nchw;
        let mut nchw = FrameConverter::new(c).unwrap();
        let mut b = nchw.new_tensor();
        nchw.to_tensor(&y, 20, &uv, 20, &mut b).unwrap();
        assert_eq!(b.shape, [1, 3, 16, 32]);
        for ch in 0..3 {
            for yy in 0..16 {
                for x in 0..32 {
                    assert_eq!(b.data[(ch * 16 + yy) * 32 + x], at(&a, yy, x, ch));
                }
            }
        }
    }

    #[test]
    fn value_ranges_map_as_specified() {
        let (y, uv) = smooth_nv12(16, 8);
        let mut tensors = Vec::new();
        for vr in [
            ValueRange::ZeroToOne,
            ValueRange::MinusOneToOne,
            ValueRange::ZeroTo255,
        ] {
            let mut conv = FrameConverter::new(ConverterConfig {
                value_range: vr,
                ..config(16, 8)
            })
            .unwrap();
            let mut t = conv.new_tensor();
            conv.to_tensor(&y, 16, &uv, 16, &mut t).unwrap();
            // The output side inverts the mapping: same codes back.
            let (mut yo, mut uvo) = (vec![0; y.len()], vec![0; uv.len()]);
            conv.from_tensor(&t, &mut yo, 16, &mut uvo, 16).unwrap();
            assert_eq!(yo, y);
            tensors.push(t);
        }
        for i in 0..tensors[0].len() {
            let x = tensors[0].data[i];
            assert!((tensors[1].data[i] - (2.0 * x - 1.0)).abs() < 1e-6);
            assert!((tensors[2].data[i] - 255.0 * x).abs() < 1e-4);
        }
        // Limited-range black/white map to the ends of each range.
        let mut conv = FrameConverter::new(config(2, 2)).unwrap();
        let mut t = conv.new_tensor();
        conv.to_tensor(&[16, 235, 16, 235], 2, &[128, 128], 2, &mut t)
            .unwrap();
        for (g, w) in t.data[..6].iter().zip([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]) {
            assert!((g - w).abs() < 1e-6, "{:?}", &t.data[..6]);
        }
    }

    #[test]
    fn flat_frames_survive_any_scale_exactly() {
        for scale in [0.25, 0.4, 0.5, 0.77, 1.0] {
            let mut conv = FrameConverter::new(ConverterConfig {
                scale,
                ..config(38, 22)
            })
            .unwrap();
            let y = vec![90u8; 38 * 22];
            let uv: Vec<u8> = (0..38 * 11)
                .map(|i| if i % 2 == 0 { 100 } else { 150 })
                .collect();
            let mut t = conv.new_tensor();
            conv.to_tensor(&y, 38, &uv, 38, &mut t).unwrap();
            let (mut yo, mut uvo) = (vec![0; y.len()], vec![0; uv.len()]);
            conv.from_tensor(&t, &mut yo, 38, &mut uvo, 38).unwrap();
            assert_eq!((yo, uvo), (y.clone(), uv), "scale {scale}");
        }
    }

    #[test]
    fn area_and_bilinear_weights() {
        // 5 → 2: [0, 2.5) and [2.5, 5): weights 0.4 0.4 0.2 / 0.2 0.4 0.4.
        let a = Resampler::area(5, 2);
        assert_eq!(a.taps, [(0, 0, 3), (2, 3, 3)]);
        for (g, w) in a.weights.iter().zip([0.4, 0.4, 0.2, 0.2, 0.4, 0.4]) {
            assert!((g - w).abs() < 1e-6);
        }
        // 2 → 4: centres at -0.25 (clamped), 0.25, 0.75, 1.25 (clamped).
        let b = Resampler::bilinear(2, 4);
        let vals: Vec<f32> = (0..4).map(|i| b.sample(i, |j| [0.0, 1.0][j])).collect();
        assert_eq!(vals, [0.0, 0.25, 0.75, 1.0]);
    }

    #[test]
    fn scaling_taps_list_the_converters_resamplers() {
        let [down_x, down_y, up_x, up_y] = scaling_taps(5, 8, 2, 4);
        assert_eq!(down_x.len(), 2);
        assert_eq!(down_x[1].first, 2);
        for (g, w) in down_x[1].weights.iter().zip([0.2, 0.4, 0.4]) {
            assert!((g - w).abs() < 1e-6);
        }
        // 8 → 4: pairs of equal weight
        assert!(
            down_y
                .iter()
                .enumerate()
                .all(|(i, t)| t.first == 2 * i && t.weights == [0.5, 0.5])
        );
        assert_eq!(up_x.len(), 5);
        assert_eq!(up_y.len(), 8);
        // every tap list sums to 1 and stays inside its input
        for (taps, input) in [(&down_x, 5), (&down_y, 8), (&up_x, 2), (&up_y, 4)] {
            for t in taps.iter() {
                assert!(t.first + t.weights.len() <= input);
                assert!((t.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            }
        }
        // at the smallest model-scale an area sample covers at most 5 inputs
        let [down_x, ..] = scaling_taps(1918, 8, scaled_dimension(1918, 0.25), 2);
        assert!(down_x.iter().all(|t| t.weights.len() <= 5));
    }

    #[test]
    fn chroma_upsampling_is_centred() {
        // One chroma row [A | B] over 4 luma columns: 3/4–1/4 weights, edges repeated.
        let mut conv = FrameConverter::new(ConverterConfig {
            layout: TensorLayout::Nchw,
            value_range: ValueRange::ZeroToOne,
            ..config(4, 2)
        })
        .unwrap();
        let mut t = conv.new_tensor();
        conv.to_tensor(&[126; 8], 4, &[128, 48, 128, 208], 4, &mut t)
            .unwrap();
        // Bilinear gives Cr 48, 88, 168, 208 across the four luma columns; the block correction
        // is ∓(208 − 48)/8 = ∓20, so the pair means are 48 and 208 again.
        // R − Y = 2(1−Kr)·(Cr−128)/224.
        let y = (126.0 - 16.0) / 219.0;
        for (x, cr) in [28.0, 68.0, 188.0, 228.0].into_iter().enumerate() {
            let want = y + 2.0 * (1.0 - 0.2126) * (cr - 128.0) / 224.0;
            assert!((t.data[x] - want).abs() < 1e-5, "column {x}");
        }
    }
}
