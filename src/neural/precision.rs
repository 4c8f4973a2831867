//! Calibrated storage precision: which stage outputs the GPU path may store in fp16.
//!
//! `precision=fp16` means mixed precision, decided as the system toonflow descends from did it:
//! run a few calibration frames through the CPU reference (f32), record every stage output's
//! range and the magnitude of every normalization's per-channel statistics, then keep fp32
//! storage for a stage output when fp16 would
//! - **overflow**: its absolute maximum, times [`OVERFLOW_HEADROOM`] (the calibration frames are
//!   not every frame), reaches fp16's largest value 65504;
//! - **lose the variance**: a normalization divides it by its per-channel standard deviation,
//!   and fp16's rounding step at the channel's magnitude is no longer small against that
//!   deviation (a channel of mean 500 and deviation 0.01 is all rounding noise in fp16), i.e.
//!   the rounding noise after normalization exceeds [`VARIANCE_TOLERANCE`] of the normalized
//!   unit;
//! - **underflow**: its root-mean-square lies below fp16's smallest normal value (2^-14), where
//!   the relative step grows (a softmax over 32,400 positions at 1080p writes ~3e-5).
//!
//! A stage that would lose its variance only because its channels sit far from zero (a mean
//! of 0.45 against a deviation of 0.016) is stored in fp16 *centered* instead when the graph
//! allows it ([`super::center`]): as `x − c`, `c` the calibration frame's per-channel means,
//! subtracted in the producing convolution's bias and taken back where a reader needs it.
//!
//! Everything else is stored in fp16. Normalization statistics, and per-channel values derived
//! from them (`[N, C, 1, 1]` outputs such as √(var + eps)), are always fp32. Accumulation is always fp32;
//! this module decides storage only.
//!
//! [`calibrate`] drives the CPU engine; [`Calibrator`] is the recorder behind it, so another
//! executor (the GPU path in its fp32 mode) can feed it stage outputs and statistics itself.
//! [`PrecisionPlan::ledger`] prints one line per stage with its decision and the figures behind
//! it; [`emulate`] runs the CPU reference with every fp16 stage output rounded to fp16, which is
//! how the decisions are tested.

use std::borrow::Cow;
use std::collections::HashMap;

use super::NeuralError;
use super::engine::Specialised;
use super::lower::StageKind;
use super::tensor::{Tensor, Value};

/// fp16's largest finite value.
pub const FP16_MAX: f32 = 65504.0;
/// fp16's smallest normal value, 2^-14.
pub const FP16_MIN_NORMAL: f32 = 6.103_515_6e-5;
/// A stage output is fp32 when its calibrated absolute maximum times this reaches
/// [`FP16_MAX`]: two bits of headroom for frames brighter or busier than the calibration set.
pub const OVERFLOW_HEADROOM: f32 = 4.0;
/// A normalized stage output is fp32 when fp16's rounding noise (step/√12 at the channel's
/// root-mean-square), divided by the channel's standard deviation, exceeds this: 1/256 of the
/// normalized unit.
pub const VARIANCE_TOLERANCE: f32 = 1.0 / 256.0;
/// A centered stage ([`Reason::Centered`]) is checked as if each channel's mean had moved by
/// this share of its calibrated value on later frames: calibration sees one frame, and the
/// noise of a centered channel grows with the distance of its mean from the center. Across
/// four unrelated photos, centered on the first, hayao_class's channel means moved by at most
/// ~1/8 of their values; this is twice that.
pub const CENTER_DRIFT: f32 = 0.25;
/// The epsilon a normalization adds to the variance (AnimeGANv3's and InstanceNormalization's
/// default): a constant channel divides by √eps, not by 0.
pub const NORM_EPS: f32 = 1e-5;

/// How a stage output is stored in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoragePrecision {
    Fp16,
    Fp32,
}

impl StoragePrecision {
    pub fn bytes(self) -> u64 {
        match self {
            StoragePrecision::Fp16 => 2,
            StoragePrecision::Fp32 => 4,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            StoragePrecision::Fp16 => "fp16",
            StoragePrecision::Fp32 => "fp32",
        }
    }
}

/// Why a stage got its precision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reason {
    /// Calibrated: fp16 keeps its range and, where it is normalized, its variance.
    Fits,
    /// Calibrated absmax × [`OVERFLOW_HEADROOM`] ≥ [`FP16_MAX`].
    Overflow,
    /// fp16 rounding noise / channel deviation > [`VARIANCE_TOLERANCE`] (worst channel).
    Variance,
    /// As `Variance`, but stored in fp16 centered on the calibrated channel means
    /// ([`super::center`]), where the noise fits.
    Centered,
    /// Root-mean-square below [`FP16_MIN_NORMAL`] (and not all zero).
    Underflow,
    /// The stage writes normalization statistics or per-channel values derived from them:
    /// always fp32.
    Statistics,
    /// Not a float activation, or never observed: kept fp32.
    Unobserved,
    /// Set for every stage ([`PrecisionPlan::all`], e.g. `precision=fp32`).
    Uniform,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Fits => "fits fp16",
            Reason::Overflow => "overflow",
            Reason::Variance => "variance",
            Reason::Centered => "centered",
            Reason::Underflow => "underflow",
            Reason::Statistics => "statistics",
            Reason::Unobserved => "unobserved",
            Reason::Uniform => "uniform",
        }
    }
}

