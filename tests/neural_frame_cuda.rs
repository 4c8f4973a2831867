//! The neural element's frame path on the device (kernels/neural_frame.cu through
//! `cuda::neural_frame::DeviceFrames` around a `NeuralGpu`) against its CPU reference
//! (src/neural/frame.rs, src/neural/temporal.rs), on the photos of tests/data:
//!
//! - NV12 → the network's input: the device tensor against `FrameConverter::to_tensor`;
//! - the network's output → the temporal output filter → NV12: the device frame against
//!   `read_output` + `OutputFilter::apply` + `write_nv12` on the same network output, within
//!   1 code value; the scene gate's verdict and score against `SceneCutGate`;
//! - temporal behaviour on the GPU: on a static noisy clip the frame-to-frame change of the
//!   output with the smoothing on (output filter and statistics smoothing) is at most half of
//!   the bare network's; a scene cut resets both (the cut frame equals the bare network's).
//!
//! At model-scale 1 and below (0.5, and 0.4 with odd content sizes and uneven area weights):
//! the down- and upscaling around the network are checked the same way.
//!
//! The element with CUDA memory (nvcodec's cudaupload/cudadownload around `toonflow model=`):
//! the same frames as with system memory on both pads, no PCIe copy in the stats for a side in
//! device memory, at model-scale 1 and 0.5.
//!
//! Eager frames and graph replays are both covered (graphs are captured after the warm-up).
//! Without a GPU every test prints that it skipped, and why. Figures are printed
//! (`--nocapture`).

mod common;
mod cuda_common;
#[path = "common/onnx_models.rs"]
mod onnx_models;

use cuda_common::{
    Frame, PHOTOS, Rng, assert_same_bits, cuda_or_skip, load_photo, max_abs_diff_f32,
};
use gst::prelude::*;
use gsttoonflow::cuda::neural::program::Storage;
use gsttoonflow::cuda::neural::{DeviceFrameIo, NeuralGpu};
use gsttoonflow::cuda::neural_frame::{DeviceFrames, FilterSettings};
use gsttoonflow::cuda::{FrameSource, FrameTarget};
use gsttoonflow::neural::Tensor;
use gsttoonflow::neural::engine::NeuralModel;
use gsttoonflow::neural::frame::{
    ColorMatrix, ColorRange, ConverterConfig, FrameConverter, ValueRange,
};
use gsttoonflow::neural::onnx::encode_model;
use gsttoonflow::neural::temporal::{OutputFilter, SceneCut, SceneCutGate};

/// Not a multiple of 16 in height: the bottom rows are reflect padding.
const W: usize = 320;
const H: usize = 232;
const THRESHOLD: f32 = 12.0;

fn settings(history: usize) -> FilterSettings {
    FilterSettings {
        history,
        strength: 0.6,
        motion_sigma: 3.0,
        scene_cut_threshold: THRESHOLD,
    }
}

fn model() -> NeuralModel {
    NeuralModel::from_bytes(&encode_model(&onnx_models::tiny_like()), "tiny_like.onnx").unwrap()
}

fn config(
    model: &NeuralModel,
    matrix: ColorMatrix,
    range: ColorRange,
    scale: f64,
) -> ConverterConfig {
    ConverterConfig {
        width: W,
        height: H,
        matrix,
        range,
        layout: model.input_layout(),
        value_range: ValueRange::MinusOneToOne,
        multiple: model.size_multiple(),
        scale,
    }
}

/// A network (fp32 storage) and the frame path around it on device 0; `probe` is a second
/// frame path on the same network for reading the input conversion before the network runs
/// (the network's layers reuse the input's memory).
struct Rig {
    gpu: NeuralGpu,
    frames: DeviceFrames,
    probe: DeviceFrames,
    converter: FrameConverter,
}

