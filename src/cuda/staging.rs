//! Uploads from pageable host memory that cannot be registered (memory allocated per frame, a
//! file read whole and cut into frames), staged by toonflow itself: the frame is copied into
//! page-locked memory in bands by a few threads, and each band's DMA is queued the moment its
//! band is copied, so the host copy and the PCIe transfer overlap and the copy is spread over
//! several cores.
//!
//! Off by default (`TOONFLOW_STAGING_THREADS`, 0): on the H200 machine the driver's own
//! pageable path (one thread, 226 µs for a 1080p frame) was as fast as 2–8 staging threads
//! (214–222 µs) and faster inside the element, because a pageable upload is bound by the host's
//! memory bandwidth (the frame crosses host memory three times: read, staged, read by the DMA),
//! not by one core's copy rate. On a host with more memory bandwidth per frame the threads may
//! win; `toonflow-bench --modes host-copies` measures both.
//!
//! [`BandCopier`] is plain Rust (the threads and the band order, unit-tested without a GPU);
//! [`StagedUpload`] adds the page-locked buffer and the driver's copies.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, DriverError};
use parking_lot::{Condvar, Mutex};

use super::copy::copy_h2d;
use super::error::CudaError;
use super::pinned::PinnedHostBuffer;

/// Bytes per band: small enough that the first DMA starts early and the threads share the work
/// evenly, large enough that a frame takes a dozen copies, not hundreds.
pub const BAND_BYTES: usize = 256 << 10;

/// Most threads one upload uses (more only add wake-ups once memory bandwidth is reached).
pub const MAX_THREADS: usize = 8;

/// The environment variable that sets the threads of a staged upload (the calling thread
/// included); 0, the default, leaves pageable uploads to the driver (see above).
pub const THREADS_VAR: &str = "TOONFLOW_STAGING_THREADS";

/// Threads per staged upload: [`THREADS_VAR`] when set, else 0 (the driver's path).
pub fn threads_from_env() -> usize {
    std::env::var(THREADS_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(0, |n| n.min(MAX_THREADS))
}

/// Rows of one plane in host memory: `rows` rows of the frame's width, `stride` bytes apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPlane {
    pub ptr: *const u8,
    pub stride: usize,
    pub rows: usize,
}

/// `rows` rows of plane `plane` from `first_row`, packed (rows `width` bytes apart) at `offset`
/// of the staging layout, which is the planes one after the other, each packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Band {
    pub plane: usize,
    pub first_row: usize,
    pub rows: usize,
    pub offset: usize,
}

impl Band {
    pub fn bytes(&self, width: usize) -> usize {
        self.rows * width
    }
}

/// The bands of planes of `plane_rows` rows of `width` bytes, about `band_bytes` each, in
/// order: together they cover every row once, and their offsets are the packed layout's.
pub fn plan_bands(width: usize, plane_rows: &[usize], band_bytes: usize) -> Vec<Band> {
    let per_band = (band_bytes / width.max(1)).max(1);
    let mut bands = Vec::new();
    let mut offset = 0;
    for (plane, &rows) in plane_rows.iter().enumerate() {
        let mut first_row = 0;
        while first_row < rows {
            let n = per_band.min(rows - first_row);
            bands.push(Band {
                plane,
                first_row,
                rows: n,
                offset: offset + first_row * width,
            });
            first_row += n;
        }
        offset += rows * width;
    }
    bands
}

/// One copy in flight: the bands left to claim and those done.
struct Job {
    planes: Vec<HostPlane>,
    width: usize,
    dst: *mut u8,
    bands: Vec<Band>,
    next: AtomicUsize,
    done: Vec<AtomicBool>,
}

// SAFETY: the raw pointers are only dereferenced for a claimed band, and `BandCopier::copy`
// returns only once every claimed band is done, while the memory they point to is still valid
// (its caller's guarantee); a thread that claims after that gets nothing.
unsafe impl Send for Job {}
// SAFETY: as above; every band is claimed by exactly one thread (an atomic counter).
unsafe impl Sync for Job {}

