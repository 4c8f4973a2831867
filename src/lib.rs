//! toonflow: a GStreamer element that turns NV12 video into a cartoon, on an NVIDIA GPU through
//! CUDA or on the CPU (fast SIMD path, exact reference).
#![allow(clippy::non_send_fields_in_send_ty, unused_doc_comments)]

use gst::glib;

pub mod cuda;
pub mod kernel_abi;
pub mod memplan;
pub mod neural;
pub mod pipeline;
mod toonflow;

fn plugin_init(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    toonflow::register(plugin)
}

gst::plugin_define!(
    toonflow,
    env!("CARGO_PKG_DESCRIPTION"),
    plugin_init,
    concat!(env!("CARGO_PKG_VERSION"), "-", env!("COMMIT_ID")),
    // The crate is "MIT OR Apache-2.0" (LICENSE-MIT, LICENSE-APACHE). GStreamer accepts only a
    // fixed list of license names (LGPL, GPL, QPL, GPL/QPL, MPL, BSD, MIT/X11, Proprietary,
    // unknown) and has none for a dual license or Apache-2.0: "MIT/X11" names the MIT option.
    "MIT/X11",
    env!("CARGO_PKG_NAME"),
    env!("CARGO_PKG_NAME"),
    // GStreamer refuses a plugin whose origin is empty, and the project has no public
    // repository (Cargo.toml names none): GStreamer's own default for an unknown origin.
    "Unknown package origin",
    env!("BUILD_REL_DATE")
);
