//! One primary CUDA context per device per process, held in a global once-cell.
//!
//! Every entry point checks that libcuda and NVRTC can be loaded *before* the first cudarc call
//! that would panic without them, and wraps the remaining cudarc calls in `catch_unwind`.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{CUcontext, CUdevice};
use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::error::{CudaError, driver};

static CONTEXTS: Lazy<Mutex<HashMap<usize, Arc<CudaContext>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// Runs `f`, turning a panic inside cudarc into [`CudaError::Panicked`].
pub(crate) fn guard<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(CudaError::Panicked {
                what: what.to_string(),
                message: msg,
            })
        }
    }
}

/// NVRTC loads? Never panics.
pub fn nvrtc_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the library; a failure to load is caught
    // (cudarc may panic) and means "absent".
    catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false)
}

/// libcuda and NVRTC load? Never panics.
pub fn libraries_present() -> Result<(), CudaError> {
    // SAFETY: `is_culib_present` only tries to dlopen the library; a failure to load is caught
    // (cudarc may panic) and means "absent".
    let cuda = catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false);
    if !cuda {
        return Err(CudaError::unavailable(
            "libcuda (the NVIDIA driver library) cannot be loaded",
        ));
    }
    if !nvrtc_present() {
        return Err(CudaError::unavailable(
            "libnvrtc (the CUDA runtime compiler) cannot be loaded",
        ));
    }
    Ok(())
}

/// The process-wide primary context of `device_id`, created on first use with cudarc's
/// per-buffer event tracking disabled (it breaks stream capture).
pub fn context(device_id: usize) -> Result<Arc<CudaContext>, CudaError> {
    libraries_present()?;
    let mut map = CONTEXTS.lock();
    if let Some(ctx) = map.get(&device_id) {
        return Ok(ctx.clone());
    }
    let ctx = guard("creating the CUDA context", || {
        let count = CudaContext::device_count().map_err(|e| CudaError::Unavailable {
            reason: "cuInit failed".into(),
            source: Some(e),
        })?;
        if count <= 0 {
            return Err(CudaError::unavailable("no CUDA device found"));
        }
        if device_id >= count as usize {
            return Err(CudaError::unavailable(format!(
                "CUDA device {device_id} does not exist ({count} device(s) present)"
            )));
        }
        let ctx = CudaContext::new(device_id).map_err(|e| CudaError::Unavailable {
            reason: format!("cannot create a context on device {device_id}"),
            source: Some(e),
        })?;
        // SAFETY: every stream of this backend keeps its own buffers; nothing is shared
        // between streams without an explicit synchronisation.
        unsafe { ctx.disable_event_tracking() };
        Ok(ctx)
    })?;
    map.insert(device_id, ctx.clone());
    Ok(ctx)
}

/// A CUDA context this process did not create (a GstCudaContext's, found in the pipeline) as a
/// cudarc context, so toonflow's kernels and copies run in it. Our own primary context of the
/// device is returned when that is what `raw` is.
///
/// cudarc would destroy a context it wraps when its last `Arc` goes; the context belongs to its
/// GstCudaContext, so one `Arc` is deliberately leaked (a few bytes per adoption): the caller
/// keeps the GstCudaContext alive for as long as it uses the returned context.
///
/// # Safety
/// `raw` is a live context on device `device_id` and outlives every use of the result.
pub unsafe fn adopt(device_id: usize, raw: CUcontext) -> Result<Arc<CudaContext>, CudaError> {
    libraries_present()?;
    if let Some(own) = CONTEXTS.lock().get(&device_id)
        && own.cu_ctx() == raw
    {
        return Ok(own.clone());
    }
    guard("adopting the pipeline's CUDA context", || {
        cudarc::driver::result::init().map_err(driver("cuInit"))?;
        let device =
            cudarc::driver::result::device::get(device_id as i32).map_err(driver("cuDeviceGet"))?;
        // SAFETY: the caller guarantees `raw` is a live context of this device; the leaked
        // clone below keeps cudarc from ever destroying it.
        let ctx = unsafe { CudaContext::from_raw_context(device_id, device, raw) }
            .map_err(driver("binding the pipeline's context"))?;
        // SAFETY: as in `context`: streams never share buffers without synchronising.
        unsafe { ctx.disable_event_tracking() };
        std::mem::forget(ctx.clone());
        Ok(ctx)
    })
}

/// The device handle (`CUdevice`) of a context.
pub fn device_of(ctx: &Arc<CudaContext>) -> CUdevice {
    ctx.cu_device()
}

/// Name and compute capability of the device.
pub fn describe(ctx: &Arc<CudaContext>) -> Result<(String, (i32, i32)), CudaError> {
    guard("querying the device", || {
        let name = ctx.name().map_err(driver("cuDeviceGetName"))?;
        let cc = ctx
            .compute_capability()
            .map_err(driver("compute capability"))?;
        Ok((name, cc))
    })
}

/// Free and total device memory in bytes.
pub fn memory_info(ctx: &Arc<CudaContext>) -> Result<(u64, u64), CudaError> {
    guard("cuMemGetInfo", || {
        let (free, total) = ctx.mem_get_info().map_err(driver("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    })
}
