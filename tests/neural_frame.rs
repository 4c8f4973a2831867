//! The neural stage's frame conversion on real photos: NV12 made by GStreamer's own converter
//! (every matrix and range) → network tensor → NV12.

mod common;

use gst_video::prelude::*;
use gsttoonflow::neural::Tensor;
use gsttoonflow::neural::frame::{
    ColorMatrix, ColorRange, ConverterConfig, FrameConverter, TensorLayout, ValueRange,
};
use gsttoonflow::neural::temporal::{OutputFilter, SceneCutGate};

const PHOTOS: [(&str, usize, usize); 4] = [
    ("astronaut.png", 512, 512),
    ("chelsea.png", 450, 300),
    ("coffee.png", 600, 400),
    ("rocket.jpg", 640, 426),
];

const COLORIMETRIES: [(ColorMatrix, ColorRange); 4] = [
    (ColorMatrix::Bt601, ColorRange::Limited),
    (ColorMatrix::Bt601, ColorRange::Full),
    (ColorMatrix::Bt709, ColorRange::Limited),
    (ColorMatrix::Bt709, ColorRange::Full),
];

/// A photo decoded and scaled by GStreamer to tightly packed 8-bit RGB.
fn rgb_photo(name: &str, width: usize, height: usize) -> Vec<u8> {
    use gst::prelude::*;
    common::init();
    let desc = format!(
        "filesrc location=\"{}\" ! decodebin ! videoconvert ! videoscale ! \
         video/x-raw,format=RGB,width={width},height={height},pixel-aspect-ratio=1/1 ! \
         appsink name=sink sync=false",
        common::fixture(name).display()
    );
    let pipeline = gst::parse::launch(&desc).unwrap();
    let sink = common::app_sink(&pipeline, "sink");
    pipeline.set_state(gst::State::Playing).unwrap();
    let sample = sink.pull_sample().expect("decoded photo");
    let info = gst_video::VideoInfo::from_caps(sample.caps().unwrap()).unwrap();
    let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(sample.buffer().unwrap(), &info)
        .unwrap();
    let stride = frame.plane_stride()[0] as usize;
    let data = frame.plane_data(0).unwrap();
    let mut out = Vec::with_capacity(3 * width * height);
    for r in 0..height {
        out.extend_from_slice(&data[r * stride..r * stride + 3 * width]);
    }
    drop(frame);
    pipeline.set_state(gst::State::Null).unwrap();
    out
}

fn gst_colorimetry(matrix: ColorMatrix, range: ColorRange) -> gst_video::VideoColorimetry {
    use gst_video::{
        VideoColorMatrix, VideoColorPrimaries, VideoColorRange, VideoTransferFunction,
    };
    let m = match matrix {
        ColorMatrix::Bt601 => VideoColorMatrix::Bt601,
        ColorMatrix::Bt709 => VideoColorMatrix::Bt709,
        ColorMatrix::Bt2020 => VideoColorMatrix::Bt2020,
    };
    let r = match range {
        ColorRange::Limited => VideoColorRange::Range16_235,
        ColorRange::Full => VideoColorRange::Range0_255,
    };
    gst_video::VideoColorimetry::new(
        r,
        m,
        VideoTransferFunction::Bt709,
        VideoColorPrimaries::Bt709,
    )
}

