//! Device memory: one allocation checked against the device's free memory first, freed on drop.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, result};

use super::context::{guard, memory_info};
use super::error::{CudaError, MemoryShortfall, driver};
use super::fault::{Fault, injected};

/// One device allocation, freed on drop.
pub(crate) struct DeviceBlock {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) bytes: u64,
    ctx: Arc<CudaContext>,
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_sync` in this context and is freed only here; its
        // owners drop the graphs addressing it first and synchronise their frames.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Allocates `bytes` of device memory in `ctx` for `what` (named in the errors), leaving the
/// context current on this thread. More than the device has free is refused before the driver
/// is asked; `TOONFLOW_CUDA_FAULT=alloc` asks it for four times the free memory instead, a real
/// allocation failure.
pub(crate) fn allocate(
    ctx: &Arc<CudaContext>,
    bytes: u64,
    what: &str,
) -> Result<DeviceBlock, CudaError> {
    let (free, _) = memory_info(ctx)?;
    let ask = if injected(Fault::Alloc) {
        free.saturating_mul(4)
    } else {
        bytes.max(1)
    };
    if bytes > free {
        return Err(CudaError::out_of_memory(format!(
            "{what} needs {bytes} bytes, the device has {free} bytes free"
        )));
    }
    guard("cuMemAlloc", || {
        ctx.bind_to_thread()
            .map_err(driver("binding the context"))?;
        // SAFETY: the context is current on this thread; the result is checked.
        let ptr = unsafe { result::malloc_sync(ask as usize) }.map_err(|e| {
            CudaError::OutOfMemory(MemoryShortfall {
                message: format!("cuMemAlloc of {ask} bytes for {what} failed"),
                source: Some(e),
            })
        })?;
        Ok(DeviceBlock {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    })
}
