//! NVRTC build of `kernels/toonflow.cu` for the device's own architecture, cached per process
//! by (architecture, precision) for the PTX and by (device, precision) for the loaded module,
//! and the NVRTC build every kernel file goes through (`compile_cached`: the per-process cache,
//! then the disk cache of [`ptx_cache`], then NVRTC).

use std::collections::HashMap;
use std::panic::catch_unwind;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileOptions, Ptx};
use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::abi;
use super::context::{describe, guard, nvrtc_present};
use super::error::{CudaError, driver};
use super::fault::{Fault, injected};
use super::ptx_cache;
use crate::pipeline::Precision;

/// The kernel source, embedded at build time (without the ABI header, see [`full_source`]).
pub const KERNEL_SOURCE: &str = include_str!("../../kernels/toonflow.cu");
/// The name NVRTC and its log give the translation unit.
pub const KERNEL_FILE: &str = "toonflow.cu";

/// fp16 storage helpers shared by the neural kernel files (kernels/fp16.cuh).
pub const FP16_HELPERS: &str = include_str!("../../kernels/fp16.cuh");

/// NV12 -> the network's input values, shared by the neural kernel files (kernels/nv12.cuh;
/// it reads the `NfFrame` their ABI headers declare).
pub const NV12_HELPERS: &str = include_str!("../../kernels/nv12.cuh");

/// The body of a neural translation unit: the fp16 and NV12 helpers, then `source` (as `file`
/// in NVRTC's messages).
pub fn with_neural_helpers(file: &str, source: &str) -> String {
    format!(
        "#line 1 \"fp16.cuh\"\n{FP16_HELPERS}\n#line 1 \"nv12.cuh\"\n{NV12_HELPERS}\n#line 1 \"{file}\"\n{source}"
    )
}

/// Names of the kernels in `toonflow.cu`.
pub const KERNEL_NAMES: [&str; 7] = [
    "tf_unpack",
    "tf_analyze",
    "tf_bilateral_x",
    "tf_bilateral_y",
    "tf_temporal",
    "tf_dog_x",
    "tf_final",
];

/// The loaded functions of one (device, precision).
pub struct Kernels {
    pub precision: Precision,
    pub unpack: CudaFunction,
    pub analyze: CudaFunction,
    pub bilateral_x: CudaFunction,
    pub bilateral_y: CudaFunction,
    pub temporal: CudaFunction,
    pub dog_x: CudaFunction,
    pub final_: CudaFunction,
    /// Milliseconds NVRTC took (0 when the PTX came from the cache).
    pub compile_ms: f64,
    pub arch: String,
}

type PtxCache = HashMap<(String, Precision), String>;
type ModuleCache = HashMap<(usize, Precision), Arc<Kernels>>;

