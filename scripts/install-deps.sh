#!/usr/bin/env bash
# Installs the Debian 12 packages toonflow's build, tests, pipelines and demo need.
#   sudo ./scripts/install-deps.sh          install whatever is missing (apt-get)
#   ./scripts/install-deps.sh --check       exit 0 when everything is installed, 1 otherwise
# Shared by scripts/demo.sh, scripts/test.sh and .ci/run. Rust (1.95+) itself is not installed
# here: get it from https://rustup.rs.
set -euo pipefail

PACKAGES=(
  # build: GStreamer headers for gstreamer-rs, pkg-config, a C toolchain for the meson sample
  # (g++: tests/neural_frame_emulated compiles kernels/neural_frame.cu for the host)
  libgstreamer1.0-dev libgstreamer-plugins-base1.0-dev pkg-config gcc g++ libc6-dev
  meson ninja-build ca-certificates git
  # run time: gst-launch/gst-inspect and the elements pipelines/ and the tests use
  gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good
  gstreamer1.0-plugins-bad gstreamer1.0-plugins-ugly gstreamer1.0-libav
  # textoverlay (the demo's labels) and X11 video sinks for the window pipelines
  gstreamer1.0-x
  # frei0r's cartoon filter, the speed peer of the benchmark
  frei0r-plugins
  # the local RTMP server of the relay test
  nginx libnginx-mod-rtmp
  # pip installs NVIDIA's NVRTC wheel for the kernel compile test (scripts/common.sh)
  python3-pip
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ "${1:-}" == "--check" ]]; then
  if ((${#missing[@]})); then
    echo "missing packages: ${missing[*]}" >&2
    exit 1
  fi
  exit 0
fi

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  echo "install-deps: needs root to install: ${missing[*]}" >&2
  echo "run: sudo $0" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
