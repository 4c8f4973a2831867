//! The element in real pipelines built with gst_parse_launch: EOS, a property changed while
//! PLAYING, stats on the bus, and the backend choice on a machine with or without CUDA.

mod common;

use common::*;
use gst::prelude::*;

fn cuda_present() -> bool {
    gsttoonflow::cuda::probe(0).is_ok()
}

/// Runs a pipeline to EOS or error and returns the messages it posted.
fn run_to_end(pipeline: &gst::Pipeline) -> Vec<gst::Message> {
    let bus = pipeline.bus().unwrap();
    let mut seen = Vec::new();
    if pipeline.set_state(gst::State::Playing).is_err() {
        // the error is on the bus
    }
    while let Some(msg) = bus.timed_pop(gst::ClockTime::from_seconds(60)) {
        let done = matches!(
            msg.view(),
            gst::MessageView::Eos(_) | gst::MessageView::Error(_)
        );
        seen.push(msg);
        if done {
            break;
        }
    }
    pipeline.set_state(gst::State::Null).unwrap();
    seen
}

fn launch(desc: &str) -> gst::Pipeline {
    init();
    gst::parse::launch(desc)
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap()
}

#[test]
fn videotestsrc_pipeline_reaches_eos_with_stats_messages() {
    let p = launch(
        "videotestsrc num-buffers=20 pattern=ball ! video/x-raw,format=NV12,width=160,height=120 ! \
         toonflow name=t backend=cpu stats-interval=5 ! fakesink",
    );
    let msgs = run_to_end(&p);
    assert!(
        matches!(msgs.last().unwrap().view(), gst::MessageView::Eos(_)),
        "{msgs:?}"
    );
    let stats: Vec<&gst::StructureRef> = msgs
        .iter()
        .filter_map(|m| match m.view() {
            gst::MessageView::Element(e) => e.structure().filter(|s| s.name() == "toonflow-stats"),
            _ => None,
        })
        .collect();
    let frames: Vec<u64> = stats
        .iter()
        .map(|s| s.get::<u64>("frames").unwrap())
        .collect();
    assert_eq!(frames, vec![5, 10, 15, 20]);
    let last = stats.last().unwrap();
    assert_eq!(last.get::<&str>("backend").unwrap(), "cpu");
    let (p50, p99) = (
        last.get::<f64>("p50-us").unwrap(),
        last.get::<f64>("p99-us").unwrap(),
    );
    assert!(p50 > 0.0 && p99 >= p50, "p50 {p50} p99 {p99}");
    let t = p.by_name("t").unwrap();
    assert_eq!(
        t.property::<gst::Structure>("stats")
            .get::<u64>("frames")
            .unwrap(),
        20
    );
}

/// Distinct luma values making up more than 1% of a frame.
fn busy_values(y: &[u8]) -> usize {
    let mut hist = [0usize; 256];
    for &v in y {
        hist[v as usize] += 1;
    }
    hist.iter().filter(|&&c| c * 100 > y.len()).count()
}

#[test]
fn a_property_changed_while_playing_takes_effect_on_the_next_frame() {
    let p = launch(
        "videotestsrc num-buffers=40 pattern=smpte ! video/x-raw,format=NV12,width=160,height=120,framerate=30/1 ! \
         toonflow name=t backend=cpu levels=16 edge-strength=0 ! appsink name=sink sync=false",
    );
    let sink = app_sink(p.upcast_ref(), "sink");
    let t = p.by_name("t").unwrap();
    p.set_state(gst::State::Playing).unwrap();
    let pull = |sink: &gst_app::AppSink| {
        let s = sink.pull_sample().unwrap();
        Nv12::from_buffer(s.buffer().unwrap(), s.caps().unwrap())
    };
    let before = pull(&sink);
    t.set_property("levels", 2u32);
    // frames already queued before the change may still come: wait for the change to show
    let mut after = pull(&sink);
    for _ in 0..5 {
        if busy_values(after.y()) <= 2 {
            break;
        }
        after = pull(&sink);
    }
    p.set_state(gst::State::Null).unwrap();
    assert!(
        busy_values(before.y()) > 2,
        "16 levels give more than 2 busy values"
    );
    assert!(
        busy_values(after.y()) <= 2,
        "levels=2 leaves at most 2 busy luma values, got {}",
        busy_values(after.y())
    );
}

#[test]
fn a_shape_change_while_playing_rebuilds_and_keeps_flowing() {
    let p = launch(
        "videotestsrc num-buffers=30 ! video/x-raw,format=NV12,width=64,height=48 ! \
         toonflow name=t backend=cpu ! fakesink name=sink signal-handoffs=true",
    );
    let t = p.by_name("t").unwrap();
    let sink = p.by_name("sink").unwrap();
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let c = count.clone();
    let t2 = t.clone();
    sink.connect("handoff", false, move |_| {
        let n = c.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if n == 10 {
            t2.set_property("temporal-history", 2u32);
            t2.set_property("bilateral-iterations", 1u32);
        }
        None
    });
    let msgs = run_to_end(&p);
    assert!(
        matches!(msgs.last().unwrap().view(), gst::MessageView::Eos(_)),
        "{msgs:?}"
    );
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 30);
}

#[test]
fn backend_auto_without_cuda_warns_once_and_runs_on_cpu() {
    let p = launch(
        "videotestsrc num-buffers=5 ! video/x-raw,format=NV12,width=64,height=48 ! toonflow name=t ! fakesink",
    );
    let msgs = run_to_end(&p);
    assert!(
        matches!(msgs.last().unwrap().view(), gst::MessageView::Eos(_)),
        "{msgs:?}"
    );
    let warnings: Vec<String> = msgs
        .iter()
        .filter_map(|m| match m.view() {
            gst::MessageView::Warning(w) => Some(w.error().to_string()),
            _ => None,
        })
        .collect();
    let backend = p
        .by_name("t")
        .unwrap()
        .property::<gst::Structure>("stats")
        .get::<String>("backend")
        .unwrap();
    if cuda_present() {
        println!("CUDA present: auto picked {backend}");
        assert_eq!(backend, "cuda");
        assert!(warnings.is_empty(), "{warnings:?}");
    } else {
        assert_eq!(backend, "cpu");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("CPU backend"), "{}", warnings[0]);
    }
}

#[test]
fn backend_cuda_without_cuda_fails_at_start_with_a_clear_error() {
    if cuda_present() {
        println!("skipped: a CUDA device is present, so backend=cuda starts");
        return;
    }
    let p = launch(
        "videotestsrc num-buffers=5 ! video/x-raw,format=NV12,width=64,height=48 ! toonflow backend=cuda ! fakesink",
    );
    let msgs = run_to_end(&p);
    let err = msgs
        .iter()
        .find_map(|m| match m.view() {
            gst::MessageView::Error(e) => Some(e.error().to_string()),
            _ => None,
        })
        .expect("an error message");
    assert!(err.contains("backend=cuda"), "{err}");
}
