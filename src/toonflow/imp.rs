//! The `toonflow` element: a GstVideoFilter on NV12. GStreamer glue only: the engine
//! (engine.rs) chooses the backend and makes the picture, the properties are declared in
//! properties.rs and the statistics kept in stats.rs.

use std::sync::LazyLock;
use std::time::Instant;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::subclass::prelude::*;
use gst_video::subclass::prelude::*;
use parking_lot::Mutex;

use super::engine::{Engine, EngineEvent, FrameOutcome, Level, StreamFormat};
use super::properties;
use super::settings::Settings;
use super::stats::Stats;
use super::{frames, pool};
use crate::pipeline::FrameGeometry;

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        "toonflow",
        gst::DebugColorFlags::empty(),
        Some("toonflow cartoon filter"),
    )
});

/// Built in `start`, dropped in `stop`; `info` is set by `set_info`.
struct State {
    engine: Engine,
    info: Option<gst_video::VideoInfo>,
}

#[derive(Default)]
pub struct Toonflow {
    settings: Mutex<Settings>,
    state: Mutex<Option<State>>,
    stats: Mutex<Stats>,
}

impl Toonflow {
    /// Logs what the engine reported and posts a warning when it fell back to the CPU.
    fn drain(&self, engine: &mut Engine) {
        for event in engine.take_events() {
            match event {
                EngineEvent::Log(Level::Debug, text) => gst::debug!(CAT, imp = self, "{text}"),
                EngineEvent::Log(Level::Info, text) => gst::info!(CAT, imp = self, "{text}"),
                EngineEvent::Log(Level::Warning, text) => gst::warning!(CAT, imp = self, "{text}"),
                EngineEvent::FellBack(reason) => {
                    gst::warning!(
                        CAT,
                        imp = self,
                        "{reason}; falling back to the CPU reference backend"
                    );
                    gst::element_imp_warning!(
                        self,
                        gst::LibraryError::Init,
                        ("{}; using the CPU reference backend (much slower)", reason)
                    );
                    self.stats.lock().set_backend(engine.backend().name());
                }
            }
        }
    }

    fn log_pool(&self, result: Result<Option<String>, String>) {
        match result {
            Ok(Some(text)) => gst::debug!(CAT, imp = self, "{text}"),
            Ok(None) => {}
            Err(text) => gst::warning!(CAT, imp = self, "{text}"),
        }
    }

    fn cuda_device(&self) -> Option<u32> {
        self.state.lock().as_ref()?.engine.cuda_device()
    }

    /// Counts a frame and posts `toonflow-stats` when one is due.
    fn record(&self, outcome: &FrameOutcome, elapsed_us: f64, geometry: FrameGeometry) {
        let interval = self.settings.lock().stats_interval;
        let message = {
            let mut stats = self.stats.lock();
            stats
                .record(outcome, elapsed_us, geometry, interval)
                .then(|| stats.snapshot())
        };
        if let Some(s) = message {
            let obj = self.obj();
            let _ = obj.post_message(gst::message::Element::builder(s).src(&*obj).build());
        }
    }
}

#[glib::object_subclass]
impl ObjectSubclass for Toonflow {
    const NAME: &'static str = "GstToonflow";
    type Type = super::Toonflow;
    type ParentType = gst_video::VideoFilter;
}

impl ObjectImpl for Toonflow {
    fn constructed(&self) {
        self.parent_constructed();
        // Late frames are skipped before they are processed, as video filters do: base
        // transform compares each buffer's running time with the sink's QoS events, drops
        // the late ones and posts the standard QoS message for each (its `qos` property can
        // turn this off).
        gst_base::prelude::BaseTransformExt::set_qos(&*self.obj(), true);
    }

    fn properties() -> &'static [glib::ParamSpec] {
        properties::specs()
    }

    fn set_property(&self, id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        properties::set(&mut self.settings.lock(), id, value);
        gst::debug!(CAT, imp = self, "{} set to {:?}", pspec.name(), value);
    }

    fn property(&self, id: usize, _pspec: &glib::ParamSpec) -> glib::Value {
        if properties::is_stats(id) {
            return self.stats.lock().snapshot().to_value();
        }
        properties::get(&self.settings.lock(), id)
    }
}

impl GstObjectImpl for Toonflow {}

impl ElementImpl for Toonflow {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static METADATA: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "Toonflow cartoon filter",
                "Filter/Effect/Video",
                "Turns NV12 video into a temporally stable cartoon (bilateral smoothing, DoG lines, soft \
                 quantization) on an NVIDIA GPU through CUDA, or on the CPU reference backend",
                "toonflow developers",
            )
        });
        Some(&*METADATA)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static PAD_TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            let size = gst::IntRange::with_step(
                FrameGeometry::MIN_SIZE as i32,
                FrameGeometry::MAX_SIZE as i32,
                2,
            );
            let caps = gst::Caps::builder("video/x-raw")
                .field("format", gst_video::VideoFormat::Nv12.to_str())
                .field("width", size)
                .field("height", size)
                .field(
                    "framerate",
                    gst::FractionRange::new(
                        gst::Fraction::new(0, 1),
                        gst::Fraction::new(i32::MAX, 1),
                    ),
                )
                .build();
            [
                ("src", gst::PadDirection::Src),
                ("sink", gst::PadDirection::Sink),
            ]
            .into_iter()
            .map(|(name, direction)| {
                gst::PadTemplate::new(name, direction, gst::PadPresence::Always, &caps).unwrap()
            })
            .collect()
        });
        PAD_TEMPLATES.as_ref()
    }
}