impl Rig {
    fn new(model: &NeuralModel, config: ConverterConfig, history: usize, graph: bool) -> Rig {
        let converter = FrameConverter::new(config).unwrap();
        let (h, w) = converter.network_size();
        let spec = model.specialise(h, w).unwrap();
        let storage = Storage::uniform(spec.stage_count(), false);
        let gpu = NeuralGpu::new(0, &spec, &storage, 0, graph).unwrap();
        let frames = || {
            DeviceFrames::new(
                gpu.context(),
                &config,
                gpu.program(),
                (h, w),
                settings(history),
            )
            .unwrap()
        };
        Rig {
            frames: frames(),
            probe: frames(),
            gpu,
            converter,
        }
    }

    /// One frame through the device path: the output, the gate's verdict, the ring entries
    /// the filter used.
    fn run(&mut self, input: &Frame) -> (Frame, SceneCut, usize) {
        let mut out = Frame::new(W, H);
        let (view, mut target) = (input.view(), out.view_mut());
        let mut job = self
            .frames
            .job(FrameSource::Host(&view), FrameTarget::Host(&mut target));
        self.gpu.run_device(&mut job).unwrap();
        let (cut, used) = job.conclude();
        (out, cut, used)
    }

    /// The network's input as the device converts `input` (through `probe`, eagerly).
    fn converted(&mut self, input: &Frame) -> Tensor<f32> {
        let mut out = Frame::new(W, H);
        let (view, mut target) = (input.view(), out.view_mut());
        let stream = self.gpu.stream().clone();
        let mut job = self
            .probe
            .job(FrameSource::Host(&view), FrameTarget::Host(&mut target));
        job.upload(&stream).unwrap();
        job.before(&stream).unwrap();
        let mut t = self.converter.new_tensor();
        self.probe.read_input(&stream, &mut t.data).unwrap();
        t
    }

    /// The network's output of the last frame.
    fn network_output(&self) -> Tensor<f32> {
        let mut t = self.converter.new_tensor();
        self.frames
            .read_output(self.gpu.stream(), &mut t.data)
            .unwrap();
        t
    }
}