/// One stage's decision and the calibrated figures behind it.
#[derive(Debug, Clone, PartialEq)]
pub struct StageDecision {
    pub precision: StoragePrecision,
    pub reason: Reason,
    /// "conv", "normalize", ... (empty for a uniform plan).
    pub kind: &'static str,
    pub name: String,
    /// Largest |x| over the calibration frames (NaN when not observed).
    pub absmax: f32,
    /// Root-mean-square over the calibration frames (NaN when not observed).
    pub rms: f32,
    /// When a normalization reads this output: the worst channel's fp16 rounding noise over its
    /// standard deviation.
    pub norm_noise: Option<f32>,
    /// `Reason::Centered`: the per-channel values subtracted before storage (the calibration
    /// frame's channel means) and the worst normalized noise stored that way.
    pub center: Option<Vec<f32>>,
    pub centered_noise: Option<f32>,
}

/// Storage precision per stage output (one entry per lowered stage).
#[derive(Debug, Clone, PartialEq)]
pub struct PrecisionPlan {
    /// What the plan is for: model and size, or "uniform".
    pub label: String,
    /// Calibration frames seen (0 for a uniform plan).
    pub frames: usize,
    pub decisions: Vec<StageDecision>,
}

impl PrecisionPlan {
    /// Every one of `stages` stage outputs in `precision` (`precision=fp32`, or a first run
    /// before calibration).
    pub fn all(stages: usize, precision: StoragePrecision) -> Self {
        let decision = StageDecision {
            precision,
            reason: Reason::Uniform,
            kind: "",
            name: String::new(),
            absmax: f32::NAN,
            rms: f32::NAN,
            norm_noise: None,
            center: None,
            centered_noise: None,
        };
        PrecisionPlan {
            label: format!("uniform {}", precision.label()),
            frames: 0,
            decisions: vec![decision; stages],
        }
    }

    pub fn len(&self) -> usize {
        self.decisions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.decisions.is_empty()
    }

    /// Stage `i`'s output storage; fp32 for an index the plan does not cover.
    pub fn stage(&self, i: usize) -> StoragePrecision {
        self.decisions
            .get(i)
            .map_or(StoragePrecision::Fp32, |d| d.precision)
    }

    /// Bytes per element of stage `i`'s output.
    pub fn bytes_per_element(&self, i: usize) -> u64 {
        self.stage(i).bytes()
    }

    /// Per stage, the values its output is stored minus (`Reason::Centered`), for
    /// [`Specialised::centered`].
    pub fn centers(&self) -> Vec<Option<Vec<f32>>> {
        self.decisions.iter().map(|d| d.center.clone()).collect()
    }

    /// The network this plan stores: `spec` with its centered stages rewritten
    /// ([`super::center`]), or `spec` itself when none is centered.
    pub fn network<'a>(&self, spec: &'a Specialised) -> Result<Cow<'a, Specialised>, NeuralError> {
        if self.decisions.iter().all(|d| d.center.is_none()) {
            return Ok(Cow::Borrowed(spec));
        }
        Ok(Cow::Owned(spec.centered(&self.centers())?))
    }

    /// Stages stored in `precision`.
    pub fn count(&self, precision: StoragePrecision) -> usize {
        self.decisions
            .iter()
            .filter(|d| d.precision == precision)
            .count()
    }

    /// One line per stage: index, kind, precision, reason, absmax, rms, worst normalized noise,
    /// name.
    pub fn ledger_lines(&self) -> Vec<String> {
        let sci = |v: f32| {
            if v.is_nan() {
                "-".to_string()
            } else {
                format!("{v:.2e}")
            }
        };
        self.decisions
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let mut noise = d.norm_noise.map_or("-".to_string(), |n| format!("{n:.1e}"));
                if let Some(c) = d.centered_noise.filter(|_| d.reason == Reason::Centered) {
                    noise = format!("{noise} -> {c:.1e}");
                }
                format!(
                    "  stage {i:>3} {:<11} {}  {:<10}  absmax {:>9}  rms {:>9}  norm noise {:>7}  {}",
                    d.kind,
                    d.precision.label(),
                    d.reason.label(),
                    sci(d.absmax),
                    sci(d.rms),
                    noise,
                    d.name
                )
            })
            .collect()
    }

    /// A header, [`ledger_lines`](Self::ledger_lines) and the counts.
    pub fn ledger(&self) -> String {
        let mut s = format!(
            "precision plan of {} ({} stages, {} calibration frames; fp32 when absmax x{} \
             >= {FP16_MAX}, normalized noise > 1/{:.0} (centered on the channel means where the \
             graph allows), or rms < 2^-14):\n",
            self.label,
            self.len(),
            self.frames,
            OVERFLOW_HEADROOM,
            1.0 / VARIANCE_TOLERANCE
        );
        for l in self.ledger_lines() {
            s.push_str(&l);
            s.push('\n');
        }
        s.push_str(&format!(
            "  {} stages fp16, {} fp32\n",
            self.count(StoragePrecision::Fp16),
            self.count(StoragePrecision::Fp32)
        ));
        s
    }
}

/// fp16's rounding noise (step/√12) at the root-mean-square of a channel of mean `mean` and
/// variance `var`, over the channel's standard deviation (what the normalization after it
/// sees).
fn normalized_noise(mean: f32, var: f32) -> f32 {
    let var = var.max(0.0);
    let rms = (mean * mean + var).sqrt();
    fp16_step(rms) / 12f32.sqrt() / (var + NORM_EPS).sqrt()
}