impl BaseTransformImpl for Toonflow {
    const MODE: gst_base::subclass::BaseTransformMode =
        gst_base::subclass::BaseTransformMode::NeverInPlace;
    const PASSTHROUGH_ON_SAME_CAPS: bool = false;
    const TRANSFORM_IP_ON_PASSTHROUGH: bool = false;

    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let settings = self.settings.lock().clone();
        let mut engine = Engine::start(&settings).map_err(|e| e.message())?;
        let mut stats = Stats::new(engine.backend().name());
        stats.set_model(engine.model_name().unwrap_or(""));
        *self.stats.lock() = stats;
        self.drain(&mut engine);
        *self.state.lock() = Some(State { engine, info: None });
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        *self.state.lock() = None;
        Ok(())
    }

    fn propose_allocation(
        &self,
        decide_query: Option<&gst::query::Allocation>,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        self.parent_propose_allocation(decide_query, query)?;
        query.add_allocation_meta::<gst_video::VideoMeta>(None);
        let Some(device_id) = self.cuda_device() else {
            return Ok(());
        };
        self.log_pool(pool::offer_upstream(query, device_id as usize));
        Ok(())
    }

    fn decide_allocation(
        &self,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        if let Some(device_id) = self.cuda_device() {
            self.log_pool(pool::use_for_output(query, device_id as usize));
        }
        self.parent_decide_allocation(query)
    }

    fn sink_event(&self, event: gst::Event) -> bool {
        // A flush, a new stream or a new segment (a seek, a source that restarted) breaks the
        // sequence of frames the temporal history was built from.
        let reason = match event.view() {
            gst::EventView::FlushStop(_) => Some("flush"),
            gst::EventView::StreamStart(_) => Some("stream start"),
            gst::EventView::Segment(_) => Some("new segment"),
            _ => None,
        };
        if let Some(reason) = reason
            && let Some(state) = self.state.lock().as_mut()
        {
            gst::debug!(CAT, imp = self, "{reason}: temporal history dropped");
            state.engine.reset();
        }
        self.parent_sink_event(event)
    }

    fn submit_input_buffer(
        &self,
        is_discont: bool,
        inbuf: gst::Buffer,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        let result = self.parent_submit_input_buffer(is_discont, inbuf);
        // The parent answers DROPPED only for a buffer it skipped as late (QoS).
        if result == Ok(gst_base::BASE_TRANSFORM_FLOW_DROPPED) {
            self.stats.lock().record_dropped();
        }
        result
    }

    fn transform(
        &self,
        inbuf: &gst::Buffer,
        outbuf: &mut gst::BufferRef,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        let settings = self.settings.lock().clone();
        let mut guard = self.state.lock();
        let Some((engine, info)) = guard
            .as_mut()
            .and_then(|s| Some((&mut s.engine, s.info.clone()?)))
        else {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Buffer received before caps")
            );
            return Err(gst::FlowError::NotNegotiated);
        };
        let updated = engine.update(&settings);
        self.drain(engine);
        if let Err(e) = updated {
            self.post_error_message(e.message());
            return Err(gst::FlowError::Error);
        }
        if inbuf.flags().contains(gst::BufferFlags::DISCONT) {
            gst::debug!(CAT, imp = self, "discont: temporal history dropped");
            engine.reset();
        }

        let geometry = engine
            .format()
            .ok_or(gst::FlowError::NotNegotiated)?
            .geometry;
        let (result, elapsed_us) =
            frames::with_nv12(inbuf, outbuf, &info, geometry, |input, output| {
                let started = Instant::now();
                let result = engine.process(input, output);
                (result, started.elapsed().as_secs_f64() * 1e6)
            })
            .map_err(|e| {
                self.post_error_message(e);
                gst::FlowError::Error
            })?;
        self.drain(engine);
        drop(guard);
        let outcome = result.map_err(|e| {
            self.post_error_message(e.message());
            gst::FlowError::Error
        })?;
        if outcome.report.scene_cut {
            gst::debug!(
                CAT,
                imp = self,
                "scene cut (score {:.2}): temporal history dropped",
                outcome.report.scene_score
            );
        }
        self.record(&outcome, elapsed_us, geometry);
        Ok(gst::FlowSuccess::Ok)
    }
}

impl VideoFilterImpl for Toonflow {
    fn set_info(
        &self,
        incaps: &gst::Caps,
        in_info: &gst_video::VideoInfo,
        _outcaps: &gst::Caps,
        _out_info: &gst_video::VideoInfo,
    ) -> Result<(), gst::LoggableError> {
        let format = StreamFormat::from_info(in_info)
            .map_err(|e| gst::loggable_error!(CAT, "Unsupported caps {incaps}: {e}"))?;
        let settings = self.settings.lock().clone();
        let mut guard = self.state.lock();
        let state = guard
            .as_mut()
            .ok_or_else(|| gst::loggable_error!(CAT, "caps {incaps} before start"))?;
        // Until the engine is configured for the new caps, frames are refused.
        state.info = None;
        let configured = state.engine.configure(format, &settings);
        self.drain(&mut state.engine);
        configured.map_err(|e| {
            self.post_error_message(e.message());
            gst::loggable_error!(CAT, "Cannot set up for {incaps}: {e}")
        })?;
        state.info = Some(in_info.clone());
        Ok(())
    }
}
