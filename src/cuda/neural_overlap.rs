//! The overlap path of the neural frame path (issue 12's, for the network): a host frame is
//! queued and the call returns without waiting for it, so the next frame's upload runs while
//! this one's network does.
//!
//! A frame runs as three graphs on the network's stream: the input kernels (thumbnail, scene
//! gate, NV12 → the network's input), the network, the output kernels (filter → NV12). Its
//! upload runs on an upload stream straight into the frame path's input planes once the
//! previous frame's input kernels have read them (where the network's stem gathers its input
//! from the planes, once the last launch doing so ran: a stem recomputed for its last reader
//! keeps them until late in the network), and its download on a download stream from
//! the output planes once its output kernels are done; the next frame's output kernels wait
//! for that download. So both copies overlap the next frame's network, with no landing slot
//! (unlike the classic pipeline's path, `overlap.rs`). The scene verdict comes back on the
//! network's stream before the next frame's gate overwrites it; the frame's `done` event is
//! recorded after its download. Each frame in flight owns a page-locked host slot (its control blocks going up, its verdict
//! coming back) and its events until its completion has been seen. The ring slots a frame's
//! output filter reads are planned before the verdicts of the frames still in flight: the
//! device trims the plan after a scene cut itself (`nf_scene`).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::GpuFrameStats;
use super::context::guard;
use super::copy::{Rows, copy_d2h, copy_h2d};
use super::error::{CudaError, driver};
use super::neural::program::NnControl;
use super::neural::{NeuralGpu, OutputGate};
use super::neural_frame::{DeviceFrames, NfControl, NfState, host_planes, verdict_of};
use super::overlap::{FlightSlot, HOST_SLOTS, InFlight, SlotRing};
use super::pipeline::{FrameSource, FrameTarget, check_host_frame, copy_nv12, elapsed_us};
use crate::neural::temporal::SceneCut;
use crate::pipeline::{Nv12Frame, Nv12FrameMut};

/// A frame's host slot: [NnControl][NfControl][NfState], each at a 64-byte boundary.
const SLOT_NET_CONTROL: usize = 0;
const SLOT_FRAME_CONTROL: usize = 64;
const SLOT_STATE: usize = 128;
const SLOT_BYTES: usize = 192;

const _: () = assert!(std::mem::size_of::<NnControl>() <= SLOT_FRAME_CONTROL - SLOT_NET_CONTROL);
const _: () = assert!(std::mem::size_of::<NfControl>() <= SLOT_STATE - SLOT_FRAME_CONTROL);
const _: () = assert!(std::mem::size_of::<NfState>() <= SLOT_BYTES - SLOT_STATE);

/// A frame of the overlap path seen complete: its scene verdict, the ring entries its filter
/// used, its figures.
#[derive(Debug, Clone, Copy)]
pub struct FinishedFrame {
    pub cut: SceneCut,
    pub history_used: usize,
    pub stats: GpuFrameStats,
}

/// What [`NeuralOverlap::submit`] returns.
pub struct QueuedFrame {
    /// Recorded after the frame's download: the output is complete once it has fired.
    pub done: Arc<CudaEvent>,
    /// Earlier frames seen complete meanwhile, oldest first.
    pub finished: Vec<FinishedFrame>,
}

/// The copy streams and the host slots of one stream's neural frame path.
pub struct NeuralOverlap {
    /// Events: 0/1 upload start and end (upload stream); 2 kernels start; 3 the input planes
    /// read (the next upload waits for it); 4 kernels and verdict done; 5 download start;
    /// 6/7 around the wait for the previous frame's download (not GPU time of this frame).
    slots: Vec<FlightSlot<8>>,
    ring: SlotRing,
    up: Arc<CudaStream>,
    down: Arc<CudaStream>,
    /// Frames seen complete by a wait outside `submit`/`harvest` (before a settings change).
    finished_early: Vec<FinishedFrame>,
}

