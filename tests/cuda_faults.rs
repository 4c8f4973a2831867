//! Driver and memory faults on the GPU path: a kernel that fails to compile, a real allocation
//! failure, a max-device-memory cap and a failed graph capture. Each must end in a clear error
//! or a logged fallback, never a panic or a hung pipeline. Runs where a CUDA device exists;
//! elsewhere each test says why it is skipped. Faults are injected with TOONFLOW_CUDA_FAULT
//! (src/cuda/fault.rs), so the tests of this file switch it in turn inside one test.

mod common;
#[path = "common/onnx_models.rs"]
mod onnx_models;

use common::*;
use gst::prelude::*;

fn set_fault(v: &str) {
    // SAFETY: this file's single test runs its scenarios one after another on one thread.
    unsafe { std::env::set_var("TOONFLOW_CUDA_FAULT", v) };
}

/// What a run ends with: the bus messages, whether EOS was reached, the element's stats.
type Outcome = (Vec<gst::Message>, bool, gst::Structure);

/// Runs `toonflow <props>` over `frames` frames of `width`x`height` from videotestsrc.
fn run(props: &str, frames: u32, width: u32, height: u32) -> Outcome {
    init();
    let p = gst::parse::launch(&format!(
        "videotestsrc num-buffers={frames} pattern=ball ! \
         video/x-raw,format=NV12,width={width},height={height} ! toonflow name=t {props} ! fakesink"
    ))
    .unwrap()
    .downcast::<gst::Pipeline>()
    .unwrap();
    let bus = p.bus().unwrap();
    let _ = p.set_state(gst::State::Playing);
    let mut msgs = Vec::new();
    let mut eos = false;
    while let Some(m) = bus.timed_pop(gst::ClockTime::from_seconds(60)) {
        let end = match m.view() {
            gst::MessageView::Eos(_) => {
                eos = true;
                true
            }
            gst::MessageView::Error(_) => true,
            _ => false,
        };
        msgs.push(m);
        if end {
            break;
        }
    }
    let stats = p.by_name("t").unwrap().property::<gst::Structure>("stats");
    p.set_state(gst::State::Null).unwrap();
    (msgs, eos, stats)
}

fn texts(msgs: &[gst::Message], ty: gst::MessageType) -> Vec<String> {
    msgs.iter()
        .filter(|m| m.type_() == ty)
        .map(|m| match m.view() {
            gst::MessageView::Error(e) => format!("{} ({:?})", e.error(), e.debug()),
            gst::MessageView::Warning(w) => format!("{} ({:?})", w.error(), w.debug()),
            _ => String::new(),
        })
        .collect()
}

#[test]
fn faults_give_clear_errors_or_logged_fallbacks() {
    if let Err(e) = gsttoonflow::cuda::probe(0) {
        println!("skipped: no CUDA device ({e})");
        return;
    }
    // The classic pipeline over 30 frames of 320x240.
    each_fault_ends_clearly("classic", "CPU backend", |props| run(props, 30, 320, 240));
    set_shape_recovers_from_a_failed_allocation();

    // The network (model=) over a few small frames: backend=auto falls back to the CPU
    // reference, which takes a while a frame.
    let dir = TempDir::new("cuda-faults-model");
    let path = dir.path("tiny_like.onnx");
    let model = gsttoonflow::neural::onnx::encode_model(&onnx_models::tiny_like());
    std::fs::write(&path, model).unwrap();
    each_fault_ends_clearly("network", "CPU reference", |props| {
        run(&format!("model=\"{}\" {props}", path.display()), 6, 96, 64)
    });
}

