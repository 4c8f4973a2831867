# Sourced by the scripts in scripts/: repository root, dependency check, plugin path.
# shellcheck shell=bash

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export ROOT

# Installs missing Debian packages (asks for sudo when not root), then checks for cargo.
ensure_deps() {
  if ! "$ROOT/scripts/install-deps.sh" --check 2>/dev/null; then
    if [[ $(id -u) -eq 0 ]]; then
      "$ROOT/scripts/install-deps.sh"
    elif command -v sudo >/dev/null; then
      echo "Installing missing Debian packages (sudo apt-get) ..."
      sudo "$ROOT/scripts/install-deps.sh"
    else
      echo "Missing Debian packages and no sudo: run $ROOT/scripts/install-deps.sh as root first" >&2
      exit 1
    fi
  fi
  if ! command -v cargo >/dev/null; then
    # a login shell that has not sourced ~/.cargo/env: look where rustup puts cargo
    for d in "${CARGO_HOME:-}" "$HOME/.cargo"; do
      if [[ -n "$d" && -x "$d/bin/cargo" ]]; then
        export PATH="$d/bin:$PATH"
        break
      fi
    done
  fi
  if ! command -v cargo >/dev/null || ! cargo --version >/dev/null 2>&1; then
    if [[ -n ${SUDO_USER:-} ]]; then
      echo "cargo does not run as root here: run the script without sudo (it asks for sudo" \
        "itself, only to install packages)" >&2
    else
      echo "cargo not found: install Rust 1.95 or newer (https://rustup.rs)" >&2
    fi
    exit 1
  fi
}

# Lets gst-launch-1.0 find the freshly built plugin.
use_built_plugin() {
  local profile=${1:-release}
  export GST_PLUGIN_PATH="$ROOT/target/$profile${GST_PLUGIN_PATH:+:$GST_PLUGIN_PATH}"
}

# NVRTC (CUDA's runtime compiler) for the kernel compile test: it needs no GPU and no driver, only
# the library. Installs NVIDIA's PyPI wheel into target/nvrtc (once; --target leaves the system
# Python alone) and puts its library directory on LD_LIBRARY_PATH, where cudarc's dlopen finds
# libnvrtc.so.12 (one of its candidate names). 12.8 matches cudarc's `cuda-12080` feature.
# Returns non-zero (and says why) when the wheel cannot be installed.
NVRTC_WHEEL=nvidia-cuda-nvrtc-cu12==12.8.93
ensure_nvrtc() {
  local target=${CARGO_TARGET_DIR:-$ROOT/target}/nvrtc
  local lib=$target/nvidia/cuda_nvrtc/lib
  if [[ ! -e $lib/libnvrtc.so.12 ]]; then
    echo "Installing NVRTC ($NVRTC_WHEEL from PyPI) into $target ..."
    local py
    py=$(command -v python3 || true)
    if [[ -z $py ]] || ! "$py" -m pip --version >/dev/null 2>&1; then
      echo "ensure_nvrtc: python3 with pip is missing (scripts/install-deps.sh installs python3-pip)" >&2
      return 1
    fi
    rm -rf "$target"
    "$py" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$target" \
      "$NVRTC_WHEEL" || return 1
    if [[ ! -e $lib/libnvrtc.so.12 ]]; then
      echo "ensure_nvrtc: the wheel has no $lib/libnvrtc.so.12" >&2
      return 1
    fi
  fi
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
