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
  4. prints one line per configuration (fps, ms per frame, peak device memory as PyTorch's
     allocator counts it: weights, activations, a graph's pool; GMAC counted from the folded
     graph) and a Markdown table at the end; --json writes the rows.

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

DEVICE = "cuda"

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
    hoist_transposes_above_pads(folded)
    return folded


def hoist_transposes_above_pads(model):
    """AnimeGANv3 pads H and W of its NHWC input, then transposes to NCHW; PyTorch's reflect
    padding only pads the last dimensions. Pad -> Transpose becomes Transpose -> Pad with the
    pads permuted (what toonflow's lowering does too): same values, PyTorch can run it."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in g.output}
    nodes = list(g.node)
    for pad in [n for n in nodes if n.op_type == "Pad"]:
        if len(pad.input) < 2 or pad.input[1] not in inits or pad.output[0] in outputs:
            continue
        pads = numpy_helper.to_array(inits[pad.input[1]]).tolist()
        rank = len(pads) // 2
        if all(v == 0 for k in range(rank - 2) for v in (pads[k], pads[rank + k])):
            continue  # pads only the last two dimensions already
        after = readers.get(pad.output[0], [])
        if len(after) != 1 or after[0].op_type != "Transpose":
            continue
        transpose = after[0]
        perm = next(list(a.ints) for a in transpose.attribute if a.name == "perm")
        moved = [pads[perm[k]] for k in range(rank)] + [pads[rank + perm[k]] for k in range(rank)]
        name = pad.output[0] + "_hoisted"
        new_pads = numpy_helper.from_array(__import__("numpy").array(moved, dtype="int64"), name + "_pads")
        g.initializer.append(new_pads)
        new_t = helper.make_node("Transpose", [pad.input[0]], [name], perm=perm, name=name + "_transpose")
        new_p = helper.make_node("Pad", [name, new_pads.name] + list(pad.input[2:]), [transpose.output[0]],
                                 name=name + "_pad")
        new_p.attribute.extend(pad.attribute)
        at = nodes.index(transpose)
        nodes[at:at + 1] = [new_t, new_p]
        nodes.remove(pad)
    del g.node[:]
    g.node.extend(nodes)


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

    net = onnx2torch_convert(folded).eval().to(DEVICE)
    # Integer shape constants (Resize sizes, Reshape shapes, Pad pads) stay on the host: the
    # converted modules call .tolist() on them, a device sync per call that a CUDA graph
    # cannot capture.
    for name, buf in list(net.named_buffers()):
        if not buf.is_floating_point():
            owner, _, leaf = name.rpartition(".")
            mod = net.get_submodule(owner) if owner else net
            mod._buffers[leaf] = buf.cpu()
    specialise_shapes(net)
    return net


def specialise_shapes(net):
    """Pad, Reshape and Resize modules that read their pads/shape/sizes from constant integer
    tensors become plain calls with Python constants (F.pad, torch.reshape, F.interpolate):
    the shape is fixed anyway, and torch.compile cannot trace torch.Size(tensor). Returns how
    many calls were rewritten."""
    import torch
    import torch.nn.functional as F
    from onnx2torch.node_converters.pad import _onnx_padding_to_torch, _torch_padding_to_mode_format
    from onnx2torch.node_converters.resize import _onnx_mode_to_torch_mode

    graph = net.graph

    def const(arg):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            t = net
            for part in arg.target.split("."):
                t = getattr(t, part)
            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                return [int(v) for v in t.flatten().tolist()]
        return None

    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        mod = net.get_submodule(node.target)
        kind = type(mod).__name__
        args = list(node.args)
        new = None
        with graph.inserting_before(node):
            if kind == "OnnxPadDynamic" and len(args) >= 2 and const(args[1]) is not None:
                pads = _torch_padding_to_mode_format(_onnx_padding_to_torch(const(args[1])), mod.mode)
                new = graph.call_function(F.pad, (args[0], pads), {"mode": mod.mode})
            elif kind == "OnnxReshape" and len(args) == 2 and const(args[1]) is not None and 0 not in const(args[1]):
                new = graph.call_function(torch.reshape, (args[0], tuple(const(args[1]))))
            elif (kind == "OnnxResize" and mod.onnx_mode == "linear"
                  and const(node.kwargs.get("sizes", args[3] if len(args) == 4 else None)) is not None):
                sizes = const(node.kwargs.get("sizes", args[3] if len(args) == 4 else None))
                mode = _onnx_mode_to_torch_mode(mod.onnx_mode, len(sizes) - 2)
                new = graph.call_function(F.interpolate, (args[0],),
                                          {"size": tuple(sizes[2:]), "mode": mode, "align_corners": mod.align_corners})
        if new is not None:
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            rewritten += 1
    graph.eliminate_dead_code()
    net.recompile()
    return rewritten


def sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


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
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        ms = (time.perf_counter() - t0) * 1000 / iters
        return 1000.0 / ms, ms, iters
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
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    x = (torch.rand(shape, device=DEVICE, generator=gen) * 2 - 1).to(dtype)
    net = net.to(dtype) if dtype == torch.float16 else net.float()
    if DEVICE != "cuda" and not mode.endswith("eager"):
        raise RuntimeError(f"{mode} needs CUDA")
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        if mode.endswith("eager"):
            fps, ms, iters = time_it(lambda: net(x), seconds, sync)
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
            fps, ms, iters = time_it(graph.replay, seconds, sync)
            del out
        else:
            raise ValueError(mode)
    # the whole peak (weights, activations, a graph's pool), as PyTorch's allocator counts it
    peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else float("nan")
    return fps, ms, iters, peak


def measure_compiled(net, layout, h, w, seconds):
    import torch

    shape = (1, h, w, 3) if layout == "nhwc" else (1, 3, h, w)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = (torch.rand(shape, device=DEVICE) * 2 - 1).to(dtype)
    net = net.to(dtype)
    compiled = torch.compile(net, dynamic=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        compiled(x)
        sync()
        compile_s = time.perf_counter() - t0
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        fps, ms, iters = time_it(lambda: compiled(x), seconds, sync)
    peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else float("nan")
    return fps, ms, iters, peak, compile_s


def parity(path, layout, m):
    """The converted network (fp32, on the device) against onnxruntime on the same folded
    graph at 256x256-ish: (max |difference| as converted, and against onnxruntime with the
    Resizes switched to half_pixel, the coordinates PyTorch's bilinear interpolation uses)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    h, w = -(-192 // m) * m, -(-256 // m) * m
    folded = static_folded(path, layout, h, w)
    net = convert(folded).float()
    shape = (1, h, w, 3) if layout == "nhwc" else (1, 3, h, w)
    x = np.random.default_rng(3).uniform(-1, 1, shape).astype(np.float32)
    with torch.inference_mode():
        y = net(torch.from_numpy(x).to(DEVICE)).float().cpu().numpy()
    diffs = []
    for half_pixel in (False, True):
        if half_pixel:
            for n in folded.graph.node:
                for a in n.attribute:
                    if n.op_type == "Resize" and a.name == "coordinate_transformation_mode":
                        a.s = b"half_pixel"
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(folded.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ref = sess.run(None, {sess.get_inputs()[0].name: x})[0]
        diffs.append(float(np.abs(y - ref).max()))
    return (w, h), diffs


def child_compile(args):
    """--child-compile MODEL SIZE: one torch.compile measurement, printed as JSON."""
    import onnx

    global DEVICE
    DEVICE = args.device
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
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    ap.add_argument("--no-parity", action="store_true", help="skip the check against onnxruntime")
    ap.add_argument("--child-compile", nargs=2, metavar=("MODEL", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_compile:
        return child_compile(args)

    global DEVICE
    DEVICE = args.device
    import onnx
    import torch

    dev = torch.cuda.get_device_name(0) if DEVICE == "cuda" else f"cpu ({os.cpu_count()} threads)"
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
        if not args.no_parity:
            try:
                (pw, ph), (as_converted, half_pixel) = parity(path, layout, m)
                print(f"{name:<22} parity at {pw}x{ph}, fp32, against onnxruntime: max |diff| {as_converted:.2e} "
                      f"as converted, {half_pixel:.2e} with the Resizes in half_pixel coordinates", flush=True)
                if out:
                    out.write(json.dumps({"model": name, "parity_size": f"{pw}x{ph}", "max_diff": as_converted,
                                          "max_diff_half_pixel_resize": half_pixel}) + "\n")
            except Exception as e:
                print(f"{name:<22} parity check failed: {type(e).__name__}: {e}", flush=True)
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
                             "--multiple", str(m), "--device", DEVICE],
                            capture_output=True, text=True, timeout=args.compile_timeout)
                        lines = [l for l in child.stdout.splitlines() if l.startswith("CHILD ")]
                        if child.returncode != 0 or not lines:
                            tail = (child.stderr or child.stdout).strip().splitlines()[-3:]
                            raise RuntimeError(" | ".join(tail))
                        r = json.loads(lines[-1][6:])
                        row.update(fps=r["fps"], ms=r["ms"], iters=r["iters"], peak_mb=(r["peak"] or 0) / 1e6,
                                   compile_s=r["compile_s"])
                    else:
                        fps, ms, iters, peak = measure(net, layout, h, w, mode, args.seconds)
                        row.update(fps=fps, ms=ms, iters=iters, peak_mb=peak / 1e6)
                    if row.get("peak_mb") != row.get("peak_mb"):  # NaN (no device memory on the CPU)
                        row["peak_mb"] = None
                except subprocess.TimeoutExpired:
                    row["error"] = f"torch.compile did not finish in {args.compile_timeout:.0f} s"
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                if "error" in row:
                    print(f"{name:<22} {label:<6} {w}x{h:<5} {mode:<13} failed: {row['error']}", flush=True)
                else:
                    extra = f"  (compile {row['compile_s']:.0f} s)" if "compile_s" in row else ""
                    print(f"{name:<22} {label:<6} {w}x{h:<5} {mode:<13} {row['fps']:9.1f} fps {row['ms']:8.2f} ms "
                          f"peak {row['peak_mb'] or 0:8.0f} MB  {gmac:7.1f} GMAC{extra}", flush=True)
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
            del net
            if DEVICE == "cuda":
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
                  f"{r['ms']:.2f} | {r['peak_mb'] or 0:.0f} | {r['gmac']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
