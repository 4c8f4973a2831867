#!/bin/bash
# Downloads the Python packages the peers need and the GPU machine lacks (it has torch, onnx,
# onnxruntime and no network) as wheels, for the bundle to carry:
#   tools/peers/fetch-wheels.sh [DIR]      (DIR defaults to .gpu/wheels of this checkout)
# On the GPU machine torch_peer.py finds them there (or under $TOONFLOW_WHEELS) by itself:
# onnx2torch is pure Python, so the wheel is imported straight from the zip.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
dir=${1:-$root/.gpu/wheels}
mkdir -p "$dir"
# onnx2torch's own requirements (numpy, onnx, torch, torchvision) are on the GPU machine.
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" "onnx2torch==1.5.15"
ls "$dir"/*.whl
