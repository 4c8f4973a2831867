//! toonflow-bench: pushes pre-made NV12 frames of real content (the photos in tests/data, cropped,
//! shifted and noised so no two consecutive frames are alike) through `appsrc ! toonflow !
//! fakesink` and prints, per resolution and mode, throughput, latency percentiles, launches per
//! frame and device memory; frei0r's cartoon filter runs on the same frames as the CPU peer.
//! Warm-up frames are excluded; each configuration is repeated and the median reported.
//!
//! The real-pipeline modes (real.rs: videotestsrc, rawvideoparse, appsrc-pinned/-pageable/-fresh,
//! nvh264dec, nvh264dec-cudadownload, nvh264dec-cuda, density, host-copies) feed the CUDA element
//! the way real upstream elements do and time it at its own pads (issue 12); the `-only` modes
//! time the source or decoder alone. `--overlap off,on` runs each of them with the element's
//! `overlap` off and on, side by side; `--pace FPS` makes the appsrc modes push at a live
//! source's rate (latency below the element's capacity).
//!
//! `--model PATH` benchmarks the neural stage instead: the same frames through `toonflow
//! model=PATH` on the CPU reference (`cpu`: a few frames, it is slow) and on CUDA
//! (`cuda-eager`, `cuda-graph`, with `--precisions`), at 720p, 1080p and 4K unless `--sizes`
//! says otherwise. A configuration the element refuses prints its error as the row.
//! `--model-scale S` runs the network at that model-scale; with `--model` the real-pipeline
//! modes (nvh264dec, nvh264dec-cuda, ...) feed the neural element too. `--set NAME=VALUE`
//! (repeatable) sets more properties of the element (e.g. `model-low-memory=true`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gst::prelude::*;
use gsttoonflow::pipeline::stats::percentile_of_sorted;

#[path = "toonflow-bench/real.rs"]
mod real;

const USAGE: &str = "usage: toonflow-bench [--quick] [--sizes 720p,1080p,1440p,4k,320x240] \
[--modes cpu,cpu-reference,cpu-stages,cpu-fast-stages,cuda-eager,cuda-graph,frei0r,videotestsrc,rawvideoparse,\
rawvideoparse-only,appsrc-pinned,\
appsrc-pageable,appsrc-fresh,nvh264dec,nvh264dec-cudadownload,nvh264dec-cuda,nvh264dec-only,\
nvh264dec-cudadownload-only,nvh264dec-cuda-only,density,host-copies] [--precisions fp16,fp32] [--frames N] [--cpu-frames N] \
[--reps N] [--json FILE] [--model PATH.onnx] [--model-scale S] [--overlap off,on] [--pace FPS] \
[--set NAME=VALUE]...";

#[derive(Clone, Debug)]
struct Options {
    sizes: Vec<(usize, usize, String)>,
    modes: Vec<String>,
    precisions: Vec<String>,
    frames: usize,
    cpu_frames: usize,
    reps: usize,
    json: Option<PathBuf>,
    /// The neural stage's model: neural rows instead of the classic pipeline's.
    model: Option<PathBuf>,
    /// model-scale of the neural rows (the element's default when `None`).
    model_scale: Option<f64>,
    /// The real-pipeline modes run once per value: `overlap=false`/`true`, or the element's
    /// default (`None`).
    overlap: Vec<Option<bool>>,
    /// The appsrc modes push at this rate (a live source) instead of as fast as they can.
    pace: Option<f64>,
    /// `--set NAME=VALUE`: more properties of the toonflow element, in every mode.
    set: Vec<String>,
}

