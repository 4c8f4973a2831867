//! The element's properties, declared once: each row of [`TABLE`] is a ParamSpec (name, nick,
//! blurb, range, default, when it may change) and the [`Settings`] field it reads and writes.
//! `properties()`, `set_property` and `property` in imp.rs are generated from it.

use std::sync::LazyLock;

use gst::glib;
use gst::prelude::*;

use super::settings::{
    BackendChoice, DEFAULT_CUDA_GRAPH, DEFAULT_DEVICE_ID, DEFAULT_MAX_DEVICE_MEMORY,
    DEFAULT_MODEL_EDGES, DEFAULT_MODEL_LOW_MEMORY, DEFAULT_MODEL_SCALE,
    DEFAULT_MODEL_SIZE_MULTIPLE, DEFAULT_MODEL_STAT_SMOOTHING, DEFAULT_OVERLAP,
    DEFAULT_STATS_INTERVAL, ModelRange, PrecisionChoice, Settings,
};
use crate::neural::frame::ConverterConfig;
use crate::pipeline::StageParams;
use crate::pipeline::params::{MAX_HISTORY, MAX_ITERATIONS};

/// `model-stat-smoothing`'s maximum as the property shows it (the smoother's f32 limit).
const MAX_SMOOTHING: f64 = 0.99;

/// One row of the table.
pub struct Property {
    pub spec: glib::ParamSpec,
    get: fn(&Settings) -> glib::Value,
    set: fn(&mut Settings, &glib::Value),
}

/// A row whose value is the [`Settings`] field at `path` (e.g. `stage.levels`).
macro_rules! row {
    ($($path:ident).+ => $spec:expr) => {
        Property {
            spec: $spec,
            get: |s| s.$($path).+.to_value(),
            set: |s, v| s.$($path).+ = v.get().expect("type checked upstream"),
        }
    };
    // A string field: unset (NULL) reads back as "".
    (string $($path:ident).+ => $spec:expr) => {
        Property {
            spec: $spec,
            get: |s| s.$($path).+.to_value(),
            set: |s, v| {
                s.$($path).+ = v
                    .get::<Option<String>>()
                    .expect("type checked upstream")
                    .unwrap_or_default()
            },
        }
    };
}

fn uint(name: &str, nick: &str, blurb: &str, range: (u32, u32), default: u32) -> glib::ParamSpec {
    glib::ParamSpecUInt::builder(name)
        .nick(nick)
        .blurb(blurb)
        .minimum(range.0)
        .maximum(range.1)
        .default_value(default)
        .mutable_playing()
        .build()
}

fn float(name: &str, nick: &str, blurb: &str, range: (f32, f32), default: f32) -> glib::ParamSpec {
    glib::ParamSpecFloat::builder(name)
        .nick(nick)
        .blurb(blurb)
        .minimum(range.0)
        .maximum(range.1)
        .default_value(default)
        .mutable_playing()
        .build()
}

fn double(name: &str, nick: &str, blurb: &str, range: (f64, f64), default: f64) -> glib::ParamSpec {
    glib::ParamSpecDouble::builder(name)
        .nick(nick)
        .blurb(blurb)
        .minimum(range.0)
        .maximum(range.1)
        .default_value(default)
        .mutable_playing()
        .build()
}

fn boolean(name: &str, nick: &str, blurb: &str, default: bool) -> glib::ParamSpec {
    glib::ParamSpecBoolean::builder(name)
        .nick(nick)
        .blurb(blurb)
        .default_value(default)
        .mutable_playing()
        .build()
}

