//! kernels/neural_frame.cu's conversions and output filter without a GPU: the kernel file is
//! compiled as C++ for the host (tests/emulate/neural_frame_host.cpp: the CUDA keywords defined
//! away, every launch run thread by thread) and its results compared with the CPU reference
//! (src/neural/frame.rs, src/neural/temporal.rs) on generated frames: NV12 → the network's input,
//! and four frames of network output through the output filter (history 2, the ring's slots from
//! `RingSlots`) → NV12, at model-scale 1, 0.77, 0.5 and 0.4, NHWC and NCHW, BT.709 limited and
//! BT.601 full. The host build has no FMA contraction, as the device build: the results must be
//! the reference's exactly. This checks the kernels' logic (indices, taps, ring slots, layouts),
//! not the device's arithmetic (tests/neural_frame_cuda.rs does, on a GPU). Without a C++
//! compiler (`c++`, or `CXX`) the test prints that it skipped.

mod common;
mod cuda_common;

use std::path::{Path, PathBuf};
use std::process::Command;

use cuda_common::Rng;
use gsttoonflow::cuda::neural_frame::{self, RingSlots, device_taps};
use gsttoonflow::neural::Tensor;
use gsttoonflow::neural::frame::{
    ColorMatrix, ColorRange, ConverterConfig, FrameConverter, TensorLayout, ValueRange,
    scaling_taps,
};
use gsttoonflow::neural::precision::{fp16_bits, round_to_fp16};
use gsttoonflow::neural::temporal::OutputFilter;

const FRAMES: usize = 4;
const HISTORY: usize = 2;

fn put_i32(out: &mut Vec<u8>, v: &[i32]) {
    out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
}

fn put_f32(out: &mut Vec<u8>, v: &[f32]) {
    out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
}

/// One case file for the host driver: the parameter block, the tap lists, an
/// NV12 frame and the reference input tensor, then per frame the ring plan, a network output
/// and the reference NV12.
/// With `half`, the network's input and output are stored in fp16 (`in_half`, `out_half`):
/// the reference input is rounded to fp16 as the kernel rounds it, the case holds the output's
/// bits and the reference filters the values they stand for.
fn write_case(path: &Path, config: ConverterConfig, seed: u64, half: bool) {
    let (w, h) = (config.width, config.height);
    let mut conv = FrameConverter::new(config).unwrap();
    let (sh, sw) = conv.scaled_size();
    let (nh, nw) = conv.network_size();
    let mut rng = Rng(seed);
    // ramps with noise in luma, a few chroma levels with noise
    let nv12: Vec<u8> = (0..w * h * 3 / 2)
        .map(|i| {
            let base = if i < w * h {
                (i % w) * 3 + (i / w) * 2
            } else {
                100 + (i % 7) * 9
            };
            ((base as u64 + rng.next() % 40) % 256) as u8
        })
        .collect();
    let mut input = conv.new_tensor();
    conv.to_tensor(&nv12[..w * h], w, &nv12[w * h..], w, &mut input)
        .unwrap();
    let taps = if (sw, sh) != (w, h) {
        device_taps(&scaling_taps(w, h, sw, sh)).unwrap()
    } else {
        Vec::new()
    };
    let (strength, sigma) = (0.6f32, 3.0f32);
    let mut filter = OutputFilter::new(sw, sh, HISTORY, config.matrix, config.range);
    filter.set_params(HISTORY, strength, sigma);
    let mut slots = RingSlots::new(HISTORY);
    let mut out = Vec::new();
    // the device's parameter block, addresses 0 (the driver points them at its buffers)
    let mut params = neural_frame::frame_params(&config, (nh, nw));
    params.out_half = half as i32;
    params.in_half = half as i32;
    out.extend_from_slice(bytemuck::bytes_of(&params));
    put_i32(&mut out, &[taps.len() as i32]);
    out.extend_from_slice(bytemuck::cast_slice(&taps));
    out.extend_from_slice(&nv12);
    if half {
        let rounded: Vec<f32> = input.data.iter().map(|&v| round_to_fp16(v)).collect();
        put_f32(&mut out, &rounded);
    } else {
        put_f32(&mut out, &input.data);
    }
    put_i32(&mut out, &[FRAMES as i32]);
    for _ in 0..FRAMES {
        let values = (0..input.data.len())
            .map(|_| {
                let v = (rng.next() % 2001) as f32 / 1000.0 - 1.0;
                if half { round_to_fp16(v) } else { v }
            })
            .collect();
        let network = Tensor::new(input.shape.clone(), values);
        let (recent, used, write) = slots.plan(HISTORY);
        conv.read_output(&network).unwrap();
        assert_eq!(filter.apply(conv.network_rgb_mut()).unwrap(), used);
        let (mut y, mut uv) = (vec![0u8; w * h], vec![0u8; w * h / 2]);
        conv.write_nv12(&mut y, w, &mut uv, w).unwrap();
        put_i32(&mut out, &recent);
        put_i32(&mut out, &[used as i32, write.map_or(-1, |s| s as i32)]);
        put_f32(&mut out, &[strength, -1.0 / (2.0 * sigma * sigma)]);
        if half {
            let bits: Vec<u16> = network.data.iter().map(|&v| fp16_bits(v)).collect();
            out.extend_from_slice(bytemuck::cast_slice(&bits));
        } else {
            put_f32(&mut out, &network.data);
        }
        out.extend_from_slice(&y);
        out.extend_from_slice(&uv);
        slots.commit(write.is_some());
    }
    std::fs::write(path, out).unwrap();
}

