//! Page-locked host memory: [`PinnedHostBuffer`] and [`is_page_locked`].

use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use super::context::{context, guard, libraries_present};
use super::error::{CudaError, MemoryShortfall, driver};

/// Page-locked host memory (cuMemHostAlloc, portable: page-locked for every context of the
/// process, so a pipeline in a context adopted from nvcodec copies from it at full speed too;
/// cached, so the CPU reads it fast). Freed on drop. Copies from and to it run at PCIe speed and asynchronously.
pub struct PinnedHostBuffer {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain host memory; the pointer is owned and freed once, in `drop`.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: shared access only reads through `&[u8]`; writes need `&mut self`.
unsafe impl Sync for PinnedHostBuffer {}

impl PinnedHostBuffer {
    /// `len` bytes of page-locked memory registered with `device_id`'s context, zeroed.
    pub fn new(device_id: usize, len: usize) -> Result<Self, CudaError> {
        Self::in_context(context(device_id)?, len)
    }

    /// `len` bytes of page-locked memory registered with `ctx`, zeroed.
    pub fn in_context(ctx: Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        let bytes = len.max(1);
        guard("cuMemHostAlloc", || {
            ctx.bind_to_thread()
                .map_err(driver("binding the context"))?;
            // SAFETY: the context is current on this thread; the flags ask for cached,
            // portable page-locked memory. The pointer is checked by the driver's result.
            let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(
                |e| {
                    CudaError::OutOfMemory(MemoryShortfall {
                        message: format!("cannot allocate {len} bytes of page-locked host memory"),
                        source: Some(e),
                    })
                },
            )? as *mut u8;
            // SAFETY: `ptr` points to `bytes` freshly allocated, writable bytes.
            unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
            Ok(PinnedHostBuffer { ptr, len, ctx })
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl std::ops::Deref for PinnedHostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` holds at least `len` initialised (zeroed at allocation) bytes that live
        // as long as `self`; mutation needs `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PinnedHostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_host` in this context and is freed only here.
        let _ = unsafe { result::free_host(self.ptr as _) };
    }
}

impl std::fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedHostBuffer({} bytes)", self.len)
    }
}

/// True when `ptr` lies in page-locked memory known to CUDA (cuMemHostAlloc'd, or registered
/// with cuMemHostRegister: the pointer's memory type is then "host").
pub fn is_page_locked(ptr: *const u8) -> bool {
    if libraries_present().is_err() {
        return false;
    }
    let addr = ptr as usize;
    // The look-ups need a current context: on a thread without one, the primary context of
    // device 0 (contexts share one address space, so any context answers).
    let mut current = std::ptr::null_mut();
    // SAFETY: writes the calling thread's current context (or null) to a local.
    let none_current = unsafe { sys::cuCtxGetCurrent(&mut current) }
        .result()
        .is_err()
        || current.is_null();
    if none_current
        && context(0)
            .and_then(|c| c.bind_to_thread().map_err(driver("binding")))
            .is_err()
    {
        return false;
    }
    std::panic::catch_unwind(move || {
        let mut flags = 0u32;
        // SAFETY: cuMemHostGetFlags only looks the address up (any address is allowed: an
        // unknown one returns an error) and writes the flags to a local.
        let allocated = unsafe {
            sys::cuMemHostGetFlags(&mut flags, addr as *mut _) == sys::CUresult::CUDA_SUCCESS
        };
        let mut kind = 0u32;
        // SAFETY: as above: a look-up of any address, the answer written to a local `u32` (the
        // attribute's type is a CUmemorytype, a C enum).
        allocated
            || unsafe {
                sys::cuPointerGetAttribute(
                    &mut kind as *mut u32 as *mut _,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    addr as sys::CUdeviceptr,
                ) == sys::CUresult::CUDA_SUCCESS
                    && kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
            }
    })
    .unwrap_or(false)
}