/// Every settable property, in the order gst-inspect lists them.
pub static TABLE: LazyLock<Vec<Property>> = LazyLock::new(|| {
    let d = StageParams::default();
    vec![
        row!(backend => glib::ParamSpecEnum::builder_with_default("backend", BackendChoice::Auto)
            .nick("Backend")
            .blurb("Where frames are processed; read at start (READY->PAUSED)")
            .mutable_ready()
            .build()),
        row!(device_id => glib::ParamSpecUInt::builder("device-id")
            .nick("CUDA device")
            .blurb("Index of the CUDA device to use; read at start")
            .maximum(63)
            .default_value(DEFAULT_DEVICE_ID)
            .mutable_ready()
            .build()),
        row!(precision => glib::ParamSpecEnum::builder_with_default("precision", PrecisionChoice::Fp16)
            .nick("Precision")
            .blurb("Storage precision of the GPU's working planes and temporal history (math is fp32; the CPU backend always uses fp32). With a model, fp16 is calibrated on the first frame: stages where fp16 would overflow keep fp32, stages whose variance fp16 would lose are stored centered on their channel means where the graph allows it, else fp32")
            .mutable_playing()
            .build()),
        row!(stage.bilateral_iterations => uint("bilateral-iterations", "Bilateral iterations", "Passes of the edge-preserving smoothing (0 disables it)", (0, MAX_ITERATIONS), d.bilateral_iterations)),
        row!(stage.edge_iterations => uint("edge-iterations", "Edge iterations", "Smoothing pass whose luma feeds the edge detector (0 = unsmoothed; capped at bilateral-iterations)", (0, MAX_ITERATIONS), d.edge_iterations)),
        row!(stage.spatial_sigma => float("spatial-sigma", "Spatial sigma", "Spatial extent of the bilateral filter in luma pixels (radius = ceil(2 sigma))", (0.5, 12.0), d.spatial_sigma)),
        row!(stage.range_sigma => float("range-sigma", "Range sigma", "Tonal extent of the bilateral filter in L units (0-100): smaller keeps more detail", (0.1, 100.0), d.range_sigma)),
        row!(stage.edge_sigma => float("edge-sigma", "Edge sigma", "Scale of the difference-of-Gaussians edge detector in pixels: larger draws thicker, fewer lines", (0.3, 7.0), d.edge_sigma)),
        row!(stage.edge_tau => float("edge-tau", "Edge tau", "Weight of the wider Gaussian in the DoG: closer to 1 draws fewer lines", (0.5, 1.0), d.edge_tau)),
        row!(stage.edge_sharpness => float("edge-sharpness", "Edge sharpness", "Steepness (phi_e) of the line ramp: larger gives crisper, darker lines", (0.1, 100.0), d.edge_sharpness)),
        row!(stage.edge_strength => float("edge-strength", "Edge strength", "How dark lines are drawn: 0 = no lines, 1 = full black", (0.0, 1.0), d.edge_strength)),
        row!(stage.levels => uint("levels", "Levels", "Number of luminance bands of the quantizer", (2, 64), d.levels)),
        row!(stage.level_sharpness => float("level-sharpness", "Level sharpness", "Steepness (phi_q) of the step between bands: 0 = no quantization, larger = harder bands", (0.0, 100.0), d.level_sharpness)),
        row!(stage.saturation => float("saturation", "Saturation", "Chroma gain of the output (1 = unchanged, 0 = grey)", (0.0, 4.0), d.saturation)),
        row!(stage.auto_levels => boolean("auto-levels", "Auto levels", "Stretch each frame's luminance between its 0.5% and 99.5% points before quantizing", d.auto_levels)),
        row!(stage.temporal_history => uint("temporal-history", "Temporal history", "Frames of smoothed features kept to steady the picture over time (0 disables the temporal filter)", (0, MAX_HISTORY), d.temporal_history)),
        row!(stage.temporal_strength => float("temporal-strength", "Temporal strength", "Weight decay per frame of age in the temporal filter (0 = current frame only)", (0.0, 1.0), d.temporal_strength)),
        row!(stage.motion_sigma => float("motion-sigma", "Motion sigma", "Motion guard of the temporal filter in L units: pixels that changed by more fall back to the current frame", (0.1, 100.0), d.motion_sigma)),
        row!(stage.scene_cut_threshold => float("scene-cut-threshold", "Scene-cut threshold", "Mean thumbnail change (L units) above which a frame starts a new scene and the temporal history is dropped", (0.0, 100.0), d.scene_cut_threshold)),
        row!(cuda_graph => boolean("cuda-graph", "CUDA graph", "Replay each frame's kernels as a captured CUDA graph (false = launch them one by one)", DEFAULT_CUDA_GRAPH)),
        row!(overlap => glib::ParamSpecBoolean::builder("overlap")
            .nick("Overlap frames")
            .blurb("With system memory on both pads and the classic pipeline or the network (model=, after an fp16 stream's calibrating first frame, without model-edges) on CUDA, upload a frame while the previous one's kernels and download run and push each frame from a second thread once its own download completes: more frames per second (classic pipeline +35-72% at 1080p on the H200, AnimeGANv3 tiny +12% on an H100, up to 757 fps at 1080p), ~25 µs more per frame below capacity, and a source that outruns the element queues its frames here instead of upstream (docs/benchmark.md); false = one frame at a time. Read at start")
            .default_value(DEFAULT_OVERLAP)
            .mutable_ready()
            .build()),
        row!(max_device_memory => glib::ParamSpecUInt64::builder("max-device-memory")
            .nick("Max device memory")
            .blurb("Largest device arena in bytes this element may allocate (0 = no limit); a larger plan fails negotiation with an error. With a model it caps the network's activation plan (fp32 on the CPU reference)")
            .default_value(DEFAULT_MAX_DEVICE_MEMORY)
            .mutable_ready()
            .build()),
        row!(stats_interval => uint("stats-interval", "Stats interval", "Post a toonflow-stats element message every this many frames (0 = never)", (0, u32::MAX), DEFAULT_STATS_INTERVAL)),
        row!(string model.path => glib::ParamSpecString::builder("model")
            .nick("Model")
            .blurb("Path to an ONNX style network (RGB in and out, 3 channels, NHWC or NCHW) that replaces the classic pipeline; empty = the classic cartoon filter. Read at start; runs on the GPU with backend=cuda or auto, else on the CPU reference (docs/neural.md)")
            .default_value(Some(""))
            .mutable_ready()
            .build()),
        row!(model.range => glib::ParamSpecEnum::builder_with_default("model-range", ModelRange::MinusOneToOne)
            .nick("Model range")
            .blurb("Value range of the network's RGB input and output")
            .mutable_playing()
            .build()),
        row!(model.scale => double("model-scale", "Model scale", "Run the network at this fraction of the frame size and scale its output up: 0.5 takes about a quarter of the time and memory and softens detail", (ConverterConfig::MIN_SCALE, ConverterConfig::MAX_SCALE), DEFAULT_MODEL_SCALE)),
        row!(model.size_multiple => uint("model-size-multiple", "Model size multiple", "The network's input is padded (reflect) to a multiple of this and its output cropped back (0 = what the model's strides need)", (0, ConverterConfig::MAX_MULTIPLE as u32), DEFAULT_MODEL_SIZE_MULTIPLE)),
        row!(model.stat_smoothing => double("model-stat-smoothing", "Model statistics smoothing", "Exponential smoothing of each normalization's statistics over recent frames against flicker (0 = each frame's own, as the network was trained)", (0.0, MAX_SMOOTHING), DEFAULT_MODEL_STAT_SMOOTHING)),
        row!(model.edges => boolean("model-edges", "Model edges", "Draw the classic pipeline's DoG lines (edge-* properties) over the network's output", DEFAULT_MODEL_EDGES)),
        row!(model.low_memory => glib::ParamSpecBoolean::builder("model-low-memory")
            .nick("Model low memory")
            .blurb("Trade speed for device memory: on CUDA, an fp16 network at model-scale 1 computes its stem a second time from the NV12 frame for its last skip connection wherever that shrinks its activations by a tenth (AnimeGANv3 tiny at 1080p: 134 -> 118 MB for the element, about 11% fewer frames per second, H100); false = only where the Hayao-class layout needs it anyway. Read at start")
            .default_value(DEFAULT_MODEL_LOW_MEMORY)
            .mutable_ready()
            .build()),
    ]
});

