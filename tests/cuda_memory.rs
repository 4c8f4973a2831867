//! Zero-copy with NVIDIA's GStreamer elements (issue 13): `memory:CUDAMemory` caps beside system
//! memory, one shared CUDA context, GstCudaMemory in and out.
//!
//! Without a GPU (CI): the pad templates, the CUDA caps withheld, the system-memory path as
//! before. With a GPU and nvcodec (the H200 bundle): `nvh264dec ! toonflow ! cudadownload`
//! against the system-memory path frame by frame, no PCIe copy in the stats, one context in the
//! pipeline (toonflow's own or the application's), state cycles and renegotiations with flat
//! device memory, a flush mid-stream, and the 1080p speed with CUDA memory in and out.

mod common;

use std::time::{Duration, Instant};

use common::{Nv12, TempDir, app_sink, init};
use gst::prelude::*;
use gsttoonflow::cuda::gstcuda::{self, GstCudaContext};

const CUDA_FEATURE: &str = "memory:CUDAMemory";

fn has_cuda(caps: &gst::CapsRef) -> bool {
    caps.iter_with_features()
        .any(|(_, f)| f.contains(CUDA_FEATURE))
}

fn is_cuda_caps(caps: &gst::CapsRef) -> bool {
    caps.features(0).is_some_and(|f| f.contains(CUDA_FEATURE))
}

/// Whether zero-copy can be tried here: a CUDA device, libgstcuda, and the nvcodec elements
/// named. Prints why not.
fn gpu_or_skip(elements: &[&str]) -> bool {
    init();
    if let Err(e) = gsttoonflow::cuda::probe(0) {
        println!("skipped: no CUDA device ({e})");
        return false;
    }
    if let Err(e) = gstcuda::api() {
        println!("skipped: {e}");
        return false;
    }
    for name in elements {
        if gst::ElementFactory::find(name).is_none() {
            println!("skipped: no {name} element (nvcodec) here");
            return false;
        }
    }
    true
}

/// Whether the caps toonflow's pads offer may contain CUDA memory here at all.
fn gpu_here() -> bool {
    gsttoonflow::cuda::probe(0).is_ok() && gstcuda::api().is_ok()
}

#[test]
fn templates_carry_cuda_and_system_memory() {
    let _device = DEVICE.read();
    init();
    let factory = gst::ElementFactory::find("toonflow").unwrap();
    for template in factory.static_pad_templates() {
        let caps = template.caps();
        let features: Vec<bool> = caps
            .iter_with_features()
            .map(|(_, f)| f.contains(CUDA_FEATURE))
            .collect();
        assert_eq!(
            features,
            vec![true, false],
            "{}: {caps}",
            template.name_template()
        );
        for (s, _) in caps.iter_with_features() {
            assert_eq!(s.get::<&str>("format").unwrap(), "NV12");
        }
    }
}

/// The sink pad's caps in READY: CUDA memory first with a usable GPU, never without one or with
/// backend=cpu.
#[test]
fn cuda_caps_are_offered_only_with_a_gpu() {
    let _device = DEVICE.read();
    init();
    for backend in ["auto", "cpu"] {
        let el = gst::ElementFactory::make("toonflow")
            .property_from_str("backend", backend)
            .build()
            .unwrap();
        el.set_state(gst::State::Ready).unwrap();
        for pad in ["sink", "src"] {
            let caps = el.static_pad(pad).unwrap().query_caps(None);
            let want = backend == "auto" && gpu_here();
            assert_eq!(has_cuda(&caps), want, "backend={backend} {pad}: {caps}");
            if want {
                assert!(is_cuda_caps(&caps), "CUDA memory comes first: {caps}");
            }
            assert!(
                caps.iter_with_features().any(
                    |(_, f)| f.is_empty() || f.contains(gst::CAPS_FEATURE_MEMORY_SYSTEM_MEMORY)
                ),
                "system memory is always offered: {caps}"
            );
        }
        el.set_state(gst::State::Null).unwrap();
    }
    if !gpu_here() {
        println!("no GPU here: checked that CUDA caps are withheld");
    }
}