/// Tightly packed NV12 (Y plane, UV plane) of an RGB picture, made by GStreamer's
/// VideoConverter with the given colorimetry, centred (JPEG) chroma siting and no dithering.
fn gst_nv12(
    rgb: &[u8],
    width: usize,
    height: usize,
    matrix: ColorMatrix,
    range: ColorRange,
) -> (Vec<u8>, Vec<u8>) {
    common::init();
    let (w, h) = (width as u32, height as u32);
    let in_info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, w, h)
        .build()
        .unwrap();
    let out_info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, w, h)
        .colorimetry(&gst_colorimetry(matrix, range))
        .chroma_site(gst_video::VideoChromaSite::JPEG)
        .build()
        .unwrap();
    let mut config = gst_video::VideoConverterConfig::new();
    config.set_dither_method(gst_video::VideoDitherMethod::None);
    let converter = gst_video::VideoConverter::new(&in_info, &out_info, Some(config)).unwrap();
    let mut src = vec![0u8; in_info.size()];
    let stride = in_info.stride()[0] as usize;
    for r in 0..height {
        src[r * stride..r * stride + 3 * width].copy_from_slice(&rgb[r * 3 * width..][..3 * width]);
    }
    let src = gst_video::VideoFrame::from_buffer_readable(gst::Buffer::from_slice(src), &in_info)
        .unwrap();
    let dst_buf = gst::Buffer::with_size(out_info.size()).unwrap();
    let mut dst = gst_video::VideoFrame::from_buffer_writable(dst_buf, &out_info).unwrap();
    converter.frame(&src, &mut dst);
    let (ys, uvs) = (
        dst.plane_stride()[0] as usize,
        dst.plane_stride()[1] as usize,
    );
    let yp = dst.plane_data(0).unwrap();
    let y: Vec<u8> = (0..height)
        .flat_map(|r| yp[r * ys..r * ys + width].iter().copied())
        .collect();
    let uvp = dst.plane_data(1).unwrap();
    let uv: Vec<u8> = (0..height / 2)
        .flat_map(|r| uvp[r * uvs..r * uvs + width].iter().copied())
        .collect();
    (y, uv)
}

fn config(width: usize, height: usize, matrix: ColorMatrix, range: ColorRange) -> ConverterConfig {
    ConverterConfig {
        width,
        height,
        matrix,
        range,
        layout: TensorLayout::Nhwc,
        value_range: ValueRange::MinusOneToOne,
        multiple: 16,
        scale: 1.0,
    }
}

/// NV12 → tensor → NV12 through one converter.
fn round_trip(conv: &mut FrameConverter, y: &[u8], uv: &[u8], width: usize) -> (Vec<u8>, Vec<u8>) {
    let mut tensor = conv.new_tensor();
    conv.to_tensor(y, width, uv, width, &mut tensor).unwrap();
    let (mut yo, mut uvo) = (vec![0u8; y.len()], vec![0u8; uv.len()]);
    conv.from_tensor(&tensor, &mut yo, width, &mut uvo, width)
        .unwrap();
    (yo, uvo)
}

/// (max |a − b|, fraction of samples with |a − b| ≤ 1, fraction ≤ 2).
fn diff_stats(a: &[u8], b: &[u8]) -> (u8, f64, f64) {
    let mut max = 0u8;
    let (mut le1, mut le2) = (0usize, 0usize);
    for (&x, &y) in a.iter().zip(b) {
        let d = x.abs_diff(y);
        max = max.max(d);
        le1 += (d <= 1) as usize;
        le2 += (d <= 2) as usize;
    }
    let n = a.len() as f64;
    (max, le1 as f64 / n, le2 as f64 / n)
}

fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let mse = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum::<f64>()
        / a.len() as f64;
    10.0 * (255.0f64 * 255.0 / mse.max(1e-12)).log10()
}

