//! The neural processor on the CPU reference: NV12 → network tensor (the caps' matrix and
//! range, the model's layout and value range, model-scale, reflect padding) → the specialised
//! network with the statistics smoother in its normalization hook → the temporal output filter
//! on its RGB → NV12. Plain Rust: the engine builds it for the negotiated size and feeds it
//! frames.

use std::sync::Arc;

use crate::memplan::ArenaPlan;
use crate::neural::engine::{NeuralModel, Specialised};
use crate::neural::frame::{ConverterConfig, FrameConverter};
use crate::neural::temporal::{NeuralTemporal, OutputFilter, SceneCut, SceneCutGate, StatSmoother};
use crate::neural::{NeuralError, Tensor};
use crate::pipeline::cpu::FrameReport;
use crate::pipeline::{Nv12Frame, Nv12FrameMut, ToonParams};

use super::lines::LineOverlay;

/// The CPU reference computes and stores every activation in f32.
pub const BYTES_PER_ELEMENT: u64 = 4;

/// The temporal settings the processor follows frame by frame.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NeuralTemporalParams {
    pub history: usize,
    pub strength: f32,
    pub motion_sigma: f32,
    pub stat_smoothing: f32,
    pub scene_cut_threshold: f32,
}

/// What a neural frame costs, for the statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NeuralFrameStats {
    pub arena_bytes: u64,
    pub peak_live_bytes: u64,
    pub stages: u32,
    /// The size the network runs at (scaled and padded).
    pub network_width: u32,
    pub network_height: u32,
}

/// What both neural processors (CPU and GPU) do around the network: the model specialised for
/// the converter's size, NV12 ↔ tensor, the temporal output filter, the scene gate and the
/// `model-edges` lines.
pub struct NetworkFrames {
    pub model: Arc<NeuralModel>,
    pub config: ConverterConfig,
    pub converter: FrameConverter,
    pub network: Specialised,
    pub temporal: NeuralTemporal,
    /// The frame as the network's input tensor.
    pub input: Tensor<f32>,
    pub params: NeuralTemporalParams,
    /// `model-edges`, allocated the first time it is asked for.
    lines: Option<LineOverlay>,
}

impl NetworkFrames {
    /// Specialises `model` for `config` (the padded network size); `smoother` is the
    /// statistics smoother kept on the host for that network.
    pub fn new(
        model: Arc<NeuralModel>,
        config: ConverterConfig,
        params: NeuralTemporalParams,
        smoother: impl FnOnce(&Specialised) -> StatSmoother,
    ) -> Result<NetworkFrames, NeuralError> {
        let converter = FrameConverter::new(config)?;
        let (h, w) = converter.network_size();
        let network = model.specialise(h, w)?;
        let expected = converter.tensor_shape();
        if network.input_shape() != expected {
            return Err(NeuralError::Model(format!(
                "{}: specialised for input {:?}, the frame converter makes {:?}",
                model.name(),
                network.input_shape(),
                expected
            )));
        }
        let (sh, sw) = converter.scaled_size();
        let temporal = NeuralTemporal {
            smoother: smoother(&network),
            filter: Self::output_filter(&config, sw, sh, params),
            scene: SceneCutGate::new(config.width, config.height),
        };
        let input = converter.new_tensor();
        Ok(NetworkFrames {
            model,
            config,
            converter,
            network,
            temporal,
            input,
            params,
            lines: None,
        })
    }

    fn output_filter(
        config: &ConverterConfig,
        width: usize,
        height: usize,
        params: NeuralTemporalParams,
    ) -> OutputFilter {
        let mut filter =
            OutputFilter::new(width, height, params.history, config.matrix, config.range);
        filter.set_params(params.history, params.strength, params.motion_sigma);
        filter
    }

    /// (height, width) the network runs at (scaled and padded).
    pub fn network_size(&self) -> (usize, usize) {
        self.converter.network_size()
    }

    /// The statistics of a frame with this network and `arena_bytes`/`peak_live_bytes`.
    pub fn frame_stats(&self, arena_bytes: u64, peak_live_bytes: u64) -> NeuralFrameStats {
        let (h, w) = self.network_size();
        NeuralFrameStats {
            arena_bytes,
            peak_live_bytes,
            stages: self.network.stage_count() as u32,
            network_width: w as u32,
            network_height: h as u32,
        }
    }

    /// Follows the temporal properties of the output filter; false when nothing changed. A
    /// longer history than the ring holds rebuilds the ring (empty); the rest keeps what the
    /// ring holds. The caller applies `stat_smoothing` where its smoother lives.
    pub fn set_params(&mut self, params: NeuralTemporalParams) -> bool {
        if params == self.params {
            return false;
        }
        if params.history > self.temporal.filter.capacity() {
            let (sh, sw) = self.converter.scaled_size();
            // The old ring goes before the larger one is allocated.
            self.temporal.filter =
                OutputFilter::new(0, 0, 0, self.config.matrix, self.config.range);
            self.temporal.filter = Self::output_filter(&self.config, sw, sh, params);
        } else {
            self.temporal
                .filter
                .set_params(params.history, params.strength, params.motion_sigma);
        }
        self.params = params;
        true
    }