static PTX_CACHE: Lazy<Mutex<PtxCache>> = Lazy::new(|| Mutex::new(HashMap::new()));
static MODULES: Lazy<Mutex<ModuleCache>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The kernels use no FMA contraction (sums in the CPU reference's order and rounding).
/// `TOONFLOW_FAST_MATH=1` builds them with fused multiply-adds instead: an experiment.
pub fn exact_math() -> bool {
    !std::env::var("TOONFLOW_FAST_MATH").is_ok_and(|v| v == "1")
}

/// Range and motion weights come from the hardware `ex2` by default (parity with the CPU is
/// measured by tests/cuda_parity.rs); `TOONFLOW_ACCURATE_EXP=1` builds the accurate `expf`
/// instead, for comparison.
pub fn accurate_exp() -> bool {
    std::env::var("TOONFLOW_ACCURATE_EXP").is_ok_and(|v| v == "1")
}

/// The translation unit NVRTC sees: the build switches, the ABI generated from Rust
/// ([`abi::header`]), then `kernels/toonflow.cu`.
pub fn full_source(precision: Precision) -> String {
    let fp16 = matches!(precision, Precision::Fp16) as i32;
    let accurate = accurate_exp() as i32;
    format!(
        "#define TF_FP16 {fp16}\n#define TF_ACCURATE_EXP {accurate}\n{}\n#line 1 \"{KERNEL_FILE}\"\n{KERNEL_SOURCE}",
        abi::header()
    )
}

/// NVRTC's options for `arch`, the exact list [`compile_to_ptx`] passes (and the disk cache's
/// key covers): IEEE division and square root, no flush to zero, FMA contraction only when
/// `fmad`, and the device's virtual architecture ([`virtual_arch`]).
fn nvrtc_options(arch: &str, fmad: bool) -> Vec<String> {
    options_for_target(&virtual_arch(arch), fmad)
}

/// The options with `target` as NVRTC's architecture (virtual, or real for [`assemble`]).
fn options_for_target(target: &str, fmad: bool) -> Vec<String> {
    vec![
        "--ftz=false".into(),
        "--prec-sqrt=true".into(),
        "--prec-div=true".into(),
        format!("--fmad={fmad}"),
        format!("--gpu-architecture={target}"),
        "--std=c++14".into(),
    ]
}

/// NVRTC for the real architecture `arch` (sm_XY) with the element's other options: NVRTC then
/// also assembles the PTX for the device (ptxas inside NVRTC), which reports what the element's
/// own build ([`virtual_arch`]) leaves to the driver at load: an instruction the architecture
/// lacks, too much shared memory or too many registers for a kernel's launch bounds. The cubin
/// is dropped; returns NVRTC's milliseconds. For the tests (no GPU needed).
pub fn assemble(
    file: &'static str,
    arch: &str,
    source: &str,
    fmad: bool,
) -> Result<f64, CudaError> {
    let start = Instant::now();
    compile_to_ptx(file, arch, source, options_for_target(arch, fmad), false)?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// The virtual architecture of a real one ("sm_90" -> "compute_90"). NVRTC writes the same PTX
/// for both, but for a real architecture it also assembles a cubin, which toonflow never loads
/// (it loads the PTX, which the driver compiles for the device): for the neural kernels at
/// sm_90 that cubin was 60 % of NVRTC's time (53.5 s against 21.7 s on a 2-core machine, NVRTC
/// 12.8, the same PTX byte for byte).
fn virtual_arch(arch: &str) -> String {
    match arch.strip_prefix("sm_") {
        Some(version) => format!("compute_{version}"),
        None => arch.to_string(),
    }
}

/// NVRTC over one kernel file's translation unit `src` with `options` ([`nvrtc_options`]); with
/// `broken` (the injected compile fault) NVRTC fails on an `#error` line.
fn compile_to_ptx(
    file: &'static str,
    arch: &str,
    src: &str,
    options: Vec<String>,
    broken: bool,
) -> Result<Ptx, CudaError> {
    let opts = CompileOptions {
        options,
        name: Some(file.into()),
        ..Default::default()
    };
    let src = if broken {
        format!("{src}\n#error \"fault injected by TOONFLOW_CUDA_FAULT=compile\"\n")
    } else {
        src.to_string()
    };
    guard("NVRTC", || {
        cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|source| CudaError::Compile {
            file,
            arch: arch.to_string(),
            source,
        })
    })
}

/// The loaded NVRTC's version (part of the disk cache's key), or None when NVRTC does not load.
fn nvrtc_version() -> Option<(i32, i32)> {
    static VERSION: OnceLock<Option<(i32, i32)>> = OnceLock::new();
    *VERSION.get_or_init(|| {
        if !nvrtc_present() {
            return None;
        }
        // SAFETY: `nvrtcVersion` writes two ints; cudarc may panic when the symbol is missing:
        // that means None.
        catch_unwind(|| unsafe {
            let (mut major, mut minor) = (0, 0);
            cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
                .result()
                .ok()
                .map(|()| (major, minor))
        })
        .ok()
        .flatten()
    })
}

/// NVRTC's PTX of `source` (the translation unit `file`) for `arch`, through the disk cache in
/// `dir` ([`ptx_cache`]; None: no disk cache): the cached file when it is there and whole, else
/// compiled and written there. Returns the PTX and NVRTC's milliseconds (0 when read from the
/// cache). A cache that cannot be read or written only costs the compile; errors are NVRTC's.
pub fn compile_with_disk_cache(
    dir: Option<&Path>,
    file: &'static str,
    arch: &str,
    source: &str,
    fmad: bool,
) -> Result<(String, f64), CudaError> {
    let options = nvrtc_options(arch, fmad);
    let path = dir.and_then(|dir| {
        let nvrtc = nvrtc_version()?;
        Some(dir.join(ptx_cache::file_name(&ptx_cache::Build {
            file,
            arch,
            options: &options,
            source,
            nvrtc,
        })))
    });
    if let Some(ptx) = path.as_ref().and_then(|p| ptx_cache::read(p, arch).ok()) {
        return Ok((ptx, 0.0));
    }
    let start = Instant::now();
    let ptx = compile_to_ptx(file, arch, source, options, false)?.to_src();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    if let Some(path) = &path {
        // A failed write (read-only or full disk) only means compiling again next time.
        let _ = ptx_cache::write(path, &ptx);
    }
    Ok((ptx, ms))
}

/// PTX from `cache` under `key`, else from the disk cache ([`ptx_cache::dir`]), else compiled
/// from `source()` by NVRTC and cached in both; returns the PTX and NVRTC's milliseconds (0 on a
/// cache hit). Under `TOONFLOW_CUDA_FAULT=compile` both caches are passed by and NVRTC fails.
pub(crate) fn compile_cached<K: Eq + std::hash::Hash>(
    cache: &Mutex<HashMap<K, String>>,
    key: K,
    file: &'static str,
    arch: &str,
    source: impl FnOnce() -> String,
    fmad: bool,
) -> Result<(String, f64), CudaError> {
    if injected(Fault::Compile) {
        let start = Instant::now();
        let ptx = compile_to_ptx(file, arch, &source(), nvrtc_options(arch, fmad), true)?;
        return Ok((ptx.to_src(), start.elapsed().as_secs_f64() * 1e3));
    }
    if let Some(ptx) = cache.lock().get(&key) {
        return Ok((ptx.clone(), 0.0));
    }
    let (ptx, ms) =
        compile_with_disk_cache(ptx_cache::dir().as_deref(), file, arch, &source(), fmad)?;
    cache.lock().insert(key, ptx.clone());
    Ok((ptx, ms))
}

/// How a build's PTX came, for the log: "NVRTC 812.5 ms", or "cached PTX" for 0 ms (this
/// process's cache or the disk cache; NVRTC did not run).
pub fn build_note(compile_ms: f64) -> String {
    if compile_ms == 0.0 {
        "cached PTX".into()
    } else {
        format!("NVRTC {compile_ms:.1} ms")
    }
}

/// Compiles the kernels to PTX for `arch` (e.g. "sm_90"); needs NVRTC, not a device.
pub fn compile(arch: &str, precision: Precision) -> Result<(String, f64), CudaError> {
    compile_cached(
        &PTX_CACHE,
        (arch.to_string(), precision),
        KERNEL_FILE,
        arch,
        || full_source(precision),
        !exact_math(),
    )
}

/// The kernels of `precision` loaded into `ctx` (compiled on first use in this process).
/// Modules of the primary contexts are cached; a pipeline's adopted context (a GstCudaContext
/// that may be destroyed and its address reused) loads its own from the cached PTX.
pub fn kernels(ctx: &Arc<CudaContext>, precision: Precision) -> Result<Arc<Kernels>, CudaError> {
    let key = (ctx.ordinal(), precision);
    let mut modules = MODULES.lock();
    if let Some(k) = modules
        .get(&key)
        .filter(|_| ctx.is_primary() && !injected(Fault::Compile))
    {
        return Ok(k.clone());
    }
    let (_, (major, minor)) = describe(ctx)?;
    let arch = format!("sm_{major}{minor}");
    let (ptx, compile_ms) = compile(&arch, precision)?;
    let k = guard("loading the kernels", || {
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(driver("cuModuleLoadData"))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(driver(format!("kernel {name}")))
        };
        Ok(Kernels {
            precision,
            unpack: f("tf_unpack")?,
            analyze: f("tf_analyze")?,
            bilateral_x: f("tf_bilateral_x")?,
            bilateral_y: f("tf_bilateral_y")?,
            temporal: f("tf_temporal")?,
            dog_x: f("tf_dog_x")?,
            final_: f("tf_final")?,
            compile_ms,
            arch: arch.clone(),
        })
    })?;
    let k = Arc::new(k);
    if ctx.is_primary() {
        modules.insert(key, k.clone());
    }
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_is_self_contained() {
        let s = full_source(Precision::Fp16);
        assert!(s.starts_with("#define TF_FP16 1"));
        assert!(!s.contains("#include"));
        assert!(s.contains("struct ToonParams"));
        // A declaration may carry `__launch_bounds__(...)` between `void` and the name.
        for name in KERNEL_NAMES {
            let declared = s.lines().any(|line| {
                line.starts_with("extern \"C\" __global__ void")
                    && line.contains(&format!(" {name}("))
            });
            assert!(declared, "{name}");
        }
        assert!(full_source(Precision::Fp32).starts_with("#define TF_FP16 0"));
    }

    #[test]
    fn nvrtc_targets_the_virtual_architecture() {
        assert_eq!(virtual_arch("sm_90"), "compute_90");
        assert_eq!(virtual_arch("sm_75"), "compute_75");
        assert_eq!(virtual_arch("compute_86"), "compute_86");
        let options = nvrtc_options("sm_89", true);
        assert!(options.contains(&"--gpu-architecture=compute_89".to_string()));
        assert!(!options.iter().any(|o| o.contains("sm_")));
        // the assembler check's options differ only in the target
        let real = options_for_target("sm_89", true);
        assert_eq!(real.len(), options.len());
        let differ: Vec<_> = real.iter().zip(&options).filter(|(a, b)| a != b).collect();
        assert_eq!(
            differ,
            [(
                &"--gpu-architecture=sm_89".to_string(),
                &"--gpu-architecture=compute_89".to_string()
            )]
        );
    }

    /// The virtual target loses nothing: NVRTC's PTX for compute_XY is the PTX for sm_XY, byte
    /// for byte (the classic kernels, fp16 at sm_90 and fp32 at sm_75), and it names the real
    /// architecture as its target, which the disk cache checks. Needs NVRTC, not a GPU; without
    /// it the test says so and passes (tests/nvrtc_compile.rs is the one that fails then in CI).
    #[test]
    fn the_virtual_architecture_gives_the_same_ptx() {
        if !nvrtc_present() {
            println!("skipped: libnvrtc cannot be loaded (scripts/test.sh installs it)");
            return;
        }
        let fmad = !exact_math();
        for (precision, arch) in [(Precision::Fp16, "sm_90"), (Precision::Fp32, "sm_75")] {
            let source = full_source(precision);
            let ptx = |options: Vec<String>| {
                compile_to_ptx(KERNEL_FILE, arch, &source, options, false)
                    .unwrap_or_else(|e| panic!("{arch}: {e}"))
                    .to_src()
            };
            let real = ptx(options_for_target(arch, fmad));
            let virt = ptx(nvrtc_options(arch, fmad));
            assert!(real == virt, "{arch} {precision:?}: the PTX differs");
            assert!(virt.lines().any(|l| l == format!(".target {arch}")));
        }
    }

    #[test]
    fn the_kernel_file_writes_no_part_of_the_abi_itself() {
        for d in abi::defines() {
            let def = format!("#define {} ", d.name);
            assert!(
                !KERNEL_SOURCE.contains(&def),
                "{def} belongs to src/cuda/abi.rs"
            );
            assert_eq!(
                full_source(Precision::Fp16).matches(&def).count(),
                1,
                "{def}"
            );
        }
        for name in ["ToonParams", "TfControl", "TfState", "TfFrame"] {
            assert!(
                !KERNEL_SOURCE.contains(&format!("struct {name} {{")),
                "{name} belongs to src/cuda/abi.rs"
            );
        }
    }
}