#[test]
fn round_trip_at_scale_1_gives_the_input_back() {
    for (name, w, h) in PHOTOS {
        let rgb = rgb_photo(name, w, h);
        for (matrix, range) in COLORIMETRIES {
            let (y, uv) = gst_nv12(&rgb, w, h, matrix, range);
            let mut conv = FrameConverter::new(config(w, h, matrix, range)).unwrap();
            let (yo, uvo) = round_trip(&mut conv, &y, &uv, w);
            let (y_max, y_le1, _) = diff_stats(&y, &yo);
            let (c_max, c_le1, c_le2) = diff_stats(&uv, &uvo);
            println!(
                "{name} {matrix:?} {range:?}: luma max {y_max} (≤1: {:.4}%), chroma max {c_max} \
                 (≤1: {:.3}%, ≤2: {:.3}%)",
                100.0 * y_le1,
                100.0 * c_le1,
                100.0 * c_le2
            );
            // Bit-exact: luma because RGB is not clamped (Y = Kr·R + Kg·G + Kb·B undoes the
            // matrix to within f32 rounding, far below half a code), chroma because the
            // block-corrected upsampler is the exact right-inverse of the 2x2 mean.
            assert_eq!(y_max, 0, "luma comes back exactly");
            assert_eq!(
                c_max, 0,
                "chroma comes back exactly ({c_le1} within 1 code)"
            );
        }
    }
}

/// The converter's RGB (unpadded, 0..1, NHWC) of an NV12 frame, in 8-bit code units.
fn converter_rgb(
    y: &[u8],
    uv: &[u8],
    w: usize,
    h: usize,
    matrix: ColorMatrix,
    range: ColorRange,
) -> Vec<f32> {
    let mut conv = FrameConverter::new(ConverterConfig {
        value_range: ValueRange::ZeroToOne,
        multiple: 1,
        ..config(w, h, matrix, range)
    })
    .unwrap();
    let mut t = Tensor::default();
    conv.to_tensor(y, w, uv, w, &mut t).unwrap();
    assert_eq!(t.shape, [1, h, w, 3]);
    t.data.iter().map(|v| 255.0 * v).collect()
}

fn mean_abs(a: &[f32], b: &[u8]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .sum::<f64>()
        / a.len() as f64
}

#[test]
fn the_matrix_and_range_agree_with_gstreamer() {
    // GStreamer encodes the photo's RGB with each colorimetry; the converter must decode it
    // back close to the source RGB (what remains is chroma subsampling at edges), and clearly
    // closer than with the other matrix or range.
    let (name, w, h) = PHOTOS[2];
    let rgb = rgb_photo(name, w, h);
    for (matrix, range) in COLORIMETRIES {
        let (y, uv) = gst_nv12(&rgb, w, h, matrix, range);
        let right = mean_abs(&converter_rgb(&y, &uv, w, h, matrix, range), &rgb);
        let other_matrix = match matrix {
            ColorMatrix::Bt601 => ColorMatrix::Bt709,
            _ => ColorMatrix::Bt601,
        };
        let other_range = match range {
            ColorRange::Limited => ColorRange::Full,
            ColorRange::Full => ColorRange::Limited,
        };
        let wrong_matrix = mean_abs(&converter_rgb(&y, &uv, w, h, other_matrix, range), &rgb);
        let wrong_range = mean_abs(&converter_rgb(&y, &uv, w, h, matrix, other_range), &rgb);
        println!(
            "{name} {matrix:?} {range:?}: mean |RGB error| {right:.3} codes \
             (wrong matrix {wrong_matrix:.3}, wrong range {wrong_range:.3})"
        );
        assert!(right < 2.5, "mean error {right}");
        assert!(wrong_matrix > 2.0 * right && wrong_range > 2.0 * right);
    }
}

