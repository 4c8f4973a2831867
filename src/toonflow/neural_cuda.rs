//! The neural processor on the GPU: the network on the device
//! ([`crate::cuda::neural::NeuralGpu`], one CUDA graph per shape, the statistics smoother on
//! the device) and the frame path too ([`DeviceFrames`]: NV12 in and out, the scene gate, the
//! conversions with the model-scale resampling and the temporal output filter as kernels
//! captured in the network's graph; per frame only the NV12 planes cross PCIe). With
//! `TOONFLOW_NEURAL_DEVICE_FRAMES=0` (for comparisons), or when the device path cannot be
//! built, the CPU processor's conversions and output filter ([`super::neural_cpu`]) run on the
//! host around the network.
//!
//! `precision=fp32` stores every activation in fp32. `precision=fp16` is calibrated: the first
//! frame runs in fp32, stage by stage, while [`Calibrator`] records every stage output's range
//! and every normalization's statistics; then the network is rebuilt with fp16 storage wherever
//! the calibration allows it (the decision per stage goes to the log).

use std::borrow::Cow;
use std::sync::Arc;

use crate::cuda::neural::DeviceFrameIo;
use crate::cuda::neural::program::Storage;
use crate::cuda::neural::{
    NeuralGpu, NeuralGpuError, NeuralGpuEvent, has_tensor_cores, with_recomputed_stem,
};
use cudarc::driver::CudaEvent;

use crate::cuda::neural_frame::{DeviceFrames, FilterSettings, input_gatherable, reborrow};
use crate::cuda::neural_overlap::{FinishedFrame, NeuralOverlap};
use crate::cuda::{CudaError, FrameSource, FrameTarget, GpuFrameStats};
use crate::neural::Tensor;
use crate::neural::engine::NeuralModel;
use crate::neural::frame::ConverterConfig;
use crate::neural::precision::{Calibrator, PrecisionPlan};
use crate::neural::temporal::{OutputFilter, SceneCut, StatSmoother};
use crate::pipeline::cpu::FrameReport;
use crate::pipeline::{Nv12Frame, Nv12FrameMut, ToonParams};

use super::neural_cpu::{NetworkFrames, NeuralFrameStats, NeuralTemporalParams};

/// Reports and figures of frames seen complete on the overlap path, oldest first.
pub type Outcomes = Vec<(FrameReport, GpuFrameStats)>;

/// One stream's neural state with the network on a CUDA device.
pub struct NeuralCuda {
    /// The overlap path's streams and host slots (made on its first frame); its frames in
    /// flight are waited for before anything they address changes or goes (see `Drop`).
    overlap: Option<NeuralOverlap>,
    /// The frames around the network (its host statistics smoother is unused: the device has
    /// its own).
    f: NetworkFrames,
    /// `None` only after a rebuild failed to allocate: frames are refused.
    gpu: Option<NeuralGpu>,
    /// The frame path on the device; `None`: the host converts.
    frames: Option<DeviceFrames>,
    device_id: usize,
    max_bytes: u64,
    use_graph: bool,
    /// `Some` until the first frame calibrated the fp16 storage.
    calibrating: Option<Calibrator>,
    precision: Option<PrecisionPlan>,
    output: Tensor<f32>,
    log: Vec<String>,
}

impl std::fmt::Debug for NeuralCuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NeuralCuda")
            .field("model", &self.f.model.name())
            .field("config", &self.f.config)
            .field("gpu", &self.gpu)
            .finish()
    }
}