/// Injects each fault in turn under `run` (toonflow's properties → the run's outcome):
/// `fallback` is what backend=auto's warning must say it fell back to.
fn each_fault_ends_clearly(what: &str, fallback: &str, run: impl Fn(&str) -> Outcome) {
    let expect_error = |props: &str, says: &str| {
        let (msgs, eos, _) = run(props);
        let errors = texts(&msgs, gst::MessageType::Error);
        println!("{what}, {props}: {errors:?}");
        assert!(
            !eos && errors.iter().any(|e| e.contains(says)),
            "{errors:?}"
        );
    };

    // A kernel that fails to compile: backend=cuda fails with NVRTC's log, auto falls back.
    set_fault("compile");
    expect_error("backend=cuda precision=fp32", "injected");
    let (msgs, eos, stats) = run("backend=auto precision=fp32");
    let warnings = texts(&msgs, gst::MessageType::Warning);
    println!("{what}, compile fault, backend=auto: {warnings:?}");
    assert!(eos, "auto must fall back and finish: {msgs:?}");
    assert_eq!(stats.get::<String>("backend").unwrap(), "cpu");
    assert!(
        warnings.iter().any(|w| w.contains(fallback)),
        "{warnings:?}"
    );

    // A real allocation failure: cuMemAlloc of four times the free memory.
    set_fault("alloc");
    expect_error("backend=cuda", "cuMemAlloc");

    // The max-device-memory cap: a clear error at negotiation (4 KiB is below any plan; the
    // network at 96x64 fits in 1 MB).
    set_fault("");
    expect_error("backend=cuda max-device-memory=4096", "max-device-memory");

    // A failed capture: frames keep flowing eagerly, on the GPU, as many as without the fault.
    let (msgs, eos, clean) = run("backend=cuda cuda-graph=true");
    assert!(eos, "{msgs:?}");
    assert!(clean.get::<bool>("graph-replayed").unwrap(), "{clean}");
    set_fault("capture");
    let (msgs, eos, stats) = run("backend=cuda cuda-graph=true");
    set_fault("");
    println!("{what}, capture fault: {stats}");
    assert!(eos, "a failed capture must not stop the stream: {msgs:?}");
    assert!(!stats.get::<bool>("graph-replayed").unwrap(), "{stats}");
    assert_eq!(stats.get::<String>("backend").unwrap(), "cuda");
    assert_eq!(
        stats.get::<u64>("frames").unwrap(),
        clean.get::<u64>("frames").unwrap()
    );
}

/// `CudaPipeline::set_shape` frees the old arena before it allocates the new one: when that
/// allocation fails, the pipeline refuses frames with a clear error until a later `set_shape`
/// succeeds, and then runs again.
fn set_shape_recovers_from_a_failed_allocation() {
    use gsttoonflow::cuda::plan::default_shape;
    use gsttoonflow::cuda::{CudaError, CudaPipeline};
    use gsttoonflow::pipeline::{
        FrameGeometry, Nv12Frame, Nv12FrameMut, Precision, StageParams, ToonParams,
    };

    let frame = |g: &mut CudaPipeline, w: usize, h: usize| {
        let geometry = FrameGeometry::new(w, h).unwrap();
        let input: Vec<u8> = (0..geometry.nv12_bytes()).map(|i| (i * 7) as u8).collect();
        let mut output = vec![0u8; geometry.nv12_bytes()];
        let params = ToonParams::new(&StageParams::default(), w as u32, h as u32);
        let report = g.process(
            &params,
            &Nv12Frame::packed(geometry, &input).unwrap(),
            &mut Nv12FrameMut::packed(geometry, &mut output).unwrap(),
        );
        report.map(|_| output)
    };
    set_fault("");
    let small = default_shape(64, 48, Precision::Fp16);
    let big = default_shape(320, 240, Precision::Fp16);
    let mut g = CudaPipeline::new(0, FrameGeometry::new(64, 48).unwrap(), small, 0, true).unwrap();
    frame(&mut g, 64, 48).unwrap();

    set_fault("alloc");
    let failed = g.set_shape(big);
    set_fault("");
    match failed {
        Err(e @ CudaError::OutOfMemory(_)) => {
            println!("set_shape with a failing allocation: {e}");
            assert!(e.to_string().contains("cuMemAlloc"), "{e}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let refused = frame(&mut g, 320, 240).unwrap_err();
    println!("a frame without an arena: {refused}");
    assert!(
        refused.to_string().contains("no device memory"),
        "{refused}"
    );

    g.set_shape(big).unwrap();
    let after = frame(&mut g, 320, 240).unwrap();
    let mut fresh =
        CudaPipeline::new(0, FrameGeometry::new(320, 240).unwrap(), big, 0, true).unwrap();
    assert_eq!(after, frame(&mut fresh, 320, 240).unwrap());
}