/// The element named `name` in a launch-line pipeline.
fn element(pipeline: &gst::Element, name: &str) -> gst::Element {
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    bin.by_name(name).unwrap()
}

/// Waits up to `seconds` for EOS; an error message or a timeout fails the test.
fn wait_eos(pipeline: &gst::Element, seconds: u64) {
    let msg = pipeline
        .bus()
        .unwrap()
        .timed_pop_filtered(
            gst::ClockTime::from_seconds(seconds),
            &[gst::MessageType::Eos, gst::MessageType::Error],
        )
        .expect("EOS");
    assert!(matches!(msg.view(), gst::MessageView::Eos(_)), "{msg:?}");
}

/// Runs a launch line with an appsink named `sink` and a toonflow named `tf` to EOS; returns
/// the frames, the element's last stats and the negotiated caps of its pads.
fn run_to_eos(desc: &str) -> (Vec<Nv12>, gst::Structure, [gst::Caps; 2]) {
    init();
    let pipeline = gst::parse::launch(desc).unwrap();
    let sink = app_sink(&pipeline, "sink");
    let tf = element(&pipeline, "tf");
    pipeline.set_state(gst::State::Playing).unwrap();
    let mut frames = Vec::new();
    let mut caps = None;
    while let Some(sample) = sink.try_pull_sample(gst::ClockTime::from_seconds(30)) {
        frames.push(Nv12::from_buffer(
            sample.buffer().unwrap(),
            sample.caps().unwrap(),
        ));
        caps.get_or_insert_with(|| {
            ["sink", "src"].map(|p| tf.static_pad(p).unwrap().current_caps().unwrap())
        });
    }
    let bus = pipeline.bus().unwrap();
    if let Some(msg) = bus.pop_filtered(&[gst::MessageType::Error]) {
        panic!("{desc}: {msg:?}");
    }
    let stats = tf.property::<gst::Structure>("stats");
    pipeline.set_state(gst::State::Null).unwrap();
    (frames, stats, caps.expect("at least one frame"))
}

#[test]
fn system_memory_neighbours_keep_system_memory() {
    let _device = DEVICE.read();
    init();
    // A source of system memory and sinks that take system memory only, or anything.
    for sink in [
        "video/x-raw,format=NV12 ! appsink name=sink sync=false",
        "appsink name=sink sync=false",
    ] {
        let desc = format!(
            "videotestsrc num-buffers=3 pattern=ball ! video/x-raw,format=NV12,width=96,height=64 \
             ! toonflow name=tf ! {sink}"
        );
        let (frames, stats, [sink_caps, src_caps]) = run_to_eos(&desc);
        assert_eq!(frames.len(), 3);
        assert!(
            !has_cuda(&sink_caps) && !has_cuda(&src_caps),
            "{sink_caps} / {src_caps}"
        );
        if stats.get::<&str>("backend").unwrap() == "cuda" {
            // The PCIe path as before: every frame goes up and comes down.
            assert_eq!(stats.get::<u64>("upload-bytes").unwrap(), 96 * 64 * 3 / 2);
            assert_eq!(stats.get::<u64>("download-bytes").unwrap(), 96 * 64 * 3 / 2);
        }
    }
    // And the frames are the CPU reference's where the CPU runs.
    if !gpu_here() {
        let (frames, _, _) = run_to_eos(
            "videotestsrc num-buffers=1 pattern=ball ! video/x-raw,format=NV12,width=96,height=64 \
             ! toonflow name=tf ! appsink name=sink sync=false",
        );
        let (reference, _, _) = run_to_eos(
            "videotestsrc num-buffers=1 pattern=ball ! video/x-raw,format=NV12,width=96,height=64 \
             ! toonflow name=tf backend=cpu ! appsink name=sink sync=false",
        );
        assert_eq!(frames[0].data, reference[0].data);
    }
}