/// fp16's rounding step at magnitude `m` (the spacing of fp16 values there).
pub fn fp16_step(m: f32) -> f32 {
    let m = m.abs();
    if m < FP16_MIN_NORMAL {
        return f32::from_bits(0x3380_0000); // 2^-24, the subnormal spacing
    }
    let exponent = (((m.to_bits() >> 23) & 0xff) as i32 - 127).min(15);
    2f32.powi(exponent - 10)
}

/// `x` rounded to the nearest fp16 value (ties to even), as f32: what storing it in fp16 and
/// reading it back gives. Overflow gives ±infinity, NaN stays NaN.
pub fn round_to_fp16(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let step = fp16_step(x);
    // x / step and back are exact (powers of two, within f32's range)
    let r = (x / step).round_ties_even() * step;
    if r.abs() > FP16_MAX {
        f32::INFINITY.copysign(x)
    } else {
        r
    }
}

/// The IEEE half bits of `x` rounded to fp16 as [`round_to_fp16`] rounds it (what the device
/// stores for it).
pub fn fp16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7e00;
    }
    let r = round_to_fp16(x);
    let sign = ((r.to_bits() >> 16) & 0x8000) as u16;
    let m = r.abs();
    if m.is_infinite() {
        return sign | 0x7c00;
    }
    if m < FP16_MIN_NORMAL {
        // a multiple of 2^-24 below 2^-14: exact
        return sign | (m * 2f32.powi(24)) as u16;
    }
    let bits = m.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    sign | ((exponent as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
}

/// The value of IEEE half bits, as f32 (exact).
pub fn fp16_value(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let frac = (h & 0x3ff) as f32;
    match exp {
        0 => sign * frac * 2f32.powi(-24),
        31 if frac == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        e => sign * (1.0 + frac / 1024.0) * 2f32.powi(e - 15),
    }
}

/// Running figures of one stage output.
#[derive(Debug, Clone, Copy, Default)]
struct Range {
    seen: bool,
    float: bool,
    /// A NaN or infinity was written (already out of range in f32).
    non_finite: bool,
    absmax: f32,
    sum_squares: f64,
    count: u64,
}

impl Range {
    fn record(&mut self, data: &[f32]) {
        self.merge(&OutputRange::of(data));
    }

    fn merge(&mut self, r: &OutputRange) {
        if !self.seen {
            self.float = true;
        }
        self.seen = true;
        self.absmax = self.absmax.max(r.absmax);
        self.sum_squares += r.sum_squares;
        self.count += r.count;
        self.non_finite |= r.non_finite > 0;
    }
}

/// What calibration keeps of one stage output: its finite values' largest magnitude and sum
/// of squares, how many values it has and how many are not finite. An executor may reduce a
/// tensor to this where it lives (the GPU's `nn_range`) and hand over only these.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OutputRange {
    pub absmax: f32,
    pub sum_squares: f64,
    pub count: u64,
    pub non_finite: u64,
}

impl OutputRange {
    pub fn of(data: &[f32]) -> Self {
        let mut r = OutputRange {
            count: data.len() as u64,
            ..OutputRange::default()
        };
        for &v in data {
            if v.is_finite() {
                r.absmax = r.absmax.max(v.abs());
                r.sum_squares += f64::from(v) * f64::from(v);
            } else {
                r.non_finite += 1;
            }
        }
        r
    }
}

/// What calibration sees of a stage its graph lets be stored centered.
#[derive(Debug, Clone, Default)]
struct CenteredRecord {
    /// The first calibration frame's channel means.
    center: Option<Vec<f32>>,
    /// The worst normalized noise stored minus `center`, drift included.
    noise: Option<f32>,
    /// Sum over channels and frames of the centered mean square, and how many values it has.
    squares: f64,
    values: usize,
}

/// Records stage outputs and normalization statistics over calibration frames, then decides.
/// [`calibrate`] feeds it from the CPU engine; another executor can feed it the same way
/// (stage outputs in any layout: only magnitudes are recorded).
#[derive(Debug, Clone)]
pub struct Calibrator {
    label: String,
    kinds: Vec<&'static str>,
    names: Vec<String>,
    /// Stage writing statistics only (mean/variance of a moments pattern).
    statistics_only: Vec<bool>,
    /// Value name → (stage that writes it).
    producer: HashMap<String, usize>,
    /// Normalize index → the stage whose output it normalizes (None: the network's input).
    normalized_producer: Vec<Option<usize>>,
    ranges: Vec<Range>,
    /// Per stage: the worst normalized fp16 noise seen through the statistics.
    norm_noise: Vec<Option<f32>>,
    /// Per stage: what centering it would give, `None` where the graph does not let its output
    /// be stored centered.
    centered: Vec<Option<CenteredRecord>>,
    centering: bool,
    frames: usize,
}