/// The read-only `stats` property; its value comes from [`super::stats::Stats`], not the
/// settings, so it follows the table.
fn stats_spec() -> glib::ParamSpec {
    glib::ParamSpecBoxed::builder::<gst::Structure>("stats")
        .nick("Statistics")
        .blurb("Running statistics: backend, frames, dropped (late frames skipped for QoS), frames-queued (frames that went through the overlap path), scene-cuts, mean-us/p50-us/p99-us per frame; on CUDA gpu-time-us, transfer-time-us, upload-bytes, download-bytes (0 with CUDA memory on both pads), device-copy-us, launches, graph-replayed, arena-bytes, peak-live-bytes, device-free-bytes; with a model its name, stages per frame, network-width/network-height it runs at, arena-bytes and peak-live-bytes of its activation plan")
        .read_only()
        .build()
}

/// What `ObjectImpl::properties` returns: the table's specs, then `stats`.
pub fn specs() -> &'static [glib::ParamSpec] {
    static SPECS: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
        TABLE
            .iter()
            .map(|p| p.spec.clone())
            .chain(std::iter::once(stats_spec()))
            .collect()
    });
    &SPECS
}

/// The row of property `id` (GObject ids count from 1 in the order of [`specs`]); `None` for
/// `stats`.
fn row(id: usize) -> Option<&'static Property> {
    id.checked_sub(1).and_then(|i| TABLE.get(i))
}

