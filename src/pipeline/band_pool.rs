//! A persistent pool of worker threads for the CPU reference's row bands.
//!
//! The pool is made once per [`CpuPipeline`](super::cpu::CpuPipeline) and joined when it is
//! dropped; a pass hands it a borrowed closure and returns when every band has run, so the
//! closure may borrow the frame's planes. Handing out a pass allocates nothing and spawns
//! nothing: the job is a pointer in a mutex-guarded slot, the workers wait on a condition
//! variable. The calling thread works on bands too, so `threads` threads run in all.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

/// Fewer rows than this run on the calling thread alone (a band per thread is not worth it).
pub const MIN_ROWS_TO_SPLIT: usize = 32;
/// Bands per thread in a pass: threads take the next band when they finish one, so a thread
/// the OS holds back (a shared machine) leaves its share to the others instead of stalling
/// the pass.
const BANDS_PER_THREAD: usize = 4;
/// Fewest rows in a band (a vertical pass recomputes its radius of rows above each band).
const MIN_ROWS_PER_BAND: usize = 16;

/// A pass's closure: `f(band)`, called once for each band index.
type Job = dyn Fn(usize) + Sync;

/// The current pass's closure, its lifetime erased (see [`BandPool::run`] for why that holds).
#[derive(Clone, Copy)]
struct JobPtr(*const Job);

// SAFETY: the pointee is `Sync`, so calling it from another thread through a shared reference is
// sound; the pointer itself is only dereferenced while the pass that set it is still running.
unsafe impl Send for JobPtr {}

struct Slot {
    job: Option<JobPtr>,
    /// Bands of the current pass.
    bands: usize,
    /// Next band to hand out.
    next: usize,
    /// Bands handed out and not finished yet.
    running: usize,
    /// The panic of a band, carried to the calling thread.
    panic: Option<Box<dyn std::any::Any + Send>>,
    shutdown: bool,
}

struct Shared {
    slot: Mutex<Slot>,
    /// Signalled when a pass starts or the pool shuts down.
    work: Condvar,
    /// Signalled when the last band of a pass finishes.
    done: Condvar,
}