/// A 1080p H.264 clip (a photo with a moving ball over it), made with x264enc.
fn h264_clip(dir: &TempDir, frames: u32) -> std::path::PathBuf {
    h264_clip_sized(dir, frames, 1920, 1080)
}

fn h264_clip_sized(dir: &TempDir, frames: u32, w: u32, h: u32) -> std::path::PathBuf {
    let out = dir.path("clip.mp4");
    let photo = common::fixture("astronaut.png");
    let desc = format!(
        "compositor name=mix ! video/x-raw,format=I420,width={w},height={h},framerate=30/1 \
         ! x264enc speed-preset=ultrafast key-int-max=30 ! h264parse ! mp4mux \
         ! filesink location=\"{}\" \
         filesrc location=\"{}\" ! decodebin ! videoconvert ! videoscale \
         ! video/x-raw,width={w},height={h} ! imagefreeze num-buffers={frames} \
         ! video/x-raw,framerate=30/1 ! mix.sink_0 \
         videotestsrc pattern=ball num-buffers={frames} \
         ! video/x-raw,width={bw},height={bh},framerate=30/1 ! mix.sink_1",
        out.display(),
        photo.display(),
        bw = w / 4,
        bh = h / 3,
    );
    let pipeline = gst::parse::launch(&desc).unwrap();
    common::play_to_eos(&pipeline, 120, "encoding the clip");
    out
}

fn decode(clip: &std::path::Path) -> String {
    format!(
        "filesrc location=\"{}\" ! qtdemux ! h264parse ! nvh264dec",
        clip.display()
    )
}

/// The four memory combinations give the same frames; the stats show PCIe copies only where
/// system memory is on a pad, and CUDA memory wins when both neighbours take it.
#[test]
fn nvh264dec_frames_match_the_system_memory_path() {
    let _device = DEVICE.read();
    if !gpu_or_skip(&["nvh264dec", "cudadownload"]) {
        return;
    }
    let dir = TempDir::new("zerocopy");
    let clip = h264_clip(&dir, 60);
    let d = decode(&clip);
    let sink = "video/x-raw,format=NV12 ! appsink name=sink sync=false";
    let cases = [
        // (pipeline, input in CUDA memory, output in CUDA memory)
        (
            format!("{d} ! cudadownload ! video/x-raw ! toonflow name=tf ! {sink}"),
            false,
            false,
        ),
        // No caps filter: CUDA memory on both pads because both neighbours take it.
        (
            format!("{d} ! toonflow name=tf ! cudadownload ! {sink}"),
            true,
            true,
        ),
        (format!("{d} ! toonflow name=tf ! {sink}"), true, false),
        (
            format!(
                "{d} ! cudadownload ! video/x-raw ! toonflow name=tf \
                 ! video/x-raw(memory:CUDAMemory) ! cudadownload ! {sink}"
            ),
            false,
            true,
        ),
    ];
    let mut reference: Option<Vec<Nv12>> = None;
    for (desc, cuda_in, cuda_out) in &cases {
        let (frames, stats, [sink_caps, src_caps]) = run_to_eos(desc);
        println!(
            "{desc}\n  in {sink_caps}\n  out {src_caps}\n  {} frames, upload-bytes {}, \
             download-bytes {}, device-copy-us {:.1}, gpu-time-us {:.1}, p50-us {:.1}",
            frames.len(),
            stats.get::<u64>("upload-bytes").unwrap(),
            stats.get::<u64>("download-bytes").unwrap(),
            stats.get::<f64>("device-copy-us").unwrap(),
            stats.get::<f64>("gpu-time-us").unwrap(),
            stats.get::<f64>("p50-us").unwrap(),
        );
        assert_eq!(stats.get::<&str>("backend").unwrap(), "cuda");
        assert_eq!(
            is_cuda_caps(&sink_caps),
            *cuda_in,
            "{desc}: input {sink_caps}"
        );
        assert_eq!(
            is_cuda_caps(&src_caps),
            *cuda_out,
            "{desc}: output {src_caps}"
        );
        let frame_bytes = 1920 * 1080 * 3 / 2;
        let want = |cuda: bool| if cuda { 0 } else { frame_bytes };
        assert_eq!(
            stats.get::<u64>("upload-bytes").unwrap(),
            want(*cuda_in),
            "{desc}"
        );
        assert_eq!(
            stats.get::<u64>("download-bytes").unwrap(),
            want(*cuda_out),
            "{desc}"
        );
        assert_eq!(frames.len(), 60, "{desc}");
        match &reference {
            None => reference = Some(frames),
            Some(r) => {
                for (i, (a, b)) in r.iter().zip(&frames).enumerate() {
                    assert!(
                        a.data == b.data,
                        "{desc}: frame {i} differs from the system path"
                    );
                }
            }
        }
    }
}