/// Whether `id` is the `stats` property.
pub fn is_stats(id: usize) -> bool {
    id == TABLE.len() + 1
}

/// Stores `value` into `settings` (GObject has checked its type and range).
pub fn set(settings: &mut Settings, id: usize, value: &glib::Value) {
    let p = row(id).unwrap_or_else(|| unreachable!("property id {id} is not settable"));
    (p.set)(settings, value)
}

/// The value of property `id` in `settings`.
pub fn get(settings: &Settings, id: usize) -> glib::Value {
    let p = row(id).unwrap_or_else(|| unreachable!("property id {id} is not in the table"));
    (p.get)(settings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::neural::temporal::MAX_STAT_SMOOTHING;

    #[test]
    fn every_row_reads_back_what_was_written_and_defaults_match_settings() {
        gst::init().unwrap();
        let defaults = Settings::default();
        for (i, p) in TABLE.iter().enumerate() {
            let id = i + 1;
            assert_eq!(
                get(&defaults, id).serialize().unwrap(),
                p.spec.default_value().serialize().unwrap(),
                "default of {}",
                p.spec.name()
            );
        }
        // A non-default value for each row lands in its own field only.
        for (i, p) in TABLE.iter().enumerate() {
            let id = i + 1;
            let mut s = Settings::default();
            let value = match p.spec.value_type() {
                t if t == u32::static_type() => {
                    let spec = p.spec.downcast_ref::<glib::ParamSpecUInt>().unwrap();
                    let v = if spec.default_value() == spec.maximum() {
                        spec.minimum()
                    } else {
                        spec.maximum()
                    };
                    v.to_value()
                }
                t if t == f32::static_type() => {
                    let spec = p.spec.downcast_ref::<glib::ParamSpecFloat>().unwrap();
                    let v = if spec.default_value() == spec.maximum() {
                        spec.minimum()
                    } else {
                        spec.maximum()
                    };
                    v.to_value()
                }
                t if t == u64::static_type() => 12345u64.to_value(),
                t if t == f64::static_type() => {
                    let spec = p.spec.downcast_ref::<glib::ParamSpecDouble>().unwrap();
                    let v = if spec.default_value() == spec.maximum() {
                        spec.minimum()
                    } else {
                        spec.maximum()
                    };
                    v.to_value()
                }
                t if t == String::static_type() => "some/model.onnx".to_value(),
                t if t == ModelRange::static_type() => ModelRange::ZeroTo255.to_value(),
                t if t == bool::static_type() => (!get(&s, id).get::<bool>().unwrap()).to_value(),
                t if t == BackendChoice::static_type() => BackendChoice::Cpu.to_value(),
                t if t == PrecisionChoice::static_type() => PrecisionChoice::Fp32.to_value(),
                t => panic!("no test value for {t}"),
            };
            set(&mut s, id, &value);
            assert_ne!(s, defaults, "{} changed nothing", p.spec.name());
            assert_eq!(
                get(&s, id).serialize().unwrap(),
                value.serialize().unwrap(),
                "{} reads back",
                p.spec.name()
            );
            set(&mut s, id, &get(&defaults, id));
            assert_eq!(s, defaults, "{} touched another field", p.spec.name());
        }
    }

    #[test]
    fn the_smoothing_limit_is_the_smoothers() {
        assert_eq!(MAX_SMOOTHING as f32, MAX_STAT_SMOOTHING);
    }

    #[test]
    fn an_unset_model_reads_back_empty() {
        gst::init().unwrap();
        let id = 1 + TABLE.iter().position(|p| p.spec.name() == "model").unwrap();
        let mut s = Settings::default();
        set(&mut s, id, &"a.onnx".to_value());
        assert_eq!(s.model.path, "a.onnx");
        set(&mut s, id, &None::<String>.to_value());
        assert_eq!(s.model.path, "");
        assert_eq!(get(&s, id).get::<String>().unwrap(), "");
    }

    #[test]
    fn names_are_unique_and_stats_comes_last() {
        gst::init().unwrap();
        let names: Vec<&str> = specs().iter().map(|s| s.name()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        assert_eq!(names.last(), Some(&"stats"));
        assert!(is_stats(names.len()));
        assert!(!is_stats(1));
    }
}