/// Worker threads that run the bands of one pass at a time.
pub struct BandPool {
    threads: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for BandPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BandPool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl BandPool {
    /// A pool where `threads` threads (the caller and `threads − 1` workers) share each pass.
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot {
                job: None,
                bands: 0,
                next: 0,
                running: 0,
                panic: None,
                shutdown: false,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let workers = (1..threads)
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("toonflow-cpu-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("spawning a CPU worker thread")
            })
            .collect();
        BandPool {
            threads,
            shared,
            workers,
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(band)` for every band in `0..bands`, spread over the pool's threads, and returns
    /// when all have run. A panic in a band is re-raised here after the pass has finished.
    pub fn run(&self, bands: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() || bands <= 1 {
            (0..bands).for_each(f);
            return;
        }
        // SAFETY: only the lifetime is erased. Workers dereference the pointer only for a band
        // they took from this pass (`next < bands` under the lock, `running` counted), and this
        // function does not return, nor unwind, before every band is finished (`running == 0`
        // with all bands handed out) and the job is cleared under the same lock. So no call
        // through the pointer outlives the borrow of `f`.
        let borrowed: *const (dyn Fn(usize) + Sync + '_) = f;
        let job = JobPtr(unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Job>(borrowed)
        });
        {
            let mut slot = self.shared.slot.lock();
            slot.job = Some(job);
            slot.bands = bands;
            slot.next = 0;
            slot.running = 0;
            slot.panic = None;
        }
        self.shared.work.notify_all();
        // The caller takes bands too, then waits for the workers' last ones.
        let mut slot = self.shared.slot.lock();
        loop {
            if slot.next < slot.bands {
                let band = slot.next;
                slot.next += 1;
                slot.running += 1;
                drop(slot);
                let result = catch_unwind(AssertUnwindSafe(|| f(band)));
                slot = self.shared.slot.lock();
                slot.running -= 1;
                if let Err(panic) = result {
                    slot.panic.get_or_insert(panic);
                }
            } else if slot.running > 0 {
                self.shared.done.wait(&mut slot);
            } else {
                break;
            }
        }
        slot.job = None;
        if let Some(panic) = slot.panic.take() {
            drop(slot);
            resume_unwind(panic);
        }
    }

    /// Runs `f(first_row, rows, band)` over bands of consecutive rows of `data` (rows of
    /// `stride` elements; the last band ends where `data` does), a few bands per thread.
    pub fn for_row_bands<T: Send>(
        &self,
        data: &mut [T],
        stride: usize,
        rows: usize,
        f: impl Fn(usize, usize, &mut [T]) + Sync,
    ) {
        let (per, bands) = self.split(rows, data.len(), stride);
        if bands == 0 {
            return;
        }
        if bands == 1 {
            f(0, rows, data);
            return;
        }
        let (base, len) = (SendPtr(data.as_mut_ptr()), data.len());
        self.run(bands, &|i| {
            let (first, start, end) = band_range(i, per, rows, stride, len);
            // SAFETY: band `i` covers elements start..end of `data`, within its length, and the
            // bands of one pass are disjoint; `data` is borrowed mutably for the whole pass.
            let band =
                unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
            f(first, per.min(rows - first), band);
        });
    }

    /// [`for_row_bands`](Self::for_row_bands) over two planes of the same layout at once.
    pub fn for_row_bands2<T: Send>(
        &self,
        a: &mut [T],
        b: &mut [T],
        stride: usize,
        rows: usize,
        f: impl Fn(usize, usize, &mut [T], &mut [T]) + Sync,
    ) {
        assert_eq!(a.len(), b.len(), "the two planes differ in size");
        let (per, bands) = self.split(rows, a.len(), stride);
        if bands == 0 {
            return;
        }
        if bands == 1 {
            f(0, rows, a, b);
            return;
        }
        let len = a.len();
        let (pa, pb) = (SendPtr(a.as_mut_ptr()), SendPtr(b.as_mut_ptr()));
        self.run(bands, &|i| {
            let (first, start, end) = band_range(i, per, rows, stride, len);
            // SAFETY: as in `for_row_bands`, for each of the two planes.
            let (ba, bb) = unsafe {
                (
                    std::slice::from_raw_parts_mut(pa.get().add(start), end - start),
                    std::slice::from_raw_parts_mut(pb.get().add(start), end - start),
                )
            };
            f(first, per.min(rows - first), ba, bb);
        });
    }

    /// Rows per band and the number of bands for a pass over `rows` rows.
    fn split(&self, rows: usize, len: usize, stride: usize) -> (usize, usize) {
        if self.threads <= 1 || rows < MIN_ROWS_TO_SPLIT || stride == 0 {
            return (rows.max(1), 1);
        }
        let per = rows
            .div_ceil(self.threads * BANDS_PER_THREAD)
            .max(MIN_ROWS_PER_BAND.min(rows.div_ceil(self.threads)));
        // Bands that start inside `data` and at or before the last row.
        let bands = rows.div_ceil(per).min(len.div_ceil(per * stride));
        (per, bands)
    }
}

/// First row, first and one-past-last element of band `i`.
fn band_range(
    i: usize,
    per: usize,
    rows: usize,
    stride: usize,
    len: usize,
) -> (usize, usize, usize) {
    let first = i * per;
    debug_assert!(first < rows);
    let start = first * stride;
    let end = (start + per * stride).min(len);
    (first, start, end)
}

struct SendPtr<T>(*mut T);

impl<T> SendPtr<T> {
    /// A method, so closures capture the whole wrapper (which is Sync) and not the raw field.
    fn get(&self) -> *mut T {
        self.0
    }
}

// SAFETY: the pointer is only turned into disjoint band slices (see `for_row_bands`), each used
// by one thread, and `T: Send`.
unsafe impl<T: Send> Sync for SendPtr<T> {}

fn worker(shared: &Shared) {
    let mut slot = shared.slot.lock();
    loop {
        if slot.shutdown {
            return;
        }
        match slot.job {
            Some(job) if slot.next < slot.bands => {
                let band = slot.next;
                slot.next += 1;
                slot.running += 1;
                drop(slot);
                // SAFETY: the band was taken from the pass that set `job`, which stays alive
                // until `running` drops back to zero (see `BandPool::run`).
                let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)(band) }));
                slot = shared.slot.lock();
                slot.running -= 1;
                if let Err(panic) = result {
                    slot.panic.get_or_insert(panic);
                }
                if slot.running == 0 && slot.next >= slot.bands {
                    shared.done.notify_all();
                }
            }
            _ => shared.work.wait(&mut slot),
        }
    }
}

impl Drop for BandPool {
    fn drop(&mut self) {
        self.shared.slot.lock().shutdown = true;
        self.shared.work.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_band_runs_once_on_several_threads() {
        let pool = BandPool::new(4);
        for _ in 0..200 {
            let hits: Vec<AtomicUsize> = (0..7).map(|_| AtomicUsize::new(0)).collect();
            pool.run(7, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn row_bands_cover_every_row_once_and_match_a_single_thread() {
        for threads in [1, 2, 3, 5, 16] {
            let pool = BandPool::new(threads);
            for (rows, stride) in [(1, 3), (31, 4), (32, 4), (33, 5), (100, 7), (7, 1)] {
                let mut data = vec![0usize; rows * stride];
                pool.for_row_bands(&mut data, stride, rows, |first, n, band| {
                    assert_eq!(band.len(), n * stride);
                    for (k, v) in band.iter_mut().enumerate() {
                        *v += first * stride + k + 1;
                    }
                });
                let expected: Vec<usize> = (1..=rows * stride).collect();
                assert_eq!(data, expected, "{threads} threads, {rows} rows of {stride}");
                let (mut a, mut b) = (vec![0usize; rows * stride], vec![0usize; rows * stride]);
                pool.for_row_bands2(&mut a, &mut b, stride, rows, |first, n, ba, bb| {
                    assert_eq!((ba.len(), bb.len()), (n * stride, n * stride));
                    for k in 0..ba.len() {
                        ba[k] = first * stride + k + 1;
                        bb[k] = 2 * (first * stride + k + 1);
                    }
                });
                assert_eq!(a, expected);
                assert!(b.iter().zip(&expected).all(|(b, e)| *b == 2 * e));
            }
        }
    }

    #[test]
    fn a_last_row_shorter_than_the_stride_is_handed_out() {
        // An NV12 plane whose buffer ends right after the last row's pixels.
        let pool = BandPool::new(3);
        let (rows, stride, width) = (40, 8, 6);
        let mut data = vec![0u8; (rows - 1) * stride + width];
        pool.for_row_bands(&mut data, stride, rows, |_, n, band| {
            for r in 0..n {
                band[r * stride..][..width].fill(1);
            }
        });
        let ones = data.iter().filter(|&&v| v == 1).count();
        assert_eq!(ones, rows * width);
    }

    #[test]
    fn a_panicking_band_reaches_the_caller_and_the_pool_goes_on() {
        let pool = BandPool::new(3);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(6, &|i| assert_ne!(i, 4, "band four fails"));
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(6, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 6);
    }
}
