//! The pipelines people run (issue 12): toonflow fed the way real upstream elements feed it,
//! timed at the element's own pads (throughput and latency of the element inside the
//! pipeline), density (N instances in one process), and the host-copy paths (page-locked,
//! pageable, registered, staged in bands) that decide how frames in foreign host memory are uploaded.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use gst::prelude::*;
use gsttoonflow::cuda::staging::{HostPlane, StagedUpload};
use gsttoonflow::pipeline::stats::percentile_of_sorted;

/// The modes this module runs.
pub const MODES: [&str; 14] = [
    "videotestsrc",
    "rawvideoparse",
    "rawvideoparse-only",
    "appsrc-pinned",
    "appsrc-pageable",
    "appsrc-fresh",
    "nvh264dec",
    "nvh264dec-cudadownload",
    "nvh264dec-cuda",
    "nvh264dec-only",
    "nvh264dec-cudadownload-only",
    "nvh264dec-cuda-only",
    "density",
    "host-copies",
];

/// Instance counts of the density mode.
pub const DENSITY: [usize; 4] = [1, 4, 8, 16];

/// One row: `instances` pipelines in one process.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    pub instances: usize,
    /// Frames per second out of all instances together.
    pub fps: f64,
    /// Time from a frame entering toonflow's sink pad to leaving its source pad.
    pub p50_us: f64,
    pub p99_us: f64,
    /// The element's own figures for its last frame (instance 0).
    pub upload_us: f64,
    pub download_us: f64,
    pub gpu_us: f64,
}

/// How frames enter a pipeline.
#[derive(Clone)]
enum Feed {
    /// The source produces them (videotestsrc, a file, a decoder).
    Source,
    /// An application thread pushes these frames into `appsrc name=src`, in turn; `fresh`
    /// copies each into a new allocation first, as an application that allocates per frame.
    Push {
        frames: Vec<gst::Buffer>,
        fresh: bool,
        /// Frames per second the application keeps to (`--pace`), as a live source would;
        /// `None`: as fast as the pipeline takes them.
        pace: Option<f64>,
    },
}

#[derive(Default)]
struct Timing {
    entered: VecDeque<Instant>,
    latencies_us: Vec<f64>,
    out_times: Vec<Instant>,
}

/// Runs `pipelines` (launch lines with `toonflow name=t`) at once until each has passed
/// `warmup + count` frames through toonflow, and measures the `count` frames after warm-up.
fn measure(
    pipelines: &[(String, Feed)],
    warmup: usize,
    count: usize,
    deadline: Duration,
) -> Result<Measured, String> {
    let total = warmup + count;
    let done = Arc::new((Mutex::new(0usize), Condvar::new()));
    let mut running = Vec::new();
    for (desc, feed) in pipelines {
        let pipeline = gst::parse::launch(desc)
            .map_err(|e| format!("{desc}: {e}"))?
            .downcast::<gst::Pipeline>()
            .map_err(|_| "not a pipeline".to_string())?;
        let toon = pipeline.by_name("t").ok_or("no element named t")?;
        let timing: Arc<Mutex<Timing>> = Arc::default();
        let t = timing.clone();
        toon.static_pad("sink")
            .unwrap()
            .add_probe(gst::PadProbeType::BUFFER, move |_, _| {
                t.lock().unwrap().entered.push_back(Instant::now());
                gst::PadProbeReturn::Ok
            });
        let (t, done) = (timing.clone(), done.clone());
        toon.static_pad("src")
            .unwrap()
            .add_probe(gst::PadProbeType::BUFFER, move |_, _| {
                let now = Instant::now();
                let mut t = t.lock().unwrap();
                if t.out_times.len() < total {
                    if let Some(t0) = t.entered.pop_front() {
                        t.latencies_us.push((now - t0).as_secs_f64() * 1e6);
                    }
                    t.out_times.push(now);
                    if t.out_times.len() == total {
                        let (lock, cv) = &*done;
                        *lock.lock().unwrap() += 1;
                        cv.notify_all();
                    }
                }
                gst::PadProbeReturn::Ok
            });
        running.push((pipeline, toon, timing, feed.clone()));
    }
    let bus_error = |p: &gst::Pipeline| -> Option<String> {
        let msg = p.bus()?.pop_filtered(&[gst::MessageType::Error])?;
        match msg.view() {
            gst::MessageView::Error(e) => {
                Some(format!("{}: {}", e.error(), e.debug().unwrap_or_default()))
            }
            _ => None,
        }
    };
    let result = (|| {
        for (p, ..) in &running {
            p.set_state(gst::State::Playing)
                .map_err(|e| format!("cannot start: {e}: {}", bus_error(p).unwrap_or_default()))?;
        }
        std::thread::scope(|scope| {
            for (p, _, _, feed) in &running {
                if let Feed::Push {
                    frames,
                    fresh,
                    pace,
                } = feed
                {
                    let src = p.by_name("src").unwrap();
                    scope.spawn(move || push_frames(&src, frames, *fresh, *pace, total));
                }
            }
            let (lock, cv) = &*done;
            let mut finished = lock.lock().unwrap();
            let end = Instant::now() + deadline;
            while *finished < running.len() {
                finished = cv
                    .wait_timeout(finished, Duration::from_millis(200))
                    .unwrap()
                    .0;
                if let Some(e) = running.iter().find_map(|(p, ..)| bus_error(p)) {
                    return Err(e);
                }
                if Instant::now() > end {
                    return Err("timed out".to_string());
                }
            }
            Ok(())
        })?;
        let mut latencies = Vec::new();
        let (mut first, mut last) = (None::<Instant>, None::<Instant>);
        for (_, _, timing, _) in &running {
            let t = timing.lock().unwrap();
            latencies.extend_from_slice(&t.latencies_us[warmup..]);
            let (a, b) = (t.out_times[warmup - 1], t.out_times[total - 1]);
            first = Some(first.map_or(a, |f| f.min(a)));
            last = Some(last.map_or(b, |l| l.max(b)));
        }
        latencies.sort_by(|a, b| a.total_cmp(b));
        let seconds = (last.unwrap() - first.unwrap()).as_secs_f64();
        // The decoder-only modes time an `identity` in toonflow's place: no stats there.
        let stats = (running[0].1.find_property("stats").is_some())
            .then(|| running[0].1.property::<gst::Structure>("stats"));
        let field = |name: &str| {
            stats
                .as_ref()
                .and_then(|s| s.get::<f64>(name).ok())
                .unwrap_or(0.0)
        };
        Ok(Measured {
            instances: running.len(),
            fps: (count * running.len()) as f64 / seconds,
            p50_us: percentile_of_sorted(&latencies, 50.0),
            p99_us: percentile_of_sorted(&latencies, 99.0),
            upload_us: field("upload-time-us"),
            download_us: field("download-time-us"),
            gpu_us: field("gpu-time-us"),
        })
    })();
    for (p, ..) in &running {
        let _ = p.set_state(gst::State::Null);
    }
    result
}

