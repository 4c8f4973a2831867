#!/usr/bin/env bash
# The test command of the README and of CI: formatting, lints, release build, every test
# (unit, element, pipelines/, the RTMP relay through a local nginx, the meson-built C sample,
# the NVRTC compile of the CUDA kernels), then the benchmark smoke test. Installs missing Debian
# packages first (sudo when not root) and NVIDIA's NVRTC wheel into target/nvrtc.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$ROOT"
ensure_deps
# NVRTC needs no GPU: with it the kernels compile here for every target GPU, and the compile
# test fails instead of skipping when it is missing.
ensure_nvrtc
export TOONFLOW_REQUIRE_NVRTC=1
# NVRTC's PTX is cached on disk across processes (src/cuda/ptx_cache.rs): the tests use their own
# cache under target/, emptied here, never the user's ~/.cache; so every kernel build is compiled
# by NVRTC once per run, and test executables after the first read it back.
export TOONFLOW_KERNEL_CACHE=${CARGO_TARGET_DIR:-$ROOT/target}/kernel-cache
rm -rf "$TOONFLOW_KERNEL_CACHE"

start=$(date +%s)
set -x
cargo fmt --check
cargo clippy --all-targets -- -D warnings
cargo build --release
cargo test --release
# The kernel compile test and the GPU tests again with their output shown: which architectures
# compiled (now read back from the kernel cache), and why the GPU tests skipped on a machine
# without CUDA.
cargo test --release --test nvrtc_compile -- --nocapture --skip kernels_assemble_for_every_target_architecture 2>&1 |
  grep -E "compiled|kernel cache|skipped|test result"
cargo test --release --test cuda_parity --test cuda_report --test cuda_faults -- --nocapture 2>&1 \
  | grep -E "skipped|test result|parity|PSNR|timing"
# Benchmark smoke test (the toonflow-bench binary; skipped while it does not exist yet).
if cargo run --release --quiet --bin toonflow-bench -- --help >/dev/null 2>&1; then
  cargo run --release --bin toonflow-bench -- --quick # BENCH: adjust arguments here
fi
set +x
echo "scripts/test.sh: all passed in $(($(date +%s) - start)) s"
