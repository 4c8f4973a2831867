#!/usr/bin/env bash
# test-pattern-to-window.sh — a moving test pattern, stylized by toonflow, in a window.
#
# Needs: gstreamer1.0-tools, -plugins-base (videotestsrc, videoconvert), -plugins-good
#        (autovideosink) and a display; the toonflow plugin on GST_PLUGIN_PATH (when that is unset, this
#        script uses the repository's target/release).
# Environment: PATTERN videotestsrc pattern (default ball), WIDTH/HEIGHT (default 640x360),
#              TOONFLOW extra element properties, NUM_BUFFERS stop after that many frames,
#              SINK the sink (default autovideosink; SINK=fakesink runs without a display).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
[[ -z ${GST_PLUGIN_PATH:-} && -f $here/target/release/libgsttoonflow.so ]] &&
  export GST_PLUGIN_PATH="$here/target/release"

# shellcheck disable=SC2086 # TOONFLOW and SINK are lists of words
exec gst-launch-1.0 -e \
  videotestsrc pattern="${PATTERN:-ball}" ${NUM_BUFFERS:+num-buffers=$NUM_BUFFERS} \
  ! "video/x-raw,width=${WIDTH:-640},height=${HEIGHT:-360},framerate=30/1" \
  ! videoconvert ! video/x-raw,format=NV12 \
  ! toonflow ${TOONFLOW:-} \
  ! videoconvert ! ${SINK:-autovideosink}