/// The GstCudaContext each neighbour of `tf` and `tf` itself answer a context query with.
fn contexts_around(tf: &gst::Element) -> Vec<GstCudaContext> {
    let ask = |pad: &gst::Pad| {
        let mut q = gst::query::Context::new(gstcuda::CONTEXT_TYPE);
        assert!(pad.query(&mut q), "{} answers", pad.name());
        GstCudaContext::in_context(&q.context_owned().unwrap()).unwrap()
    };
    let sink = tf.static_pad("sink").unwrap();
    let src = tf.static_pad("src").unwrap();
    vec![
        ask(&sink.peer().unwrap()), // the decoder's src pad
        ask(&src),                  // toonflow
        ask(&src.peer().unwrap()),  // cudadownload's sink pad
    ]
}

/// Plays `nvh264dec ! toonflow ! cudadownload` for a few frames and returns the contexts the
/// three elements hold.
fn play_and_ask(clip: &std::path::Path, app_context: Option<&gst::Context>) -> Vec<GstCudaContext> {
    let desc = format!(
        "{} ! toonflow name=tf ! cudadownload ! video/x-raw,format=NV12 ! appsink name=sink sync=false",
        decode(clip)
    );
    let pipeline = gst::parse::launch(&desc).unwrap();
    if let Some(c) = app_context {
        pipeline.set_context(c);
    }
    let sink = app_sink(&pipeline, "sink");
    pipeline.set_state(gst::State::Playing).unwrap();
    let first = sink.try_pull_sample(gst::ClockTime::from_seconds(30));
    assert!(first.is_some(), "a frame");
    let tf = element(&pipeline, "tf");
    let contexts = contexts_around(&tf);
    let stats = tf.property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("upload-bytes").unwrap(), 0);
    assert_eq!(stats.get::<u64>("download-bytes").unwrap(), 0);
    pipeline.set_state(gst::State::Null).unwrap();
    contexts
}

#[test]
fn one_cuda_context_in_the_pipeline() {
    let _device = DEVICE.read();
    if !gpu_or_skip(&["nvh264dec", "cudadownload"]) {
        return;
    }
    let dir = TempDir::new("zerocopy-ctx");
    let clip = h264_clip(&dir, 10);

    // Nobody brings one: toonflow wraps its own primary context and the others take it.
    let own = play_and_ask(&clip, None);
    let primary = gsttoonflow::cuda::context::context(0).unwrap();
    for c in &own {
        assert_eq!(c, &own[0], "one GstCudaContext object");
        assert_eq!(c.handle(), primary.cu_ctx(), "toonflow's primary context");
        assert_eq!(c.device_id(), 0);
    }

    // The application brings one (as nvcodec would make it): everybody adopts it.
    let app = GstCudaContext::new_owned(0).unwrap();
    assert_ne!(app.handle(), primary.cu_ctx());
    let adopted = play_and_ask(&clip, Some(&app.to_context()));
    for c in &adopted {
        assert_eq!(c.handle(), app.handle(), "the application's context");
    }
    println!(
        "own context {:?} shared by decoder, toonflow, cudadownload; application context {:?} adopted by all three",
        own[0].handle(),
        app.handle()
    );
}

