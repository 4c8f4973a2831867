//! Asynchronous host↔device and device↔device copies on a stream: contiguous blocks and 2D
//! planes whose pitches differ (a GStreamer frame's stride against the tightly packed device
//! plane).
//!
//! All are `unsafe`: the driver reads and writes raw addresses. Each function's `# Safety`
//! says what the caller guarantees.

use cudarc::driver::DriverError;
use cudarc::driver::sys::{self, CUdeviceptr};

/// Copies `bytes` bytes from host memory to the device.
///
/// # Safety
/// `src..src + bytes` is readable host memory and `dst..dst + bytes` lies in one device
/// allocation of the stream's context; both stay valid until the stream reaches the copy (page-
/// locked host memory makes the copy asynchronous; pageable memory is copied before return).
pub(crate) unsafe fn copy_h2d(
    stream: sys::CUstream,
    src: *const u8,
    dst: CUdeviceptr,
    bytes: usize,
) -> Result<(), DriverError> {
    // SAFETY: the caller guarantees both ranges (see above).
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const _, bytes, stream).result() }
}

/// Copies `bytes` bytes from the device to host memory.
///
/// # Safety
/// `src..src + bytes` lies in one device allocation of the stream's context and
/// `dst..dst + bytes` is writable host memory that nothing reads before the stream has reached
/// the copy (synchronise first).
pub(crate) unsafe fn copy_d2h(
    stream: sys::CUstream,
    src: CUdeviceptr,
    dst: *mut u8,
    bytes: usize,
) -> Result<(), DriverError> {
    // SAFETY: the caller guarantees both ranges (see above).
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut _, src, bytes, stream).result() }
}

/// Copies `rows` rows of `width` bytes from host rows `src_pitch` apart to device rows
/// `dst_pitch` apart.
///
/// # Safety
/// Every source row `src + r·src_pitch .. + width` is readable host memory, every destination
/// row lies in one device allocation of the stream's context, and both stay valid until the
/// stream reaches the copy.
pub(crate) unsafe fn copy_2d_h2d(
    stream: sys::CUstream,
    src: *const u8,
    src_pitch: usize,
    dst: CUdeviceptr,
    dst_pitch: usize,
    width: usize,
    rows: usize,
) -> Result<(), DriverError> {
    use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
    let c = memcpy_2d(
        CU_MEMORYTYPE_HOST,
        src,
        0,
        src_pitch,
        CU_MEMORYTYPE_DEVICE,
        std::ptr::null_mut(),
        dst,
        dst_pitch,
        width,
        rows,
    );
    // SAFETY: `c` is fully initialised and describes ranges the caller guarantees.
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream).result() }
}

/// Copies `rows` rows of `width` bytes from device rows `src_pitch` apart to host rows
/// `dst_pitch` apart.
///
/// # Safety
/// Every source row lies in one device allocation of the stream's context, every destination
/// row `dst + r·dst_pitch .. + width` is writable host memory that nothing reads before the
/// stream has reached the copy.
pub(crate) unsafe fn copy_2d_d2h(
    stream: sys::CUstream,
    src: CUdeviceptr,
    src_pitch: usize,
    dst: *mut u8,
    dst_pitch: usize,
    width: usize,
    rows: usize,
) -> Result<(), DriverError> {
    use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
    let c = memcpy_2d(
        CU_MEMORYTYPE_DEVICE,
        std::ptr::null(),
        src,
        src_pitch,
        CU_MEMORYTYPE_HOST,
        dst,
        0,
        dst_pitch,
        width,
        rows,
    );
    // SAFETY: `c` is fully initialised and describes ranges the caller guarantees.
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream).result() }
}

/// Copies `rows` rows of `width` bytes between two device allocations of the stream's context
/// (a GstCudaMemory frame and the arena): no PCIe traffic.
///
/// # Safety
/// Every source and destination row lies in one device allocation of the stream's context, and
/// both stay valid until the stream reaches the copy.
pub(crate) unsafe fn copy_2d_d2d(
    stream: sys::CUstream,
    src: CUdeviceptr,
    src_pitch: usize,
    dst: CUdeviceptr,
    dst_pitch: usize,
    width: usize,
    rows: usize,
) -> Result<(), DriverError> {
    use sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let c = memcpy_2d(
        CU_MEMORYTYPE_DEVICE,
        std::ptr::null(),
        src,
        src_pitch,
        CU_MEMORYTYPE_DEVICE,
        std::ptr::null_mut(),
        dst,
        dst_pitch,
        width,
        rows,
    );
    // SAFETY: `c` is fully initialised and describes ranges the caller guarantees.
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream).result() }
}

/// A 2D copy between host and device rows (pitches may differ); every field set explicitly
/// (the struct holds enums, so it must not be zero-initialised).
#[allow(clippy::too_many_arguments)]
fn memcpy_2d(
    src_type: sys::CUmemorytype,
    src_host: *const u8,
    src_device: CUdeviceptr,
    src_pitch: usize,
    dst_type: sys::CUmemorytype,
    dst_host: *mut u8,
    dst_device: CUdeviceptr,
    dst_pitch: usize,
    width: usize,
    rows: usize,
) -> sys::CUDA_MEMCPY2D {
    sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: src_type,
        srcHost: src_host as *const _,
        srcDevice: src_device,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dst_type,
        dstHost: dst_host as *mut _,
        dstDevice: dst_device,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: rows,
    }
}
