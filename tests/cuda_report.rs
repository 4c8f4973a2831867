//! Figures for the closing note (issue 3/4): launches per frame, memory plans at 720p, 1080p and
//! 4K, and GPU time per frame eager against graph replay. Run with `--nocapture`.

mod common;
mod cuda_common;

use cuda_common::*;
use gsttoonflow::cuda::plan::{classic_plan, default_shape};
use gsttoonflow::cuda::{CudaPipeline, PinnedHostBuffer};
use gsttoonflow::pipeline::{Nv12Frame, Nv12FrameMut, Precision};

const SIZES: [(usize, usize); 3] = [(1280, 720), (1920, 1080), (3840, 2160)];

#[test]
fn memory_plans() {
    for (w, h) in SIZES {
        for prec in [Precision::Fp16, Precision::Fp32] {
            let p = classic_plan(&default_shape(w as u32, h as u32, prec));
            println!(
                "plan {w}x{h} {prec:?} history 4: arena {} bytes ({:.1} MB), peak live {} bytes, utilisation {:.1}%",
                p.arena_bytes,
                p.arena_bytes as f64 / 1e6,
                p.peak_live_bytes,
                100.0 * p.utilisation()
            );
        }
    }
    println!(
        "{}",
        classic_plan(&default_shape(1920, 1080, Precision::Fp16)).describe()
    );
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[test]
fn timings_eager_vs_graph() {
    let Some(dev) = cuda_or_skip() else { return };
    println!("device: {dev}");
    for (w, h) in SIZES {
        let photo = load_photo("astronaut.png", w, h);
        let p = params(w, h);
        let bytes = photo.data.len();
        for prec in [Precision::Fp16, Precision::Fp32] {
            for graph in [false, true] {
                let mut pin_in = PinnedHostBuffer::new(0, bytes).unwrap();
                let mut pin_out = PinnedHostBuffer::new(0, bytes).unwrap();
                pin_in.copy_from_slice(&photo.data);
                let shape = default_shape(w as u32, h as u32, prec);
                let mut g = CudaPipeline::new(0, photo.geometry, shape, 0, graph).unwrap();
                let (mut gpu, mut host, mut xfer) = (Vec::new(), Vec::new(), Vec::new());
                let t = std::time::Instant::now();
                let frames = 300;
                for i in 0..frames + 20 {
                    let inp = Nv12Frame::packed(photo.geometry, &pin_in).unwrap();
                    let mut out = Nv12FrameMut::packed(photo.geometry, &mut pin_out).unwrap();
                    g.process(&p, &inp, &mut out).unwrap();
                    if i >= 20 {
                        let s = g.last_frame_stats();
                        gpu.push(s.gpu_time_us);
                        host.push(s.host_time_us);
                        xfer.push(s.transfer_time_us);
                    }
                }
                let wall = t.elapsed().as_secs_f64();
                let s = g.last_frame_stats();
                let mut host_sorted = host.clone();
                host_sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
                let p99 = host_sorted[host_sorted.len() * 99 / 100];
                println!(
                    "timing {w}x{h} {prec:?} {}: launches {}, kernels {:.1} us/frame (median, events), \
                     transfers {:.1} us, host {:.1} us (p99 {:.1}), ~{:.0} frames/s, replayed {}, arena {} bytes",
                    if graph { "graph" } else { "eager" },
                    s.launches,
                    median(&mut gpu),
                    median(&mut xfer),
                    median(&mut host),
                    p99,
                    (frames + 20) as f64 / wall,
                    s.graph_replayed,
                    s.arena_bytes
                );
                for e in g.take_events() {
                    if let gsttoonflow::cuda::PipelineEvent::Plan { .. } = e {
                        continue;
                    }
                    println!("  event: {e:?}");
                }
            }
        }
    }
}