impl NeuralCuda {
    /// Specialises `model` for `config` and builds it on CUDA device `device_id`: fp32 storage
    /// (also the calibration run of `fp16`). `max_bytes` (max-device-memory, 0 = no cap)
    /// bounds activations, weights and state together; `low_memory` (model-low-memory): the
    /// stem recomputed from the NV12 frame wherever that shrinks the arena by a tenth.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device_id: usize,
        model: Arc<NeuralModel>,
        config: ConverterConfig,
        params: NeuralTemporalParams,
        max_bytes: u64,
        fp16: bool,
        low_memory: bool,
        use_graph: bool,
    ) -> Result<NeuralCuda, NeuralGpuError> {
        // The smoother runs on the device; the host one only stands in for the shared type.
        let mut f = NetworkFrames::new(model, config, params, |_| StatSmoother::new(0, 0.0))?;
        let mut log = Vec::new();
        // an fp16 network at the frame's size gathers its input from the frame path's NV12
        // planes where its stem can; with `low_memory` its stem copy may read them too, where
        // that shrinks the arena without keeping an input tensor (the tiny layout); the
        // Hayao-class layout's copy pays beside an input tensor already
        // (the plans compared are the device's: without tensor cores nothing gathers the frame)
        let gathers = fp16 && device_frames_enabled() && input_gatherable(&config);
        if let Some((network, before, after)) = with_recomputed_stem(
            &f.network,
            gathers && low_memory,
            has_tensor_cores(device_id)?,
        ) {
            log.push(format!(
                "the stem is computed again for its last reader: fp16 arena {before} -> {after} \
                 bytes"
            ));
            f.network = network;
        }
        let storage = Storage::uniform(f.network.stage_count(), false);
        let mut gpu = NeuralGpu::new(device_id, &f.network, &storage, max_bytes, use_graph)?;
        gpu.set_smoothing(params.stat_smoothing);
        let output = f.converter.new_tensor();
        let frames = if !device_frames_enabled() {
            log.push("frame conversions on the host (TOONFLOW_NEURAL_DEVICE_FRAMES=0)".into());
            None
        } else {
            let settings = filter_settings(&params);
            let size = f.network_size();
            match DeviceFrames::new(gpu.context(), &config, gpu.program(), size, settings) {
                Ok(frames) => {
                    gpu.attach_frame(frames.frame_block())?;
                    log.push(format!(
                        "frame conversions, scene gate and output filter on the device ({} \
                         bytes)",
                        frames.device_bytes()
                    ));
                    Some(frames)
                }
                Err(e) => {
                    log.push(format!(
                        "frame conversions on the host: the device path failed: {e}"
                    ));
                    None
                }
            }
        };
        if frames.is_some() {
            // the output filter runs on the device: no host ring
            f.temporal.filter = OutputFilter::new(0, 0, 0, config.matrix, config.range);
        }
        Ok(NeuralCuda {
            overlap: None,
            calibrating: fp16.then(|| calibrator(&f.network)),
            precision: None,
            gpu: Some(gpu),
            frames,
            f,
            device_id,
            max_bytes,
            use_graph,
            output,
            log,
        })
    }

    pub fn config(&self) -> &ConverterConfig {
        &self.f.config
    }

    pub fn network_size(&self) -> (usize, usize) {
        self.f.network_size()
    }

    /// The device network (program, plan, launches); `None` after a failed rebuild.
    pub fn gpu(&self) -> Option<&NeuralGpu> {
        self.gpu.as_ref()
    }

    fn device(&mut self) -> Result<&mut NeuralGpu, NeuralGpuError> {
        self.gpu.as_mut().ok_or_else(no_network)
    }

    /// Lines to log since the last call (kernels, graph captures, the calibration's decision).
    pub fn take_log(&mut self) -> Vec<String> {
        let events = self
            .gpu
            .as_mut()
            .map(|g| g.take_events())
            .unwrap_or_default();
        for e in events {
            self.log.push(match e {
                NeuralGpuEvent::KernelsReady { arch, compile_ms } => {
                    format!(
                        "neural kernels for {arch} ready ({})",
                        crate::cuda::kernels::build_note(compile_ms)
                    )
                }
                NeuralGpuEvent::GraphCaptured {
                    launches,
                    capture_us,
                } => format!(
                    "captured the network as a CUDA graph: {launches} launches, {capture_us:.0} µs"
                ),
                NeuralGpuEvent::GraphCaptureFailed { reason } => {
                    format!("graph capture of the network failed, running eagerly: {reason}")
                }
            });
        }
        std::mem::take(&mut self.log)
    }

    pub fn frame_stats(&self) -> NeuralFrameStats {
        let gpu = self.gpu.as_ref();
        let frames = self.frames.as_ref().map_or(0, |f| f.device_bytes());
        self.f.frame_stats(
            gpu.map_or(0, |g| g.device_bytes()) + frames,
            gpu.map_or(0, |g| g.program().arena.peak_live_bytes),
        )
    }

    /// The last frame's figures; on the device frame path the NV12 planes are what crossed
    /// PCIe each way, nothing for a side in device memory (the host path's f32 tensors are
    /// not counted), whose copy is a device copy, not a transfer.
    pub fn gpu_stats(&self) -> GpuFrameStats {
        let mut stats = self
            .gpu
            .as_ref()
            .map(|g| g.last_frame_stats())
            .unwrap_or_default();
        if let Some(frames) = &self.frames {
            (stats.upload_bytes, stats.download_bytes) = frames.transferred_bytes();
            for (bytes, time) in [
                (stats.upload_bytes, &mut stats.upload_time_us),
                (stats.download_bytes, &mut stats.download_time_us),
            ] {
                if bytes == 0 {
                    stats.device_copy_time_us += std::mem::take(time);
                }
            }
            stats.transfer_time_us = stats.upload_time_us + stats.download_time_us;
        }
        stats
    }

    /// Whether frames in device memory of the network's context can be processed
    /// ([`process_frames`](Self::process_frames)): the frame path runs on the device.
    pub fn takes_device_frames(&self) -> bool {
        self.frames.is_some() && self.gpu.is_some()
    }

    pub fn set_use_graph(&mut self, on: bool) {
        self.finish_in_flight();
        self.use_graph = on;
        if let Some(g) = &mut self.gpu {
            g.set_use_graph(on);
        }
    }

    /// Follows the temporal properties (as the CPU processor does).
    /// A longer history than the device ring holds reallocates it; when that fails the ring
    /// keeps its size (the history is clamped to it) and the log says why.
    pub fn set_params(&mut self, params: NeuralTemporalParams) {
        let changed = if self.frames.is_some() {
            // the output filter runs on the device: the host ring stays empty
            let changed = self.f.params != params;
            self.f.params = params;
            changed
        } else {
            self.f.set_params(params)
        };
        if !changed {
            return;
        }
        // a longer history reallocates the ring the frames in flight address (the other
        // settings travel with each frame's control block)
        if self
            .frames
            .as_ref()
            .is_some_and(|f| f.ring_grows(params.history))
        {
            self.finish_in_flight();
        }
        if let Some(g) = &mut self.gpu {
            g.set_smoothing(params.stat_smoothing);
        }
        if let Some(frames) = &mut self.frames
            && let Err(e) = frames.set_settings(filter_settings(&params))
        {
            self.log.push(format!(
                "temporal-history {} kept at the device ring's size: {e}",
                params.history
            ));
        }
    }

    /// Forgets statistics, outputs and the scene reference (FLUSH, DISCONT, caps).
    pub fn reset(&mut self) {
        self.f.temporal.reset();
        if let Some(g) = &mut self.gpu {
            g.reset();
        }
        if let Some(frames) = &mut self.frames {
            frames.reset();
        }
    }

    /// Stylizes one frame; on the first frame of an fp16 stream, calibrates first.
    pub fn process(
        &mut self,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
        lines: Option<&ToonParams>,
    ) -> Result<FrameReport, NeuralGpuError> {
        if self.frames.is_none() {
            return self.process_on_host(input, output, lines);
        }
        let report = self.process_frames(FrameSource::Host(input), FrameTarget::Host(output))?;
        self.f.draw_lines(lines, output);
        Ok(report)
    }

    /// Stylizes one frame on the device frame path, either side in host memory or in device
    /// memory of the network's context (no lines: model-edges draws on host frames).
    pub fn process_frames(
        &mut self,
        input: FrameSource,
        output: FrameTarget,
    ) -> Result<FrameReport, NeuralGpuError> {
        self.finish_in_flight();
        let (cut, history_used) = if self.calibrating.is_some() {
            self.calibrate_on_device(input, output)?
        } else {
            let (Some(gpu), Some(frames)) = (self.gpu.as_mut(), self.frames.as_mut()) else {
                return Err(no_device_frames());
            };
            let mut job = frames.job(input, output);
            gpu.run_device(&mut job)?;
            job.conclude()
        };
        Ok(FrameReport {
            scene_cut: cut.cut,
            scene_score: cut.score,
            history_used,
        })
    }

    /// Whether host frames can be queued with [`submit_host`](Self::submit_host): the frame
    /// path runs on the device and the calibration (a synchronous first frame) is done.
    pub fn can_submit(&self) -> bool {
        self.takes_device_frames() && self.calibrating.is_none()
    }

    /// The overlap path: queues a host frame on the device frame path and returns without
    /// waiting for it (see [`NeuralOverlap`]; it takes no device memory). Returns the event that fires when `output` is complete and the
    /// frames seen complete meanwhile, oldest first.
    ///
    /// # Safety
    /// Both frames' memory must stay valid and untouched (`output` unread, `input` unwritten)
    /// until the returned event has fired.
    pub unsafe fn submit_host(
        &mut self,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
    ) -> Result<(Arc<CudaEvent>, Outcomes), NeuralGpuError> {
        if !self.can_submit() {
            return Err(no_device_frames());
        }
        let (Some(gpu), Some(frames)) = (self.gpu.as_mut(), self.frames.as_mut()) else {
            return Err(no_device_frames());
        };
        if self.overlap.is_none() {
            self.overlap = Some(NeuralOverlap::new(gpu.context())?);
        }
        let overlap = self.overlap.as_mut().expect("made above");
        // SAFETY: passed on to the caller (see above).
        let queued = unsafe { overlap.submit(gpu, frames, input, output) }?;
        Ok((queued.done, finished_reports(queued.finished)))
    }

    /// Reports and figures of queued frames seen complete, oldest first; with `wait`, of all.
    pub fn harvest(&mut self, wait: bool) -> Result<Outcomes, NeuralGpuError> {
        let (Some(overlap), Some(gpu), Some(frames)) = (
            self.overlap.as_mut(),
            self.gpu.as_ref(),
            self.frames.as_ref(),
        ) else {
            return Ok(Vec::new());
        };
        Ok(finished_reports(overlap.harvest(gpu, frames, wait)?))
    }

    /// Queued frames whose outcome has not been harvested.
    pub fn in_flight(&self) -> usize {
        self.overlap.as_ref().map_or(0, |o| o.in_flight())
    }

    /// Waits for the queued frames (their outcomes stay for the next harvest).
    fn finish_in_flight(&mut self) {
        if let (Some(overlap), Some(gpu), Some(frames)) = (
            self.overlap.as_mut(),
            self.gpu.as_ref(),
            self.frames.as_ref(),
        ) {
            overlap.finish_in_flight(gpu, frames);
        }
    }

    /// The first frame of an fp16 stream on the device frame path: the conversion on the
    /// device, the network eagerly in fp32 with the calibrator watching, the rebuild with the
    /// calibrated storage, the output filter on the device from the fp32 result.
    fn calibrate_on_device(
        &mut self,
        input: FrameSource,
        mut output: FrameTarget,
    ) -> Result<(SceneCut, usize), NeuralGpuError> {
        let (Some(gpu), Some(frames)) = (self.gpu.as_mut(), self.frames.as_mut()) else {
            return Err(no_device_frames());
        };
        {
            let mut job = frames.job(input, reborrow(&mut output));
            gpu.context()
                .bind_to_thread()
                .map_err(|e| CudaError::Failed(format!("binding the context: {e}")))?;
            job.upload(gpu.stream())?;
            job.before(gpu.stream())?;
        }
        frames.read_input(gpu.stream(), &mut self.f.input.data)?;
        self.calibrate()?;
        let (Some(gpu), Some(frames)) = (self.gpu.as_mut(), self.frames.as_mut()) else {
            return Err(no_device_frames());
        };
        frames.attach(gpu.program())?;
        gpu.attach_frame(frames.frame_block())?;
        frames.write_output(gpu.stream(), &self.output.data)?;
        let mut job = frames.job(input, output);
        job.after(gpu.stream())?;
        job.download(gpu.stream())?;
        gpu.synchronize()?;
        Ok(job.conclude())
    }

    /// Runs `self.f.input` through the fp32 network eagerly with the calibrator watching
    /// (result in `self.output`), then rebuilds the network with the calibrated storage.
    fn calibrate(&mut self) -> Result<(), NeuralGpuError> {
        let Some(mut calibrator) = self.calibrating.take() else {
            return Ok(());
        };
        let mut stats: Vec<(usize, Vec<f32>, Vec<f32>)> = Vec::new();
        let gpu = self.gpu.as_mut().ok_or_else(no_network)?;
        gpu.run_calibration(
            &self.f.input,
            &mut self.output,
            &mut |stage, range| calibrator.record_output_range(stage, range),
            &mut |index, mean, var| stats.push((index, mean.to_vec(), var.to_vec())),
        )?;
        for (index, mean, var) in &stats {
            calibrator.record_stats(*index, mean, var);
        }
        calibrator.frame_done();
        let mut plan = calibrator.finish();
        self.log.push(format!(
            "calibrated storage of {} ({} of {} stages fp16):\n{}",
            self.f.model.name(),
            plan.count(crate::neural::precision::StoragePrecision::Fp16),
            plan.len(),
            plan.ledger()
        ));
        // centered stages change the network's biases and chains, not what it computes; a
        // centered network the device cannot build (a chain past the kernel's operator or
        // operand count) keeps those stages fp32 instead
        let rebuilt = match plan.network(&self.f.network) {
            Ok(Cow::Owned(centered)) => {
                let plain = std::mem::replace(&mut self.f.network, centered);
                let rebuilt = self.rebuild(&Storage::from_plan(&plan));
                if rebuilt.is_err() {
                    self.f.network = plain;
                }
                rebuilt
            }
            Ok(Cow::Borrowed(_)) => self.rebuild(&Storage::from_plan(&plan)),
            Err(e) => Err(e.into()),
        };
        match rebuilt {
            Ok(()) => {}
            Err(e) if plan.decisions.iter().any(|d| d.center.is_some()) => {
                self.log.push(format!(
                    "the centered network did not build ({e}): its centered stages stay fp32"
                ));
                plan = calibrator.without_centering().finish();
                self.rebuild(&Storage::from_plan(&plan))?;
            }
            Err(e) => return Err(e),
        }
        self.precision = Some(plan);
        Ok(())
    }

    /// The host frame path: conversions and the output filter on the CPU, the network on the
    /// device with f32 tensors copied each way.
    fn process_on_host(
        &mut self,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
        lines: Option<&ToonParams>,
    ) -> Result<FrameReport, NeuralGpuError> {
        let cut = self.f.begin(input)?;
        if cut.cut {
            self.device()?.reset();
        }
        if self.calibrating.is_some() {
            self.calibrate()?;
        } else {
            let gpu = self.gpu.as_mut().ok_or_else(no_network)?;
            gpu.run(&self.f.input, &mut self.output)?;
        }
        Ok(self.f.finish(cut, &self.output, output, lines)?)
    }

    /// The network again with `storage` (the old device memory goes first, then the new is
    /// allocated; the smoother starts over).
    fn rebuild(&mut self, storage: &Storage) -> Result<(), NeuralGpuError> {
        self.gpu = None;
        // the frame path attaches the rebuilt network (`calibrate_on_device`)
        let gathers = self.frames.is_some() && input_gatherable(&self.f.config);
        let mut gpu = NeuralGpu::new(
            self.device_id,
            &self.f.network,
            &storage.clone().with_frame_input(gathers),
            self.max_bytes,
            self.use_graph,
        )?;
        gpu.set_smoothing(self.f.params.stat_smoothing);
        self.gpu = Some(gpu);
        Ok(())
    }
}