fn repo() -> PathBuf {
    std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into())
        .into()
}

#[test]
fn the_frame_kernels_run_on_the_host_give_the_cpu_references_results() {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if Command::new(&compiler).arg("--version").output().is_err() {
        println!("skipped: no C++ compiler ({compiler}) to build the host emulation");
        return;
    }
    let dir = std::env::temp_dir().join(format!("toonflow-nf-emulated-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // the generated ABI, without the fp16 helpers (PTX; the driver has host ones)
    let source = neural_frame::full_source();
    let abi_end = source
        .find("#line 1 \"fp16.cuh\"")
        .expect("the fp16 helpers follow the ABI");
    std::fs::write(dir.join("abi.h"), &source[..abi_end]).unwrap();
    std::fs::write(dir.join("neural_frame.cu"), neural_frame::KERNEL_SOURCE).unwrap();
    std::fs::write(
        dir.join("nv12.cuh"),
        gsttoonflow::cuda::kernels::NV12_HELPERS,
    )
    .unwrap();
    let driver = repo().join("tests/emulate/neural_frame_host.cpp");
    let exe = dir.join("neural_frame_host");
    let built = Command::new(&compiler)
        .args(["-std=c++17", "-O2", "-ffp-contract=off", "-w", "-I"])
        .arg(&dir)
        .arg(&driver)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    if !built.status.success() {
        let why = String::from_utf8_lossy(&built.stderr);
        // _Float16 needs GCC 12 / Clang 15 on x86-64
        if why.contains("_Float16") {
            println!("skipped: {compiler} has no _Float16");
            return;
        }
        panic!("building the host emulation failed:\n{why}");
    }
    let base = ConverterConfig {
        width: 64,
        height: 46,
        matrix: ColorMatrix::Bt709,
        range: ColorRange::Limited,
        layout: TensorLayout::Nhwc,
        value_range: ValueRange::MinusOneToOne,
        multiple: 8,
        scale: 0.5,
    };
    let cases = [
        base,
        ConverterConfig {
            width: 70,
            matrix: ColorMatrix::Bt601,
            range: ColorRange::Full,
            layout: TensorLayout::Nchw,
            scale: 0.4,
            ..base
        },
        ConverterConfig {
            width: 38,
            height: 22,
            scale: 1.0,
            ..base
        },
        ConverterConfig {
            width: 40,
            height: 24,
            layout: TensorLayout::Nchw,
            scale: 0.77,
            ..base
        },
    ];
    // each configuration with the network's output in fp32 and in fp16
    let files: Vec<PathBuf> = cases
        .iter()
        .enumerate()
        .flat_map(|(i, &config)| [(i, config, false), (i, config, true)])
        .map(|(i, config, half)| {
            let path = dir.join(format!(
                "case{i}-{}.bin",
                if half { "fp16" } else { "fp32" }
            ));
            write_case(&path, config, 12345 + i as u64, half);
            path
        })
        .collect();
    let run = Command::new(&exe).args(&files).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    print!("{report}");
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(report.lines().count(), 2 * cases.len(), "{report}");
    assert!(
        run.status.success(),
        "the host emulation differs from the CPU reference:\n{report}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    for line in report.lines() {
        assert!(
            line.contains("input max diff 0,") && line.contains("NV12 worst 0 codes"),
            "not exact: {line}"
        );
    }
}