#[test]
fn flat_colour_patches_match_gstreamer_codes() {
    // 16x16 patches of colours taken from a photo: inside a patch chroma subsampling loses
    // nothing, so GStreamer's codes are its matrix alone. Its 8-bit path is fixed point and
    // truncates where we round (grey 254 becomes Y 253 in BT.709 full range): its codes lie
    // up to 1.72 below our unrounded values; the other matrix misses by 9 codes or more.
    let (name, pw, ph) = PHOTOS[0];
    let photo = rgb_photo(name, pw, ph);
    let (w, h, tile) = (128, 64, 16);
    let mut rgb = vec![0u8; 3 * w * h];
    for yy in 0..h {
        for x in 0..w {
            let t = (yy / tile) * (w / tile) + x / tile;
            let src = 3 * ((t * 97 % ph) * pw + t * 61 % pw);
            rgb[3 * (yy * w + x)..][..3].copy_from_slice(&photo[src..src + 3]);
        }
    }
    let centres: Vec<(usize, usize)> = (0..(w / tile) * (h / tile))
        .map(|t| ((t / (w / tile)) * tile + 8, (t % (w / tile)) * tile + 8))
        .collect();
    for (matrix, range) in COLORIMETRIES {
        let (y, uv) = gst_nv12(&rgb, w, h, matrix, range);
        let worst_code_error = |matrix: ColorMatrix| {
            let conv = FrameConverter::new(config(w, h, matrix, range)).unwrap();
            let mut worst = 0.0f32;
            for &(yy, x) in &centres {
                let i = yy * w + x;
                let px = [0, 1, 2].map(|c| rgb[3 * i + c] as f32 / 255.0);
                let exact = conv.rgb_to_ycbcr(px);
                let ci = (yy / 2) * w + 2 * (x / 2);
                for (e, g) in exact.iter().zip([y[i], uv[ci], uv[ci + 1]]) {
                    worst = worst.max((e - g as f32).abs());
                }
            }
            worst
        };
        let other = match matrix {
            ColorMatrix::Bt601 => ColorMatrix::Bt709,
            _ => ColorMatrix::Bt601,
        };
        let (right, wrong) = (worst_code_error(matrix), worst_code_error(other));
        // Decoding the interiors back to RGB: the quantization of three codes remains, biased
        // by GStreamer's truncation (≈ −0.5 code each, amplified up to 1.8x into R and B).
        let ours = converter_rgb(&y, &uv, w, h, matrix, range);
        let (mut max, mut sum, mut n) = (0.0f32, 0.0f64, 0usize);
        for yy in (0..h).filter(|v| (2..tile - 2).contains(&(v % tile))) {
            for x in (0..w).filter(|v| (2..tile - 2).contains(&(v % tile))) {
                for c in 0..3 {
                    let i = 3 * (yy * w + x) + c;
                    let d = (ours[i] - rgb[i] as f32).abs();
                    max = max.max(d);
                    sum += d as f64;
                    n += 1;
                }
            }
        }
        let mean = sum / n as f64;
        println!(
            "patches {matrix:?} {range:?}: GStreamer codes within {right:.3} of ours \
             (other matrix {wrong:.2}); decoded RGB error mean {mean:.3}, max {max:.3} codes"
        );
        assert!(right <= 2.0, "{right}");
        assert!(wrong > 5.0, "{wrong}");
        assert!(mean <= 1.5 && max <= 4.5, "mean {mean}, max {max}");
    }
}

#[test]
fn model_scale_round_trip_psnr() {
    for (name, w, h) in PHOTOS {
        let rgb = rgb_photo(name, w, h);
        let (y, uv) = gst_nv12(&rgb, w, h, ColorMatrix::Bt709, ColorRange::Limited);
        let mut figures = Vec::new();
        for scale in [0.25, 0.5, 0.75] {
            let mut conv = FrameConverter::new(ConverterConfig {
                scale,
                ..config(w, h, ColorMatrix::Bt709, ColorRange::Limited)
            })
            .unwrap();
            let (yo, uvo) = round_trip(&mut conv, &y, &uv, w);
            let (py, pc) = (psnr(&y, &yo), psnr(&uv, &uvo));
            figures.push(py);
            println!(
                "{name} {w}x{h} model-scale {scale} (network {:?}): PSNR luma {py:.2} dB, chroma {pc:.2} dB",
                conv.network_size()
            );
        }
        // Less detail survives a smaller network size, and half size still resembles the input.
        assert!(
            figures[0] < figures[1] && figures[1] < figures[2],
            "{figures:?}"
        );
        assert!(figures[1] > 25.0, "{figures:?}");
    }
}

