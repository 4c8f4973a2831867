//! The `toonflow` element.

use gst::glib;
use gst::prelude::*;

mod cuda_memory;
mod engine;
mod frames;
mod hostmem;
mod imp;
mod lines;
mod neural_cpu;
mod neural_cuda;
mod pool;
mod properties;
mod pusher;
mod settings;
mod stats;

pub use settings::{BackendChoice, ModelRange, PrecisionChoice};

glib::wrapper! {
    pub struct Toonflow(ObjectSubclass<imp::Toonflow>)
        @extends gst_video::VideoFilter, gst_base::BaseTransform, gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    BackendChoice::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    PrecisionChoice::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    ModelRange::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    gst::Element::register(
        Some(plugin),
        "toonflow",
        gst::Rank::NONE,
        Toonflow::static_type(),
    )
}
