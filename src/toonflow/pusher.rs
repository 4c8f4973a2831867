//! The overlap path's push thread (issue 12): frames whose GPU work is queued but not finished
//! wait here, in order, for their completion and are then pushed downstream by one thread,
//! while the streaming thread goes on with the next frame's upload.
//!
//! Plain Rust, no GPU: [`Pusher`] runs a closure on each item in submission order on its own
//! thread (the element's closure waits for the frame's CUDA event and pushes the buffer).
//! - [`Pusher::wait_room`] bounds the frames in flight (backpressure) and returns the first
//!   error a push gave (NOT_LINKED, EOS, FLUSHING, ERROR): the streaming thread returns it for
//!   its next frame.
//! - [`Pusher::drain`] waits until every queued item is handled (serialized events and queries,
//!   renegotiation, a frame that takes the synchronous path).
//! - [`Pusher::set_flushing`] (FLUSH_START) turns the queue into discards: items still wait
//!   for their completion (the GPU may be writing their buffers) but are dropped, not pushed;
//!   [`Pusher::flush_stop`] clears the flushing state and the stored error.
//! - Dropping the pusher finishes (discards) what is queued and joins the thread.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the thread does with an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposal {
    /// Wait for it, then push it downstream.
    Push,
    /// Wait for it, then drop it (flushing, stopping, or an earlier push failed).
    Discard,
}

struct Inner<T> {
    queue: VecDeque<T>,
    /// An item is being handled by the thread (out of the queue, not finished).
    busy: bool,
    /// The first error the handler returned since the last flush.
    error: Option<gst::FlowError>,
    flushing: bool,
    quit: bool,
}

struct Shared<T> {
    inner: Mutex<Inner<T>>,
    cv: Condvar,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A bounded, ordered queue of frames in flight with one thread that handles them.
pub struct Pusher<T: Send + 'static> {
    shared: Arc<Shared<T>>,
    max_in_flight: usize,
    thread: Option<JoinHandle<()>>,
}