/// The tests of this file share one device, and the flat-memory test reads how much of it is
/// free: the others take this lock shared (they may run together), that one alone, so no other
/// test's contexts, pools or arenas come and go while it measures.
static DEVICE: parking_lot::RwLock<()> = parking_lot::RwLock::new(());

fn device_free() -> u64 {
    let ctx = gsttoonflow::cuda::context::context(0).unwrap();
    gsttoonflow::cuda::context::memory_info(&ctx).unwrap().0
}

const MIB: f64 = 1024.0 * 1024.0;

#[test]
fn state_cycles_and_renegotiation_keep_device_memory_flat() {
    let _device = DEVICE.write();
    if !gpu_or_skip(&["cudaupload", "cudadownload"]) {
        return;
    }
    // (cudaupload passes system memory through when downstream takes it: ask for CUDA memory.)
    let desc = "videotestsrc num-buffers=3 pattern=ball ! video/x-raw,format=NV12,width=640,height=360 \
                ! cudaupload ! video/x-raw(memory:CUDAMemory) ! toonflow name=tf ! cudadownload \
                ! fakesink";
    let cycle = || {
        let pipeline = gst::parse::launch(desc).unwrap();
        pipeline.set_state(gst::State::Playing).unwrap();
        wait_eos(&pipeline, 30);
        let tf = element(&pipeline, "tf");
        let stats = tf.property::<gst::Structure>("stats");
        assert_eq!(stats.get::<u64>("upload-bytes").unwrap(), 0);
        assert_eq!(stats.get::<u64>("download-bytes").unwrap(), 0);
        pipeline.set_state(gst::State::Null).unwrap();
    };
    for _ in 0..5 {
        cycle();
    }
    let before = device_free();
    let started = Instant::now();
    for _ in 0..100 {
        cycle();
    }
    let after = device_free();
    let grown = before.saturating_sub(after) as f64 / MIB;
    println!(
        "100 state cycles in {:.1} s: device free {:.1} -> {:.1} MiB ({grown:.1} MiB used more)",
        started.elapsed().as_secs_f64(),
        before as f64 / MIB,
        after as f64 / MIB
    );
    assert!(
        grown < 16.0,
        "device memory grew by {grown:.1} MiB over 100 cycles"
    );

    // Renegotiation: the size changes back and forth while playing.
    let pipeline = gst::parse::launch(
        "videotestsrc pattern=ball is-live=true ! capsfilter name=cf \
         caps=video/x-raw,format=NV12,width=640,height=360,framerate=120/1 \
         ! cudaupload ! video/x-raw(memory:CUDAMemory) ! toonflow name=tf ! cudadownload \
         ! fakesink sync=false",
    )
    .unwrap();
    let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
    let cf = bin.by_name("cf").unwrap();
    let tf = bin.by_name("tf").unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let sizes = [(640, 360), (1280, 720)];
    let mut free_after_warmup = 0;
    for i in 0..24 {
        let (w, h) = sizes[i % 2];
        cf.set_property(
            "caps",
            gst::Caps::builder("video/x-raw")
                .field("format", "NV12")
                .field("width", w)
                .field("height", h)
                .field("framerate", gst::Fraction::new(120, 1))
                .build(),
        );
        std::thread::sleep(Duration::from_millis(150));
        let stats = tf.property::<gst::Structure>("stats");
        assert_eq!(stats.get::<u32>("width").unwrap(), w as u32, "switch {i}");
        if i == 3 {
            free_after_warmup = device_free();
        }
    }
    let bus = pipeline.bus().unwrap();
    if let Some(msg) = bus.pop_filtered(&[gst::MessageType::Error]) {
        panic!("renegotiation: {msg:?}");
    }
    let frames = tf
        .property::<gst::Structure>("stats")
        .get::<u64>("frames")
        .unwrap();
    pipeline.set_state(gst::State::Null).unwrap();
    let end = device_free();
    let grown = free_after_warmup.saturating_sub(end) as f64 / MIB;
    println!("24 renegotiations, {frames} frames: {grown:.1} MiB used more after the 4th");
    assert!(
        grown < 16.0,
        "device memory grew by {grown:.1} MiB over renegotiations"
    );
}