#[test]
fn nhwc_and_nchw_hold_the_same_values_transposed() {
    let (name, w, h) = PHOTOS[1];
    let rgb = rgb_photo(name, w, h);
    let (y, uv) = gst_nv12(&rgb, w, h, ColorMatrix::Bt601, ColorRange::Limited);
    for scale in [1.0, 0.6] {
        let cfg = ConverterConfig {
            scale,
            ..config(w, h, ColorMatrix::Bt601, ColorRange::Limited)
        };
        let mut nhwc = FrameConverter::new(cfg).unwrap();
        let mut nchw = FrameConverter::new(ConverterConfig {
            layout: TensorLayout::Nchw,
            ..cfg
        })
        .unwrap();
        let (mut a, mut b) = (Tensor::default(), Tensor::default());
        nhwc.to_tensor(&y, w, &uv, w, &mut a).unwrap();
        nchw.to_tensor(&y, w, &uv, w, &mut b).unwrap();
        let (ph, pw) = nhwc.network_size();
        assert_eq!(a.shape, [1, ph, pw, 3]);
        assert_eq!(b.shape, [1, 3, ph, pw]);
        for c in 0..3 {
            for yy in 0..ph {
                for x in 0..pw {
                    assert_eq!(
                        a.data[(yy * pw + x) * 3 + c],
                        b.data[(c * ph + yy) * pw + x]
                    );
                }
            }
        }
        // And both come back to the same NV12.
        let mut outs = Vec::new();
        for (conv, t) in [(&mut nhwc, &a), (&mut nchw, &b)] {
            let (mut yo, mut uvo) = (vec![0u8; y.len()], vec![0u8; uv.len()]);
            conv.from_tensor(t, &mut yo, w, &mut uvo, w).unwrap();
            outs.push((yo, uvo));
        }
        assert_eq!(outs[0], outs[1]);
    }
}

#[test]
fn padding_of_a_photo_mirrors_its_last_rows_and_columns() {
    // 450x300 at multiple 16 → 464x304: 14 columns and 4 rows of reflection.
    let (name, w, h) = PHOTOS[1];
    let rgb = rgb_photo(name, w, h);
    let (y, uv) = gst_nv12(&rgb, w, h, ColorMatrix::Bt709, ColorRange::Full);
    let mut conv = FrameConverter::new(config(w, h, ColorMatrix::Bt709, ColorRange::Full)).unwrap();
    let mut t = conv.new_tensor();
    conv.to_tensor(&y, w, &uv, w, &mut t).unwrap();
    let (ph, pw) = conv.network_size();
    assert_eq!((ph, pw), (304, 464));
    let at = |yy: usize, x: usize, c: usize| t.data[(yy * pw + x) * 3 + c];
    for c in 0..3 {
        for k in 1..=(pw - w) {
            for yy in 0..ph {
                assert_eq!(
                    at(yy, w - 1 + k, c),
                    at(yy, w - 1 - k, c),
                    "column {}",
                    w - 1 + k
                );
            }
        }
        for k in 1..=(ph - h) {
            for x in 0..pw {
                assert_eq!(
                    at(h - 1 + k, x, c),
                    at(h - 1 - k, x, c),
                    "row {}",
                    h - 1 + k
                );
            }
        }
    }
}

