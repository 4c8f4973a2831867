//! Asynchronous host↔device and device↔device copies on a stream: contiguous blocks, and 2D
//! planes whose pitches differ (a GStreamer frame's stride against the tightly packed device
//! plane) in one function for every direction.
//!
//! All are `unsafe`: the driver reads and writes raw addresses. Each function's `# Safety`
//! says what the caller guarantees.

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaStream, DriverError};

use super::error::{CudaError, driver};
use crate::neural::precision::{fp16_bits, fp16_value};

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

/// Downloads the `out.len()` values stored at `src`, fp16 with `half` (widened exactly) or
/// f32, into `out` on `stream`, and waits for them.
///
/// # Safety
/// `src` holds `out.len()` values of that storage in one device allocation of the stream's
/// context.
pub(crate) unsafe fn download_values(
    stream: &CudaStream,
    src: CUdeviceptr,
    half: bool,
    out: &mut [f32],
    what: &'static str,
) -> Result<(), CudaError> {
    let mut halves = vec![0u16; if half { out.len() } else { 0 }];
    let (dst, bytes) = if half {
        (halves.as_mut_ptr() as *mut u8, 2 * out.len())
    } else {
        (out.as_mut_ptr() as *mut u8, 4 * out.len())
    };
    // SAFETY: the caller guarantees the device range; the host buffer is as long and is read
    // only after the synchronisation below.
    unsafe { copy_d2h(stream.cu_stream(), src, dst, bytes) }.map_err(driver(what))?;
    stream
        .synchronize()
        .map_err(driver("cuStreamSynchronize"))?;
    widen_halves(&halves, out);
    Ok(())
}

/// Uploads `values` to `dst`, as fp16 with `half` (rounded to nearest even, as the device
/// rounds) or as f32, on `stream`, and waits for the copy.
///
/// # Safety
/// `dst` holds `values.len()` values of that storage in one device allocation of the stream's
/// context, which nothing reads or writes meanwhile.
pub(crate) unsafe fn upload_values(
    stream: &CudaStream,
    values: &[f32],
    dst: CUdeviceptr,
    half: bool,
    what: &'static str,
) -> Result<(), CudaError> {
    let mut halves = Vec::new();
    let bytes = stored_bytes(values, half, &mut halves);
    // SAFETY: the caller guarantees the device range; the host bytes are as long and outlive
    // the synchronisation below.
    unsafe { copy_h2d(stream.cu_stream(), bytes.as_ptr(), dst, bytes.len()) }
        .map_err(driver(what))?;
    stream.synchronize().map_err(driver("cuStreamSynchronize"))
}

/// The bytes `values` take on the device: their f32 bytes, or with `half` their fp16 bits
/// (rounded to nearest even, as the device rounds) written into `halves`.
pub(crate) fn stored_bytes<'a>(
    values: &'a [f32],
    half: bool,
    halves: &'a mut Vec<u16>,
) -> &'a [u8] {
    if !half {
        return bytemuck::cast_slice(values);
    }
    halves.clear();
    halves.extend(values.iter().map(|&v| fp16_bits(v)));
    bytemuck::cast_slice(halves)
}

/// fp16 bits into f32 values (exact), pair by pair.
pub(crate) fn widen_halves(halves: &[u16], out: &mut [f32]) {
    for (v, &h) in out.iter_mut().zip(halves) {
        *v = fp16_value(h);
    }
}

/// One side of a 2D copy: rows `pitch` bytes apart from `ptr`, in host memory or in device
/// memory of the stream's context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rows {
    Host { ptr: *mut u8, pitch: usize },
    Device { ptr: CUdeviceptr, pitch: usize },
}

impl Rows {
    /// Host rows that are only read (a copy's source).
    pub(crate) fn host_source(ptr: *const u8, pitch: usize) -> Rows {
        Rows::Host {
            ptr: ptr as *mut u8,
            pitch,
        }
    }

    pub(crate) fn device(ptr: CUdeviceptr, pitch: usize) -> Rows {
        Rows::Device { ptr, pitch }
    }

    /// The rows `bytes` further on (a second plane in the same allocation).
    pub(crate) fn offset(self, bytes: usize) -> Rows {
        match self {
            Rows::Host { ptr, pitch } => Rows::Host {
                ptr: ptr.wrapping_add(bytes),
                pitch,
            },
            Rows::Device { ptr, pitch } => Rows::Device {
                ptr: ptr + bytes as u64,
                pitch,
            },
        }
    }

    /// The memory type, host address, device address and pitch of a CUDA_MEMCPY2D side.
    fn parts(self) -> (sys::CUmemorytype, *mut u8, CUdeviceptr, usize) {
        use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
        match self {
            Rows::Host { ptr, pitch } => (CU_MEMORYTYPE_HOST, ptr, 0, pitch),
            Rows::Device { ptr, pitch } => (CU_MEMORYTYPE_DEVICE, std::ptr::null_mut(), ptr, pitch),
        }
    }
}

/// Copies `rows` rows of `width` bytes from `src` to `dst`, each side with its own pitch: host
/// to device, device to host, or device to device (a GstCudaMemory frame and the arena, no
/// PCIe traffic). Host memory that is page-locked (allocated so or registered) makes the copy
/// asynchronous and runs it at PCIe speed; pageable memory is staged by the driver.
///
/// # Safety
/// Every source row `src + r·pitch .. + width` is readable and every destination row writable
/// memory of its kind (device rows in one allocation of the stream's context); both stay valid,
/// and nothing reads the destination, until the stream has reached the copy.
pub(crate) unsafe fn copy_2d(
    stream: sys::CUstream,
    src: Rows,
    dst: Rows,
    width: usize,
    rows: usize,
) -> Result<(), DriverError> {
    let (src_type, src_host, src_device, src_pitch) = src.parts();
    let (dst_type, dst_host, dst_device, dst_pitch) = dst.parts();
    // Every field set explicitly: the struct holds enums, so it must not be zero-initialised.
    let c = sys::CUDA_MEMCPY2D {
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
    };
    // SAFETY: `c` is fully initialised and describes ranges the caller guarantees.
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream).result() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_bytes_are_the_f32_bytes_or_the_fp16_bits() {
        let values = [0.0f32, -1.5, 0.1, 65504.0, 1e-8];
        let mut halves = vec![7u16; 2];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(stored_bytes(&values, false, &mut halves), &f32_bytes[..]);
        let f16_bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| fp16_bits(v).to_le_bytes())
            .collect();
        assert_eq!(stored_bytes(&values, true, &mut halves), &f16_bytes[..]);
        // the scratch is reused, not appended to
        assert_eq!(halves.len(), values.len());
        let mut one = [0.0f32; 1];
        widen_halves(&halves[1..2], &mut one);
        assert_eq!(one[0], -1.5);
    }
}