impl Calibrator {
    pub fn new(spec: &Specialised) -> Self {
        let lowered = spec.lowered();
        let stages = &lowered.stages;
        let mut producer = HashMap::new();
        for (i, s) in stages.iter().enumerate() {
            for o in &s.outputs {
                producer.insert(o.clone(), i);
            }
        }
        let mut normalized_producer = vec![None; lowered.normalize_channels.len()];
        for s in stages {
            if let Some(st) = &s.stats
                && let Some(slot) = normalized_producer.get_mut(st.index)
            {
                *slot = producer.get(&st.input).copied();
            }
        }
        // statistics, and per-channel values derived from them ([N, C, 1, 1]: √(var + eps),
        // scales), are always fp32: they are tiny and every pixel of a channel reads them
        let per_channel = |v: &String| {
            lowered
                .shapes
                .get(v)
                .is_some_and(|s| s.len() >= 3 && s[2..].iter().product::<usize>() == 1)
        };
        let statistics_only = stages
            .iter()
            .map(|s| {
                let moments = s.kind == StageKind::Normalize
                    && s.stats.as_ref().is_some_and(|st| st.instance.is_none());
                moments || (!s.outputs.is_empty() && s.outputs.iter().all(per_channel))
            })
            .collect();
        let [_, a, b, c] = spec.input_shape();
        let size = if a == 3 {
            format!("{c}x{b}")
        } else {
            format!("{b}x{a}")
        };
        Calibrator {
            label: format!("{} {size}", spec.model_name()),
            kinds: stages.iter().map(|s| s.kind.label()).collect(),
            names: stages.iter().map(|s| s.name.clone()).collect(),
            statistics_only,
            producer,
            normalized_producer,
            ranges: vec![Range::default(); stages.len()],
            norm_noise: vec![None; stages.len()],
            centered: super::center::centerable(lowered)
                .into_iter()
                .map(|c| c.then(CenteredRecord::default))
                .collect(),
            centering: true,
            frames: 0,
        }
    }

    /// Decides without centered storage (a stage losing its variance stays fp32), for
    /// comparisons (`TOONFLOW_NEURAL_CENTER=0` in the element).
    pub fn without_centering(mut self) -> Self {
        self.centering = false;
        self
    }

    /// Counts one calibration frame (call once per frame, before or after its records).
    pub fn frame_done(&mut self) {
        self.frames += 1;
    }

    /// Stage `stage` wrote `value` (any float layout).
    pub fn record_output(&mut self, stage: usize, value: &Value) {
        match value {
            Value::Float(t) => self.record_output_data(stage, &t.data),
            Value::Int(_) => {
                if let Some(r) = self.ranges.get_mut(stage) {
                    r.seen = true;
                    r.float = false;
                }
            }
        }
    }

    /// Stage `stage` wrote `data` (f32 values, e.g. read back from another executor).
    pub fn record_output_data(&mut self, stage: usize, data: &[f32]) {
        if let Some(r) = self.ranges.get_mut(stage) {
            r.record(data);
        }
    }

    /// Stage `stage` wrote values of these magnitudes (`OutputRange::of` them, reduced where
    /// they were computed): the same record as [`record_output_data`](Self::record_output_data).
    pub fn record_output_range(&mut self, stage: usize, range: &OutputRange) {
        if let Some(r) = self.ranges.get_mut(stage) {
            r.merge(range);
        }
    }

    /// Normalization `index` computed these per-channel statistics of its input.
    pub fn record_stats(&mut self, index: usize, mean: &[f32], var: &[f32]) {
        let Some(&Some(stage)) = self.normalized_producer.get(index) else {
            return;
        };
        let worst = mean
            .iter()
            .zip(var)
            .map(|(&m, &v)| normalized_noise(m, v))
            .fold(0.0f32, f32::max);
        let slot = &mut self.norm_noise[stage];
        *slot = Some(slot.map_or(worst, |w| w.max(worst)));
        let Some(record) = &mut self.centered[stage] else {
            return;
        };
        let center = record.center.get_or_insert_with(|| mean.to_vec());
        if center.len() != mean.len() {
            self.centered[stage] = None;
            return;
        }
        for ((&m, &v), &c) in mean.iter().zip(var).zip(center.iter()) {
            // as if the channel's mean had moved by CENTER_DRIFT of its calibrated value
            let noise = normalized_noise((m - c).abs() + CENTER_DRIFT * c.abs(), v);
            record.noise = Some(record.noise.map_or(noise, |w| w.max(noise)));
            record.squares += f64::from(m - c).powi(2) + f64::from(v.max(0.0));
        }
        record.values += mean.len();
    }

    /// The decision per stage from what was recorded.
    pub fn finish(&self) -> PrecisionPlan {
        let decisions = (0..self.ranges.len())
            .map(|i| {
                let r = self.ranges[i];
                let rms = if r.count > 0 {
                    (r.sum_squares / r.count as f64).sqrt() as f32
                } else {
                    f32::NAN
                };
                let (absmax, rms) = if r.seen && r.float {
                    (r.absmax, rms)
                } else {
                    (f32::NAN, f32::NAN)
                };
                let noise = self.norm_noise[i];
                let reason = if self.statistics_only[i] {
                    Reason::Statistics
                } else if !r.seen || !r.float || r.count == 0 {
                    Reason::Unobserved
                } else if r.non_finite || absmax * OVERFLOW_HEADROOM >= FP16_MAX {
                    Reason::Overflow
                } else if noise.is_some_and(|n| n > VARIANCE_TOLERANCE) {
                    if self.centering && self.centered_fits(i, absmax) {
                        Reason::Centered
                    } else {
                        Reason::Variance
                    }
                } else if rms < FP16_MIN_NORMAL && absmax > 0.0 {
                    Reason::Underflow
                } else {
                    Reason::Fits
                };
                StageDecision {
                    precision: if matches!(reason, Reason::Fits | Reason::Centered) {
                        StoragePrecision::Fp16
                    } else {
                        StoragePrecision::Fp32
                    },
                    reason,
                    kind: self.kinds[i],
                    name: self.names[i].clone(),
                    absmax,
                    rms,
                    norm_noise: noise,
                    center: (reason == Reason::Centered)
                        .then(|| self.centered[i].as_ref().and_then(|r| r.center.clone()))
                        .flatten(),
                    centered_noise: self.centered[i].as_ref().and_then(|r| r.noise),
                }
            })
            .collect();
        PrecisionPlan {
            label: self.label.clone(),
            frames: self.frames,
            decisions,
        }
    }

