#!/usr/bin/env bash
# The README's main command: builds the plugin (release), makes an 8-second pan/zoom with motion
# over a photo the project ships (tests/data/astronaut.png), runs toonflow on it (backend=auto:
# CUDA where there is a GPU, else the CPU reference) and writes
#   out/demo.mp4          input left, toonflow right, H.264, 1280x360 at 30 fps
#   docs/images/demo-N.png three stills of the same side-by-side frames, 960 px wide
# Installs missing Debian packages first (asks for sudo when not root); needs Rust 1.95+.
# Environment: PHOTO (default tests/data/astronaut.png), WIDTH/HEIGHT per side (640x360),
#              DEMO_SECONDS (8), STILLS directory for the stills (docs/images), OUT (out/demo.mp4).
# The pan/zoom and the side-by-side pipeline are in scripts/demo.c (C, GStreamer, GstController).
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$ROOT"
ensure_deps

photo=${PHOTO:-tests/data/astronaut.png}
out=${OUT:-out/demo.mp4}
stills=${STILLS:-docs/images}
mkdir -p "$(dirname "$out")" "$stills" out

cargo build --release
# shellcheck disable=SC2046 # pkg-config prints several flags
gcc -O2 -Wall -Wextra scripts/demo.c -o out/toonflow-demo \
  $(pkg-config --cflags --libs gstreamer-1.0 gstreamer-controller-1.0)

use_built_plugin release
rm -f "$stills"/demo-[0-9].png
out/toonflow-demo "$photo" "$out" "$stills" "${WIDTH:-640}" "${HEIGHT:-360}" "${DEMO_SECONDS:-8}"

echo
echo "Wrote $out ($(du -h "$out" | cut -f1)) and stills: $(ls "$stills"/demo-[0-9].png | tr '\n' ' ')"
echo "Watch it: gst-play-1.0 $out   (or any video player)"