/// A flushing seek mid-stream: the stream goes on, and the temporal history starts again, so
/// the frames after the seek are the frames of a fresh start.
#[test]
fn a_flush_mid_stream_restarts_cleanly() {
    let _device = DEVICE.read();
    if !gpu_or_skip(&["nvh264dec", "cudadownload"]) {
        return;
    }
    let dir = TempDir::new("zerocopy-flush");
    let clip = h264_clip(&dir, 60);
    let desc = format!(
        "{} ! toonflow name=tf ! cudadownload ! video/x-raw,format=NV12 ! appsink name=sink sync=false",
        decode(&clip)
    );
    let (fresh, _, _) = run_to_eos(&desc);
    let pipeline = gst::parse::launch(&desc).unwrap();
    let sink = app_sink(&pipeline, "sink");
    pipeline.set_state(gst::State::Playing).unwrap();
    for _ in 0..25 {
        sink.try_pull_sample(gst::ClockTime::from_seconds(30))
            .expect("frame before the seek");
    }
    pipeline
        .seek_simple(
            gst::SeekFlags::FLUSH | gst::SeekFlags::KEY_UNIT,
            gst::ClockTime::ZERO,
        )
        .expect("seek");
    let mut after = Vec::new();
    while let Some(sample) = sink.try_pull_sample(gst::ClockTime::from_seconds(30)) {
        after.push(Nv12::from_buffer(
            sample.buffer().unwrap(),
            sample.caps().unwrap(),
        ));
    }
    if let Some(msg) = pipeline
        .bus()
        .unwrap()
        .pop_filtered(&[gst::MessageType::Error])
    {
        panic!("flush: {msg:?}");
    }
    pipeline.set_state(gst::State::Null).unwrap();
    // Frames pulled before the seek may still be queued: find the restart by content.
    let start = after
        .iter()
        .position(|f| f.data == fresh[0].data)
        .expect("the first frame comes again after the seek, as from a fresh start");
    let replayed = &after[start..];
    assert_eq!(replayed.len(), fresh.len(), "the whole clip after the seek");
    for (i, (a, b)) in fresh.iter().zip(replayed).enumerate() {
        assert!(
            a.data == b.data,
            "frame {i} after the flush differs from a fresh start"
        );
    }
    println!(
        "flush at frame 25: {} frames after, identical to a fresh start",
        replayed.len()
    );
}

