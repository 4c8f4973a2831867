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