impl NeuralOverlap {
    /// The copy streams and the host slots in `ctx` (no device memory).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<NeuralOverlap, CudaError> {
        guard("setting up the neural overlap", || {
            let up = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
            let down = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
            Ok(NeuralOverlap {
                slots: FlightSlot::make_all(ctx, SLOT_BYTES)?,
                ring: SlotRing::new(HOST_SLOTS),
                up,
                down,
                finished_early: Vec::new(),
            })
        })
    }

    /// Frames queued whose completion has not been handed out yet.
    pub fn in_flight(&self) -> usize {
        self.ring.in_flight() + self.finished_early.len()
    }

    /// Queues a host frame through `frames` and `gpu` and returns without waiting for it
    /// (see the module documentation). At most [`HOST_SLOTS`] frames are in flight: a
    /// fourth waits for the oldest. On an error nothing of the frame runs on, and the frame
    /// path and the network's statistics start over (as after a DISCONT): the frame may have
    /// passed the scene gate and written its ring slot, so its rerun must not compare with
    /// itself.
    ///
    /// # Safety
    /// Both frames' memory must stay valid and untouched (`output` unread, `input` unwritten)
    /// until `done` has fired: the copies run after this call returns.
    pub unsafe fn submit(
        &mut self,
        gpu: &mut NeuralGpu,
        frames: &mut DeviceFrames,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<QueuedFrame, CudaError> {
        let started = Instant::now();
        let mut finished = std::mem::take(&mut self.finished_early);
        let r = guard("queuing a neural frame", || {
            self.submit_inner(gpu, frames, input, output, &mut finished)
        });
        match r {
            Ok(slot) => {
                let slot = &mut self.slots[slot];
                slot.frame.host_time_us = started.elapsed().as_secs_f64() * 1e6;
                Ok(QueuedFrame {
                    done: slot.done.clone(),
                    finished,
                })
            }
            Err(e) => {
                // A frame cut short: nothing of it may run on after the error is returned.
                self.synchronize(gpu);
                frames.reset();
                gpu.reset();
                // the outcomes of earlier frames seen complete wait for the next harvest
                self.finished_early = finished;
                Err(e)
            }
        }
    }

    fn submit_inner(
        &mut self,
        gpu: &mut NeuralGpu,
        frames: &mut DeviceFrames,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
        finished: &mut Vec<FinishedFrame>,
    ) -> Result<usize, CudaError> {
        let (w, h) = (
            frames.params().width as usize,
            frames.params().height as usize,
        );
        check_host_frame(input.geometry, input.check(), (w, h), "input")?;
        check_host_frame(output.geometry, output.check(), (w, h), "output")?;
        gpu.context()
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        finished.extend(self.harvest_from(gpu, frames, false)?);
        if self.ring.next_free().is_none() {
            finished.extend(self.harvest_from(gpu, frames, true)?);
        }
        let i = self
            .ring
            .next_free()
            .ok_or_else(|| CudaError::Failed("no free host slot after a wait".into()))?;
        let (s, up, down) = (gpu.stream().clone(), self.up.clone(), self.down.clone());
        // The input planes are free once the last submitted frame's input kernels (or its
        // network's last launch gathering the planes) read them.
        let prev = self.ring.last_submitted();
        if let Some(prev) = prev {
            up.wait(&self.slots[prev].ev[3])
                .map_err(driver("cuStreamWaitEvent"))?;
        }
        let nv12_in = Rows::device(frames.params().nv12_in, w);
        let nv12_in = [nv12_in, nv12_in.offset(w * h)];
        let source = host_planes(
            input.y.as_ptr() as *mut u8,
            input.y_stride,
            input.uv.as_ptr() as *mut u8,
            input.uv_stride,
        );
        let target = host_planes(
            output.y.as_mut_ptr(),
            output.y_stride,
            output.uv.as_mut_ptr(),
            output.uv_stride,
        );
        let slot = &mut self.slots[i];
        slot.ev[0].record(&up).map_err(driver("cuEventRecord"))?;
        // SAFETY: the input planes hold `h` (`h/2`) rows of `w` bytes (checked above) and the
        // caller keeps them unwritten until `done`; "nv12_in" holds a packed frame.
        unsafe { copy_nv12(up.cu_stream(), source, nv12_in, w, h, "upload")? };
        slot.ev[1].record(&up).map_err(driver("cuEventRecord"))?;

        let cs = s.cu_stream();
        s.wait(&slot.ev[1]).map_err(driver("cuStreamWaitEvent"))?;
        slot.ev[2].record(&s).map_err(driver("cuEventRecord"))?;
        // The job plans the frame's ring slots; it gives the graph its kernels below.
        let job = frames.job(FrameSource::Host(input), FrameTarget::Host(output));
        let (net_control, net_control_at) = gpu.next_control();
        let frame_control = job.control();
        let p = *job.params();
        let host = &mut slot.host;
        host[SLOT_NET_CONTROL..SLOT_NET_CONTROL + std::mem::size_of::<NnControl>()]
            .copy_from_slice(bytemuck::bytes_of(&net_control));
        host[SLOT_FRAME_CONTROL..SLOT_FRAME_CONTROL + std::mem::size_of::<NfControl>()]
            .copy_from_slice(bytemuck::bytes_of(&frame_control));
        // SAFETY: the slot's page-locked block is not written again before its frame is seen
        // complete (the ring hands it out again only then); the control blocks are device
        // buffers of the network and the frame path of these sizes.
        unsafe {
            copy_h2d(
                cs,
                host.as_ptr().add(SLOT_NET_CONTROL),
                net_control_at,
                std::mem::size_of::<NnControl>(),
            )
            .map_err(driver("network control upload"))?;
            copy_h2d(
                cs,
                host.as_ptr().add(SLOT_FRAME_CONTROL),
                p.control,
                std::mem::size_of::<NfControl>(),
            )
            .map_err(driver("neural frame control upload"))?;
        }
        // the output planes are free once the last submitted frame's download read them
        let gate = OutputGate {
            free: prev.map(|prev| &*self.slots[prev].done),
            before_wait: &self.slots[i].ev[6],
            after_wait: &self.slots[i].ev[7],
        };
        let replayed = gpu.enqueue_device_frame(&job, &self.slots[i].ev[3], gate)?;
        let slot = &mut self.slots[i];
        // SAFETY: the slot's block is read only after `done`, which follows this copy (the
        // download stream waits for ev[4]); the verdict is copied before the next frame's
        // scene gate (the same stream) writes it again.
        unsafe {
            copy_d2h(
                cs,
                p.state,
                slot.host.as_mut_ptr().add(SLOT_STATE),
                std::mem::size_of::<NfState>(),
            )
            .map_err(driver("scene verdict download"))?;
        }
        slot.ev[4].record(&s).map_err(driver("cuEventRecord"))?;
        down.wait(&slot.ev[4])
            .map_err(driver("cuStreamWaitEvent"))?;
        slot.ev[5].record(&down).map_err(driver("cuEventRecord"))?;
        let planes = Rows::device(p.nv12_out, w);
        // SAFETY: "nv12_out" holds the packed frame (the download waits for the output
        // kernels, and the next frame's output kernels wait for `done`); the output planes were
        // checked to hold the frame and the caller keeps them alive and unread until `done`.
        unsafe {
            copy_nv12(
                down.cu_stream(),
                [planes, planes.offset(w * h)],
                target,
                w,
                h,
                "download",
            )?;
        }
        slot.done.record(&down).map_err(driver("cuEventRecord"))?;
        slot.frame = InFlight {
            launches: gpu.launches_per_frame() + frames.launches(),
            replayed,
            host_time_us: 0.0,
        };
        frames.frame_queued();
        gpu.control_queued();
        self.ring.begin(i);
        Ok(i)
    }

    /// Frames seen complete, oldest first; with `wait`, all of them after waiting.
    pub fn harvest(
        &mut self,
        gpu: &NeuralGpu,
        frames: &DeviceFrames,
        wait: bool,
    ) -> Result<Vec<FinishedFrame>, CudaError> {
        let mut out = std::mem::take(&mut self.finished_early);
        loop {
            let more = self.harvest_from(gpu, frames, wait)?;
            if more.is_empty() || !wait {
                out.extend(more);
                return Ok(out);
            }
            out.extend(more);
        }
    }

    /// Waits for every frame in flight and keeps their outcomes for the next `submit` or
    /// `harvest` (before the ring or the graphs change, or the memory goes).
    pub fn finish_in_flight(&mut self, gpu: &NeuralGpu, frames: &DeviceFrames) {
        if self.ring.in_flight() == 0 {
            return;
        }
        self.synchronize(gpu);
        if let Ok(done) = self.harvest_from(gpu, frames, true) {
            self.finished_early.extend(done);
        }
        // The streams are idle: no frame is left in flight.
        self.ring.clear();
    }

    /// Waits for the three streams (errors ignored: nothing of the frames may run on).
    fn synchronize(&self, gpu: &NeuralGpu) {
        let _ = gpu.context().bind_to_thread();
        let _ = gpu.stream().synchronize();
        let _ = self.up.synchronize();
        let _ = self.down.synchronize();
    }

    /// Frames complete, oldest first: without `wait_one` those already done, with it the
    /// oldest after waiting for it (and any done after it).
    fn harvest_from(
        &mut self,
        gpu: &NeuralGpu,
        frames: &DeviceFrames,
        wait_one: bool,
    ) -> Result<Vec<FinishedFrame>, CudaError> {
        let mut out = Vec::new();
        while let Some(i) = self.ring.oldest() {
            let slot = &self.slots[i];
            if !slot.complete(wait_one && out.is_empty())? {
                break;
            }
            let state: NfState = bytemuck::pod_read_unaligned(
                &slot.host[SLOT_STATE..SLOT_STATE + std::mem::size_of::<NfState>()],
            );
            let (cut, history_used) = verdict_of(&state);
            let bytes = frames.frame_bytes();
            let (upload, download) = (
                elapsed_us(&slot.ev[0], &slot.ev[1]),
                elapsed_us(&slot.ev[5], &slot.done),
            );
            let stats = GpuFrameStats {
                gpu_time_us: elapsed_us(&slot.ev[2], &slot.ev[6])
                    + elapsed_us(&slot.ev[7], &slot.ev[4]),
                transfer_time_us: upload + download,
                launches: slot.frame.launches,
                graph_replayed: slot.frame.replayed,
                arena_bytes: gpu.device_bytes(),
                peak_live_bytes: gpu.program().arena.peak_live_bytes,
                host_time_us: slot.frame.host_time_us,
                upload_time_us: upload,
                download_time_us: download,
                upload_bytes: bytes,
                download_bytes: bytes,
                ..GpuFrameStats::default()
            };
            self.ring.finish_oldest();
            out.push(FinishedFrame {
                cut,
                history_used,
                stats,
            });
        }
        Ok(out)
    }
}