    /// Whether stage `i` (of calibrated largest magnitude `absmax`) fits fp16 centered: its
    /// normalized noise does, `absmax` plus the largest center keeps the overflow headroom,
    /// and the centered values are not below fp16's normal range.
    fn centered_fits(&self, i: usize, absmax: f32) -> bool {
        let Some(CenteredRecord {
            center: Some(center),
            noise: Some(noise),
            squares,
            values,
        }) = &self.centered[i]
        else {
            return false;
        };
        let rms = (squares / (*values).max(1) as f64).sqrt() as f32;
        let shift = center.iter().fold(0.0f32, |a, c| a.max(c.abs()));
        *noise <= VARIANCE_TOLERANCE
            && (absmax + shift) * OVERFLOW_HEADROOM < FP16_MAX
            && rms >= FP16_MIN_NORMAL
    }

    /// The stage writing `value`, if a stage does.
    pub fn producer_of(&self, value: &str) -> Option<usize> {
        self.producer.get(value).copied()
    }
}

/// Runs `frames` (the model's layout and value range, the specialised size) through the CPU
/// reference and decides each stage's storage precision.
pub fn calibrate(spec: &Specialised, frames: &[Tensor<f32>]) -> Result<PrecisionPlan, NeuralError> {
    calibrate_with(Calibrator::new(spec), spec, frames)
}

/// [`calibrate`] with a calibrator of the caller's (e.g. [`Calibrator::without_centering`]).
pub fn calibrate_with(
    mut calibrator: Calibrator,
    spec: &Specialised,
    frames: &[Tensor<f32>],
) -> Result<PrecisionPlan, NeuralError> {
    if frames.is_empty() {
        return Err(NeuralError::Model(format!(
            "calibrating '{}' needs at least one frame",
            spec.model_name()
        )));
    }
    for frame in frames {
        let stats = std::cell::RefCell::new(Vec::new());
        let mut hook = |index: usize, mean: &mut [f32], var: &mut [f32]| {
            stats
                .borrow_mut()
                .push((index, mean.to_vec(), var.to_vec()));
        };
        let mut observe = |stage: usize, _name: &str, value: &mut Value| {
            calibrator.record_output(stage, value);
        };
        spec.run_observed(frame, Some(&mut hook), Some(&mut observe))?;
        for (index, mean, var) in stats.into_inner() {
            calibrator.record_stats(index, &mean, &var);
        }
        calibrator.frame_done();
    }
    Ok(calibrator.finish())
}