impl Job {
    fn claim(&self) -> Option<usize> {
        let k = self.next.fetch_add(1, Ordering::AcqRel);
        (k < self.bands.len()).then_some(k)
    }

    /// Stops further claims; returns how many bands were claimed.
    fn stop(&self) -> usize {
        self.next
            .swap(self.bands.len(), Ordering::AcqRel)
            .min(self.bands.len())
    }

    /// Copies band `k` (claimed by this thread) and marks it done.
    fn run(&self, k: usize) {
        let band = self.bands[k];
        let plane = self.planes[band.plane];
        let w = self.width;
        // SAFETY: `BandCopier::copy`'s caller guarantees each plane's rows and the packed
        // destination; `plan_bands` keeps a band inside its plane's rows and the destination
        // layout; bands do not overlap, and this thread alone claimed band `k`.
        unsafe {
            let src = plane.ptr.add(band.first_row * plane.stride);
            let dst = self.dst.add(band.offset);
            if plane.stride == w {
                std::ptr::copy_nonoverlapping(src, dst, band.rows * w);
            } else {
                for r in 0..band.rows {
                    std::ptr::copy_nonoverlapping(src.add(r * plane.stride), dst.add(r * w), w);
                }
            }
        }
        self.done[k].store(true, Ordering::Release);
    }

    /// Copies bands until none is left to claim.
    fn help(&self) {
        while let Some(k) = self.claim() {
            self.run(k);
        }
    }

    fn wait_done(&self, k: usize) {
        while !self.done[k].load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
    }
}

#[derive(Default)]
struct Slot {
    epoch: u64,
    job: Option<Arc<Job>>,
    quit: bool,
}

#[derive(Default)]
struct Shared {
    slot: Mutex<Slot>,
    wake: Condvar,
}

/// Copies frames band by band with the calling thread and `threads - 1` helpers (started once,
/// asleep between frames), handing each band to a callback in band order as soon as it is
/// copied.
pub struct BandCopier {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
}

impl BandCopier {
    pub fn new(threads: usize) -> BandCopier {
        let shared = Arc::new(Shared::default());
        let helpers = (1..threads.clamp(1, MAX_THREADS))
            .filter_map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("toonflow-stage-{i}"))
                    .spawn(move || helper(&shared))
                    .ok()
            })
            .collect();
        BandCopier { shared, helpers }
    }

    /// Threads that copy (the caller included).
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Copies `bands` of `planes` (rows of `width` bytes) into the packed layout at `dst`,
    /// calling `ready` for each band, in order, once it is in `dst`. Returns `ready`'s first
    /// error (no band after it is handed over), and only once no thread touches `planes` or
    /// `dst` any more.
    ///
    /// # Safety
    /// Each plane holds `rows` readable rows of `width` bytes `stride` apart and `dst` is
    /// writable for every band's `offset + rows·width`; both stay valid until this returns.
    pub unsafe fn copy<E>(
        &self,
        planes: &[HostPlane],
        width: usize,
        dst: *mut u8,
        bands: &[Band],
        mut ready: impl FnMut(&Band) -> Result<(), E>,
    ) -> Result<(), E> {
        // Checked here, on the caller's thread: a helper that panicked would leave its band
        // undone and the caller waiting for it.
        assert!(
            bands.iter().all(|b| b.plane < planes.len()),
            "a band of a plane that was not given"
        );
        // A few small vectors per frame, against a copy of megabytes: not worth a free list
        // that a late helper could still be reading.
        let job = Arc::new(Job {
            planes: planes.to_vec(),
            width,
            dst,
            bands: bands.to_vec(),
            next: AtomicUsize::new(0),
            done: bands.iter().map(|_| AtomicBool::new(false)).collect(),
        });
        if !self.helpers.is_empty() {
            let mut slot = self.shared.slot.lock();
            slot.epoch += 1;
            slot.job = Some(job.clone());
            drop(slot);
            self.shared.wake.notify_all();
        }
        let mut handed = 0;
        while handed < bands.len() {
            if job.done[handed].load(Ordering::Acquire) {
                if let Err(e) = ready(&bands[handed]) {
                    let claimed = job.stop();
                    (0..claimed).for_each(|k| job.wait_done(k));
                    return Err(e);
                }
                handed += 1;
            } else if let Some(k) = job.claim() {
                job.run(k);
            } else {
                // A helper is copying this band.
                std::hint::spin_loop();
            }
        }
        Ok(())
    }
}

