//! The counters behind the `stats` property and the `toonflow-stats` element message.

use crate::cuda::GpuFrameStats;
use crate::pipeline::FrameGeometry;
use crate::pipeline::stats::TimeWindow;

use super::engine::FrameOutcome;
use super::neural_cpu::NeuralFrameStats;

/// Frames kept for the latency percentiles.
const TIME_WINDOW: usize = 1024;

/// Running statistics of one element instance, reset at start.
pub struct Stats {
    backend: &'static str,
    frames: u64,
    /// Frames skipped as late (QoS) before they were processed.
    dropped: u64,
    /// Frames that went through the overlap path (queued, pushed by the push thread).
    queued: u64,
    scene_cuts: u64,
    last_scene_score: f32,
    history_used: usize,
    width: u32,
    height: u32,
    times: TimeWindow,
    gpu: GpuFrameStats,
    /// The model's name in neural mode ("" for the classic pipeline).
    model: String,
    neural: NeuralFrameStats,
}

impl Default for Stats {
    fn default() -> Self {
        Stats::new("none")
    }
}

impl Stats {
    pub fn new(backend: &'static str) -> Self {
        Stats {
            backend,
            frames: 0,
            dropped: 0,
            queued: 0,
            scene_cuts: 0,
            last_scene_score: 0.0,
            history_used: 0,
            width: 0,
            height: 0,
            times: TimeWindow::new(TIME_WINDOW),
            gpu: GpuFrameStats::default(),
            model: String::new(),
            neural: NeuralFrameStats::default(),
        }
    }

    /// The backend now running (it changes when CUDA falls back to the CPU).
    pub fn set_backend(&mut self, backend: &'static str) {
        self.backend = backend;
    }

    /// The model in use (neural mode).
    pub fn set_model(&mut self, name: &str) {
        self.model = name.to_string();
    }

    /// Counts one processed frame, with its time when known here (the overlap path's push
    /// thread gives it later, [`record_time`](Self::record_time)). Returns whether a
    /// `toonflow-stats` message is due after it (`interval` > 0 and the frame count a multiple
    /// of it).
    pub fn record(
        &mut self,
        outcome: &FrameOutcome,
        elapsed_us: Option<f64>,
        geometry: FrameGeometry,
        interval: u32,
    ) -> bool {
        let report = &outcome.report;
        self.frames += 1;
        self.scene_cuts += report.scene_cut as u64;
        self.last_scene_score = report.scene_score;
        self.history_used = report.history_used;
        self.width = geometry.width as u32;
        self.height = geometry.height as u32;
        match elapsed_us {
            Some(us) => self.times.push(us),
            None => self.queued += 1,
        }
        if let Some(gpu) = outcome.gpu {
            self.gpu = gpu;
        }
        if let Some(neural) = outcome.neural {
            self.neural = neural;
        }
        interval > 0 && self.frames.is_multiple_of(interval as u64)
    }

    /// A frame's time from its arrival to its completion (the overlap path's push thread).
    pub fn record_time(&mut self, elapsed_us: f64) {
        self.times.push(elapsed_us);
    }

    /// Counts one frame skipped as late (QoS).
    pub fn record_dropped(&mut self) {
        self.dropped += 1;
    }

