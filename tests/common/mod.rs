//! Shared helpers of the integration tests: plugin registration, photo fixtures decoded to NV12
//! through GStreamer itself, and frame statistics.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Once;

use gst::prelude::*;
use gst_video::prelude::*;

pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        gst::init().unwrap();
        gsttoonflow::plugin_register_static().expect("register toonflow");
    });
}

/// The checkout, found through the run-time CARGO_MANIFEST_DIR (the GPU machine runs the test
/// executables from a copy of the checkout at another path).
pub fn repo_root() -> PathBuf {
    std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into())
        .into()
}

/// A fixture under tests/data.
pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/data").join(name)
}

/// The directory holding the libgsttoonflow.so built with this test executable
/// (target/<profile>/deps/<test>-* → target/<profile>), or TOONFLOW_PLUGIN_DIR.
pub fn plugin_dir() -> PathBuf {
    let dir = match std::env::var_os("TOONFLOW_PLUGIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let exe = std::env::current_exe().expect("current_exe");
            exe.parent()
                .and_then(std::path::Path::parent)
                .unwrap()
                .to_path_buf()
        }
    };
    assert!(
        dir.join("libgsttoonflow.so").exists(),
        "no libgsttoonflow.so in {} (build the crate first, or set TOONFLOW_PLUGIN_DIR)",
        dir.display()
    );
    dir
}

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir =
            std::env::temp_dir().join(format!("toonflow-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tightly packed NV12 frame.
#[derive(Clone, Debug)]
pub struct Nv12 {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl Nv12 {
    pub fn new(width: usize, height: usize) -> Self {
        Nv12 {
            width,
            height,
            data: vec![0; width * height * 3 / 2],
        }
    }
    pub fn y(&self) -> &[u8] {
        &self.data[..self.width * self.height]
    }
    pub fn y_mut(&mut self) -> &mut [u8] {
        let n = self.width * self.height;
        &mut self.data[..n]
    }
    pub fn uv(&self) -> &[u8] {
        &self.data[self.width * self.height..]
    }
    pub fn luma(&self, x: usize, y: usize) -> u8 {
        self.data[y * self.width + x]
    }
    pub fn caps(&self) -> gst::Caps {
        nv12_caps(self.width, self.height)
    }
    /// A buffer laid out as GStreamer lays out this size by default (rows padded to 4 bytes).
    pub fn to_buffer(&self) -> gst::Buffer {
        let info = gst_video::VideoInfo::from_caps(&self.caps()).unwrap();
        let (w, h) = (self.width, self.height);
        let mut data = vec![0u8; info.size()];
        let (ys, uvs) = (info.stride()[0] as usize, info.stride()[1] as usize);
        let uv_offset = info.offset()[1];
        for r in 0..h {
            data[r * ys..r * ys + w].copy_from_slice(&self.data[r * w..(r + 1) * w]);
        }
        for r in 0..h / 2 {
            let src = w * h + r * w;
            data[uv_offset + r * uvs..uv_offset + r * uvs + w]
                .copy_from_slice(&self.data[src..src + w]);
        }
        gst::Buffer::from_slice(data)
    }
    /// Adds deterministic pseudo-random noise of about `amplitude` codes to luma and chroma.
    pub fn with_noise(&self, amplitude: f32, seed: u64) -> Nv12 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut out = self.clone();
        for v in out.data.iter_mut() {
            let n = rng.gaussian() * amplitude;
            *v = (*v as f32 + n).round().clamp(0.0, 255.0) as u8;
        }
        out
    }
    /// A tightly packed copy of a mapped buffer with the given caps.
    pub fn from_buffer(buffer: &gst::BufferRef, caps: &gst::CapsRef) -> Nv12 {
        let info = gst_video::VideoInfo::from_caps(caps).unwrap();
        let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(buffer, &info).unwrap();
        let (w, h) = (info.width() as usize, info.height() as usize);
        let mut out = Nv12::new(w, h);
        let ys = frame.plane_stride()[0] as usize;
        let uvs = frame.plane_stride()[1] as usize;
        let yp = frame.plane_data(0).unwrap();
        let uvp = frame.plane_data(1).unwrap();
        for r in 0..h {
            out.data[r * w..(r + 1) * w].copy_from_slice(&yp[r * ys..r * ys + w]);
        }
        for r in 0..h / 2 {
            let o = w * h + r * w;
            out.data[o..o + w].copy_from_slice(&uvp[r * uvs..r * uvs + w]);
        }
        out
    }
}

pub fn nv12_caps(width: usize, height: usize) -> gst::Caps {
    gst::Caps::builder("video/x-raw")
        .field("format", "NV12")
        .field("width", width as i32)
        .field("height", height as i32)
        .field("framerate", gst::Fraction::new(30, 1))
        .build()
}

/// The appsink named `name` inside a pipeline (or any bin) made by gst_parse_launch.
/// Plays a launch-line pipeline to its end, stops it, and fails the test (naming `what`) on an
/// error message or when no EOS comes within `seconds`.
#[allow(dead_code)] // not every test file plays whole pipelines
pub fn play_to_eos(pipeline: &gst::Element, seconds: u64, what: &str) {
    pipeline.set_state(gst::State::Playing).unwrap();
    let msg = pipeline.bus().unwrap().timed_pop_filtered(
        gst::ClockTime::from_seconds(seconds),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    pipeline.set_state(gst::State::Null).unwrap();
    assert!(
        matches!(
            msg.as_ref().map(|m| m.view()),
            Some(gst::MessageView::Eos(_))
        ),
        "{what} failed: {msg:?}"
    );
}

pub fn app_sink(pipeline: &gst::Element, name: &str) -> gst_app::AppSink {
    pipeline
        .downcast_ref::<gst::Bin>()
        .expect("a bin")
        .by_name(name)
        .unwrap_or_else(|| panic!("no element named {name}"))
        .downcast::<gst_app::AppSink>()
        .unwrap_or_else(|_| panic!("{name} is not an appsink"))
}

/// Decodes a photo of tests/data and scales it to `width`×`height` NV12.
pub fn photo(name: &str, width: usize, height: usize) -> Nv12 {
    init();
    let path = fixture(name);
    assert!(path.exists(), "fixture {} is missing", path.display());
    let desc = format!(
        "filesrc location=\"{}\" ! decodebin ! videoconvert ! videoscale ! \
         video/x-raw,format=NV12,width={width},height={height},pixel-aspect-ratio=1/1 ! appsink name=sink sync=false",
        path.display()
    );
    let pipeline = gst::parse::launch(&desc)
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
    let sink = app_sink(pipeline.upcast_ref(), "sink");
    pipeline.set_state(gst::State::Playing).unwrap();
    let sample = sink.pull_sample().expect("decoded photo");
    let out = Nv12::from_buffer(sample.buffer().unwrap(), sample.caps().unwrap());
    pipeline.set_state(gst::State::Null).unwrap();
    out
}

/// A harness around one toonflow element with NV12 caps for `width`×`height`.
pub fn harness(width: usize, height: usize, props: &[(&str, &dyn ToValue)]) -> gst_check::Harness {
    init();
    // Properties read at start (backend, model, ...) must be set before the harness starts the
    // element, so the element is made and configured first.
    let el = gst::ElementFactory::make("toonflow")
        .build()
        .expect("toonflow element");
    el.set_property_from_str("backend", "cpu");
    for (name, value) in props {
        el.set_property(name, value.to_value());
    }
    let mut h = gst_check::Harness::with_element(&el, Some("sink"), Some("src"));
    h.set_src_caps(nv12_caps(width, height));
    h
}

/// Pushes one frame and returns the output frame.
pub fn push_frame(h: &mut gst_check::Harness, frame: &Nv12) -> Nv12 {
    h.push(frame.to_buffer()).expect("push");
    let out = pull_output(h);
    Nv12::from_buffer(&out, &frame.caps())
}

/// The next output buffer of a harness after a push. The harness pushes synchronously, so
/// without overlap the output is queued when push returns (no pull timeout can cut short a slow
/// CPU frame); with overlap (CUDA, or its CPU emulation) the push thread pushes it once its
/// GPU work completes, shortly after.
pub fn pull_output(h: &mut gst_check::Harness) -> gst::Buffer {
    h.try_pull()
        .or_else(|| h.pull().ok())
        .expect("output buffer")
}

/// Runs a single frame through a fresh CPU element.
pub fn stylize(frame: &Nv12, props: &[(&str, &dyn ToValue)]) -> Nv12 {
    let mut h = harness(frame.width, frame.height, props);
    push_frame(&mut h, frame)
}

pub fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as i32 - y as i32).unsigned_abs() as f64)
        .sum::<f64>()
        / a.len() as f64
}

/// xorshift64* with Box–Muller: deterministic noise without a dependency.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    pub fn gaussian(&mut self) -> f32 {
        let (a, b) = (self.uniform(), self.uniform());
        (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
    }
}

/// How far statistic `a` (mean, variance) lies from `b`: the larger of the means' and the
/// standard deviations' difference, in units of `b`'s magnitude sqrt(mean^2 + variance) (fp16
/// rounds relative to the values' magnitude, not their spread).
pub fn statistic_apart(a: (f32, f32), b: (f32, f32)) -> f64 {
    let s = (f64::from(b.0).powi(2) + f64::from(b.1.max(0.0))).sqrt() + 1e-6;
    let dsd = (f64::from(a.1.max(0.0)).sqrt() - f64::from(b.1.max(0.0)).sqrt()).abs();
    (f64::from((a.0 - b.0).abs()) / s).max(dsd / s)
}