fn parse_size(s: &str) -> Result<(usize, usize, String), String> {
    let (w, h) = match s {
        "720p" => (1280, 720),
        "1080p" => (1920, 1080),
        "1440p" => (2560, 1440),
        "4k" | "2160p" => (3840, 2160),
        other => {
            let (w, h) = other.split_once('x').ok_or(format!("bad size {other}"))?;
            (
                w.parse().map_err(|_| format!("bad size {other}"))?,
                h.parse().map_err(|_| format!("bad size {other}"))?,
            )
        }
    };
    Ok((w, h, s.to_string()))
}

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        sizes: ["720p", "1080p", "1440p", "4k"]
            .iter()
            .map(|s| parse_size(s).unwrap())
            .collect(),
        modes: ["cpu", "frei0r", "cuda-eager", "cuda-graph"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        precisions: vec!["fp16".into(), "fp32".into()],
        frames: 2000,
        cpu_frames: 4,
        reps: 3,
        json: None,
        model: None,
        model_scale: None,
        set: Vec::new(),
        overlap: vec![None],
        pace: None,
    };
    let (mut sizes_given, mut modes_given) = (false, false);
    let mut args = std::env::args().skip(1);
    let list = |v: Option<String>| -> Result<Vec<String>, String> {
        Ok(v.ok_or("missing value")?
            .split(',')
            .map(|s| s.trim().to_string())
            .collect())
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => {
                o.sizes = vec![parse_size("320x240")?];
                o.modes = vec!["cpu".into(), "frei0r".into()];
                o.precisions = vec!["fp32".into()];
                o.cpu_frames = 6;
                o.reps = 2;
            }
            "--sizes" => {
                sizes_given = true;
                o.sizes = list(args.next())?
                    .iter()
                    .map(|s| parse_size(s))
                    .collect::<Result<_, _>>()?
            }
            "--modes" => {
                modes_given = true;
                o.modes = list(args.next())?
            }
            "--model" => o.model = Some(args.next().ok_or("--model PATH")?.into()),
            "--model-scale" => {
                o.model_scale = Some(
                    args.next()
                        .and_then(|v| v.parse().ok())
                        .ok_or("--model-scale S")?,
                )
            }
            "--precisions" => o.precisions = list(args.next())?,
            "--set" => {
                let v = args
                    .next()
                    .filter(|v| v.contains('='))
                    .ok_or("--set NAME=VALUE")?;
                o.set.push(v)
            }
            "--pace" => {
                o.pace = Some(
                    args.next()
                        .and_then(|v| v.parse().ok())
                        .filter(|&v: &f64| v > 0.0)
                        .ok_or("--pace FPS")?,
                )
            }
            "--overlap" => {
                o.overlap = list(args.next())?
                    .iter()
                    .map(|v| match v.as_str() {
                        "on" | "true" => Ok(Some(true)),
                        "off" | "false" => Ok(Some(false)),
                        "default" => Ok(None),
                        other => Err(format!("--overlap on,off,default: not {other}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--frames" => {
                o.frames = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--frames N")?
            }
            "--cpu-frames" => {
                o.cpu_frames = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--cpu-frames N")?
            }
            "--reps" => o.reps = args.next().and_then(|v| v.parse().ok()).ok_or("--reps N")?,
            "--json" => o.json = Some(args.next().ok_or("--json FILE")?.into()),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if o.model.is_some() {
        if !sizes_given {
            o.sizes = ["720p", "1080p", "4k"]
                .iter()
                .map(|s| parse_size(s).unwrap())
                .collect();
        }
        if !modes_given {
            o.modes = ["cpu", "cuda-eager", "cuda-graph"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        }
    }
    Ok(o)
}

fn data_dir() -> PathBuf {
    let root =
        std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    PathBuf::from(root).join("tests/data")
}

/// Decodes a photo to NV12 at the given size with GStreamer (stride-padded buffer as is).
fn decode_photo(name: &str, width: usize, height: usize) -> Result<gst::Buffer, String> {
    let desc = format!(
        "filesrc location=\"{}\" ! decodebin ! videoconvert ! videoscale ! \
         video/x-raw,format=NV12,width={width},height={height},pixel-aspect-ratio=1/1 ! appsink name=sink sync=false",
        data_dir().join(name).display()
    );
    let pipeline = gst::parse::launch(&desc)
        .map_err(|e| e.to_string())?
        .downcast::<gst::Pipeline>()
        .unwrap();
    let sink = pipeline.by_name("sink").unwrap();
    pipeline
        .set_state(gst::State::Playing)
        .map_err(|e| e.to_string())?;
    let sample = sink.emit_by_name::<Option<gst::Sample>>("pull-sample", &[]);
    pipeline.set_state(gst::State::Null).ok();
    let sample = sample.ok_or(format!("could not decode {name}"))?;
    Ok(sample.buffer_owned().unwrap())
}

/// Eight distinct frames: four photos, each plain and with deterministic noise.
fn make_frames(width: usize, height: usize) -> Result<Vec<gst::Buffer>, String> {
    let mut frames = Vec::new();
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    for name in ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"] {
        let clean = decode_photo(name, width, height)?;
        let mut noisy = clean.copy_deep().map_err(|e| e.to_string())?;
        {
            let nb = noisy.make_mut();
            let mut map = nb.map_writable().map_err(|e| e.to_string())?;
            for v in map.iter_mut() {
                seed ^= seed >> 12;
                seed ^= seed << 25;
                seed ^= seed >> 27;
                let n = ((seed.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 61) as i32) - 3;
                *v = (*v as i32 + n).clamp(0, 255) as u8;
            }
        }
        frames.push(clean);
        frames.push(noisy);
    }
    Ok(frames)
}

/// Page-locked memory backing a GstMemory, as upstream gets it from toonflow's proposed pool.
struct Pinned(gsttoonflow::cuda::PinnedHostBuffer);

impl AsMut<[u8]> for Pinned {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// Copies the frames into page-locked buffers (keeping their video meta, if any).
fn pin_frames(frames: &[gst::Buffer]) -> Result<Vec<gst::Buffer>, String> {
    frames
        .iter()
        .map(|f| {
            let map = f.map_readable().map_err(|e| e.to_string())?;
            let mut pinned = gsttoonflow::cuda::PinnedHostBuffer::new(0, map.len())
                .map_err(|e| e.to_string())?;
            pinned.copy_from_slice(&map);
            let mut b = gst::Buffer::new();
            b.get_mut()
                .unwrap()
                .append_memory(gst::Memory::from_mut_slice(Pinned(pinned)));
            Ok(b)
        })
        .collect()
}

#[derive(Clone, Debug, Default)]
struct RunResult {
    fps: f64,
    p50_us: f64,
    p99_us: f64,
    launches: u32,
    arena_bytes: u64,
    gpu_time_us: f64,
    graph_replayed: bool,
    backend: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// One measured run: `warmup` frames, then `frames` frames timed, through `filter`.
fn run_once(
    filter: &str,
    width: usize,
    height: usize,
    frames: &[gst::Buffer],
    warmup: usize,
    count: usize,
    deadline: Duration,
) -> Result<RunResult, String> {
    let desc = format!(
        "appsrc name=src format=time is-live=false block=true max-buffers=4 \
         caps=video/x-raw,format=NV12,width={width},height={height},framerate=30/1 ! \
         {filter} ! fakesink name=sink sync=false async=false"
    );
    let pipeline = gst::parse::launch(&desc)
        .map_err(|e| e.to_string())?
        .downcast::<gst::Pipeline>()
        .unwrap();
    let src = pipeline.by_name("src").unwrap();
    let sink = pipeline.by_name("sink").unwrap();
    let toon = pipeline.by_name("t");

    // Latency: time from the frame entering the filter chain to it reaching the sink.
    let entered: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let done = Arc::new((Mutex::new(0usize), std::sync::Condvar::new()));
    {
        let entered_at_src = entered.clone();
        let srcpad = src.static_pad("src").unwrap();
        srcpad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
            if let Some(b) = info.buffer() {
                entered_at_src
                    .lock()
                    .unwrap()
                    .insert(b.pts().map_or(0, |t| t.nseconds()), Instant::now());
            }
            gst::PadProbeReturn::Ok
        });
        let (entered, latencies, done) = (entered.clone(), latencies.clone(), done.clone());
        sink.static_pad("sink")
            .unwrap()
            .add_probe(gst::PadProbeType::BUFFER, move |_, info| {
                if let Some(b) = info.buffer() {
                    let key = b.pts().map_or(0, |t| t.nseconds());
                    if let Some(t0) = entered.lock().unwrap().remove(&key) {
                        latencies
                            .lock()
                            .unwrap()
                            .push(t0.elapsed().as_secs_f64() * 1e6);
                    }
                    let (lock, cv) = &*done;
                    *lock.lock().unwrap() += 1;
                    cv.notify_all();
                }
                gst::PadProbeReturn::Ok
            });
    }
    pipeline
        .set_state(gst::State::Playing)
        .map_err(|e| format!("cannot start {filter}: {e}"))?;
    let bus = pipeline.bus().unwrap();
    // An error stops the element's streaming thread while the push below may be blocked on
    // a full appsrc (block=true): a watcher takes the error off the bus and stops the
    // pipeline, which unblocks the push, and the run reports the error.
    let failed: Arc<Mutex<Option<String>>> = Arc::default();
    let stop_watching = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (bus, failed, stop) = (bus.clone(), failed.clone(), stop_watching.clone());
        let pipeline = pipeline.downgrade();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let Some(msg) = bus.timed_pop_filtered(
                    gst::ClockTime::from_mseconds(100),
                    &[gst::MessageType::Error],
                ) else {
                    continue;
                };
                if let gst::MessageView::Error(e) = msg.view() {
                    *failed.lock().unwrap() =
                        Some(format!("{}: {}", e.error(), e.debug().unwrap_or_default()));
                }
                if let Some(p) = pipeline.upgrade() {
                    p.set_state(gst::State::Null).ok();
                }
                return;
            }
        })
    };
    let failure = || failed.lock().unwrap().clone();
    let frame_duration = gst::ClockTime::from_nseconds(33_333_333);
    let check_bus = || -> Result<(), String> { failure().map_or(Ok(()), Err) };
    let wait_for = |n: usize| -> Result<(), String> {
        let (lock, cv) = &*done;
        let mut got = lock.lock().unwrap();
        let deadline = Instant::now() + deadline;
        while *got < n {
            let (g, _) = cv.wait_timeout(got, Duration::from_millis(200)).unwrap();
            got = g;
            if *got < n {
                check_bus()?;
                if Instant::now() > deadline {
                    return Err("timed out".into());
                }
            }
        }
        Ok(())
    };
    let push = |i: usize| -> Result<(), String> {
        let mut b = frames[i % frames.len()].copy();
        {
            let b = b.make_mut();
            b.set_pts(frame_duration * i as u64);
            b.set_duration(frame_duration);
        }
        let r = src.emit_by_name::<gst::FlowReturn>("push-buffer", &[&b]);
        if r != gst::FlowReturn::Ok {
            check_bus()?;
            return Err(format!("push-buffer returned {r:?}"));
        }
        Ok(())
    };
    let result = (|| {
        for i in 0..warmup {
            push(i)?;
        }
        wait_for(warmup)?;
        latencies.lock().unwrap().clear();
        let start = Instant::now();
        for i in warmup..warmup + count {
            push(i)?;
        }
        wait_for(warmup + count)?;
        let elapsed = start.elapsed().as_secs_f64();
        let mut lat = latencies.lock().unwrap().clone();
        lat.sort_by(|a, b| a.total_cmp(b));
        let mut r = RunResult {
            fps: count as f64 / elapsed,
            p50_us: percentile_of_sorted(&lat, 50.0),
            p99_us: percentile_of_sorted(&lat, 99.0),
            ..Default::default()
        };
        if let Some(t) = &toon {
            let s = t.property::<gst::Structure>("stats");
            r.backend = s.get::<String>("backend").unwrap_or_default();
            r.launches = s.get::<u32>("launches").unwrap_or(0);
            r.arena_bytes = s.get::<u64>("arena-bytes").unwrap_or(0);
            r.gpu_time_us = s.get::<f64>("gpu-time-us").unwrap_or(0.0);
            r.graph_replayed = s.get::<bool>("graph-replayed").unwrap_or(false);
        } else {
            r.backend = "frei0r".into();
        }
        Ok(r)
    })();
    let _ = src.emit_by_name::<gst::FlowReturn>("end-of-stream", &[]);
    pipeline.set_state(gst::State::Null).ok();
    stop_watching.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().ok();
    // an error the watcher saw last (a push that returned Flushing because of it)
    result.map_err(|e| failure().unwrap_or(e))
}

/// Runs a real-pipeline mode (see real.rs) in the first precision, prints its rows and adds
/// them to the JSON `rows`.
/// `inputs`: the frames, the pinned frames, the neural element's properties (or "").
fn real_rows(
    mode: &str,
    w: usize,
    h: usize,
    label: &str,
    opts: &Options,
    inputs: (&[gst::Buffer], &Result<Vec<gst::Buffer>, String>, &str),
    rows: &mut Vec<String>,
) {
    let (frames, pinned, toonflow_props) = inputs;
    if mode == "host-copies" {
        match real::host_copies(w, h) {
            Ok(copies) => {
                for (name, us) in &copies {
                    println!("{label:<10} host-copies {name:<48} {us:>8.1} µs");
                }
                rows.push(format!(
                    "{{\"size\":\"{}\",\"mode\":\"host-copies\",\"copies_us\":{{{}}}}}",
                    json_escape(label),
                    copies
                        .iter()
                        .map(|(n, us)| format!("\"{}\":{us:.1}", json_escape(n)))
                        .collect::<Vec<_>>()
                        .join(",")
                ));
            }
            Err(e) => println!("{label:<10} host-copies failed: {e}"),
        }
        return;
    }
    let Ok(pinned) = pinned else {
        println!("{label:<10} {mode:<11} skipped: no pinned frames");
        return;
    };
    for overlap in &opts.overlap {
        let props = match overlap {
            Some(on) => format!("{toonflow_props} overlap={on}"),
            None => toonflow_props.to_string(),
        };
        let inputs = (frames, pinned.as_slice(), props.as_str());
        real_mode_rows(mode, w, h, label, opts, inputs, *overlap, rows);
    }
}

/// The rows of one real-pipeline mode with these toonflow properties.
#[allow(clippy::too_many_arguments)]
fn real_mode_rows(
    mode: &str,
    w: usize,
    h: usize,
    label: &str,
    opts: &Options,
    inputs: (&[gst::Buffer], &[gst::Buffer], &str),
    overlap: Option<bool>,
    rows: &mut Vec<String>,
) {
    let (frames, pinned, toonflow_props) = inputs;
    let precision = opts.precisions.first().map_or("fp16", |p| p.as_str());
    let measured = (0..opts.reps.max(1))
        .map(|_| {
            real::run_mode(
                mode,
                w,
                h,
                precision,
                frames,
                pinned,
                toonflow_props,
                opts.frames,
                Duration::from_secs(300),
                opts.pace,
            )
        })
        .collect::<Result<Vec<_>, _>>();
    let runs = match measured {
        Ok(runs) => runs,
        Err(e) => {
            println!("{label:<10} {mode:<11} {precision:<5} {e}");
            return;
        }
    };
    // One row per instance count (density), each the median over the repetitions.
    for i in 0..runs[0].len() {
        let pick = |f: fn(&real::Measured) -> f64| median(runs.iter().map(|r| f(&r[i])).collect());
        let (fps, p50, p99) = (pick(|m| m.fps), pick(|m| m.p50_us), pick(|m| m.p99_us));
        let (up, down, gpu) = (
            pick(|m| m.upload_us),
            pick(|m| m.download_us),
            pick(|m| m.gpu_us),
        );
        let n = runs[0][i].instances;
        let mut name = if mode == "density" {
            format!("density-{n}")
        } else {
            mode.to_string()
        };
        let paced = opts
            .pace
            .filter(|_| mode.starts_with("appsrc") || mode == "density");
        if let Some(fps) = paced {
            name += &format!(" paced={fps}");
        }
        let pace_json = paced.map_or("null".to_string(), |f| format!("{f}"));
        let overlap_json = match overlap {
            Some(on) => {
                name += if on { " overlap=on" } else { " overlap=off" };
                on.to_string()
            }
            None => "null".to_string(),
        };
        println!(
            "{label:<10} {name:<30} {precision:<5} {:>10} fps  p50 {p50:>6.0} µs  p99 {p99:>6.0} µs  \
             upload {up:>6.1} µs  download {down:>6.1} µs  gpu {gpu:>6.1} µs",
            fps_text(fps)
        );
        rows.push(format!(
            "{{\"model\":null,\"size\":\"{}\",\"width\":{w},\"height\":{h},\"mode\":\"{}\",\"precision\":\"{}\",\
             \"instances\":{n},\"overlap\":{overlap_json},\"pace_fps\":{pace_json},\"fps_median\":{fps:.3},\"fps_runs\":[{}],\"latency_p50_us\":{p50:.1},\"latency_p99_us\":{p99:.1},\
             \"upload_us\":{up:.1},\"download_us\":{down:.1},\"gpu_time_us\":{gpu:.2},\"frames_per_run\":{},\"runs\":{}}}",
            json_escape(label),
            json_escape(&name),
            json_escape(precision),
            runs.iter().map(|r| format!("{:.3}", r[i].fps)).collect::<Vec<_>>().join(","),
            opts.frames,
            runs.len()
        ));
    }
}

/// One decimal, or three significant digits below 10 fps (the neural CPU reference runs at
/// 0.01–0.1 fps).
fn fps_text(fps: f64) -> String {
    if fps >= 10.0 || fps == 0.0 {
        format!("{fps:.1}")
    } else {
        let decimals = (2 - fps.log10().floor() as i32).clamp(1, 6) as usize;
        format!("{fps:.decimals$}")
    }
}

/// ` model="PATH"` for a launch line (quotes and backslashes escaped as gst-launch reads them).
fn model_property(path: &std::path::Path) -> String {
    let p = path.display().to_string();
    format!(
        " model=\"{}\"",
        p.replace('\\', "\\\\").replace('"', "\\\"")
    )
}

/// A tightly packed copy of a frame buffer in GStreamer's default NV12 layout.
fn packed_nv12(buffer: &gst::Buffer, width: usize, height: usize) -> Result<Vec<u8>, String> {
    let info =
        gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, width as u32, height as u32)
            .build()
            .map_err(|e| e.to_string())?;
    let map = buffer.map_readable().map_err(|e| e.to_string())?;
    if map.len() < info.size() {
        return Err(format!(
            "frame holds {} bytes, NV12 needs {}",
            map.len(),
            info.size()
        ));
    }
    let (ys, uvs, uvo) = (
        info.stride()[0] as usize,
        info.stride()[1] as usize,
        info.offset()[1],
    );
    let mut out = Vec::with_capacity(width * height * 3 / 2);
    for r in 0..height {
        out.extend_from_slice(&map[r * ys..][..width]);
    }
    for r in 0..height / 2 {
        out.extend_from_slice(&map[uvo + r * uvs..][..width]);
    }
    Ok(out)
}