    /// The `toonflow-stats` structure (the property's value and the message's body).
    pub fn snapshot(&mut self) -> gst::Structure {
        let [p50, p99] = self.times.percentiles([50.0, 99.0]);
        gst::Structure::builder("toonflow-stats")
            .field("backend", self.backend)
            .field("frames", self.frames)
            .field("dropped", self.dropped)
            .field("frames-queued", self.queued)
            .field("scene-cuts", self.scene_cuts)
            .field("last-scene-score", self.last_scene_score as f64)
            .field("history-used", self.history_used as u32)
            .field("width", self.width)
            .field("height", self.height)
            .field("mean-us", self.times.mean())
            .field("p50-us", p50)
            .field("p99-us", p99)
            .field("gpu-time-us", self.gpu.gpu_time_us)
            .field("transfer-time-us", self.gpu.transfer_time_us)
            .field("upload-time-us", self.gpu.upload_time_us)
            .field("download-time-us", self.gpu.download_time_us)
            .field("upload-bytes", self.gpu.upload_bytes)
            .field("download-bytes", self.gpu.download_bytes)
            .field("device-copy-us", self.gpu.device_copy_time_us)
            .field("launches", self.gpu.launches)
            .field("graph-replayed", self.gpu.graph_replayed)
            .field(
                "arena-bytes",
                self.gpu.arena_bytes.max(self.neural.arena_bytes),
            )
            .field(
                "peak-live-bytes",
                self.gpu.peak_live_bytes.max(self.neural.peak_live_bytes),
            )
            .field("device-free-bytes", self.gpu.device_free_bytes)
            .field("model", self.model.as_str())
            .field("stages", self.neural.stages)
            .field("network-width", self.neural.network_width)
            .field("network-height", self.neural.network_height)
            .build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::cpu::FrameReport;

    fn outcome(scene_cut: bool, gpu: Option<GpuFrameStats>) -> FrameOutcome {
        FrameOutcome {
            report: FrameReport {
                scene_cut,
                scene_score: 3.5,
                history_used: 2,
            },
            gpu,
            neural: None,
        }
    }

    #[test]
    fn neural_frames_report_plan_and_stages() {
        gst::init().unwrap();
        let mut s = Stats::new("cpu");
        s.set_model("tiny");
        let g = FrameGeometry {
            width: 64,
            height: 64,
        };
        let mut o = outcome(false, None);
        o.neural = Some(NeuralFrameStats {
            arena_bytes: 1 << 20,
            peak_live_bytes: 3 << 18,
            stages: 12,
            network_width: 64,
            network_height: 64,
        });
        s.record(&o, Some(1.0), g, 0);
        let snap = s.snapshot();
        assert_eq!(snap.get::<&str>("model").unwrap(), "tiny");
        assert_eq!(snap.get::<u32>("stages").unwrap(), 12);
        assert_eq!(snap.get::<u64>("arena-bytes").unwrap(), 1 << 20);
        assert_eq!(snap.get::<u64>("peak-live-bytes").unwrap(), 3 << 18);
    }

    #[test]
    fn counts_frames_and_cuts_and_says_when_a_message_is_due() {
        gst::init().unwrap();
        let mut s = Stats::new("cpu");
        let g = FrameGeometry {
            width: 64,
            height: 48,
        };
        let due: Vec<bool> = (0..6)
            .map(|i| s.record(&outcome(i == 2, None), Some(100.0 + i as f64), g, 3))
            .collect();
        assert_eq!(due, [false, false, true, false, false, true]);
        let snap = s.snapshot();
        assert_eq!(snap.get::<&str>("backend").unwrap(), "cpu");
        assert_eq!(snap.get::<u64>("frames").unwrap(), 6);
        assert_eq!(snap.get::<u64>("scene-cuts").unwrap(), 1);
        assert_eq!(snap.get::<u32>("width").unwrap(), 64);
        assert_eq!(snap.get::<u32>("history-used").unwrap(), 2);
        assert_eq!(snap.get::<f64>("mean-us").unwrap(), 102.5);
        assert_eq!(snap.get::<f64>("p99-us").unwrap(), 105.0);
        assert_eq!(snap.get::<u64>("arena-bytes").unwrap(), 0);
        assert_eq!(snap.get::<u64>("dropped").unwrap(), 0);
        assert_eq!(snap.get::<u64>("frames-queued").unwrap(), 0);
    }

    #[test]
    fn a_frame_without_its_time_is_counted_and_timed_later() {
        gst::init().unwrap();
        let g = FrameGeometry::new(64, 48).unwrap();
        let mut s = Stats::default();
        s.record(&outcome(false, None), None, g, 0);
        let snap = s.snapshot();
        assert_eq!(snap.get::<u64>("frames").unwrap(), 1);
        assert_eq!(snap.get::<u64>("frames-queued").unwrap(), 1);
        assert_eq!(snap.get::<f64>("p50-us").unwrap(), 0.0);
        s.record_time(250.0);
        assert_eq!(s.snapshot().get::<f64>("p50-us").unwrap(), 250.0);
    }

    #[test]
    fn dropped_frames_are_counted_apart_from_processed_ones() {
        gst::init().unwrap();
        let mut s = Stats::new("cpu");
        let g = FrameGeometry {
            width: 2,
            height: 2,
        };
        s.record(&outcome(false, None), Some(1.0), g, 0);
        s.record_dropped();
        s.record_dropped();
        let snap = s.snapshot();
        assert_eq!(snap.get::<u64>("frames").unwrap(), 1);
        assert_eq!(snap.get::<u64>("dropped").unwrap(), 2);
        // and a message is still due by processed frames only
        assert!(s.record(&outcome(false, None), Some(1.0), g, 2));
    }

    #[test]
    fn interval_zero_never_posts_and_gpu_figures_are_kept() {
        gst::init().unwrap();
        let mut s = Stats::new("cuda");
        let g = FrameGeometry {
            width: 2,
            height: 2,
        };
        let gpu = GpuFrameStats {
            launches: 7,
            arena_bytes: 4096,
            ..Default::default()
        };
        assert!(!s.record(&outcome(false, Some(gpu)), Some(1.0), g, 0));
        assert!(!s.record(&outcome(false, None), Some(1.0), g, 0));
        let snap = s.snapshot();
        assert_eq!(snap.get::<u32>("launches").unwrap(), 7);
        assert_eq!(snap.get::<u64>("arena-bytes").unwrap(), 4096);
        s.set_backend("cpu");
        assert_eq!(s.snapshot().get::<&str>("backend").unwrap(), "cpu");
    }
}
