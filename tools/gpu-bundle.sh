#!/bin/bash
# Builds .gpu/ at the top of this checkout (any worktree): everything a run on a GPU machine that
# has CUDA and a driver but no Rust toolchain and no GStreamer needs.
#   .gpu/gst/       a GStreamer runtime copied from this machine (Debian 12's 1.22): libraries,
#                   core plugins (nvcodec, multifile, rawparse, x264, mp4 ... see PLUGINS), tools
#   .gpu/plugins/   the project's plugin library (libgsttoonflow.so, release)
#   .gpu/tests/     the project's release test executables (cargo test --release --no-run), less
#                   the CPU-only ones (CPU_ONLY_TESTS; TOONFLOW_GPU_BUNDLE_SKIP overrides the list)
#   .gpu/bin/       the project's release executables (toonflow-bench) and tools/h200.sh
#   .gpu/frei0r/    frei0r's cartoon filter, the benchmark's speed peer (when installed here)
#   .gpu/wheels/    onnx2torch for the PyTorch peer (tools/peers/fetch-wheels.sh)
#   .gpu/env.sh     source it first on the GPU machine
#   .gpu/run-tests.sh  runs every test executable of the bundle
# Usage, from anywhere inside the checkout:  tools/gpu-bundle.sh [extra cargo args]
# TOONFLOW_GPU_BUNDLE_TESTS="a b" packs only those test executables (see below).
# TOONFLOW_GPU_BUNDLE_DIR=/path writes the bundle there instead (a helper worktree's bundle must
# sit inside the checkout that the device tool sends, e.g. /work/main/.gpu-<name>/).
# Then, on the GPU machine, with the checkout and .gpu/ beside it:
#   source .gpu/env.sh && .gpu/run-tests.sh          every test, the GPU tests included
#   source .gpu/env.sh && tools/h200.sh parity report element bench
# .gpu/ is listed in the checkout's git exclude file, so git ignores it; a tool that copies only
# what git tracks must be told to take .gpu/ along (it must stay under 64 MiB for that).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
# info/exclude lives in the common git dir, also from a linked worktree (where .git is a file).
exclude=$(git rev-parse --path-format=absolute --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
grep -qxF '/.gpu-*/' "$exclude" 2>/dev/null || echo '/.gpu-*/' >>"$exclude"
# Where cargo puts the build (CARGO_TARGET_DIR, .cargo/config.toml or ./target).
target=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
release=$target/release
out=${TOONFLOW_GPU_BUNDLE_DIR:-$root/.gpu}
rm -rf "$out"
mkdir -p "$out"/{gst/lib,gst/plugins,gst/bin,plugins,tests,bin,frei0r}

# 1. The project's release artifacts.
CPU_ONLY_TESTS="neural_ops neural_models neural_frame neural_frame_emulated cpu_threads nvrtc_compile pipelines relay meson_sample"
# TOONFLOW_GPU_BUNDLE_TESTS="cuda_parity neural_cuda ..." builds and packs only those test
# executables (the others, tract's above all, take minutes to relink); unset, every test.
if [[ -n ${TOONFLOW_GPU_BUNDLE_TESTS:-} ]]; then
  only=()
  for t in $TOONFLOW_GPU_BUNDLE_TESTS; do only+=(--test "$t"); done
  cargo build --release --lib --bins "$@" >/dev/null
else
  only=()
  cargo build --release --all-targets "$@" >/dev/null
fi
cargo test --release --no-run --message-format=json "${only[@]}" "$@" 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"])' |
  while read -r exe; do
    name=${exe##*/}
    name=${name%-*}
    # Tests that never touch the GPU (the CPU reference, the ONNX engine against tract, the
    # kernel source compile) stay here: some link tract and would push the bundle past 64 MiB.
    if [[ " ${TOONFLOW_GPU_BUNDLE_SKIP-$CPU_ONLY_TESTS} " == *" $name "* ]]; then continue; fi
    cp "$exe" "$out/tests/"
  done
cp "$release"/libgsttoonflow.so "$out/plugins/"
find "$release" -maxdepth 1 -type f -perm -u+x -name 'toonflow-*' ! -name '*.d' -exec cp {} "$out/bin/" \;
cp tools/h200.sh "$out/bin/"
# Keep the bundle small.
strip --strip-unneeded "$out"/tests/* "$out"/bin/toonflow-* "$out"/plugins/* 2>/dev/null || true

# 2. A GStreamer runtime from this machine's Debian packages. libav (FFmpeg, about 200 MB with
# its libraries) and pango (textoverlay) stay out to keep the bundle under 64 MiB; the tests
# that need them (or gcc, meson, nginx) are skipped by run-tests.sh, see NEEDS_MORE below.
L=/usr/lib/x86_64-linux-gnu
PLUGINS="nvcodec multifile rawparse coreelements videotestsrc videoconvertscale app videorate
  videoparsersbad x264 openh264 isomp4 matroska playback typefindfunctions png jpeg imagefreeze
  videocrop videobox compositor audiotestsrc audioconvert audioresample flv debug frei0r
  vpx vorbis ogg autodetect voaacenc rtmp2 audioparsers"
for p in $PLUGINS; do
  if [[ -f $L/gstreamer-1.0/libgst$p.so ]]; then
    cp "$L/gstreamer-1.0/libgst$p.so" "$out/gst/plugins/"
  else
    echo "gpu-bundle: plugin $p is not installed here (scripts/install-deps.sh), left out" >&2
  fi
done
if [[ -f /usr/lib/frei0r-1/cartoon.so ]]; then
  cp /usr/lib/frei0r-1/cartoon.so "$out/frei0r/"
fi
cp /usr/bin/gst-launch-1.0 /usr/bin/gst-inspect-1.0 "$out/gst/bin/"
cp "$L/gstreamer1.0/gstreamer-1.0/gst-plugin-scanner" "$out/gst/bin/"
# Every shared library these need, except the C library itself (the GPU machine's is newer) and
# the NVIDIA driver's own libraries (libcuda, libnvrtc come from the GPU machine).
for f in "$out"/gst/plugins/* "$out"/gst/bin/* "$out"/plugins/* "$out"/tests/* "$out"/bin/* "$out"/frei0r/*; do
  ldd "$f" 2>/dev/null | awk '/=> \//{print $3}' || true # scripts are not ELF files
done | sort -u |
  grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libcuda|libnvrtc[^/]*)\.so' |
  while read -r so; do cp -L "$so" "$out/gst/lib/"; done

cat >"$out/env.sh" <<'ENV'
# Source this on the GPU machine: the bundle's GStreamer, the project's plugin and executables.
H=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH=$H/gst/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export GST_PLUGIN_SYSTEM_PATH=$H/gst/plugins
export GST_PLUGIN_PATH=$H/plugins
export TOONFLOW_PLUGIN_DIR=$H/plugins
export GST_PLUGIN_SCANNER=$H/gst/bin/gst-plugin-scanner
export GST_REGISTRY=/tmp/gst-registry-$$.bin
# NVRTC's PTX cache (src/cuda/ptx_cache.rs) in the bundle, not the machine's ~/.cache.
export TOONFLOW_KERNEL_CACHE=${TOONFLOW_KERNEL_CACHE:-$H/kernel-cache}
export FREI0R_PATH=$H/frei0r
export PATH=$H/gst/bin:$H/bin:$PATH
ENV
cat >"$out/run-tests.sh" <<'RUN'
#!/bin/bash
# Runs every test executable of the bundle; exits non-zero if any failed.
H=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rc=0
# The checkout sits at another path there: tests find their fixtures (tests/data) through the
# run-time CARGO_MANIFEST_DIR, as cargo test sets it.
export CARGO_MANIFEST_DIR=$(cd "$H/.." && pwd)
# Test executables that need what the bundle does not carry: gcc, libav and pango (pipelines:
# the demo program), nginx (relay), meson and a C toolchain (meson_sample).
NEEDS_MORE="pipelines relay meson_sample"
for t in "$H"/tests/*; do
  name=${t##*/}
  name=${name%-*}
  if [[ " $NEEDS_MORE " == *" $name "* ]]; then
    echo "== $name: skipped (needs tools the bundle does not carry)"
    continue
  fi
  echo "== $name"
  "$t" "$@" || rc=1
done
exit $rc
RUN
chmod +x "$out/run-tests.sh"
# The PyTorch peer's onnx2torch (tools/peers/torch_peer.py; the GPU machine has no network).
tools/peers/fetch-wheels.sh "$out/wheels" >/dev/null ||
  echo "gpu-bundle: no onnx2torch wheel (offline?): tools/h200.sh peer will not run" >&2
size_mib=$(du -sm "$out" | cut -f1)
echo "gpu-bundle: ${size_mib} MiB in $out"
if ((size_mib >= 64)); then
  echo "gpu-bundle: over the 64 MiB a device run carries; set TOONFLOW_GPU_BUNDLE_SKIP to leave more tests out" >&2
  exit 1
fi
