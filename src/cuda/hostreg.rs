//! Foreign host memory registered with the CUDA driver (cuMemHostRegister), so copies from an
//! upstream's and to a downstream's own buffers run at page-locked speed with no staging copy.
//!
//! The policy is here, plain Rust: a block of host memory is registered the *second* time it
//! is seen (pools recycle their buffers; memory allocated per frame is seen once and never
//! registered, so there is never a registration per frame), only when the block is at most
//! [`MAX_BLOCK_FRAMES`] frames large (a file read whole and cut into frames would cost more to
//! pin than it saves), and only while the registered bytes stay under the registry's bound.
//! A [`Sighting`] is the record of one block; whoever owns it (the GstMemory's qdata, see
//! `toonflow/hostmem.rs`) drops it when the memory is freed, and dropping a registered
//! sighting unregisters the block before its memory goes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaContext, sys};

use super::context::guard;
use super::error::driver;

/// Blocks larger than this many frames are not registered.
pub const MAX_BLOCK_FRAMES: usize = 4;
/// Default bound on the bytes registered in the process (all pipelines together).
pub const DEFAULT_LIMIT_BYTES: u64 = 2 << 30;

/// Registers and unregisters host ranges (the driver, or a recorder in tests).
pub trait Registrar: Send + Sync {
    fn register(&self, addr: usize, len: usize) -> Result<(), String>;
    fn unregister(&self, addr: usize, len: usize);
}

/// A block of host memory: the whole allocation a frame's planes lie in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBlock {
    pub addr: usize,
    pub len: usize,
}

/// What the registry knows about one block.
pub enum Sighting {
    /// Seen once (or refused by the byte bound last time): registered when seen again.
    Seen,
    /// Already page-locked (cuMemHostAlloc'd, or registered by someone else): nothing to do.
    PageLocked,
    Registered(Registration),
    /// Never registered (too large, or the driver refused): copies take the pageable path.
    Refused,
}

/// What [`Registry::observe`] did for a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Copies of this block run at page-locked speed.
    Fast,
    /// Registered just now: copies of this block run at page-locked speed from now on.
    NewlyRegistered,
    /// Seen for the first time: not registered yet.
    FirstSighting,
    /// Not registered: the bound on registered bytes is reached (retried on the next sighting).
    OverBudget,
    /// Never registered (too large, or the driver refused it).
    Refused,
}

impl Verdict {
    pub fn is_fast(self) -> bool {
        matches!(self, Verdict::Fast | Verdict::NewlyRegistered)
    }
}

/// Counters of a registry (for stats and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegistryCounts {
    pub registrations: u64,
    pub unregistrations: u64,
    pub refusals: u64,
    pub live_bytes: u64,
}

#[derive(Default)]
struct Shared {
    limit: u64,
    live_bytes: AtomicU64,
    registrations: AtomicU64,
    unregistrations: AtomicU64,
    refusals: AtomicU64,
}

impl Shared {
    /// Reserves `len` bytes under the limit.
    fn reserve(&self, len: u64) -> bool {
        self.live_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                (live + len <= self.limit).then_some(live + len)
            })
            .is_ok()
    }

    fn release(&self, len: u64) {
        self.live_bytes.fetch_sub(len, Ordering::AcqRel);
    }
}

/// A registered block; unregistered on drop.
pub struct Registration {
    block: HostBlock,
    registrar: Arc<dyn Registrar>,
    shared: Arc<Shared>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registrar.unregister(self.block.addr, self.block.len);
        self.shared.release(self.block.len as u64);
        self.shared.unregistrations.fetch_add(1, Ordering::Relaxed);
    }
}

/// The registration policy and its bookkeeping (bounded: at most `limit` bytes registered).
#[derive(Clone)]
pub struct Registry {
    shared: Arc<Shared>,
}

impl Registry {
    pub fn new(limit_bytes: u64) -> Registry {
        Registry {
            shared: Arc::new(Shared {
                limit: limit_bytes,
                ..Shared::default()
            }),
        }
    }