/// The CPU reference with every stage output the plan stores in fp16 rounded to fp16 before
/// later stages read it (statistics and accumulation stay f32): what the plan's storage costs
/// in accuracy, without a GPU.
pub fn emulate(
    spec: &Specialised,
    plan: &PrecisionPlan,
    input: &Tensor<f32>,
) -> Result<Tensor<f32>, NeuralError> {
    if plan.len() != spec.stage_count() {
        return Err(NeuralError::Model(format!(
            "precision plan of {} stages for '{}', which has {}",
            plan.len(),
            spec.model_name(),
            spec.stage_count()
        )));
    }
    let network = plan.network(spec)?;
    let mut round = |stage: usize, _name: &str, value: &mut Value| {
        if plan.stage(stage) == StoragePrecision::Fp16
            && let Value::Float(t) = value
        {
            t.data.iter_mut().for_each(|v| *v = round_to_fp16(*v));
        }
    };
    network.run_observed(input, None, Some(&mut round))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::neural::engine::NeuralModel;
    use crate::neural::onnx::*;

    #[test]
    fn fp16_bits_round_trip_through_the_value() {
        for (x, bits) in [
            (0.0f32, 0x0000u16),
            (-0.0, 0x8000),
            (1.0, 0x3c00),
            (-2.0, 0xc000),
            (0.1, 0x2e66),
            (65504.0, 0x7bff),
            (65520.0, 0x7c00),
            (-1e6, 0xfc00),
            (5.960_464_5e-8, 0x0001),
            (6.097_555e-5, 0x03ff),
            (6.103_515_6e-5, 0x0400),
        ] {
            assert_eq!(fp16_bits(x), bits, "{x}");
            assert_eq!(fp16_value(bits), round_to_fp16(x), "{x}");
        }
        assert!(fp16_value(fp16_bits(f32::NAN)).is_nan());
        // every finite half survives value -> bits
        for h in (0u16..=0xffff).filter(|h| h & 0x7c00 != 0x7c00) {
            assert_eq!(fp16_bits(fp16_value(h)), h, "{h:#06x}");
        }
        // and an f32 between two halves lands where round_to_fp16 says
        let mut x = -3.0f32;
        while x < 3.0 {
            assert_eq!(fp16_value(fp16_bits(x)), round_to_fp16(x), "{x}");
            x += 0.000_123_7;
        }
    }

    #[test]
    fn fp16_rounding_matches_the_format() {
        assert_eq!(round_to_fp16(1.0), 1.0);
        assert_eq!(round_to_fp16(0.1), 0.099_975_586);
        assert_eq!(round_to_fp16(-2049.0), -2048.0); // tie to even
        assert_eq!(round_to_fp16(2051.0), 2052.0);
        assert_eq!(round_to_fp16(65504.0), 65504.0);
        assert_eq!(round_to_fp16(65519.0), 65504.0);
        assert_eq!(round_to_fp16(65520.0), f32::INFINITY);
        assert_eq!(round_to_fp16(-1e6), f32::NEG_INFINITY);
        assert_eq!(round_to_fp16(5.960_464_5e-8), 5.960_464_5e-8); // smallest subnormal
        assert_eq!(round_to_fp16(2e-8), 0.0);
        assert_eq!(round_to_fp16(1e-6), 1.013_279e-6); // 17 subnormal steps
        assert!(round_to_fp16(f32::NAN).is_nan());
        // every fp16 value survives; f16_to_f32 decodes the format independently
        for bits in (0u16..0x7c00).step_by(7) {
            let v = f16_to_f32(bits);
            assert_eq!(round_to_fp16(v), v, "bits {bits:#x}");
            assert_eq!(round_to_fp16(-v), -v);
        }
        assert_eq!(fp16_step(1.0), 2f32.powi(-10));
        assert_eq!(fp16_step(500.0), 0.25);
    }

    /// NCHW `[1, 3, H, W]` → `body` → `[1, 3, H, W]`.
    fn model_of(nodes: Vec<NodeProto>, inits: Vec<TensorProto>, output: &str) -> NeuralModel {
        crate::neural::engine::nchw_test_model("precision_test", nodes, inits, output)
    }

    /// A 1x1 conv `cin → cout`: every weight `w`, every bias `b`.
    fn conv1x1(
        x: &str,
        out: &str,
        cin: usize,
        cout: usize,
        w: f32,
        b: f32,
    ) -> (NodeProto, Vec<TensorProto>) {
        let (wn, bn) = (format!("{out}_w"), format!("{out}_b"));
        (
            node(
                "Conv",
                &[x, &wn, &bn],
                &[out],
                vec![attr_ints("kernel_shape", &[1, 1])],
            ),
            vec![
                float_tensor(&wn, &[cout as i64, cin as i64, 1, 1], &vec![w; cin * cout]),
                float_tensor(&bn, &[cout as i64], &vec![b; cout]),
            ],
        )
    }

    fn frames(n: usize, h: usize, w: usize) -> Vec<Tensor<f32>> {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        (0..n)
            .map(|_| {
                let data = (0..3 * h * w)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                    })
                    .collect();
                Tensor::new(vec![1, 3, h, w], data)
            })
            .collect()
    }

    fn max_diff(a: &Tensor<f32>, b: &Tensor<f32>) -> f32 {
        a.data
            .iter()
            .zip(&b.data)
            .map(|(x, y)| {
                if x.is_finite() && y.is_finite() {
                    (x - y).abs()
                } else {
                    f32::INFINITY
                }
            })
            .fold(0.0, f32::max)
    }

    /// The stage writing `value`.
    fn stage_of(spec: &Specialised, value: &str) -> usize {
        spec.lowered()
            .stage_writing(value)
            .unwrap_or_else(|| panic!("no stage writes {value}"))
    }

    /// Checks the calibrated plan against fp32 and all-fp16 under emulation; returns
    /// (calibrated error, all-fp16 error).
    fn errors(spec: &Specialised, plan: &PrecisionPlan, input: &Tensor<f32>) -> (f32, f32) {
        let exact = spec.run(input, None).unwrap();
        let calibrated = emulate(spec, plan, input).unwrap();
        let fp16 = emulate(
            spec,
            &PrecisionPlan::all(spec.stage_count(), StoragePrecision::Fp16),
            input,
        )
        .unwrap();
        (max_diff(&exact, &calibrated), max_diff(&exact, &fp16))
    }

    #[test]
    fn an_output_range_keeps_the_finite_values_and_counts_the_rest() {
        let r = OutputRange::of(&[1.0, -3.0, f32::NAN, f32::INFINITY, 2.0, f32::NEG_INFINITY]);
        assert_eq!(r.absmax, 3.0);
        assert_eq!(r.sum_squares, 14.0);
        assert_eq!((r.count, r.non_finite), (6, 3));
    }

    #[test]
    fn a_stage_beyond_the_fp16_range_is_fp32() {
        // 3 → 4 channels with weights 30000: |x| up to 90000 → fp16 infinity; then back to
        // ~[-1, 1] by weights 1e-5
        let (c1, mut w) = conv1x1("input", "big", 3, 4, 30000.0, 0.0);
        let (c2, w2) = conv1x1("big", "output", 4, 3, 1e-5, 0.0);
        w.extend(w2);
        let spec = model_of(vec![c1, c2], w, "output")
            .specialise(8, 8)
            .unwrap();
        let f = frames(2, 8, 8);
        let plan = calibrate(&spec, &f).unwrap();
        print!("{}", plan.ledger());
        let (big, out) = (stage_of(&spec, "big"), stage_of(&spec, "output"));
        assert_eq!(plan.stage(big), StoragePrecision::Fp32);
        assert_eq!(plan.decisions[big].reason, Reason::Overflow);
        assert!(plan.decisions[big].absmax > 20000.0);
        assert_eq!(plan.stage(out), StoragePrecision::Fp16);
        assert_eq!(plan.decisions[out].reason, Reason::Fits);
        assert_eq!(plan.frames, 2);
        let (calibrated, fp16) = errors(&spec, &plan, &f[0]);
        println!("overflow model: calibrated max error {calibrated:e}, all-fp16 {fp16:e}");
        assert!(calibrated < 2e-3, "calibrated {calibrated}");
        assert!(fp16.is_infinite(), "all-fp16 should overflow, error {fp16}");
        // the ledger names the decision on the stage's line
        let line = &plan.ledger_lines()[big];
        assert!(line.contains("fp32") && line.contains("overflow"), "{line}");
    }

    /// x → conv 1x1 (identity × `gain`, bias `bias`) → normalized by its own per-channel
    /// statistics (AnimeGANv3's GlobalAveragePool/Sub/Mul/GlobalAveragePool/Add/Sqrt/Div).
    fn normalized_model(gain: f32, bias: f32) -> NeuralModel {
        let (w, b) = ("g_w", "g_b");
        let mut eye = vec![0.0f32; 9];
        for c in 0..3 {
            eye[c * 4] = gain;
        }
        let inits = vec![
            float_tensor(w, &[3, 3, 1, 1], &eye),
            float_tensor(b, &[3], &[bias; 3]),
            float_tensor("eps", &[1, 1, 1, 1], &[1e-5]),
        ];
        let nodes = vec![
            node(
                "Conv",
                &["input", w, b],
                &["a"],
                vec![attr_ints("kernel_shape", &[1, 1])],
            ),
            node("GlobalAveragePool", &["a"], &["mean"], vec![]),
            node("Sub", &["a", "mean"], &["d"], vec![]),
            node("Mul", &["d", "d"], &["sq"], vec![]),
            node("GlobalAveragePool", &["sq"], &["var"], vec![]),
            node("Add", &["var", "eps"], &["ve"], vec![]),
            node("Sqrt", &["ve"], &["std"], vec![]),
            node("Div", &["d", "std"], &["output"], vec![]),
        ];
        model_of(nodes, inits, "output")
    }

    #[test]
    fn a_normalized_stage_whose_variance_fp16_cannot_resolve_is_centered_or_fp32() {
        // mean 500, deviation ~0.006: fp16's step at 500 is 0.25
        let spec = normalized_model(0.01, 500.0).specialise(16, 16).unwrap();
        let f = frames(2, 16, 16);
        let plan = calibrate_with(Calibrator::new(&spec).without_centering(), &spec, &f).unwrap();
        print!("{}", plan.ledger());
        let a = stage_of(&spec, "a");
        assert_eq!(plan.stage(a), StoragePrecision::Fp32);
        assert_eq!(plan.decisions[a].reason, Reason::Variance);
        assert!(plan.decisions[a].norm_noise.unwrap() > 1.0);
        // a plan without centered stages runs the network as it is
        assert!(matches!(plan.network(&spec).unwrap(), Cow::Borrowed(_)));
        // the statistics stage is fp32, whatever the data
        let stats: Vec<&StageDecision> = plan
            .decisions
            .iter()
            .filter(|d| d.reason == Reason::Statistics)
            .collect();
        // the moments and √(var + eps)
        assert_eq!(stats.len(), 2, "{}", plan.ledger());
        assert!(stats.iter().all(|d| d.precision == StoragePrecision::Fp32));
        assert!(plan.count(StoragePrecision::Fp16) >= 1, "{}", plan.ledger());
        let (calibrated, fp16) = errors(&spec, &plan, &f[1]);
        println!("variance model: calibrated max error {calibrated:e}, all-fp16 {fp16:e}");
        assert!(calibrated < 1e-2, "calibrated {calibrated}");
        assert!(fp16 > 0.5, "all-fp16 error {fp16}");

        // centering cannot help a deviation this far below the mean: a drift of
        // CENTER_DRIFT of the mean on a later frame would bring the noise back
        let default = calibrate(&spec, &f).unwrap();
        assert_eq!(default.decisions[a].reason, Reason::Variance);
        assert!(default.decisions[a].centered_noise.unwrap() > VARIANCE_TOLERANCE);

        // mean 0.45, deviation ~0.012 (hayao_class's worst channels): fp16's noise is 1.5
        // times the tolerance, centered on the first frame's channel means (the Sub and the
        // moments are its only readers) a quarter of it, drift included
        let spec = normalized_model(0.02, 0.45).specialise(16, 16).unwrap();
        let fp32 = calibrate_with(Calibrator::new(&spec).without_centering(), &spec, &f).unwrap();
        assert_eq!(
            fp32.decisions[a].reason,
            Reason::Variance,
            "{}",
            fp32.ledger()
        );
        assert!(fp32.centers().iter().all(Option::is_none));
        let centered = calibrate(&spec, &f).unwrap();
        print!("{}", centered.ledger());
        let d = &centered.decisions[a];
        assert_eq!(
            (d.precision, d.reason),
            (StoragePrecision::Fp16, Reason::Centered)
        );
        assert!(
            d.centered_noise.unwrap() < VARIANCE_TOLERANCE,
            "{}",
            centered.ledger()
        );
        let c = d.center.as_ref().unwrap();
        assert!(c.iter().all(|&m| (m - 0.45).abs() < 0.01), "{c:?}");
        let line = &centered.ledger_lines()[a];
        assert!(line.contains("centered") && line.contains("->"), "{line}");
        let (centered_error, fp16) = errors(&spec, &centered, &f[1]);
        let (fp32_error, _) = errors(&spec, &fp32, &f[1]);
        println!(
            "centered: max error {centered_error:e} (fp32 kept {fp32_error:e}, all-fp16 {fp16:e})"
        );
        assert!(
            centered_error < fp16 / 4.0,
            "centered {centered_error}, fp16 {fp16}"
        );

        // the same network on a well-scaled activation stores it in fp16
        let spec = normalized_model(1.0, 0.5).specialise(16, 16).unwrap();
        let plan = calibrate(&spec, &f).unwrap();
        let a = stage_of(&spec, "a");
        assert_eq!(plan.stage(a), StoragePrecision::Fp16, "{}", plan.ledger());
        assert!(plan.decisions[a].norm_noise.unwrap() < VARIANCE_TOLERANCE);
        let (calibrated, _) = errors(&spec, &plan, &f[1]);
        assert!(calibrated < 1e-2, "calibrated {calibrated}");
    }

    #[test]
    fn a_stage_below_fp16_normals_is_fp32() {
        // weights 1e-7: |x| ~ 3e-7, a few subnormal steps of fp16
        let (c1, mut w) = conv1x1("input", "tiny", 3, 4, 1e-7, 0.0);
        let (c2, w2) = conv1x1("tiny", "output", 4, 3, 1e6, 0.0);
        w.extend(w2);
        let spec = model_of(vec![c1, c2], w, "output")
            .specialise(8, 8)
            .unwrap();
        let f = frames(1, 8, 8);
        let plan = calibrate(&spec, &f).unwrap();
        let tiny = stage_of(&spec, "tiny");
        assert_eq!(
            plan.decisions[tiny].reason,
            Reason::Underflow,
            "{}",
            plan.ledger()
        );
        assert_eq!(
            plan.stage(stage_of(&spec, "output")),
            StoragePrecision::Fp16
        );
        let (calibrated, fp16) = errors(&spec, &plan, &f[0]);
        println!("underflow model: calibrated max error {calibrated:e}, all-fp16 {fp16:e}");
        assert!(calibrated < 2e-3 && fp16 > 2e-2, "{calibrated} {fp16}");
    }

    #[test]
    fn another_executor_feeding_the_calibrator_gets_the_same_plan() {
        // what the GPU path does: its own fp32 stage outputs (as plain f32 slices) and its own
        // statistics, stage by stage, frame by frame
        let spec = normalized_model(0.01, 500.0).specialise(16, 16).unwrap();
        let f = frames(2, 16, 16);
        let mut calibrator = Calibrator::new(&spec);
        for frame in &f {
            let mut outputs: Vec<(usize, Vec<f32>)> = Vec::new();
            let mut stats: Vec<(usize, Vec<f32>, Vec<f32>)> = Vec::new();
            let mut hook =
                |i: usize, m: &mut [f32], v: &mut [f32]| stats.push((i, m.to_vec(), v.to_vec()));
            let mut observe = |stage: usize, _: &str, v: &mut Value| {
                if let Value::Float(t) = v {
                    outputs.push((stage, t.data.clone()));
                }
            };
            spec.run_observed(frame, Some(&mut hook), Some(&mut observe))
                .unwrap();
            for (stage, data) in &outputs {
                calibrator.record_output_data(*stage, data);
            }
            for (i, m, v) in &stats {
                calibrator.record_stats(*i, m, v);
            }
            calibrator.frame_done();
        }
        let a = stage_of(&spec, "a");
        assert_eq!(calibrator.producer_of("a"), Some(a));
        assert_eq!(calibrator.finish(), calibrate(&spec, &f).unwrap());
        // out-of-range indices are ignored, not a panic
        calibrator.record_output_data(999, &[1e9]);
        calibrator.record_stats(999, &[1.0], &[0.0]);
        assert_eq!(calibrator.finish(), calibrate(&spec, &f).unwrap());
    }

    #[test]
    fn uniform_plans_and_bad_calls() {
        let spec = normalized_model(1.0, 0.0).specialise(8, 8).unwrap();
        let n = spec.stage_count();
        let plan = PrecisionPlan::all(n, StoragePrecision::Fp32);
        assert_eq!(plan.count(StoragePrecision::Fp32), n);
        assert_eq!(plan.stage(n + 5), StoragePrecision::Fp32);
        assert_eq!(plan.bytes_per_element(0), 4);
        assert_eq!(plan.ledger_lines().len(), n);
        // fp32 emulation is the reference itself
        let f = frames(1, 8, 8);
        assert_eq!(
            emulate(&spec, &plan, &f[0]).unwrap(),
            spec.run(&f[0], None).unwrap()
        );
        let err = calibrate(&spec, &[]).unwrap_err();
        assert!(err.to_string().contains("at least one frame"), "{err}");
        let wrong = frames(1, 16, 16);
        assert!(calibrate(&spec, &wrong).is_err());
        let short = PrecisionPlan::all(n - 1, StoragePrecision::Fp16);
        assert!(
            emulate(&spec, &short, &f[0])
                .unwrap_err()
                .to_string()
                .contains("stages")
        );
    }
}