#[test]
fn strided_planes_convert_like_packed_ones() {
    let (name, w, h) = PHOTOS[3];
    let rgb = rgb_photo(name, w, h);
    let (y, uv) = gst_nv12(&rgb, w, h, ColorMatrix::Bt709, ColorRange::Limited);
    let stride = w + 24;
    let mut ys = vec![7u8; stride * h];
    let mut uvs = vec![7u8; stride * h / 2];
    for r in 0..h {
        ys[r * stride..][..w].copy_from_slice(&y[r * w..][..w]);
    }
    for r in 0..h / 2 {
        uvs[r * stride..][..w].copy_from_slice(&uv[r * w..][..w]);
    }
    let cfg = ConverterConfig {
        scale: 0.5,
        ..config(w, h, ColorMatrix::Bt709, ColorRange::Limited)
    };
    let mut conv = FrameConverter::new(cfg).unwrap();
    let (mut a, mut b) = (conv.new_tensor(), conv.new_tensor());
    conv.to_tensor(&y, w, &uv, w, &mut a).unwrap();
    conv.to_tensor(&ys, stride, &uvs, stride, &mut b).unwrap();
    assert_eq!(a, b);
    let (mut yo, mut uvo) = (vec![0u8; y.len()], vec![0u8; uv.len()]);
    conv.from_tensor(&a, &mut yo, w, &mut uvo, w).unwrap();
    let (mut yso, mut uvso) = (vec![7u8; ys.len()], vec![7u8; uvs.len()]);
    conv.from_tensor(&a, &mut yso, stride, &mut uvso, stride)
        .unwrap();
    for r in 0..h {
        assert_eq!(yso[r * stride..][..w], yo[r * w..][..w]);
        assert!(
            yso[r * stride + w..(r + 1) * stride]
                .iter()
                .all(|&v| v == 7),
            "row padding untouched"
        );
    }
    for r in 0..h / 2 {
        assert_eq!(uvso[r * stride..][..w], uvo[r * w..][..w]);
    }
}

/// Runs NV12 frames through the converter, an identity "network" and the output filter the
/// way the element does (filter between `read_output` and `write_nv12`); returns the output
/// frames (packed).
fn filtered_clip(
    frames: &[common::Nv12],
    scale: f64,
    history: usize,
    strength: f32,
    sigma: f32,
) -> Vec<common::Nv12> {
    let (w, h) = (frames[0].width, frames[0].height);
    let mut conv = FrameConverter::new(ConverterConfig {
        scale,
        ..config(w, h, ColorMatrix::Bt709, ColorRange::Limited)
    })
    .unwrap();
    let (sh, sw) = conv.scaled_size();
    let mut filter = OutputFilter::new(sw, sh, history, ColorMatrix::Bt709, ColorRange::Limited);
    filter.set_params(history, strength, sigma);
    let mut tensor = conv.new_tensor();
    frames
        .iter()
        .map(|f| {
            conv.to_tensor(f.y(), w, f.uv(), w, &mut tensor).unwrap();
            conv.read_output(&tensor).unwrap();
            filter.apply(conv.network_rgb_mut()).unwrap();
            let mut out = common::Nv12::new(w, h);
            let (y, uv) = out.data.split_at_mut(w * h);
            conv.write_nv12(y, w, uv, w).unwrap();
            out
        })
        .collect()
}

/// Mean |Δ| of the Y planes between consecutive frames, from frame `from` on.
fn luma_flicker(frames: &[common::Nv12], from: usize) -> f64 {
    let pairs = frames[from.max(1) - 1..].windows(2);
    let n = pairs.len() as f64;
    pairs
        .map(|p| common::mean_abs_diff(p[0].y(), p[1].y()))
        .sum::<f64>()
        / n
}

#[test]
fn the_output_filter_halves_the_flicker_of_a_static_noisy_clip() {
    let (w, h) = (320, 240);
    let clean = common::photo("chelsea.png", w, h);
    let frames: Vec<common::Nv12> = (0..10).map(|t| clean.with_noise(2.0, 100 + t)).collect();
    let bare = luma_flicker(&frames, 5);
    for scale in [1.0, 0.5] {
        let off = filtered_clip(&frames, scale, 0, 0.6, 3.0);
        let on = filtered_clip(&frames, scale, 4, 0.6, 3.0);
        let (f_off, f_on) = (luma_flicker(&off, 5), luma_flicker(&on, 5));
        let err_off = common::mean_abs_diff(off[9].y(), clean.y());
        let err_on = common::mean_abs_diff(on[9].y(), clean.y());
        println!(
            "static noisy clip (σ 2 codes) model-scale {scale}: luma change per frame {f_on:.3} \
             filtered vs {f_off:.3} unfiltered (input {bare:.3}); |out − clean| {err_on:.3} vs {err_off:.3}"
        );
        if scale == 1.0 {
            assert_eq!(
                off.iter().map(|f| &f.data).collect::<Vec<_>>(),
                frames.iter().map(|f| &f.data).collect::<Vec<_>>(),
                "history 0 and scale 1: the identity network gives the input back"
            );
        }
        assert!(f_on <= 0.5 * f_off, "{f_on} vs {f_off}");
        assert!(err_on < err_off);
    }
}

