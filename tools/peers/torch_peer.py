#!/usr/bin/env python3
"""The PyTorch peer of toonflow's neural stage: the same ONNX file through onnx2torch.

For each model and size (720p, 1080p, 4K; padded up to the model's size multiple, as the
element pads) the script
  1. fixes the input size in the graph and folds what depends only on shapes (onnxruntime's
     basic graph optimisations: the Shape -> Gather -> Mul subgraphs that compute AnimeGANv3's
     Resize sizes become constants; toonflow folds them too),
  2. converts it with onnx2torch, keeps integer shape constants on the host (so Resize/Reshape
     read them without a device sync, which also lets a CUDA graph capture the network),
  3. times fp32 eager, fp16 eager, fp16 replayed as one CUDA graph, and fp16 through
     torch.compile (in a child process with a time limit: compiling takes minutes), with CUDA
     events over at least --seconds after warm-up, batch 1, one frame at a time,
  4. prints one line per configuration (fps, ms per frame, peak device memory, GMAC counted
     from the folded graph) and a Markdown table at the end; --json writes the rows.

Usage (on the GPU machine; onnx2torch comes as a wheel from tools/peers/fetch-wheels.sh, found
in .gpu/wheels, $TOONFLOW_WHEELS or wheels/ beside this script):
  python3 tools/peers/torch_peer.py MODEL.onnx ... \
      [--sizes 720p,1080p,4k] [--modes fp32-eager,fp16-eager,fp16-graph,fp16-compile] \
      [--compile-sizes 1080p] [--seconds 1.0] [--json FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

def find_wheels():
    """Puts carried pure-Python wheels (tools/peers/fetch-wheels.sh) on sys.path when
    onnx2torch is not installed: $TOONFLOW_WHEELS, .gpu/wheels, or wheels/ beside this file."""
    try:
        import onnx2torch  # noqa: F401

        return
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    for d in (os.environ.get("TOONFLOW_WHEELS"), os.path.join(root, ".gpu", "wheels"), os.path.join(here, "wheels")):
        if d and os.path.isdir(d):
            sys.path.extend(os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".whl"))


find_wheels()

SIZES = {"720p": (1280, 720), "1080p": (1920, 1080), "4k": (3840, 2160), "256": (256, 256)}


def parse_size(s):
    s = s.strip().lower()
    if s in SIZES:
        return s, SIZES[s]
    w, h = s.split("x")
    return s, (int(w), int(h))


def input_layout(model):
    """('nhwc' | 'nchw', input name) of the model's one picture input."""
    inits = {i.name for i in model.graph.initializer}
    inp = next(i for i in model.graph.input if i.name not in inits)
    dims = inp.type.tensor_type.shape.dim
    if len(dims) == 4 and dims[3].dim_value == 3:
        return "nhwc", inp
    if len(dims) == 4 and dims[1].dim_value == 3:
        return "nchw", inp
    raise SystemExit(f"input {inp.name} is not a 3-channel NHWC/NCHW picture")


def size_multiple(model):
    """2^(stride-2 convolutions): 16 for AnimeGANv3 tiny, 8 for Hayao/Shinkai (their strided
    convolutions all lie on one path)."""
    n = 0
    for node in model.graph.node:
        if node.op_type == "Conv":
            for a in node.attribute:
                if a.name == "strides" and max(a.ints) == 2:
                    n += 1
    return 2 ** n