/// Nanoseconds the threads of this process have run on a CPU so far (Linux schedstat; `None`
/// elsewhere). Threads that have exited are not counted, so measure while they live.
fn process_cpu_ns() -> Option<u64> {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

/// The two CPU paths outside GStreamer on the same frames: the median time of each stage per
/// frame, fast path against the reference, printed as a table; returns the JSON fields.
fn cpu_stages(
    width: usize,
    height: usize,
    frames: &[gst::Buffer],
    reference_frames: usize,
    reps: usize,
    with_reference: bool,
) -> Result<String, String> {
    use gsttoonflow::pipeline::cpu::StageTimes;
    use gsttoonflow::pipeline::fast::CpuClassic;
    use gsttoonflow::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut, StageParams, ToonParams};
    let geometry = FrameGeometry::new(width, height)?;
    let params = ToonParams::new(&StageParams::default(), width as u32, height as u32);
    let packed: Vec<Vec<u8>> = frames
        .iter()
        .map(|b| packed_nv12(b, width, height))
        .collect::<Result<_, _>>()?;
    let mut out = vec![0u8; geometry.nv12_bytes()];
    // Per path: each stage's per-frame times (ms), whole frames (ms) over all repetitions, and
    // the CPU time of all threads per frame (ms, median over repetitions).
    type Measured = (Vec<Vec<f64>>, Vec<f64>, f64);
    let mut measure = |reference: bool, count: usize| -> Result<Measured, String> {
        let mut stages = vec![Vec::new(); StageTimes::NAMES.len()];
        let mut totals = Vec::new();
        let mut cpu_ms = Vec::new();
        for _ in 0..reps.max(1) {
            let mut cpu = CpuClassic::new(geometry, params.history as usize, reference);
            let mut cpu_start = None;
            for i in 0..count + 1 {
                if i == 1 {
                    cpu_start = process_cpu_ns();
                }
                let input = Nv12Frame::packed(geometry, &packed[i % packed.len()])?;
                let mut output = Nv12FrameMut::packed(geometry, &mut out)?;
                let t = Instant::now();
                cpu.process(&params, &input, &mut output);
                let total = t.elapsed().as_secs_f64() * 1e3;
                if i == 0 {
                    continue; // warm-up
                }
                totals.push(total);
                for (s, d) in stages.iter_mut().zip(cpu.last_stage_times().as_array()) {
                    s.push(d.as_secs_f64() * 1e3);
                }
            }
            if let (Some(a), Some(b)) = (cpu_start, process_cpu_ns()) {
                cpu_ms.push(b.saturating_sub(a) as f64 / 1e6 / count as f64);
            }
        }
        Ok((stages, totals, median(cpu_ms)))
    };
    // cpu-fast-stages leaves the reference out (a quicker look at the fast path alone).
    let (ref_stages, ref_total, ref_cpu) = if with_reference {
        measure(true, reference_frames)?
    } else {
        (vec![vec![0.0]; StageTimes::NAMES.len()], vec![0.0], 0.0)
    };
    let (fast_stages, fast_total, fast_cpu) = measure(false, 10 * reference_frames)?;
    println!(
        "  {width}x{height} stages, ms per frame (median; reference {} frames, fast {} frames):",
        ref_total.len(),
        fast_total.len()
    );
    println!(
        "  {:<24} {:>12} {:>10} {:>9}",
        "stage", "reference", "fast", "speed-up"
    );
    let mut json = Vec::new();
    let rows = StageTimes::NAMES
        .iter()
        .zip(ref_stages.into_iter().zip(fast_stages))
        .map(|(name, (r, f))| (name.to_string(), median(r), median(f)))
        .chain([
            ("frame".to_string(), median(ref_total), median(fast_total)),
            // All threads' CPU time: what a frame costs whatever else loads the machine.
            ("frame CPU time".to_string(), ref_cpu, fast_cpu),
        ]);
    for (name, r, f) in rows {
        println!("  {name:<24} {r:>12.2} {f:>10.2} {:>8.1}x", r / f.max(1e-9));
        json.push(format!(
            "{{\"stage\":\"{}\",\"reference_ms\":{r:.3},\"fast_ms\":{f:.3}}}",
            json_escape(&name)
        ));
    }
    Ok(format!("\"stages\":[{}]", json.join(",")))
}

