//! The project's generated models as .onnx files, for the speed peers and `toonflow-bench
//! --model` (tools/peers/torch_peer.py reads the same files): written, read back through the
//! engine's loader, specialised at 720p/1080p/4K, and their convolution work counted.
//!
//! `TOONFLOW_PEER_MODEL_DIR=DIR` writes them there (e.g. `.gpu/models` before a GPU run);
//! otherwise into a temporary folder that is removed.

#[path = "common/onnx_models.rs"]
mod onnx_models;

use std::path::PathBuf;

use gsttoonflow::neural::Value;
use gsttoonflow::neural::engine::{NeuralModel, Specialised};
use gsttoonflow::neural::lower::StageKind;
use gsttoonflow::neural::onnx::encode_model;

/// Multiply-accumulates of every convolution at the specialised size.
fn conv_macs(spec: &Specialised) -> u64 {
    let lowered = spec.lowered();
    let mut macs = 0u64;
    for stage in lowered.stages.iter().filter(|s| s.kind == StageKind::Conv) {
        for conv in stage.nodes.iter().filter(|n| n.op_type == "Conv") {
            let weight = match lowered.consts.get(&conv.input[1]) {
                Some(Value::Float(t)) => &t.shape,
                _ => panic!("conv {} has computed weights", conv.name),
            };
            let out = stage
                .outputs
                .iter()
                .chain(&conv.output)
                .find_map(|o| lowered.shapes.get(o))
                .expect("conv output shape");
            let per_output: usize = weight[1..].iter().product();
            macs += (out.iter().product::<usize>() * per_output) as u64;
        }
    }
    macs
}

#[test]
fn generated_models_write_load_specialise_and_count_their_work() {
    let keep = std::env::var_os("TOONFLOW_PEER_MODEL_DIR").map(PathBuf::from);
    let tmp = std::env::temp_dir().join(format!("toonflow-peer-models-{}", std::process::id()));
    let dir = keep.clone().unwrap_or(tmp.clone());
    std::fs::create_dir_all(&dir).unwrap();
    let models = [
        ("tiny_like.onnx", onnx_models::tiny_like()),
        ("hayao_like.onnx", onnx_models::hayao_like()),
        (
            "hayao_class.onnx",
            onnx_models::hayao_like_channels([32, 64, 128, 256], "hayao_class"),
        ),
    ];
    let mut hayao_class_1080p = 0;
    for (file, proto) in &models {
        let path = dir.join(file);
        std::fs::write(&path, encode_model(proto)).unwrap();
        let model = NeuralModel::load(&path).unwrap();
        let m = model.size_multiple();
        assert!(m == 8 || m == 16, "{file}: multiple {m}");
        let mut line = format!(
            "{file}: {} bytes, {} bytes of weights, multiple {m}",
            std::fs::metadata(&path).unwrap().len(),
            model.weight_bytes()
        );
        for (w, h, label) in [
            (1280usize, 720usize, "720p"),
            (1920, 1080, "1080p"),
            (3840, 2160, "4K"),
        ] {
            let (w, h) = (w.div_ceil(m) * m, h.div_ceil(m) * m);
            let spec = model.specialise(h, w).unwrap();
            let macs = conv_macs(&spec);
            assert!(macs > 0);
            if *file == "hayao_class.onnx" && label == "1080p" {
                hayao_class_1080p = macs;
            }
            line.push_str(&format!(
                "; {label} ({w}x{h}) {} stages {:.1} GMAC",
                spec.stage_count(),
                macs as f64 / 1e9
            ));
        }
        println!("{line}");
    }
    // Hayao-class: the real Hayao_36 does 236 GMAC at 1080p
    assert!(
        (150e9..400e9).contains(&(hayao_class_1080p as f64)),
        "hayao_class at 1080p: {hayao_class_1080p} MAC"
    );
    match keep {
        Some(d) => println!("models kept in {}", d.display()),
        None => std::fs::remove_dir_all(&tmp).unwrap(),
    }
}