#[test]
fn a_moving_photo_leaves_no_ghost() {
    // A window sliding 12 pixels per frame over a photo: pixels that moved far beyond
    // motion-sigma show the current frame, not a blend with the past.
    let (w, h, step) = (256, 192, 12);
    let big = rgb_photo("coffee.png", 600, 400);
    let frames: Vec<Vec<f32>> = (0..6)
        .map(|t| {
            let mut planes = vec![0.0f32; 3 * w * h];
            for y in 0..h {
                for x in 0..w {
                    for c in 0..3 {
                        let v = big[3 * ((y + 100) * 600 + x + 100 + step * t) + c];
                        planes[c * w * h + y * w + x] = v as f32 / 255.0;
                    }
                }
            }
            planes
        })
        .collect();
    let conv = FrameConverter::new(config(w, h, ColorMatrix::Bt709, ColorRange::Limited)).unwrap();
    let (sigma, history) = (3.0f32, 4usize);
    // The joint distance in L units (100/255 per code of Y, Cb, Cr).
    let distance = |a: &[f32], b: &[f32], i: usize| {
        let p = |f: &[f32]| [f[i], f[w * h + i], f[2 * w * h + i]];
        let (ya, yb) = (conv.rgb_to_ycbcr(p(a)), conv.rgb_to_ycbcr(p(b)));
        (0..3)
            .map(|c| (100.0 * (ya[c] - yb[c]) / 255.0).powi(2))
            .sum::<f32>()
            .sqrt()
    };
    let mut filter = OutputFilter::new(w, h, history, ColorMatrix::Bt709, ColorRange::Limited);
    filter.set_params(history, 0.9, sigma);
    let (mut moved, mut still_blended) = (0usize, 0usize);
    for t in 0..frames.len() {
        let mut out = frames[t].clone();
        let used = filter.apply(&mut out).unwrap();
        for i in 0..w * h {
            let nearest = (1..=used)
                .map(|k| distance(&frames[t], &frames[t - k], i))
                .fold(f32::INFINITY, f32::min);
            if nearest > 6.0 * sigma {
                moved += 1;
                for c in 0..3 {
                    let j = c * w * h + i;
                    if (out[j] - frames[t][j]).abs() > 1e-4 {
                        still_blended += 1;
                    }
                }
            }
        }
    }
    println!("moving photo: {moved} pixel-frames moved by more than 6σ, {still_blended} blended");
    assert!(moved > w * h, "the clip moves ({moved})");
    assert_eq!(still_blended, 0);
}

#[test]
fn the_scene_gate_sees_a_cut_between_photos_not_noise() {
    let (w, h) = (320, 240);
    let a = common::photo("chelsea.png", w, h);
    let b = common::photo("rocket.jpg", w, h);
    let mut gate = SceneCutGate::new(w, h);
    let threshold = 12.0; // the classic scene-cut-threshold default
    for t in 0..4 {
        let cut = gate.observe(a.with_noise(3.0, t).y(), w, threshold);
        assert!(!cut.cut && cut.score < 2.0, "{cut:?}");
    }
    let cut = gate.observe(b.y(), w, threshold);
    println!("scene cut chelsea → rocket: score {:.1}", cut.score);
    assert!(cut.cut, "{cut:?}");
}