impl Drop for NeuralCuda {
    fn drop(&mut self) {
        // the frames in flight address the network and the frame path
        self.finish_in_flight();
    }
}

fn finished_reports(frames: Vec<FinishedFrame>) -> Outcomes {
    frames
        .into_iter()
        .map(|f| {
            (
                FrameReport {
                    scene_cut: f.cut.cut,
                    scene_score: f.cut.score,
                    history_used: f.history_used,
                },
                f.stats,
            )
        })
        .collect()
}

fn no_network() -> NeuralGpuError {
    CudaError::Failed(
        "the network has no device memory: its rebuild after calibration failed".into(),
    )
    .into()
}

fn no_device_frames() -> NeuralGpuError {
    CudaError::Failed(
        "the neural frame path is not on the device (or its network has no device memory)".into(),
    )
    .into()
}

/// The calibrator of `precision=fp16`; `TOONFLOW_NEURAL_CENTER=0` keeps stages that lose
/// their variance fp32 instead of storing them centered (for comparisons).
fn calibrator(network: &crate::neural::engine::Specialised) -> Calibrator {
    let calibrator = Calibrator::new(network);
    if std::env::var("TOONFLOW_NEURAL_CENTER").is_ok_and(|v| v == "0") {
        calibrator.without_centering()
    } else {
        calibrator
    }
}

/// The frame path on the device unless `TOONFLOW_NEURAL_DEVICE_FRAMES=0`.
fn device_frames_enabled() -> bool {
    std::env::var("TOONFLOW_NEURAL_DEVICE_FRAMES").map_or(true, |v| v != "0")
}

fn filter_settings(params: &NeuralTemporalParams) -> FilterSettings {
    FilterSettings {
        history: params.history,
        strength: params.strength,
        motion_sigma: params.motion_sigma,
        scene_cut_threshold: params.scene_cut_threshold,
    }
}