/// `photo` with noise of ±`noise` codes on every byte (luma and chroma; a new draw per seed).
fn noisy(photo: &Frame, noise: u64, seed: u64) -> Frame {
    let mut f = photo.clone();
    let mut rng = Rng((seed + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for _ in 0..8 {
        rng.next();
    }
    for v in &mut f.data {
        let n = (rng.next() % (2 * noise + 1)) as i32 - noise as i32;
        *v = (*v as i32 + n).clamp(0, 255) as u8;
    }
    f
}

fn max_abs_diff(a: &[u8], b: &[u8]) -> (u8, usize) {
    let mut worst = 0;
    let mut differing = 0;
    for (x, y) in a.iter().zip(b) {
        let d = x.abs_diff(*y);
        worst = worst.max(d);
        differing += (d > 0) as usize;
    }
    (worst, differing)
}

/// Mean absolute change of the NV12 codes between consecutive frames.
fn flicker(frames: &[Frame]) -> f64 {
    let pairs = frames.windows(2);
    let n = pairs.len() as f64;
    pairs
        .map(|p| common::mean_abs_diff(&p[0].data, &p[1].data))
        .sum::<f64>()
        / n
}

#[test]
fn device_conversions_and_filter_match_the_cpu_reference_on_photos() {
    match_the_cpu_reference(&[
        (ColorMatrix::Bt709, ColorRange::Limited, 1.0),
        (ColorMatrix::Bt601, ColorRange::Full, 1.0),
    ]);
}

#[test]
fn scaled_device_conversions_and_filter_match_the_cpu_reference_on_photos() {
    // 0.5: 160x116 content; 0.4: 128x93 (odd height, area weights of 0.4/0.6 coverage)
    match_the_cpu_reference(&[
        (ColorMatrix::Bt709, ColorRange::Limited, 0.5),
        (ColorMatrix::Bt601, ColorRange::Full, 0.4),
    ]);
}

/// For each (matrix, range, model-scale): four noisy frames of each photo through the device
/// path, every step against the CPU reference.
fn match_the_cpu_reference(cases: &[(ColorMatrix, ColorRange, f64)]) {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    println!("device: {device}");
    let model = model();
    let photos: Vec<Frame> = PHOTOS.iter().map(|p| load_photo(p, W, H)).collect();
    for &(matrix, range, scale) in cases {
        let config = config(&model, matrix, range, scale);
        let mut rig = Rig::new(&model, config, 4, true);
        let mut converter = FrameConverter::new(config).unwrap();
        let (sh, sw) = converter.scaled_size();
        let mut filter = OutputFilter::new(sw, sh, 4, matrix, range);
        filter.set_params(4, 0.6, 3.0);
        let mut gate = SceneCutGate::new(W, H);
        // four noisy frames of each photo: the ring fills, graphs are captured and replayed,
        // each new photo is a scene cut
        let mut worst_input = 0.0f32;
        let mut cuts = 0;
        for (i, photo) in photos.iter().enumerate() {
            for k in 0..4 {
                let input = noisy(photo, 3, (i * 10 + k) as u64);
                let (device_out, cut, used) = rig.run(&input);
                // before the probe converts again (its input may share the output's memory)
                let network_output = rig.network_output();
                let label = format!("{matrix:?}/{range:?} scale {scale} {} frame {k}", PHOTOS[i]);

                let view = input.view();
                let mut want_in = converter.new_tensor();
                converter
                    .to_tensor(view.y, view.y_stride, view.uv, view.uv_stride, &mut want_in)
                    .unwrap();
                let got_in = rig.converted(&input);
                let input_diff = max_abs_diff_f32(&got_in.data, &want_in.data);
                assert!(
                    input_diff <= 1e-4,
                    "{label}: network input differs by {input_diff}"
                );
                worst_input = worst_input.max(input_diff);

                let want_cut = gate.observe(view.y, view.y_stride, THRESHOLD);
                assert_eq!(cut.cut, want_cut.cut, "{label}: scene verdict");
                assert!(
                    (cut.score - want_cut.score).abs() <= 1e-3,
                    "{label}: score {} vs {}",
                    cut.score,
                    want_cut.score
                );
                if want_cut.cut {
                    filter.reset();
                    cuts += 1;
                }
                converter.read_output(&network_output).unwrap();
                let want_used = filter.apply(converter.network_rgb_mut()).unwrap();
                assert_eq!(used, want_used, "{label}: ring entries used");
                let mut want = Frame::new(W, H);
                let target = want.view_mut();
                converter
                    .write_nv12(target.y, target.y_stride, target.uv, target.uv_stride)
                    .unwrap();
                let (worst, differing) = max_abs_diff(&device_out.data, &want.data);
                assert!(
                    worst <= 1,
                    "{label}: NV12 differs by up to {worst} codes ({differing} bytes)"
                );
                println!(
                    "{label}: input max diff {input_diff:.2e}, cut {} (score {:.3}), {used} \
                     ring entries, NV12 max diff {worst} ({differing} of {} bytes)",
                    cut.cut,
                    cut.score,
                    want.data.len()
                );
            }
        }
        assert_eq!(cuts, photos.len() - 1, "every new photo is a cut");
        println!("{matrix:?}/{range:?} scale {scale}: worst input diff {worst_input:.2e}");
    }
}

#[test]
fn smoothing_halves_the_flicker_of_a_static_noisy_clip_and_a_cut_resets_on_the_gpu() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    println!("device: {device}");
    let model = model();
    for scale in [1.0, 0.5] {
        smoothing_and_cut(
            &model,
            config(&model, ColorMatrix::Bt709, ColorRange::Limited, scale),
        );
    }
}

fn smoothing_and_cut(model: &NeuralModel, config: ConverterConfig) {
    let scale = config.scale;
    let mut bare = Rig::new(model, config, 0, true);
    let mut smooth = Rig::new(model, config, 4, true);
    smooth.gpu.set_smoothing(0.8);
    let still = load_photo("chelsea.png", W, H);
    let (mut bare_out, mut smooth_out) = (Vec::new(), Vec::new());
    for k in 0..12 {
        let input = noisy(&still, 3, 100 + k);
        let (b, b_cut, b_used) = bare.run(&input);
        let (s, s_cut, _) = smooth.run(&input);
        assert!(!b_cut.cut && !s_cut.cut, "noise is no scene cut");
        assert_eq!(b_used, 0, "history 0 filters nothing");
        bare_out.push(b);
        smooth_out.push(s);
    }
    // from the fourth frame on, the ring is full
    let (fb, fs) = (flicker(&bare_out[4..]), flicker(&smooth_out[4..]));
    println!(
        "scale {scale}: static noisy clip: frame-to-frame change bare {fb:.3}, smoothed {fs:.3} \
         codes"
    );
    assert!(fb > 0.0, "the bare network follows the noise");
    assert!(fs <= 0.5 * fb, "smoothed {fs:.3} vs bare {fb:.3}");

    // a cut: the first frame of the new scene is the bare network's, bit for bit
    let other = noisy(&load_photo("rocket.jpg", W, H), 3, 7);
    let (b, _, _) = bare.run(&other);
    let (s, cut, used) = smooth.run(&other);
    assert!(cut.cut, "a new photo is a scene cut (score {})", cut.score);
    assert_eq!(used, 0, "the cut empties the ring");
    let (worst, differing) = max_abs_diff(&s.data, &b.data);
    assert_eq!(
        (worst, differing),
        (0, 0),
        "the cut frame equals the bare network's"
    );
    // and the next frame filters against the cut frame alone
    let (_, cut, used) = smooth.run(&noisy(&load_photo("rocket.jpg", W, H), 3, 8));
    assert!(!cut.cut);
    assert_eq!(used, 1, "the ring restarted at the cut");
}

/// Runs `desc` (a `toonflow name=tf` and an `appsink name=sink`) to its end: the frames, the
/// element's stats, whether its sink and src pads negotiated CUDA memory.
fn run_pipeline(desc: &str) -> (Vec<common::Nv12>, gst::Structure, [bool; 2]) {
    let pipeline = gst::parse::launch(desc).unwrap();
    let sink = common::app_sink(&pipeline, "sink");
    let tf = pipeline
        .downcast_ref::<gst::Bin>()
        .unwrap()
        .by_name("tf")
        .unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let mut frames = Vec::new();
    let mut cuda = None;
    while let Some(sample) = sink.try_pull_sample(gst::ClockTime::from_seconds(60)) {
        frames.push(common::Nv12::from_buffer(
            sample.buffer().unwrap(),
            sample.caps().unwrap(),
        ));
        cuda.get_or_insert_with(|| {
            ["sink", "src"].map(|p| {
                let caps = tf.static_pad(p).unwrap().current_caps().unwrap();
                caps.features(0)
                    .is_some_and(|f| f.contains("memory:CUDAMemory"))
            })
        });
    }
    if let Some(msg) = pipeline
        .bus()
        .unwrap()
        .pop_filtered(&[gst::MessageType::Error])
    {
        panic!("{desc}: {msg:?}");
    }
    let stats = tf.property::<gst::Structure>("stats");
    pipeline.set_state(gst::State::Null).unwrap();
    (frames, stats, cuda.expect("at least one frame"))
}

#[test]
fn the_element_takes_and_gives_cuda_memory_with_the_frames_of_system_memory() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    common::init();
    for name in ["cudaupload", "cudadownload"] {
        if gst::ElementFactory::find(name).is_none() {
            println!("skipped: no {name} element (nvcodec) here");
            return;
        }
    }
    println!("device: {device}");
    let dir = common::TempDir::new("neural-cuda-memory");
    let model = dir.path("tiny_like.onnx");
    std::fs::write(&model, encode_model(&onnx_models::tiny_like())).unwrap();
    let frames = 12;
    let source = format!(
        "videotestsrc pattern=ball num-buffers={frames} \
         ! video/x-raw,format=NV12,width={W},height={H},framerate=30/1"
    );
    let sink = "video/x-raw,format=NV12 ! appsink name=sink sync=false";
    let up = "cudaupload ! video/x-raw(memory:CUDAMemory)";
    let down = "video/x-raw(memory:CUDAMemory) ! cudadownload";
    let frame_bytes = (W * H * 3 / 2) as u64;
    for scale in [1.0, 0.5] {
        let tf = format!(
            "toonflow name=tf backend=cuda model=\"{}\" model-scale={scale}",
            model.display()
        );
        // (pipeline, input in CUDA memory, output in CUDA memory); the first is the reference
        let cases = [
            (format!("{source} ! {tf} ! {sink}"), false, false),
            (
                format!("{source} ! {up} ! {tf} ! {down} ! {sink}"),
                true,
                true,
            ),
            (format!("{source} ! {up} ! {tf} ! {sink}"), true, false),
            (format!("{source} ! {tf} ! {down} ! {sink}"), false, true),
        ];
        let mut reference: Option<Vec<common::Nv12>> = None;
        for (desc, cuda_in, cuda_out) in &cases {
            let (out, stats, negotiated) = run_pipeline(desc);
            let bytes = ["upload-bytes", "download-bytes"].map(|k| stats.get::<u64>(k).unwrap());
            let times =
                ["upload-time-us", "download-time-us"].map(|k| stats.get::<f64>(k).unwrap());
            println!(
                "scale {scale}, CUDA memory in {cuda_in} out {cuda_out}: {} frames, \
                 upload-bytes {}, download-bytes {}, upload-time-us {:.1}, \
                 download-time-us {:.1}, gpu-time-us {:.1}, p50-us {:.1}",
                out.len(),
                bytes[0],
                bytes[1],
                times[0],
                times[1],
                stats.get::<f64>("gpu-time-us").unwrap(),
                stats.get::<f64>("p50-us").unwrap(),
            );
            assert_eq!(stats.get::<&str>("backend").unwrap(), "cuda", "{desc}");
            assert_eq!(negotiated, [*cuda_in, *cuda_out], "{desc}: caps");
            let want = |cuda: bool| if cuda { 0 } else { frame_bytes };
            assert_eq!(bytes, [want(*cuda_in), want(*cuda_out)], "{desc}");
            // A PCIe copy is timed; a side in device memory has none (its copy is a device copy).
            assert_eq!(
                times.map(|t| t > 0.0),
                [!cuda_in, !cuda_out],
                "{desc}: {times:?}"
            );
            assert_eq!(out.len(), frames, "{desc}");
            match &reference {
                None => reference = Some(out),
                Some(r) => {
                    for (i, (a, b)) in r.iter().zip(&out).enumerate() {
                        assert!(
                            a.data == b.data,
                            "{desc}: frame {i} differs from system memory"
                        );
                    }
                }
            }
        }
    }
}