    /// The process's registry (bounded by [`DEFAULT_LIMIT_BYTES`]).
    pub fn global() -> &'static Registry {
        static GLOBAL: once_cell::sync::Lazy<Registry> =
            once_cell::sync::Lazy::new(|| Registry::new(DEFAULT_LIMIT_BYTES));
        &GLOBAL
    }

    pub fn counts(&self) -> RegistryCounts {
        let s = &self.shared;
        RegistryCounts {
            registrations: s.registrations.load(Ordering::Relaxed),
            unregistrations: s.unregistrations.load(Ordering::Relaxed),
            refusals: s.refusals.load(Ordering::Relaxed),
            live_bytes: s.live_bytes.load(Ordering::Relaxed),
        }
    }

    /// One frame's use of `block` (whose record is `sighting`, `None` the first time), for a
    /// frame of `frame_bytes`. `page_locked` says whether the block is page-locked already (asked
    /// the first time only); `registrar` is asked for on registration only.
    pub fn observe(
        &self,
        sighting: &mut Option<Sighting>,
        block: HostBlock,
        frame_bytes: usize,
        page_locked: impl FnOnce() -> bool,
        registrar: impl FnOnce() -> Option<Arc<dyn Registrar>>,
    ) -> Verdict {
        match sighting {
            None if page_locked() => {
                *sighting = Some(Sighting::PageLocked);
                Verdict::Fast
            }
            None => {
                *sighting = Some(Sighting::Seen);
                Verdict::FirstSighting
            }
            Some(Sighting::PageLocked | Sighting::Registered(_)) => Verdict::Fast,
            Some(Sighting::Refused) => Verdict::Refused,
            Some(Sighting::Seen) => {
                if block.len == 0 || block.len > MAX_BLOCK_FRAMES * frame_bytes.max(1) {
                    self.shared.refusals.fetch_add(1, Ordering::Relaxed);
                    *sighting = Some(Sighting::Refused);
                    return Verdict::Refused;
                }
                if !self.shared.reserve(block.len as u64) {
                    return Verdict::OverBudget;
                }
                let registered = registrar()
                    .ok_or_else(|| "no CUDA context".to_string())
                    .and_then(|r| r.register(block.addr, block.len).map(|_| r));
                match registered {
                    Ok(registrar) => {
                        self.shared.registrations.fetch_add(1, Ordering::Relaxed);
                        *sighting = Some(Sighting::Registered(Registration {
                            block,
                            registrar,
                            shared: self.shared.clone(),
                        }));
                        Verdict::NewlyRegistered
                    }
                    Err(_) => {
                        self.shared.release(block.len as u64);
                        self.shared.refusals.fetch_add(1, Ordering::Relaxed);
                        *sighting = Some(Sighting::Refused);
                        Verdict::Refused
                    }
                }
            }
        }
    }
}

/// The driver: portable registrations (page-locked for every context of the process, so a
/// pipeline in an adopted context profits too), made in `ctx`.
pub struct DriverRegistrar {
    ctx: Arc<CudaContext>,
}

impl DriverRegistrar {
    pub fn shared(ctx: Arc<CudaContext>) -> Arc<dyn Registrar> {
        Arc::new(DriverRegistrar { ctx })
    }
}

impl DriverRegistrar {
    /// Runs `call` with the context pushed on this thread and pops it after: a registration
    /// may be dropped on any thread (wherever GStreamer frees the memory), whose current
    /// context is left as it was.
    fn in_context(
        &self,
        what: &'static str,
        call: impl FnOnce() -> sys::CUresult,
    ) -> Result<(), String> {
        guard(what, || {
            // SAFETY: the context is alive (held by `self.ctx`); the push is undone below.
            unsafe { sys::cuCtxPushCurrent_v2(self.ctx.cu_ctx()).result() }
                .map_err(driver("cuCtxPushCurrent"))?;
            let result = call().result().map_err(driver(what));
            let mut popped = std::ptr::null_mut();
            // SAFETY: pops the context pushed above.
            unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
            result
        })
        .map_err(|e| e.to_string())
    }
}

impl Registrar for DriverRegistrar {
    fn register(&self, addr: usize, len: usize) -> Result<(), String> {
        self.in_context("cuMemHostRegister", || {
            // SAFETY: the caller (the registry's owner) passes a live host allocation of `len`
            // bytes that stays allocated until the registration is dropped, which unregisters.
            unsafe {
                sys::cuMemHostRegister_v2(addr as *mut _, len, sys::CU_MEMHOSTREGISTER_PORTABLE)
            }
        })
    }

