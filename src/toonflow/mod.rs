use gst::glib;
pub fn register(_plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    Ok(())
}