/// 1080p per-frame time of the element with CUDA memory in and out, against system memory.
#[test]
fn speed_1080p_with_cuda_memory_in_and_out() {
    let _device = DEVICE.read();
    if !gpu_or_skip(&["cudaupload"]) {
        return;
    }
    let frames = 3000;
    let run = |tail: &str, cuda: bool| {
        let upload = if cuda {
            "cudaupload ! video/x-raw(memory:CUDAMemory) !"
        } else {
            ""
        };
        let desc = format!(
            "videotestsrc num-buffers=1 pattern=smpte ! video/x-raw,format=NV12,width=1920,height=1080 \
             ! imagefreeze num-buffers={frames} ! {upload} toonflow name=tf ! {tail}"
        );
        let pipeline = gst::parse::launch(&desc).unwrap();
        let started = Instant::now();
        pipeline.set_state(gst::State::Playing).unwrap();
        wait_eos(&pipeline, 120);
        let wall = started.elapsed().as_secs_f64();
        let tf = element(&pipeline, "tf");
        let stats = tf.property::<gst::Structure>("stats");
        pipeline.set_state(gst::State::Null).unwrap();
        let p50 = stats.get::<f64>("p50-us").unwrap();
        println!(
            "{}: element p50 {p50:.1} µs = {:.0} fps, mean {:.1} µs, gpu {:.1} µs, device copies \
             {:.1} µs, transfers {:.1} µs, upload {} B, download {} B; pipeline {:.0} fps",
            if cuda {
                "CUDA memory in and out"
            } else {
                "system memory in and out"
            },
            1e6 / p50,
            stats.get::<f64>("mean-us").unwrap(),
            stats.get::<f64>("gpu-time-us").unwrap(),
            stats.get::<f64>("device-copy-us").unwrap(),
            stats.get::<f64>("transfer-time-us").unwrap(),
            stats.get::<u64>("upload-bytes").unwrap(),
            stats.get::<u64>("download-bytes").unwrap(),
            frames as f64 / wall
        );
        stats
    };
    // fakesink takes any memory: CUDA in, so CUDA out.
    let cuda = run("fakesink sync=false", true);
    assert_eq!(cuda.get::<u64>("upload-bytes").unwrap(), 0);
    assert_eq!(cuda.get::<u64>("download-bytes").unwrap(), 0);
    let system = run("video/x-raw ! fakesink sync=false", false);
    assert!(system.get::<u64>("upload-bytes").unwrap() > 0);
}

/// pipelines/nvcodec-file-to-file.sh as a user runs it: NVDEC → toonflow → NVENC (or x264 after
/// cudadownload where the card has no NVENC); the output decodes to as many frames, and the
/// statistics show no upload, and no download where NVENC encodes.
#[test]
fn nvcodec_script_restyles_a_clip() {
    let _device = DEVICE.read();
    if !gpu_or_skip(&["nvh264dec", "cudadownload"]) {
        return;
    }
    let dir = TempDir::new("zerocopy-script");
    let clip = h264_clip_sized(&dir, 30, 640, 360);
    let out = dir.path("out.mp4");
    let script = common::repo_root().join("pipelines/nvcodec-file-to-file.sh");
    let run = std::process::Command::new("bash")
        .arg(&script)
        .arg(&clip)
        .arg(&out)
        .env("GST_PLUGIN_PATH", common::plugin_dir())
        .env("STATS", "10")
        .output()
        .expect("bash");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success() && !text.contains("ERROR"), "{text}");
    let stats: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("toonflow-stats"))
        .collect();
    assert!(!stats.is_empty(), "no statistics printed:\n{text}");
    let last = stats.last().unwrap();
    assert!(last.contains("upload-bytes=(guint64)0"), "{last}");
    // toonflow's output stays in CUDA memory for nvh264enc and for cudadownload alike.
    assert!(last.contains("download-bytes=(guint64)0"), "{last}");
    let nvenc = gst::ElementFactory::find("nvh264enc").is_some();
    println!(
        "{}",
        text.lines()
            .find(|l| l.contains("NVENC"))
            .unwrap_or_default()
    );
    println!(
        "encoder: {}",
        if nvenc {
            "nvh264enc"
        } else {
            "x264enc after cudadownload"
        }
    );
    let (frames, _, _) = run_to_eos(&format!(
        "filesrc location=\"{}\" ! qtdemux ! h264parse ! nvh264dec ! cudadownload \
         ! video/x-raw,format=NV12 ! toonflow name=tf ! appsink name=sink sync=false",
        out.display()
    ));
    assert_eq!(frames.len(), 30, "the restyled file holds every frame");
}
