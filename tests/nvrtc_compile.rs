//! The CUDA kernels compile with NVRTC, through the project's own build function
//! (`cuda::kernels::compile`: the generated ABI header, the build switches and the options the
//! element uses), for the GPUs people run: sm_75 (T4), sm_86 (A10, RTX 3090), sm_89 (L4,
//! RTX 4090) and sm_90 (H100, H200), in both precisions. NVRTC needs no GPU and no driver, so
//! CI runs this: scripts/test.sh installs NVIDIA's NVRTC wheel (scripts/common.sh,
//! `ensure_nvrtc`) and sets TOONFLOW_REQUIRE_NVRTC=1, which turns a missing NVRTC into a
//! failure. Elsewhere, without NVRTC, the test prints "skipped: <why>" and passes.
//!
//! The builds go through the disk cache of NVRTC's PTX (`cuda::ptx_cache`; scripts/test.sh points
//! `TOONFLOW_KERNEL_CACHE` at a directory under target/ that it empties first): a build another
//! test executable already made is read back and printed as "from the kernel cache".

mod common;

use std::panic::catch_unwind;

use common::TempDir;

use gsttoonflow::cuda::kernels::{
    KERNEL_FILE, KERNEL_NAMES, assemble, compile, compile_with_disk_cache, exact_math, full_source,
};
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

/// "in N ms", or where the PTX came from when NVRTC did not run.
fn took(ms: f64) -> String {
    if ms == 0.0 {
        "from the kernel cache".into()
    } else {
        format!("in {ms:.0} ms")
    }
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
                "compiled {KERNEL_FILE} for {arch} {precision:?}: {} kernels, {} bytes of PTX {}",
                KERNEL_NAMES.len(),
                ptx.len(),
                took(ms)
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
            "compiled {file} for {arch}: {} kernels, {} bytes of PTX {}",
            names.len(),
            ptx.len(),
            took(ms)
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// kernels/neural.cu (the style network's kernels, one build for both storage precisions: the
/// storage of each buffer is chosen per launch), as its `neural::PARTS` programs: every part
/// compiles, and every kernel is defined in exactly one of them.
#[test]
fn neural_kernels_compile_for_every_target_architecture() {
    if skipped_without_nvrtc() {
        return;
    }
    let file = neural::KERNEL_FILE;
    let mut failures = Vec::new();
    for arch in ARCHES {
        let (parts, ms) = match neural::compile(arch) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{file} {arch}: {e}"));
                continue;
            }
        };
        assert_eq!(parts.len(), neural::PARTS as usize, "{arch}");
        for (part, ptx) in parts.iter().enumerate() {
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "{arch} part {part}"
            );
        }
        // (the element finds each kernel's part by these entries, as here)
        let entries: Vec<Vec<&str>> = parts
            .iter()
            .map(|p| neural::ptx_entries(p).collect())
            .collect();
        for name in neural::KERNEL_NAMES {
            let defined: Vec<usize> = (0..parts.len())
                .filter(|&part| entries[part].contains(&name))
                .collect();
            assert!(
                defined.len() == 1,
                "{file} {arch}: {name} is defined in parts {defined:?}, not in exactly one"
            );
        }
        assert_eq!(
            entries.iter().map(Vec::len).sum::<usize>(),
            neural::KERNEL_NAMES.len(),
            "{file} {arch}: entries in the PTX {entries:?}"
        );
        println!(
            "compiled {file} for {arch}: {} kernels in {} parts, {} bytes of PTX {}",
            neural::KERNEL_NAMES.len(),
            parts.len(),
            parts.iter().map(String::len).sum::<usize>(),
            took(ms)
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every kernel file assembles for every target architecture: NVRTC for the real `sm_XY`
/// runs the assembler the element's own build (for `compute_XY`) leaves to the driver, which
/// reports an instruction the architecture lacks, too much shared memory or too many registers
/// for a kernel's launch bounds. One thread an architecture.
#[test]
fn kernels_assemble_for_every_target_architecture() {
    if skipped_without_nvrtc() {
        return;
    }
    let builds: Vec<(&'static str, String, bool)> = vec![
        (KERNEL_FILE, full_source(Precision::Fp16), !exact_math()),
        (KERNEL_FILE, full_source(Precision::Fp32), !exact_math()),
        (neural::KERNEL_FILE, neural::full_source(), true),
        (
            neural_frame::KERNEL_FILE,
            neural_frame::full_source(),
            false,
        ),
    ];
    let failures: Vec<String> = std::thread::scope(|scope| {
        let threads: Vec<_> = ARCHES
            .iter()
            .map(|&arch| {
                let builds = &builds;
                scope.spawn(move || {
                    let mut failures = Vec::new();
                    for (file, source, fmad) in builds {
                        match assemble(file, arch, source, *fmad) {
                            Ok(ms) => println!("assembled {file} for {arch} in {ms:.0} ms"),
                            Err(e) => failures.push(format!("{file} {arch}: {e}")),
                        }
                    }
                    failures
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().expect("an assembling thread panicked"))
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
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

/// The disk cache with the real NVRTC: kernels/neural_frame.cu (the small file) compiled into an
/// empty directory, then read back (no NVRTC: 0 ms) as the same PTX; a truncated file is compiled
/// again and rewritten.
#[test]
fn a_second_build_reads_the_ptx_from_the_disk_cache() {
    if skipped_without_nvrtc() {
        return;
    }
    let scratch = TempDir::new("nvrtc-cache");
    let dir = &scratch.0;
    let source = neural_frame::full_source();
    let build = || {
        compile_with_disk_cache(
            Some(dir),
            neural_frame::KERNEL_FILE,
            "sm_90",
            &source,
            false,
        )
        .unwrap()
    };
    let files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    };
    let (first, ms) = build();
    assert!(ms > 0.0, "an empty cache: NVRTC ran");
    let written = files();
    assert_eq!(written.len(), 1, "{written:?}");
    let name = written[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        name.starts_with("neural_frame-sm_90-") && name.ends_with(".ptx"),
        "{name}"
    );
    let (second, ms) = build();
    assert_eq!(ms, 0.0, "the second build is read from {name}");
    assert_eq!(second, first);
    // A truncated file (a crash while writing, a full disk) is compiled again and rewritten.
    let whole = std::fs::read(&written[0]).unwrap();
    std::fs::write(&written[0], &whole[..whole.len() / 2]).unwrap();
    let (third, ms) = build();
    assert!(ms > 0.0, "the truncated file was not used");
    assert_eq!(third, first);
    assert_eq!(std::fs::read(&written[0]).unwrap(), whole);
    assert_eq!(build(), (first, 0.0));
    println!("kernel cache: {name} written, read back, rewritten after truncation");
}
