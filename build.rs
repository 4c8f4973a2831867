fn main() {
    // Kernels are compiled at run time by NVRTC; rebuild when their source changes.
    println!("cargo:rerun-if-changed=kernels");
    gst_plugin_version_helper::info()
}