/// `s` as the inside of a JSON string: quote, backslash and every control character escaped.
fn json_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\u{:04x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out
}

fn main() {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("{e}");
            }
            eprintln!("{USAGE}");
            std::process::exit(if e.is_empty() { 0 } else { 2 });
        }
    };
    gst::init().expect("GStreamer init");
    gsttoonflow::plugin_register_static().expect("register toonflow");
    let cuda = gsttoonflow::cuda::probe(0);
    let frei0r = gst::ElementFactory::find("frei0r-filter-cartoon").is_some();
    let device = match &cuda {
        Ok(name) => name.clone(),
        Err(e) => format!("no CUDA ({e})"),
    };
    let host = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The neural stage's model, checked once here so a bad file is one clear error.
    let model = match &opts.model {
        Some(path) => match gsttoonflow::neural::engine::NeuralModel::load(path) {
            Ok(m) => {
                println!(
                    "model: {} ({}): size multiple {}, {} bytes of weights",
                    m.name(),
                    path.display(),
                    m.size_multiple(),
                    m.weight_bytes()
                );
                Some((m.name().to_string(), model_property(path)))
            }
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        },
        None => None,
    };
    let mut model_prop = match (&model, opts.model_scale) {
        (Some((_, p)), Some(scale)) => format!("{p} model-scale={scale}"),
        (Some((_, p)), None) => p.clone(),
        (None, _) => String::new(),
    };
    for set in &opts.set {
        model_prop += &format!(" {set}");
    }
    println!(
        "toonflow-bench: device: {device}; host: {host} cores; frames of real content (4 photos, plain and noised)"
    );
    println!(
        "{:<10} {:<11} {:<5} {:>10} {:>10} {:>10} {:>9} {:>10} {:>10} {:>6}",
        "size",
        "mode",
        "prec",
        "fps",
        "p50 µs",
        "p99 µs",
        "launches",
        "arena MB",
        "gpu µs",
        "graph"
    );
    let mut rows = Vec::new();
    let mut stage_rows = Vec::new();
    for (w, h, label) in &opts.sizes {
        let frames = match make_frames(*w, *h) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("{label}: {e}");
                continue;
            }
        };
        // What an upstream element that takes toonflow's proposed pool hands it.
        let pinned = if cuda.is_ok() {
            pin_frames(&frames)
        } else {
            Err(String::new())
        };
        for mode in &opts.modes {
            let configs: Vec<(String, String)> = match mode.as_str() {
                "cpu" => vec![(
                    "fp32".into(),
                    format!("toonflow name=t backend=cpu{model_prop}"),
                )],
                "cpu-reference" => vec![(
                    "fp32".into(),
                    format!("toonflow name=t backend=cpu-reference{model_prop}"),
                )],
                "cpu-stages" | "cpu-fast-stages" => {
                    let with_reference = mode == "cpu-stages";
                    let (w, h, n) = (*w, *h, opts.cpu_frames.max(2));
                    match cpu_stages(w, h, &frames, n, opts.reps, with_reference) {
                        Ok(json) => stage_rows.push(format!(
                            "{{\"size\":\"{}\",\"width\":{w},\"height\":{h},{json}}}",
                            json_escape(label)
                        )),
                        Err(e) => println!("{label:<10} {mode:<11} failed: {e}"),
                    }
                    continue;
                }
                "frei0r" if frei0r => vec![(
                    "-".into(),
                    "videoconvert ! video/x-raw,format=BGRA ! frei0r-filter-cartoon ! videoconvert ! video/x-raw,format=NV12"
                        .into(),
                )],
                "frei0r" => {
                    println!("{label:<10} {mode:<11} skipped: frei0r-filter-cartoon not installed");
                    continue;
                }
                m if real::MODES.contains(&m) => {
                    if cuda.is_err() {
                        println!("{label:<10} {mode:<11} skipped: no CUDA device");
                    } else {
                        let inputs = (&frames[..], &pinned, model_prop.as_str());
                        real_rows(mode, *w, *h, label, &opts, inputs, &mut rows);
                    }
                    continue;
                }
                "cuda-eager" | "cuda-graph" if cuda.is_err() => {
                    println!("{label:<10} {mode:<11} skipped: no CUDA device");
                    continue;
                }
                "cuda-eager" | "cuda-graph" => opts
                    .precisions
                    .iter()
                    .map(|p| {
                        (
                            p.clone(),
                            format!(
                                "toonflow name=t backend=cuda precision={p} cuda-graph={}{model_prop}",
                                mode == "cuda-graph"
                            ),
                        )
                    })
                    .collect(),
                other => {
                    eprintln!("unknown mode {other}");
                    continue;
                }
            };
            for (precision, filter) in configs {
                let slow = mode.starts_with("cpu") || mode == "frei0r";
                let count = match mode.as_str() {
                    // the network on the CPU takes seconds a frame
                    "cpu" | "cpu-reference" if model.is_some() => opts.cpu_frames.max(1),
                    "cpu-reference" => opts.cpu_frames.max(2),
                    "cpu" | "frei0r" => 10 * opts.cpu_frames.max(2),
                    _ => opts.frames,
                };
                let warmup = if slow { 1 } else { 50 };
                // the neural CPU reference: minutes a frame at 4K on a small machine
                let deadline = if model.is_some() && mode == "cpu" {
                    Duration::from_secs(600 * (warmup + count) as u64)
                } else {
                    Duration::from_secs(600)
                };
                let input = match (&pinned, slow) {
                    (Ok(p), false) => p.as_slice(),
                    _ => frames.as_slice(),
                };
                let runs: Vec<RunResult> = (0..opts.reps.max(1))
                    .map_while(|_| {
                        match run_once(&filter, *w, *h, input, warmup, count, deadline) {
                            Ok(r) => Some(r),
                            Err(e) => {
                                println!("{label:<10} {mode:<11} {precision:<5} failed: {e}");
                                None
                            }
                        }
                    })
                    .collect();
                if runs.is_empty() {
                    continue;
                }
                let fps = median(runs.iter().map(|r| r.fps).collect());
                let p50 = median(runs.iter().map(|r| r.p50_us).collect());
                let p99 = median(runs.iter().map(|r| r.p99_us).collect());
                let gpu = median(runs.iter().map(|r| r.gpu_time_us).collect());
                let last = runs.last().unwrap();
                println!(
                    "{:<10} {:<11} {:<5} {:>10} {:>10.0} {:>10.0} {:>9} {:>10.1} {:>10.1} {:>6}",
                    label,
                    mode,
                    precision,
                    fps_text(fps),
                    p50,
                    p99,
                    last.launches,
                    last.arena_bytes as f64 / 1e6,
                    gpu,
                    last.graph_replayed
                );
                rows.push(format!(
                    "{{\"model\":{},\"size\":\"{}\",\"width\":{w},\"height\":{h},\"mode\":\"{}\",\"precision\":\"{}\",\"fps_median\":{fps:.3},\
                     \"fps_runs\":[{}],\"latency_p50_us\":{p50:.1},\"latency_p99_us\":{p99:.1},\"launches\":{},\
                     \"arena_bytes\":{},\"gpu_time_us\":{gpu:.2},\"graph_replayed\":{},\"frames_per_run\":{count},\"runs\":{}}}",
                    model.as_ref().map_or("null".to_string(), |(n, _)| format!("\"{}\"", json_escape(n))),
                    json_escape(label),
                    json_escape(mode),
                    json_escape(&precision),
                    runs.iter().map(|r| format!("{:.3}", r.fps)).collect::<Vec<_>>().join(","),
                    last.launches,
                    last.arena_bytes,
                    last.graph_replayed,
                    runs.len()
                ));
            }
        }
    }
    let json = format!(
        "{{\"device\":\"{}\",\"host_cores\":{host},\"results\":[{}],\"cpu_stages\":[{}]}}",
        json_escape(&device),
        rows.join(","),
        stage_rows.join(",")
    );
    match &opts.json {
        Some(path) => {
            if let Err(e) = std::fs::write(path, &json) {
                eprintln!("cannot write {}: {e}", path.display());
                std::process::exit(1);
            }
        }
        None => println!("{json}"),
    }
    if rows.is_empty() && stage_rows.is_empty() {
        eprintln!("no configuration ran");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::{fps_text, json_escape};

    #[test]
    fn slow_rates_keep_three_significant_digits() {
        assert_eq!(fps_text(3341.04), "3341.0");
        assert_eq!(fps_text(9.377), "9.38");
        assert_eq!(fps_text(0.0901), "0.0901");
        assert_eq!(fps_text(0.0041), "0.00410");
        assert_eq!(fps_text(0.0), "0.0");
    }

    #[test]
    fn json_strings_escape_quotes_backslashes_and_control_characters() {
        assert_eq!(json_escape("NVIDIA H200"), "NVIDIA H200");
        assert_eq!(json_escape(r#"a "b" \ c"#), r#"a \"b\" \\ c"#);
        assert_eq!(json_escape("l1\nl2\r\t"), r"l1\nl2\r\t");
        assert_eq!(
            json_escape("\u{0}\u{1b}[0m\u{7f}"),
            r"\u0000\u001b[0m\u007f"
        );
        assert_eq!(json_escape("é ✓"), "é ✓");
    }
}