/// A helper thread: sleeps until a job is posted, copies bands of it, sleeps again.
fn helper(shared: &Shared) {
    let mut seen = 0;
    loop {
        let job = {
            let mut slot = shared.slot.lock();
            while slot.epoch == seen && !slot.quit {
                shared.wake.wait(&mut slot);
            }
            if slot.quit {
                return;
            }
            seen = slot.epoch;
            slot.job.clone()
        };
        if let Some(job) = job {
            job.help();
        }
    }
}

impl Drop for BandCopier {
    fn drop(&mut self) {
        self.shared.slot.lock().quit = true;
        self.shared.wake.notify_all();
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Staged uploads of frames of one geometry: the copier, a page-locked buffer in the packed
/// layout, and the bands.
pub struct StagedUpload {
    copier: BandCopier,
    buffer: PinnedHostBuffer,
    width: usize,
    plane_rows: Vec<usize>,
    bands: Vec<Band>,
}

impl StagedUpload {
    /// For planes of `plane_rows` rows of `width` bytes, page-locked in `ctx`, with `threads`
    /// copying threads.
    pub fn new(
        ctx: Arc<CudaContext>,
        threads: usize,
        width: usize,
        plane_rows: &[usize],
    ) -> Result<StagedUpload, CudaError> {
        let bytes = width * plane_rows.iter().sum::<usize>();
        Ok(StagedUpload {
            copier: BandCopier::new(threads),
            buffer: PinnedHostBuffer::in_context(ctx, bytes)?,
            width,
            plane_rows: plane_rows.to_vec(),
            bands: plan_bands(width, plane_rows, BAND_BYTES),
        })
    }

    /// Whether this stager serves frames of this geometry.
    pub fn fits(&self, width: usize, plane_rows: &[usize]) -> bool {
        self.width == width && self.plane_rows == plane_rows
    }

    pub fn threads(&self) -> usize {
        self.copier.threads()
    }

    /// Queues on `stream` the upload of the planes whose `staged` flag is set into the device
    /// planes at `dst` (packed, one after the other, as the staging layout), copying them into
    /// the staging buffer in bands. The other planes are left to the caller.
    ///
    /// # Safety
    /// `planes` are as in [`BandCopier::copy`] (one per plane of the geometry); `dst` holds the
    /// packed planes in one device allocation of the stream's context; the stream has
    /// finished every earlier copy out of the staging buffer (the pipeline synchronises each
    /// frame), and reaches these copies before the next call.
    pub unsafe fn upload(
        &mut self,
        stream: sys::CUstream,
        planes: &[HostPlane],
        staged: &[bool],
        dst: CUdeviceptr,
    ) -> Result<(), DriverError> {
        let bands: Vec<Band> = self
            .bands
            .iter()
            .filter(|b| staged.get(b.plane).copied().unwrap_or(false))
            .copied()
            .collect();
        let (base, w) = (self.buffer.as_mut_ptr(), self.width);
        // SAFETY: the caller guarantees the planes; the buffer holds the whole packed layout.
        unsafe {
            self.copier.copy(planes, w, base, &bands, |b| {
                // SAFETY: the band lies in the staging buffer (page-locked, so the copy is
                // queued, not done now) and in the device planes; the buffer is not written
                // again before the stream has reached this copy (see above).
                copy_h2d(
                    stream,
                    base.add(b.offset),
                    dst + b.offset as u64,
                    b.bytes(w),
                )
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_cover_every_row_once_in_the_packed_layout() {
        let (w, rows) = (1920, [1080, 540]);
        let bands = plan_bands(w, &rows, BAND_BYTES);
        let mut offset = 0;
        for (plane, &n) in rows.iter().enumerate() {
            let mine: Vec<_> = bands.iter().filter(|b| b.plane == plane).collect();
            let mut next_row = 0;
            for b in mine {
                assert_eq!(b.first_row, next_row);
                assert_eq!(b.offset, offset + b.first_row * w);
                assert!(b.bytes(w) <= BAND_BYTES);
                next_row += b.rows;
            }
            assert_eq!(next_row, n);
            offset += n * w;
        }
        assert_eq!(bands.len(), 12, "1080p NV12 in 256 KiB bands");
        // A row wider than a band still makes progress, one row per band.
        let wide = plan_bands(BAND_BYTES * 2, &[3], BAND_BYTES);
        assert_eq!(wide.len(), 3);
    }

    /// A frame of `w`×`h` NV12 in strided planes (stride > w) with distinct bytes.
    fn strided_frame(w: usize, h: usize, stride: usize) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let y: Vec<u8> = (0..stride * h).map(|i| (i * 7 + i / 251) as u8).collect();
        let uv: Vec<u8> = (0..stride * h / 2).map(|i| (i * 13 + 5) as u8).collect();
        let mut packed = Vec::new();
        for r in 0..h {
            packed.extend_from_slice(&y[r * stride..r * stride + w]);
        }
        for r in 0..h / 2 {
            packed.extend_from_slice(&uv[r * stride..r * stride + w]);
        }
        (y, uv, packed)
    }

    fn nv12_planes(y: &[u8], uv: &[u8], stride: usize, h: usize) -> [HostPlane; 2] {
        [(y, h), (uv, h / 2)].map(|(plane, rows)| HostPlane {
            ptr: plane.as_ptr(),
            stride,
            rows,
        })
    }

    #[test]
    fn threads_copy_strided_planes_and_hand_bands_over_in_order() {
        let (w, h, stride) = (640, 360, 704);
        let (y, uv, packed) = strided_frame(w, h, stride);
        let planes = nv12_planes(&y, &uv, stride, h);
        let bands = plan_bands(w, &[h, h / 2], 16 << 10);
        for threads in [1, 2, 4] {
            let copier = BandCopier::new(threads);
            assert_eq!(copier.threads(), threads);
            for _ in 0..20 {
                let mut dst = vec![0u8; packed.len()];
                let dst_ptr = dst.as_mut_ptr();
                let mut order = Vec::new();
                // SAFETY: the planes and `dst` are as described and outlive the call.
                let r: Result<(), ()> = unsafe {
                    copier.copy(&planes, w, dst_ptr, &bands, |b| {
                        // The band handed over is already in place.
                        let s = std::slice::from_raw_parts(dst_ptr.add(b.offset), b.bytes(w));
                        assert_eq!(s, &packed[b.offset..b.offset + b.bytes(w)]);
                        order.push(b.offset);
                        Ok(())
                    })
                };
                assert!(r.is_ok());
                assert_eq!(dst, packed, "{threads} threads");
                assert_eq!(order, bands.iter().map(|b| b.offset).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn an_error_stops_the_hand_over_and_returns_once_the_threads_let_go() {
        let (w, h, stride) = (256, 512, 256);
        let (y, uv, _) = strided_frame(w, h, stride);
        let planes = nv12_planes(&y, &uv, stride, h);
        let bands = plan_bands(w, &[h, h / 2], 4096);
        let copier = BandCopier::new(3);
        for fail_at in [0, 5, bands.len() - 1] {
            let mut dst = vec![0u8; w * h * 3 / 2];
            let mut handed = 0;
            // SAFETY: as above.
            let r = unsafe {
                copier.copy(&planes, w, dst.as_mut_ptr(), &bands, |_| {
                    handed += 1;
                    if handed > fail_at {
                        Err("refused")
                    } else {
                        Ok(())
                    }
                })
            };
            assert_eq!(r, Err("refused"));
            assert_eq!(handed, fail_at + 1, "nothing handed over after the error");
            drop(dst); // nothing writes into it any more
        }
        // The copier still works after errors.
        let mut dst = vec![0u8; w * h * 3 / 2];
        // SAFETY: as above.
        let r: Result<(), ()> =
            unsafe { copier.copy(&planes, w, dst.as_mut_ptr(), &bands, |_| Ok(())) };
        assert!(r.is_ok());
        assert_eq!(&dst[..w], &y[..w]);
    }
}