/// Where the frame path feeds an fp16 network at model-scale 1 (`Storage::frame_input`), its stem
/// gathers the input from the NV12 frame itself (kernels/nv12.cuh, the conversion's own
/// arithmetic): the network's output and the filtered NV12 frames have the same bits as with the
/// conversion kernel's fp16 input tensor, frame after frame with graphs captured (three frames
/// of two photos each, BT.709 limited and BT.601 full): tiny_16 (the 7x7 tap-packed stem over 3
/// channels), hayao_32 with its stem recomputed for its last reader (the frame read twice, the
/// network in two graphs on the overlap path). Below model-scale 1 the frame path refuses such
/// a network (it resamples the frame first).
#[test]
fn the_stem_gathering_the_nv12_frame_gives_the_conversions_bits() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    println!("device: {device}");
    let tiny_16 = onnx_models::tiny_like_channels([16, 16, 16, 32, 32], false, "tiny_16");
    let hayao_32 = onnx_models::hayao_like_channels([16, 32, 32, 32], "hayao_32");
    let models = [
        (
            NeuralModel::from_bytes(&encode_model(&tiny_16), "tiny_16").unwrap(),
            false,
        ),
        (
            NeuralModel::from_bytes(&encode_model(&hayao_32), "hayao_32").unwrap(),
            true,
        ),
    ];
    let photos: Vec<Frame> = PHOTOS[..2].iter().map(|p| load_photo(p, W, H)).collect();
    for (model, recompute) in &models {
        for (matrix, range) in [
            (ColorMatrix::Bt709, ColorRange::Limited),
            (ColorMatrix::Bt601, ColorRange::Full),
        ] {
            let config = config(model, matrix, range, 1.0);
            let converter = FrameConverter::new(config).unwrap();
            let (h, w) = converter.network_size();
            let spec = model.specialise(h, w).unwrap();
            let spec = if *recompute {
                spec.recomputed_stem().expect("a recomputable stem")
            } else {
                spec
            };
            let storage = Storage::uniform(spec.stage_count(), true);
            let rig = |storage: &Storage| {
                let mut gpu = NeuralGpu::new(0, &spec, storage, 0, true).unwrap();
                let frames =
                    DeviceFrames::new(gpu.context(), &config, gpu.program(), (h, w), settings(4))
                        .unwrap();
                gpu.attach_frame(frames.frame_block()).unwrap();
                (gpu, frames)
            };
            let mut plain = rig(&storage);
            let mut fed = rig(&storage.clone().with_frame_input(true));
            assert!(!plain.0.program().frame_fed());
            assert!(
                fed.0.program().frame_fed(),
                "{}: no NV12 gather",
                model.name()
            );
            assert_eq!(
                fed.0.program().frame_fields.len(),
                1 + *recompute as usize,
                "{}",
                model.name()
            );
            assert_eq!(fed.1.launches() + 1, plain.1.launches());
            for (i, photo) in photos.iter().enumerate() {
                for k in 0..3 {
                    let input = noisy(photo, 3, (i * 10 + k) as u64);
                    let mut outs = Vec::new();
                    for (gpu, frames) in [&mut plain, &mut fed] {
                        let mut out = Frame::new(W, H);
                        let (view, mut target) = (input.view(), out.view_mut());
                        let mut job =
                            frames.job(FrameSource::Host(&view), FrameTarget::Host(&mut target));
                        gpu.run_device(&mut job).unwrap();
                        job.conclude();
                        let mut net = converter.new_tensor();
                        frames.read_output(gpu.stream(), &mut net.data).unwrap();
                        outs.push((out, net, gpu.last_frame_stats().graph_replayed));
                    }
                    let label = format!(
                        "{} {matrix:?}/{range:?} {} frame {k}",
                        model.name(),
                        PHOTOS[i]
                    );
                    assert_same_bits(&outs[0].1, &outs[1].1, &format!("{label}: the NV12 gather"));
                    assert!(
                        outs[0].0.data == outs[1].0.data,
                        "{label}: the NV12 frames differ"
                    );
                    println!(
                        "{label}: same bits (graphs replayed: {} / {})",
                        outs[0].2, outs[1].2
                    );
                }
            }
        }
    }
    // below model-scale 1 the frame is resampled before the network: refused
    let (model, _) = &models[0];
    let config = config(model, ColorMatrix::Bt709, ColorRange::Limited, 0.5);
    let converter = FrameConverter::new(config).unwrap();
    let (h, w) = converter.network_size();
    let spec = model.specialise(h, w).unwrap();
    let storage = Storage::uniform(spec.stage_count(), true).with_frame_input(true);
    let gpu = NeuralGpu::new(0, &spec, &storage, 0, true).unwrap();
    assert!(gpu.program().frame_fed());
    let refused = DeviceFrames::new(gpu.context(), &config, gpu.program(), (h, w), settings(4));
    assert!(refused.is_err(), "a resampled frame fed to the stem");
}