    /// The scene gate sees the frame, which becomes the network's input tensor.
    pub fn begin(&mut self, input: &Nv12Frame) -> Result<SceneCut, NeuralError> {
        let cut =
            self.temporal
                .begin_frame(input.y, input.y_stride, self.params.scene_cut_threshold);
        self.converter
            .to_tensor(
                input.y,
                input.y_stride,
                input.uv,
                input.uv_stride,
                &mut self.input,
            )
            .map_err(NeuralError::Model)?;
        Ok(cut)
    }

    /// The network's `result` through the output filter into `output`; with `lines` the
    /// classic DoG lines of those parameters are drawn over it (`model-edges`).
    pub fn finish(
        &mut self,
        cut: SceneCut,
        result: &Tensor<f32>,
        output: &mut Nv12FrameMut,
        lines: Option<&ToonParams>,
    ) -> Result<FrameReport, NeuralError> {
        self.converter
            .read_output(result)
            .map_err(NeuralError::Model)?;
        let history_used = self
            .temporal
            .filter
            .apply(self.converter.network_rgb_mut())
            .map_err(NeuralError::Model)?;
        self.converter
            .write_nv12(output.y, output.y_stride, output.uv, output.uv_stride)
            .map_err(NeuralError::Model)?;
        self.draw_lines(lines, output);
        Ok(FrameReport {
            scene_cut: cut.cut,
            scene_score: cut.score,
            history_used,
        })
    }
}

impl NetworkFrames {
    /// With `lines`, the classic DoG lines of those parameters over `output` (`model-edges`).
    pub fn draw_lines(&mut self, lines: Option<&ToonParams>, output: &mut Nv12FrameMut) {
        if let Some(p) = lines {
            self.lines
                .get_or_insert_with(|| LineOverlay::new(output.geometry))
                .apply(p, output);
        }
    }
}

/// One stream's neural state on the CPU reference: the frames around the network and the
/// network's activation plan.
pub struct NeuralCpu {
    f: NetworkFrames,
    plan: ArenaPlan,
}

impl std::fmt::Debug for NeuralCpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NeuralCpu")
            .field("model", &self.f.model.name())
            .field("config", &self.f.config)
            .field("arena_bytes", &self.plan.arena_bytes)
            .finish()
    }
}

/// The converter configuration's size multiple: the property when set, else the model's.
pub fn size_multiple(model: &NeuralModel, property: u32) -> usize {
    if property == 0 {
        model.size_multiple()
    } else {
        property as usize
    }
}

impl NeuralCpu {
    /// Specialises `model` for `config` (the padded network size) and checks its activation
    /// plan against `max_bytes` (max-device-memory; 0 = no cap) before anything is allocated
    /// for frames.
    pub fn new(
        model: Arc<NeuralModel>,
        config: ConverterConfig,
        params: NeuralTemporalParams,
        max_bytes: u64,
    ) -> Result<NeuralCpu, NeuralError> {
        let f = NetworkFrames::new(model, config, params, |network| {
            StatSmoother::with_channels(&network.normalize_channels(), params.stat_smoothing)
        })?;
        let plan = f.network.plan(BYTES_PER_ELEMENT);
        if let Some(why) = plan.exceeds_cap(max_bytes) {
            return Err(NeuralError::Model(format!(
                "{}: {why} (max-device-memory); raise max-device-memory or lower model-scale",
                f.model.name()
            )));
        }
        Ok(NeuralCpu { f, plan })
    }

    pub fn config(&self) -> &ConverterConfig {
        &self.f.config
    }

    pub fn model(&self) -> &Arc<NeuralModel> {
        &self.f.model
    }

    /// The activation plan (arena, peak and where it occurs).
    pub fn plan(&self) -> &ArenaPlan {
        &self.plan
    }

    /// One line per stage and the peak, for the debug log.
    pub fn ledger(&self) -> String {
        self.f.network.ledger(BYTES_PER_ELEMENT)
    }

    /// (height, width) the network runs at (scaled and padded).
    pub fn network_size(&self) -> (usize, usize) {
        self.f.network_size()
    }

    pub fn frame_stats(&self) -> NeuralFrameStats {
        self.f
            .frame_stats(self.plan.arena_bytes, self.plan.peak_live_bytes)
    }

    /// Follows the temporal properties (see [`NetworkFrames::set_params`]).
    pub fn set_params(&mut self, params: NeuralTemporalParams) {
        if self.f.set_params(params) {
            self.f
                .temporal
                .smoother
                .set_smoothing(params.stat_smoothing);
        }
    }

    /// Forgets statistics, outputs and the scene reference (FLUSH, DISCONT, caps).
    pub fn reset(&mut self) {
        self.f.temporal.reset();
    }

    /// Stylizes one frame (the geometry of the configuration); with `lines` the classic DoG
    /// lines of those parameters are drawn over the result (`model-edges`).
    pub fn process(
        &mut self,
        input: &Nv12Frame,
        output: &mut Nv12FrameMut,
        lines: Option<&ToonParams>,
    ) -> Result<FrameReport, NeuralError> {
        let cut = self.f.begin(input)?;
        let f = &mut self.f;
        let result = if f.temporal.smoother.smoothing() > 0.0 {
            let mut hook = f.temporal.smoother.hook();
            f.network.run(&f.input, Some(&mut hook))?
        } else {
            f.network.run(&f.input, None)?
        };
        self.f.finish(cut, &result, output, lines)
    }
}