/// The application thread of a `Feed::Push` pipeline; stops at the first refused push. With
/// `pace`, frames are pushed 1 / pace seconds apart, as a live source would; a push that comes
/// back late moves the schedule on (no burst to catch up).
fn push_frames(
    src: &gst::Element,
    frames: &[gst::Buffer],
    fresh: bool,
    pace: Option<f64>,
    total: usize,
) {
    let frame_duration = gst::ClockTime::from_nseconds(33_333_333);
    let mut due = Instant::now();
    for i in 0..total {
        if let Some(fps) = pace {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            } else {
                due = now;
            }
            due += Duration::from_secs_f64(1.0 / fps);
        }
        let template = &frames[i % frames.len()];
        let mut b = if fresh {
            template.copy_deep().expect("copy")
        } else {
            template.copy()
        };
        {
            let b = b.make_mut();
            b.set_pts(frame_duration * i as u64);
            b.set_duration(frame_duration);
        }
        if src.emit_by_name::<gst::FlowReturn>("push-buffer", &[&b]) != gst::FlowReturn::Ok {
            return;
        }
    }
    let _ = src.emit_by_name::<gst::FlowReturn>("end-of-stream", &[]);
}

/// `frames` packed tightly (no stride padding) into a file of NV12 frames, for rawvideoparse.
fn raw_file(w: usize, h: usize, frames: &[gst::Buffer]) -> Result<PathBuf, String> {
    let path = std::env::temp_dir().join(format!("toonflow-bench-{w}x{h}.nv12"));
    let mut bytes = Vec::new();
    for f in frames {
        bytes.extend_from_slice(&super::packed_nv12(f, w, h)?);
    }
    std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// An H.264 stream of `frames` frames (x264enc), for the decoder modes.
fn h264_file(w: usize, h: usize, frames: usize) -> Result<PathBuf, String> {
    let path = std::env::temp_dir().join(format!("toonflow-bench-{w}x{h}-{frames}.mp4"));
    if path.exists() {
        return Ok(path);
    }
    let desc = format!(
        "videotestsrc pattern=ball num-buffers={frames} ! video/x-raw,format=I420,width={w},height={h},framerate=30/1 ! \
         x264enc speed-preset=ultrafast key-int-max=60 ! h264parse ! mp4mux ! filesink location=\"{}\"",
        path.display()
    );
    let pipeline = gst::parse::launch(&desc).map_err(|e| e.to_string())?;
    pipeline
        .set_state(gst::State::Playing)
        .map_err(|e| e.to_string())?;
    let bus = pipeline.bus().unwrap();
    let msg = bus.timed_pop_filtered(
        gst::ClockTime::from_seconds(300),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    let _ = pipeline.set_state(gst::State::Null);
    match msg.as_ref().map(|m| m.view()) {
        Some(gst::MessageView::Eos(_)) => Ok(path),
        Some(gst::MessageView::Error(e)) => Err(format!("encoding the test stream: {}", e.error())),
        _ => Err("encoding the test stream timed out".into()),
    }
}

/// The rows of one real-pipeline mode at `w`×`h` (density: one row per instance count).
#[allow(clippy::too_many_arguments)]
pub fn run_mode(
    mode: &str,
    w: usize,
    h: usize,
    precision: &str,
    frames: &[gst::Buffer],
    pinned: &[gst::Buffer],
    toonflow_props: &str,
    count: usize,
    deadline: Duration,
    pace: Option<f64>,
) -> Result<Vec<Measured>, String> {
    let size = format!("format=NV12,width={w},height={h}");
    let caps = format!("video/x-raw,{size},framerate=30/1");
    // After a decoder: the stream's own frame rate.
    let decoded = format!("video/x-raw,{size}");
    // `toonflow_props`: e.g. the neural element's ` model="PATH" model-scale=0.5`
    let toon = format!(
        "toonflow name=t backend=cuda precision={precision} cuda-graph=true{toonflow_props}"
    );
    let sink = "fakesink sync=false async=false";
    let appsrc =
        format!("appsrc name=src format=time is-live=false block=true max-buffers=4 caps={caps}");
    let push = |frames: &[gst::Buffer], fresh: bool| {
        (
            format!("{appsrc} ! {toon} ! {sink}"),
            Feed::Push {
                frames: frames.to_vec(),
                fresh,
                pace,
            },
        )
    };
    let has = |f: &str| gst::ElementFactory::find(f).is_some();
    let decoder = |tail: &str| -> Result<(String, Feed), String> {
        if !has("nvh264dec") || !has("x264enc") {
            return Err("skipped: nvh264dec or x264enc not available".into());
        }
        let file = h264_file(w, h, 60 + count)?;
        Ok((
            format!(
                "filesrc location=\"{}\" ! qtdemux ! h264parse ! nvh264dec ! {tail}",
                file.display()
            ),
            Feed::Source,
        ))
    };
    // nvh264dec's output up to the queue, the element under test, what follows it.
    let via_cudadownload = format!("cudadownload ! {decoded}");
    let in_cuda = format!("video/x-raw(memory:CUDAMemory),{size}");
    let decode = |front: &str, element: &str, back: &str| {
        decoder(&format!(
            "{front} ! queue max-size-buffers=4 ! {element} ! {back}{sink}"
        ))
    };
    let warmup = 50;
    let one = match mode {
        "videotestsrc" => (
            format!(
                "videotestsrc pattern=solid-color foreground-color=0xff808080 ! {caps} ! \
                 queue max-size-buffers=4 ! {toon} ! {sink}"
            ),
            Feed::Source,
        ),
        // The source alone (`-only`: an `identity` where toonflow sits) says how much of the
        // mode's rate is the file reading and parsing.
        "rawvideoparse" | "rawvideoparse-only" => {
            let file = raw_file(w, h, frames)?;
            let element = if mode == "rawvideoparse" {
                toon.as_str()
            } else {
                "identity name=t"
            };
            (
                format!(
                    "multifilesrc location=\"{}\" loop=true ! rawvideoparse format=nv12 width={w} height={h} \
                     framerate=30/1 ! queue max-size-buffers=4 ! {element} ! {sink}",
                    file.display()
                ),
                Feed::Source,
            )
        }
        "appsrc-pinned" => push(pinned, false),
        "appsrc-pageable" => push(frames, false),
        "appsrc-fresh" => push(frames, true),
        "nvh264dec" => decode(&decoded, &toon, "")?,
        "nvh264dec-cudadownload" => decode(&via_cudadownload, &toon, "")?,
        "nvh264dec-cuda" => decode(
            &in_cuda,
            &toon,
            "video/x-raw(memory:CUDAMemory) ! cudadownload ! ",
        )?,
        // The decoder alone (an `identity` where toonflow sits): what NVDEC gives before
        // toonflow adds anything.
        "nvh264dec-only" => decode(&decoded, "identity name=t", "")?,
        "nvh264dec-cudadownload-only" => decode(&via_cudadownload, "identity name=t", "")?,
        "nvh264dec-cuda-only" => decode(&in_cuda, "identity name=t", "")?,
        "density" => {
            let mut rows = Vec::new();
            for n in DENSITY {
                let lines: Vec<_> = (0..n).map(|_| push(pinned, false)).collect();
                rows.push(measure(&lines, warmup, count, deadline)?);
            }
            return Ok(rows);
        }
        other => return Err(format!("unknown mode {other}")),
    };
    Ok(vec![measure(&[one], warmup, count, deadline)?])
}

/// Median wall time of `reps` runs of `f` in µs.
fn time_us(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The host-copy paths for one NV12 frame of `w`×`h`, each the median of many runs, as
/// (name, µs) pairs: what an upload or download from each kind of host memory costs.
pub fn host_copies(w: usize, h: usize) -> Result<Vec<(String, f64)>, String> {
    use cudarc::driver::sys;
    let bytes = w * h * 3 / 2;
    let ctx = gsttoonflow::cuda::context::context(0).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let cs = stream.cu_stream();
    let mut device: sys::CUdeviceptr = 0;
    // SAFETY: plain driver calls on the bound context; `device` receives the allocation,
    // freed at the end of this function.
    unsafe {
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        sys::cuMemAlloc_v2(&mut device, bytes)
            .result()
            .map_err(|e| e.to_string())?;
    }
    let mut pinned =
        gsttoonflow::cuda::PinnedHostBuffer::new(0, bytes).map_err(|e| e.to_string())?;
    let mut pageable = vec![1u8; bytes];
    let mut rows = Vec::new();
    let reps = 200;
    let sync = || {
        // SAFETY: the stream lives for this function.
        unsafe { sys::cuStreamSynchronize(cs) };
    };
    // SAFETY (every closure below): `device` holds `bytes` bytes; the host buffers hold
    // `bytes` bytes and outlive the copies, each synchronised before the next step.
    let h2d = |src: *const u8| unsafe {
        sys::cuMemcpyHtoDAsync_v2(device, src as *const _, bytes, cs);
        sync();
    };
    let d2h = |dst: *mut u8| unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst as *mut _, device, bytes, cs);
        sync();
    };
    rows.push((
        "upload, page-locked".into(),
        time_us(reps, || h2d(pinned.as_ptr())),
    ));
    rows.push((
        "upload, pageable (driver staging)".into(),
        time_us(reps, || h2d(pageable.as_ptr())),
    ));
    rows.push((
        "download, page-locked".into(),
        time_us(reps, || d2h(pinned.as_mut_ptr())),
    ));
    rows.push((
        "download, pageable (driver staging)".into(),
        time_us(reps, || d2h(pageable.as_mut_ptr())),
    ));
    // Staged in bands by toonflow's copier (the element's path for pageable frames).
    let planes = [
        HostPlane {
            ptr: pageable.as_ptr(),
            stride: w,
            rows: h,
        },
        HostPlane {
            ptr: pageable[w * h..].as_ptr(),
            stride: w,
            rows: h / 2,
        },
    ];
    for threads in [1, 2, 3, 4, 6, 8] {
        let mut stager =
            StagedUpload::new(ctx.clone(), threads, w, &[h, h / 2]).map_err(|e| e.to_string())?;
        rows.push((
            format!("upload, staged in bands by {threads} thread(s)"),
            // SAFETY: `pageable` holds both planes; `device` holds the frame; each upload is
            // synchronised before the next.
            time_us(reps, || unsafe {
                let _ = stager.upload(cs, &planes, &[true, true], device);
                sync();
            }),
        ));
    }
    let addr = pageable.as_mut_ptr();
    rows.push((
        "register + unregister (once per buffer)".into(),
        // SAFETY: `pageable` stays allocated; every registration is undone at once.
        time_us(20, || unsafe {
            sys::cuMemHostRegister_v2(addr as *mut _, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE);
            sys::cuMemHostUnregister(addr as *mut _);
        }),
    ));
    // SAFETY: as above; unregistered before `pageable` is dropped.
    unsafe {
        sys::cuMemHostRegister_v2(addr as *mut _, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE)
            .result()
            .map_err(|e| e.to_string())?;
    }
    rows.push(("upload, registered".into(), time_us(reps, || h2d(addr))));
    rows.push(("download, registered".into(), time_us(reps, || d2h(addr))));
    // SAFETY: registered above; the device buffer is no longer used.
    unsafe {
        sys::cuMemHostUnregister(addr as *mut _);
        sys::cuMemFree_v2(device);
    }
    Ok(rows)
}
