# Sourced by the scripts in scripts/: repository root, dependency check, plugin path.
# shellcheck shell=bash

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export ROOT

# Installs missing Debian packages (asks for sudo when not root), then checks for cargo.
ensure_deps() {
  if ! "$ROOT/scripts/install-deps.sh" --check 2>/dev/null; then
    if [[ $(id -u) -eq 0 ]]; then
      "$ROOT/scripts/install-deps.sh"
    else
      echo "Installing missing Debian packages (sudo apt-get) ..."
      sudo "$ROOT/scripts/install-deps.sh"
    fi
  fi
  if ! command -v cargo >/dev/null; then
    # sudo drops the user's PATH; look where rustup puts cargo
    for d in "${CARGO_HOME:-}" "$HOME/.cargo" "${SUDO_USER:+/home/$SUDO_USER/.cargo}"; do
      if [[ -n "$d" && -x "$d/bin/cargo" ]]; then
        export PATH="$d/bin:$PATH"
        break
      fi
    done
  fi
  command -v cargo >/dev/null || {
    echo "cargo not found: install Rust 1.95 or newer (https://rustup.rs)" >&2
    exit 1
  }
}

# Lets gst-launch-1.0 find the freshly built plugin.
use_built_plugin() {
  local profile=${1:-release}
  export GST_PLUGIN_PATH="$ROOT/target/$profile${GST_PLUGIN_PATH:+:$GST_PLUGIN_PATH}"
}
