//! [`CudaError`]: why the CUDA backend cannot run or failed, with the driver's and NVRTC's own
//! errors as sources.
//!
//! The element posts `Display` on the bus, so each message carries its source's text too (not
//! only the chain): "CUDA error: cuMemsetD8Async: CUDA_ERROR_..., ...".

use std::borrow::Cow;

use cudarc::driver::DriverError;
use cudarc::nvrtc::CompileError;

/// Why the CUDA backend cannot run or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// libcuda, NVRTC or a device is missing: the element may fall back to the CPU.
    #[error("CUDA unavailable: {reason}{}", colon(.source))]
    Unavailable {
        reason: String,
        #[source]
        source: Option<DriverError>,
    },
    /// The memory plan is larger than `max-device-memory` or than the device has free, or an
    /// allocation failed.
    #[error("device memory: {0}")]
    OutOfMemory(#[source] MemoryShortfall),
    /// A driver call failed.
    #[error("CUDA error: {what}: {source}")]
    Driver {
        what: Cow<'static, str>,
        #[source]
        source: DriverError,
    },
    /// NVRTC could not compile the kernels (the log is in the source).
    #[error("CUDA error: {}", compile_message(.file, .arch, .source))]
    Compile {
        file: &'static str,
        arch: String,
        #[source]
        source: CompileError,
    },
    /// cudarc panicked inside a call (caught; see `context::guard`).
    #[error("CUDA error: {what}: cudarc panicked: {message}")]
    Panicked { what: String, message: String },
    /// Anything else: a request the pipeline cannot serve (wrong geometry, no arena), a
    /// capture that produced no graph.
    #[error("CUDA error: {0}")]
    Failed(String),
}

/// Why memory could not be had: the plan against a cap or the free memory, or the driver's
/// refusal (then the source).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}{}", colon(.source))]
pub struct MemoryShortfall {
    pub message: String,
    #[source]
    pub source: Option<DriverError>,
}

impl CudaError {
    pub(crate) fn unavailable(reason: impl Into<String>) -> Self {
        CudaError::Unavailable {
            reason: reason.into(),
            source: None,
        }
    }

    /// A shortfall with no driver error behind it (a cap, a free-memory check).
    pub(crate) fn out_of_memory(message: impl Into<String>) -> Self {
        CudaError::OutOfMemory(MemoryShortfall {
            message: message.into(),
            source: None,
        })
    }
}

/// The one way to turn a failed driver call into a [`CudaError`]:
/// `call().map_err(driver("cuStreamSynchronize"))`.
pub(crate) fn driver(what: impl Into<Cow<'static, str>>) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver {
        what: what.into(),
        source,
    }
}

fn colon(source: &Option<DriverError>) -> String {
    source.map_or_else(String::new, |e| format!(": {e}"))
}

fn compile_message(file: &str, arch: &str, e: &CompileError) -> String {
    match e {
        CompileError::CompileError { nvrtc, log, .. } => format!(
            "NVRTC could not compile {file} for {arch} ({nvrtc:?}):\n{}",
            log.to_string_lossy()
        ),
        other => format!("NVRTC failed: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;
    use std::error::Error;

    #[test]
    fn the_chain_reaches_the_driver_error() {
        let oom = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let e = CudaError::OutOfMemory(MemoryShortfall {
            message: "cuMemAlloc of 10 bytes failed".into(),
            source: Some(oom),
        });
        let inner = e.source().unwrap();
        assert_eq!(
            inner.source().unwrap().downcast_ref::<DriverError>(),
            Some(&oom)
        );
        let e = driver("cuStreamSynchronize")(oom);
        assert_eq!(
            e.source().unwrap().downcast_ref::<DriverError>(),
            Some(&oom)
        );
        assert!(
            CudaError::out_of_memory("x")
                .source()
                .unwrap()
                .source()
                .is_none()
        );
    }

    #[test]
    fn messages_carry_the_source_text() {
        assert_eq!(
            CudaError::unavailable("no CUDA device found").to_string(),
            "CUDA unavailable: no CUDA device found"
        );
        assert_eq!(
            CudaError::out_of_memory("the memory plan for x needs 2 bytes").to_string(),
            "device memory: the memory plan for x needs 2 bytes"
        );
        // A driver error's text comes from libcuda (cuGetErrorString): only where it loads.
        if crate::cuda::context::libraries_present().is_err() {
            println!("skipped the driver texts: libcuda not found");
            return;
        }
        let oom = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let e = CudaError::OutOfMemory(MemoryShortfall {
            message: "cuMemAlloc of 10 bytes failed".into(),
            source: Some(oom),
        });
        assert_eq!(
            e.to_string(),
            format!("device memory: cuMemAlloc of 10 bytes failed: {oom}")
        );
        assert_eq!(
            driver("cuStreamSynchronize")(oom).to_string(),
            format!("CUDA error: cuStreamSynchronize: {oom}")
        );
    }

    #[test]
    fn a_compile_error_shows_the_log() {
        let e = CudaError::Compile {
            file: "toonflow.cu",
            arch: "sm_90".into(),
            source: CompileError::CompileError {
                nvrtc: cudarc::nvrtc::result::NvrtcError(
                    cudarc::nvrtc::sys::nvrtcResult::NVRTC_ERROR_COMPILATION,
                ),
                options: vec![],
                log: std::ffi::CString::new("toonflow.cu(3): error: injected").unwrap(),
            },
        };
        let text = e.to_string();
        assert!(
            text.starts_with("CUDA error: NVRTC could not compile toonflow.cu for sm_90"),
            "{text}"
        );
        assert!(text.ends_with("error: injected"), "{text}");
        assert!(e.source().unwrap().downcast_ref::<CompileError>().is_some());
    }
}