    fn unregister(&self, addr: usize, _len: usize) {
        // SAFETY: `addr` was registered by `register` and is still allocated (the owner drops
        // the registration before freeing the memory).
        let _ = self.in_context("cuMemHostUnregister", || unsafe {
            sys::cuMemHostUnregister(addr as *mut _)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;

    #[derive(Default)]
    struct Recorder {
        live: Mutex<Vec<(usize, usize)>>,
        refuse: bool,
    }

    impl Registrar for Recorder {
        fn register(&self, addr: usize, len: usize) -> Result<(), String> {
            if self.refuse {
                return Err("refused".into());
            }
            let mut live = self.live.lock();
            assert!(
                !live.iter().any(|&(a, l)| a < addr + len && addr < a + l),
                "overlapping registration"
            );
            live.push((addr, len));
            Ok(())
        }
        fn unregister(&self, addr: usize, len: usize) {
            let mut live = self.live.lock();
            let i = live
                .iter()
                .position(|&e| e == (addr, len))
                .expect("registered");
            live.remove(i);
        }
    }

    const FRAME: usize = 3_110_400;

    fn block(i: usize) -> HostBlock {
        HostBlock {
            addr: 0x1000_0000 * (i + 1),
            len: FRAME,
        }
    }

    fn see(reg: &Registry, rec: &Arc<Recorder>, s: &mut Option<Sighting>, b: HostBlock) -> Verdict {
        let r: Arc<dyn Registrar> = rec.clone();
        reg.observe(s, b, FRAME, || false, || Some(r))
    }

    #[test]
    fn a_recycled_block_is_registered_once_on_its_second_sighting() {
        let (reg, rec) = (Registry::new(1 << 30), Arc::new(Recorder::default()));
        let mut s = None;
        assert_eq!(see(&reg, &rec, &mut s, block(0)), Verdict::FirstSighting);
        assert!(rec.live.lock().is_empty());
        assert_eq!(see(&reg, &rec, &mut s, block(0)), Verdict::NewlyRegistered);
        for _ in 0..100 {
            assert_eq!(see(&reg, &rec, &mut s, block(0)), Verdict::Fast);
        }
        assert_eq!(reg.counts().registrations, 1);
        assert_eq!(reg.counts().live_bytes, FRAME as u64);
        drop(s);
        assert!(rec.live.lock().is_empty(), "freed memory is unregistered");
        assert_eq!(reg.counts().live_bytes, 0);
        assert_eq!(reg.counts().unregistrations, 1);
    }

    #[test]
    fn memory_allocated_per_frame_is_never_registered() {
        let (reg, rec) = (Registry::new(1 << 30), Arc::new(Recorder::default()));
        for i in 0..50 {
            let mut s = None;
            assert_eq!(see(&reg, &rec, &mut s, block(i)), Verdict::FirstSighting);
        }
        assert_eq!(reg.counts().registrations, 0);
    }

    #[test]
    fn page_locked_memory_is_asked_about_once_and_never_registered() {
        let (reg, rec) = (Registry::new(1 << 30), Arc::new(Recorder::default()));
        let mut s = None;
        let mut asked = 0;
        for _ in 0..5 {
            let r: Arc<dyn Registrar> = rec.clone();
            let v = reg.observe(
                &mut s,
                block(0),
                FRAME,
                || {
                    asked += 1;
                    true
                },
                || Some(r),
            );
            assert_eq!(v, Verdict::Fast);
        }
        assert_eq!(asked, 1);
        assert_eq!(reg.counts().registrations, 0);
    }

    #[test]
    fn a_pool_that_grows_and_shrinks_stays_under_the_bound() {
        // Room for three frames: a fourth recycled buffer waits until one is freed.
        let (reg, rec) = (
            Registry::new(3 * FRAME as u64),
            Arc::new(Recorder::default()),
        );
        let mut pool: Vec<Option<Sighting>> = (0..4).map(|_| None).collect();
        for _ in 0..2 {
            for (i, s) in pool.iter_mut().enumerate() {
                see(&reg, &rec, s, block(i));
            }
        }
        assert_eq!(reg.counts().live_bytes, 3 * FRAME as u64);
        assert_eq!(see(&reg, &rec, &mut pool[3], block(3)), Verdict::OverBudget);
        pool.remove(0); // the pool shrinks: its buffer is freed, and unregistered
        assert_eq!(
            see(&reg, &rec, &mut pool[2], block(3)),
            Verdict::NewlyRegistered
        );
        assert_eq!(rec.live.lock().len(), 3);
        // The pool reallocates: every buffer freed, new ones at other addresses.
        pool.clear();
        assert!(rec.live.lock().is_empty());
        let mut fresh: Vec<Option<Sighting>> = (0..2).map(|_| None).collect();
        for _ in 0..3 {
            for (i, s) in fresh.iter_mut().enumerate() {
                see(&reg, &rec, s, block(10 + i));
            }
        }
        assert_eq!(rec.live.lock().len(), 2);
        assert_eq!(reg.counts().registrations, 6);
        assert_eq!(reg.counts().unregistrations, 4);
    }

    #[test]
    fn large_blocks_and_driver_refusals_are_not_retried() {
        let (reg, rec) = (Registry::new(1 << 40), Arc::new(Recorder::default()));
        let big = HostBlock {
            addr: 0x1000,
            len: (MAX_BLOCK_FRAMES + 1) * FRAME,
        };
        let mut s = None;
        see(&reg, &rec, &mut s, big);
        for _ in 0..3 {
            assert_eq!(see(&reg, &rec, &mut s, big), Verdict::Refused);
        }
        let refusing = Arc::new(Recorder {
            refuse: true,
            ..Recorder::default()
        });
        let mut s = None;
        see(&reg, &refusing, &mut s, block(0));
        assert_eq!(see(&reg, &refusing, &mut s, block(0)), Verdict::Refused);
        assert_eq!(see(&reg, &refusing, &mut s, block(0)), Verdict::Refused);
        assert_eq!(reg.counts().refusals, 2);
        assert_eq!(reg.counts().live_bytes, 0);
    }
}