def static_folded(path, layout, h, w):
    """The model with its input fixed to h x w and shape subgraphs folded (onnxruntime basic
    optimisations, which keep standard ONNX operators)."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(path)
    _, inp = input_layout(model)
    values = [1, h, w, 3] if layout == "nhwc" else [1, 3, h, w]
    for d, v in zip(inp.type.tensor_type.shape.dim, values):
        d.ClearField("dim_param")
        d.dim_value = v
    for out in model.graph.output:
        for d in out.type.tensor_type.shape.dim:
            d.ClearField("dim_value")
            d.dim_param = "out"
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.onnx"), os.path.join(tmp, "out.onnx")
        onnx.save(model, src)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = dst
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
        folded = onnx.load(dst)
    # onnxruntime lists its own operator domains; every node stays in the default one
    keep = [o for o in folded.opset_import if o.domain in ("", "ai.onnx")]
    del folded.opset_import[:]
    folded.opset_import.extend(keep)
    return folded


def conv_gmac(model):
    """Multiply-accumulates of every Conv/ConvTranspose, from inferred shapes."""
    import onnx
    from onnx import numpy_helper

    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        shapes[vi.name] = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    weights = {i.name: list(i.dims) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    weights[node.output[0]] = list(numpy_helper.to_array(a.t).shape)
    macs = 0
    for node in model.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose"):
            continue
        wshape = weights.get(node.input[1])
        out = shapes.get(node.output[0])
        if not wshape or not out or 0 in out:
            return float("nan")
        if node.op_type == "Conv":
            per = 1
            for d in wshape[1:]:
                per *= d
            n = 1
            for d in out:
                n *= d
            macs += n * per
        else:  # each input element feeds C_out/groups * k*k outputs
            inp = shapes.get(node.input[0])
            n = 1
            for d in inp:
                n *= d
            per = 1
            for d in wshape[1:]:
                per *= d
            macs += n * per
    return macs / 1e9


def convert(folded):
    import torch
    from onnx2torch import convert as onnx2torch_convert

    net = onnx2torch_convert(folded).eval().cuda()
    # Integer shape constants (Resize sizes, Reshape shapes, Pad pads) stay on the host: the
    # converted modules call .tolist() on them, a device sync per call that a CUDA graph
    # cannot capture.
    for name, buf in list(net.named_buffers()):
        if not buf.is_floating_point():
            owner, _, leaf = name.rpartition(".")
            mod = net.get_submodule(owner) if owner else net
            mod._buffers[leaf] = buf.cpu()
    return net


def time_it(step, seconds, sync):
    """fps and ms per frame of `step` (one frame each), CUDA events around a loop that lasts
    at least `seconds`, after warm-up."""
    import torch

    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.2 or n < 3:
        step()
        n += 1
    sync()
    per = (time.perf_counter() - t0) / n
    iters = max(5, int(seconds / max(per, 1e-6)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / iters
    return 1000.0 / ms, ms, iters


def measure(net, layout, h, w, mode, seconds):
    import torch

    dtype = torch.float16 if mode.startswith("fp16") else torch.float32
    shape = (1, h, w, 3) if layout == "nhwc" else (1, 3, h, w)
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.rand(shape, device="cuda", generator=gen) * 2 - 1).to(dtype)
    net = net.to(dtype) if dtype == torch.float16 else net.float()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.inference_mode():
        if mode.endswith("eager"):
            fps, ms, iters = time_it(lambda: net(x), seconds, torch.cuda.synchronize)
        elif mode.endswith("graph"):
            static_in = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    net(static_in)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = net(static_in)
            fps, ms, iters = time_it(graph.replay, seconds, torch.cuda.synchronize)
            del out
        else:
            raise ValueError(mode)
    peak = torch.cuda.max_memory_allocated() - base
    return fps, ms, iters, peak


def measure_compiled(net, layout, h, w, seconds):
    import torch

    shape = (1, h, w, 3) if layout == "nhwc" else (1, 3, h, w)
    x = (torch.rand(shape, device="cuda") * 2 - 1).half()
    net = net.half()
    compiled = torch.compile(net, dynamic=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        compiled(x)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fps, ms, iters = time_it(lambda: compiled(x), seconds, torch.cuda.synchronize)
    return fps, ms, iters, torch.cuda.max_memory_allocated() - base, compile_s


def child_compile(args):
    """--child-compile MODEL SIZE: one torch.compile measurement, printed as JSON."""
    import onnx

    path, size = args.child_compile
    label, (w, h) = parse_size(size)
    layout, _ = input_layout(onnx.load(path))
    m = args.multiple or size_multiple(onnx.load(path))
    h, w = -(-h // m) * m, -(-w // m) * m
    net = convert(static_folded(path, layout, h, w))
    fps, ms, iters, peak, compile_s = measure_compiled(net, layout, h, w, args.seconds)
    print("CHILD " + json.dumps({"fps": fps, "ms": ms, "iters": iters, "peak": peak, "compile_s": compile_s}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--sizes", default="720p,1080p,4k")
    ap.add_argument("--modes", default="fp32-eager,fp16-eager,fp16-graph,fp16-compile")
    ap.add_argument("--compile-sizes", default="1080p", help="sizes torch.compile runs at")
    ap.add_argument("--compile-timeout", type=float, default=120.0)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--multiple", type=int, default=0, help="size multiple (0: from the strides)")
    ap.add_argument("--json")
    ap.add_argument("--child-compile", nargs=2, metavar=("MODEL", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_compile:
        return child_compile(args)

    import onnx
    import torch

    dev = torch.cuda.get_device_name(0)
    print(f"torch_peer: {dev}; torch {torch.__version__}; onnx {onnx.__version__}", flush=True)
    rows = []
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    compile_sizes = {parse_size(s)[0] for s in args.compile_sizes.split(",") if s.strip()}
    out = open(args.json, "w") if args.json else None
    for path in args.models:
        name = os.path.basename(path).removesuffix(".onnx")
        model = onnx.load(path)
        layout, _ = input_layout(model)
        m = args.multiple or size_multiple(model)
        del model
        for size in args.sizes.split(","):
            label, (w, h) = parse_size(size)
            h, w = -(-h // m) * m, -(-w // m) * m
            try:
                t0 = time.perf_counter()
                folded = static_folded(path, layout, h, w)
                gmac = conv_gmac(folded)
                net = convert(folded)
                prep = time.perf_counter() - t0
            except Exception as e:  # a model onnx2torch cannot take: say so, go on
                print(f"{name:<22} {label:<6} conversion failed: {type(e).__name__}: {e}", flush=True)
                continue
            for mode in modes:
                row = {"model": name, "size": label, "width": w, "height": h, "mode": mode, "gmac": gmac, "device": dev}
                try:
                    if mode == "fp16-compile":
                        if label not in compile_sizes:
                            continue
                        child = subprocess.run(
                            [sys.executable, __file__, "--child-compile", path, size, "--seconds", str(args.seconds),
                             "--multiple", str(m)],
                            capture_output=True, text=True, timeout=args.compile_timeout)
                        lines = [l for l in child.stdout.splitlines() if l.startswith("CHILD ")]
                        if child.returncode != 0 or not lines:
                            tail = (child.stderr or child.stdout).strip().splitlines()[-3:]
                            raise RuntimeError(" | ".join(tail))
                        r = json.loads(lines[-1][6:])
                        row.update(fps=r["fps"], ms=r["ms"], iters=r["iters"], peak_mb=r["peak"] / 1e6,
                                   compile_s=r["compile_s"])
                    else:
                        fps, ms, iters, peak = measure(net, layout, h, w, mode, args.seconds)
                        row.update(fps=fps, ms=ms, iters=iters, peak_mb=peak / 1e6)
                except subprocess.TimeoutExpired:
                    row["error"] = f"torch.compile did not finish in {args.compile_timeout:.0f} s"
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                if "error" in row:
                    print(f"{name:<22} {label:<6} {w}x{h:<5} {mode:<13} failed: {row['error']}", flush=True)
                else:
                    extra = f"  (compile {row['compile_s']:.0f} s)" if "compile_s" in row else ""
                    print(f"{name:<22} {label:<6} {w}x{h:<5} {mode:<13} {row['fps']:9.1f} fps {row['ms']:8.2f} ms "
                          f"peak {row['peak_mb']:8.0f} MB  {gmac:7.1f} GMAC{extra}", flush=True)
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
            del net
            torch.cuda.empty_cache()
            print(f"  ({name} {label}: fold + convert {prep:.1f} s)", flush=True)
    print()
    print("| model | size | mode | fps | ms/frame | peak MB | GMAC |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['size']} ({r['width']}x{r['height']}) | {r['mode']} | failed: {r['error']} | | | |")
        else:
            print(f"| {r['model']} | {r['size']} ({r['width']}x{r['height']}) | {r['mode']} | {r['fps']:.1f} | "
                  f"{r['ms']:.2f} | {r['peak_mb']:.0f} | {r['gmac']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
