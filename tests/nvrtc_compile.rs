//! The CUDA kernels compile with NVRTC, through the project's own build function
//! (`cuda::kernels::compile`: the generated ABI header, the build switches and the options the
//! element uses), for the GPUs people run: sm_75 (T4), sm_86 (A10, RTX 3090), sm_89 (L4,
//! RTX 4090) and sm_90 (H100, H200), in both precisions. NVRTC needs no GPU and no driver, so
//! CI runs this: scripts/test.sh installs NVIDIA's NVRTC wheel (scripts/common.sh,
//! `ensure_nvrtc`) and sets TOONFLOW_REQUIRE_NVRTC=1, which turns a missing NVRTC into a
//! failure. Elsewhere, without NVRTC, the test prints "skipped: <why>" and passes.

use std::panic::catch_unwind;

use gsttoonflow::cuda::kernels::{KERNEL_FILE, KERNEL_NAMES, compile};
use gsttoonflow::cuda::{neural, neural_frame};
use gsttoonflow::pipeline::Precision;

const ARCHES: [&str; 4] = ["sm_75", "sm_86", "sm_89", "sm_90"];

/// Why NVRTC cannot be used here, or None when it loads.
fn nvrtc_missing() -> Option<String> {
    // SAFETY: `is_culib_present` only tries to dlopen libnvrtc; cudarc may panic when it cannot,
    // which catch_unwind turns into "absent".
    let present = catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() });
    match present {
        Ok(true) => None,
        _ => Some(
            "libnvrtc cannot be loaded (install CUDA's NVRTC, or run scripts/test.sh, which \
             installs the nvidia-cuda-nvrtc-cu12 wheel)"
                .into(),
        ),
    }
}

fn nvrtc_required() -> bool {
    std::env::var("TOONFLOW_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// Every `.cu` file under kernels/ is one this test compiles: a new kernel file must get its
/// own build function and be added here, or CI would never compile it.
#[test]
fn every_kernel_file_is_covered() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".cu"))
        .collect();
    files.sort();
    assert_eq!(
        files,
        [neural::KERNEL_FILE, neural_frame::KERNEL_FILE, KERNEL_FILE],
        "kernels/*.cu and the files this test compiles"
    );
}

/// True (and says so) where NVRTC is missing; a failure instead when TOONFLOW_REQUIRE_NVRTC=1.
fn skipped_without_nvrtc() -> bool {
    let Some(why) = nvrtc_missing() else {
        return false;
    };
    assert!(
        !nvrtc_required(),
        "TOONFLOW_REQUIRE_NVRTC=1 but NVRTC is missing: {why}"
    );
    println!("skipped: {why}");
    true
}

#[test]
fn kernels_compile_for_every_target_architecture_and_precision() {
    if skipped_without_nvrtc() {
        return;
    }
    let mut failures = Vec::new();
    for arch in ARCHES {
        for precision in [Precision::Fp16, Precision::Fp32] {
            let (ptx, ms) = match compile(arch, precision) {
                Ok(r) => r,
                Err(e) => {
                    failures.push(format!("{KERNEL_FILE} {arch} {precision:?}: {e}"));
                    continue;
                }
            };
            // The PTX is for the architecture asked for and defines every kernel the backend
            // loads by name.
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "{arch} {precision:?}: no `.target {arch}` in the PTX"
            );
            for name in KERNEL_NAMES {
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "{arch} {precision:?}: no entry {name} in the PTX"
                );
            }
            println!(
                "compiled {KERNEL_FILE} for {arch} {precision:?}: {} kernels, {} bytes of PTX in {ms:.0} ms",
                KERNEL_NAMES.len(),
                ptx.len()
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Compiles one kernel file with its build function for every architecture: the PTX is for
/// that architecture and defines every kernel the backend loads by name.
fn compile_everywhere(
    file: &str,
    names: &[&str],
    compile: fn(&str) -> Result<(String, f64), gsttoonflow::cuda::CudaError>,
) {
    if skipped_without_nvrtc() {
        return;
    }
    let mut failures = Vec::new();
    for arch in ARCHES {
        let (ptx, ms) = match compile(arch) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{file} {arch}: {e}"));
                continue;
            }
        };
        assert!(ptx.contains(&format!(".target {arch}")), "{arch}");
        for name in names {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{file} {arch}: no entry {name} in the PTX"
            );
        }
        println!(
            "compiled {file} for {arch}: {} kernels, {} bytes of PTX in {ms:.0} ms",
            names.len(),
            ptx.len()
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// kernels/neural.cu (the style network's kernels, one build for both storage precisions: the
/// storage of each buffer is chosen per launch).
#[test]
fn neural_kernels_compile_for_every_target_architecture() {
    compile_everywhere(neural::KERNEL_FILE, &neural::KERNEL_NAMES, neural::compile);
}

/// kernels/neural_frame.cu (the neural element's frame conversions and output filter).
#[test]
fn neural_frame_kernels_compile_for_every_target_architecture() {
    compile_everywhere(
        neural_frame::KERNEL_FILE,
        &neural_frame::KERNEL_NAMES,
        neural_frame::compile,
    );
}