impl<T: Send + 'static> Pusher<T> {
    /// Starts the thread. `handle` is called with each item in order and what to do with it;
    /// an `Err` from a [`Disposal::Push`] is stored and returned by the next
    /// [`Pusher::wait_room`], and the items after it are discarded until [`Pusher::flush_stop`].
    pub fn new(
        name: &str,
        max_in_flight: usize,
        mut handle: impl FnMut(T, Disposal) -> Result<(), gst::FlowError> + Send + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                queue: VecDeque::new(),
                busy: false,
                error: None,
                flushing: false,
                quit: false,
            }),
            cv: Condvar::new(),
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                loop {
                    let (item, disposal) = {
                        let mut inner = worker.lock();
                        while inner.queue.is_empty() && !inner.quit {
                            inner = worker.cv.wait(inner).unwrap_or_else(|e| e.into_inner());
                        }
                        let Some(item) = inner.queue.pop_front() else {
                            break; // quit with nothing left
                        };
                        inner.busy = true;
                        let discard = inner.flushing || inner.quit || inner.error.is_some();
                        (
                            item,
                            if discard {
                                Disposal::Discard
                            } else {
                                Disposal::Push
                            },
                        )
                    };
                    let result = handle(item, disposal);
                    let mut inner = worker.lock();
                    inner.busy = false;
                    if let Err(e) = result
                        && inner.error.is_none()
                    {
                        inner.error = Some(e);
                    }
                    worker.cv.notify_all();
                }
            })?;
        Ok(Pusher {
            shared,
            max_in_flight: max_in_flight.max(1),
            thread: Some(thread),
        })
    }

    /// Items queued or being handled.
    pub fn in_flight(&self) -> usize {
        let inner = self.shared.lock();
        inner.queue.len() + inner.busy as usize
    }

    /// Waits until fewer than `max_in_flight` items are in flight. Returns the stored error
    /// of an earlier push, or FLUSHING while flushing, without waiting.
    pub fn wait_room(&self) -> Result<(), gst::FlowError> {
        let mut inner = self.shared.lock();
        loop {
            if let Some(e) = inner.error {
                return Err(e);
            }
            if inner.flushing {
                return Err(gst::FlowError::Flushing);
            }
            if inner.queue.len() + (inner.busy as usize) < self.max_in_flight {
                return Ok(());
            }
            inner = self
                .shared
                .cv
                .wait(inner)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Queues an item whose work has been started; it is always handled (pushed, or discarded
    /// when flushing or after an error), never dropped unfinished.
    pub fn push(&self, item: T) {
        let mut inner = self.shared.lock();
        inner.queue.push_back(item);
        self.shared.cv.notify_all();
    }

    /// Waits until every queued item has been handled; returns the stored error, if any.
    pub fn drain(&self) -> Result<(), gst::FlowError> {
        let mut inner = self.shared.lock();
        while !inner.queue.is_empty() || inner.busy {
            inner = self
                .shared
                .cv
                .wait(inner)
                .unwrap_or_else(|e| e.into_inner());
        }
        inner.error.map_or(Ok(()), Err)
    }

    /// FLUSH_START: what is queued (and queued later) is discarded until [`Pusher::flush_stop`];
    /// a waiting [`Pusher::wait_room`] returns FLUSHING. Does not wait.
    pub fn set_flushing(&self) {
        let mut inner = self.shared.lock();
        inner.flushing = true;
        self.shared.cv.notify_all();
    }

    /// FLUSH_STOP: waits for the discards, then accepts frames again with no stored error.
    pub fn flush_stop(&self) {
        let _ = self.drain();
        let mut inner = self.shared.lock();
        inner.flushing = false;
        inner.error = None;
    }
}

impl<T: Send + 'static> Drop for Pusher<T> {
    fn drop(&mut self) {
        {
            let mut inner = self.shared.lock();
            inner.quit = true;
            self.shared.cv.notify_all();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The environment variable that sets how long, in µs, the push thread polls a frame's event
/// before it sleeps on it ([`DEFAULT_SPIN_US`] unset; 0 sleeps at once).
pub const SPIN_VAR: &str = "TOONFLOW_OVERLAP_SPIN_US";

/// Two milliseconds: longer than a 1080p frame's GPU work with the one before it (~0.5 ms), so
/// at real-time rates the push thread wakes by polling, as the synchronous path does in
/// `cuStreamSynchronize` (the driver spins there too while cores are free); a sleeping
/// thread's wake-up cost ~0.1 ms of latency per frame on the H200.
pub const DEFAULT_SPIN_US: u64 = 2000;

static SPIN: LazyLock<Duration> = LazyLock::new(|| {
    let us = std::env::var(SPIN_VAR)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_SPIN_US);
    Duration::from_micros(us)
});

/// When a frame's work is finished.
pub enum Completion {
    /// Its last CUDA event (recorded with blocking sync: a thread that waits on it sleeps).
    Cuda(Arc<cudarc::driver::CudaEvent>),
    /// At this instant (the CPU emulation of the overlap path, for tests without a GPU).
    At(Instant),
}

impl Completion {
    /// Blocks until the frame is finished. A CUDA frame is polled for up to [`SPIN_VAR`] µs,
    /// the core yielded between polls, before the thread sleeps on its event.
    pub fn wait(&self) -> Result<(), String> {
        match self {
            Completion::Cuda(event) => {
                let started = Instant::now();
                while started.elapsed() < *SPIN {
                    match event.try_is_complete() {
                        Ok(true) => return Ok(()),
                        Ok(false) => std::thread::yield_now(),
                        Err(e) => return Err(format!("polling a frame's GPU work: {e}")),
                    }
                }
                event
                    .synchronize()
                    .map_err(|e| format!("waiting for a frame's GPU work: {e}"))
            }
            Completion::At(at) => {
                let now = Instant::now();
                if *at > now {
                    std::thread::sleep(*at - now);
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    type Handled = mpsc::Receiver<(u32, Disposal)>;

    /// A pusher whose items are (sequence, completion instant); handled ones go to the channel.
    fn pusher(max: usize, fail_at: Option<u32>) -> (Pusher<(u32, Instant)>, Handled) {
        let (tx, rx) = mpsc::channel();
        let p = Pusher::new("test-pusher", max, move |(n, at): (u32, Instant), d| {
            Completion::At(at).wait().unwrap();
            tx.send((n, d)).unwrap();
            if d == Disposal::Push && Some(n) == fail_at {
                return Err(gst::FlowError::NotLinked);
            }
            Ok(())
        })
        .unwrap();
        (p, rx)
    }

    fn later(us: u64) -> Instant {
        Instant::now() + Duration::from_micros(us)
    }

    #[test]
    fn items_are_pushed_in_order_even_when_later_ones_finish_first() {
        let (p, rx) = pusher(8, None);
        // Completion instants decreasing: the thread still handles them in submission order.
        for n in 0..6u32 {
            p.wait_room().unwrap();
            p.push((n, later(3000 - 400 * n as u64)));
        }
        p.drain().unwrap();
        let got: Vec<_> = rx.try_iter().collect();
        assert_eq!(got, (0..6).map(|n| (n, Disposal::Push)).collect::<Vec<_>>());
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn wait_room_bounds_the_frames_in_flight() {
        let (p, _rx) = pusher(2, None);
        let start = Instant::now();
        for n in 0..5u32 {
            p.wait_room().unwrap();
            assert!(p.in_flight() < 2);
            p.push((n, later(2000)));
        }
        p.drain().unwrap();
        // 5 items of ≥ 2 ms each, at most 2 in flight and handled one at a time: ≥ 4 waits.
        assert!(start.elapsed() >= Duration::from_millis(6));
    }

    #[test]
    fn an_error_comes_back_at_the_next_wait_and_later_items_are_discarded() {
        let (p, rx) = pusher(4, Some(1));
        for n in 0..4u32 {
            p.push((n, later(200)));
        }
        assert_eq!(p.drain(), Err(gst::FlowError::NotLinked));
        assert_eq!(p.wait_room(), Err(gst::FlowError::NotLinked));
        let got: Vec<_> = rx.try_iter().collect();
        assert_eq!(
            got,
            vec![
                (0, Disposal::Push),
                (1, Disposal::Push),
                (2, Disposal::Discard),
                (3, Disposal::Discard)
            ]
        );
        p.flush_stop();
        p.wait_room().unwrap();
        p.push((4, later(0)));
        p.drain().unwrap();
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![(4, Disposal::Push)]);
    }

    #[test]
    fn a_flush_discards_what_is_in_flight_without_deadlock() {
        let (p, rx) = pusher(3, None);
        p.push((0, later(0)));
        p.drain().unwrap();
        for n in 1..4u32 {
            p.push((n, later(3000)));
        }
        std::thread::sleep(Duration::from_millis(1));
        p.set_flushing();
        assert_eq!(p.wait_room(), Err(gst::FlowError::Flushing));
        // Queued while flushing (the streaming thread raced the flush): discarded too.
        p.push((4, later(0)));
        p.flush_stop();
        assert_eq!(p.in_flight(), 0);
        p.wait_room().unwrap();
        p.push((5, later(0)));
        p.drain().unwrap();
        let got: Vec<_> = rx.try_iter().collect();
        assert_eq!(got[0], (0, Disposal::Push));
        assert_eq!(*got.last().unwrap(), (5, Disposal::Push));
        assert_eq!(got.len(), 6, "every item handled once: {got:?}");
        // 2..4 were queued when the flush started: discarded (1 may have been pushed already).
        for item in &got[2..5] {
            assert_eq!(item.1, Disposal::Discard, "{got:?}");
        }
    }

    #[test]
    fn a_flush_wakes_a_streaming_thread_waiting_for_room() {
        let (p, _rx) = pusher(1, None);
        let p = Arc::new(p);
        p.push((0, later(200_000)));
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.wait_room())
        };
        std::thread::sleep(Duration::from_millis(5));
        p.set_flushing();
        assert_eq!(waiter.join().unwrap(), Err(gst::FlowError::Flushing));
    }

    #[test]
    fn dropping_finishes_queued_items_as_discards_and_joins() {
        let (p, rx) = pusher(8, None);
        for n in 0..3u32 {
            p.push((n, later(1000)));
        }
        drop(p);
        let got: Vec<_> = rx.try_iter().collect();
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![0, 1, 2]);
    }
}
