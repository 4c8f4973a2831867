#!/usr/bin/env bash
# camera-to-window.sh — a V4L2 camera (webcam), stylized by toonflow, in a window.
#
# Needs: gstreamer1.0-tools, -plugins-base, -plugins-good (v4l2src, jpegdec, autovideosink),
#        a camera at /dev/video0 (or DEVICE) and a display; the toonflow plugin on
#        GST_PLUGIN_PATH (when that is unset, this script uses the repository's target/release).
# Cameras give YUY2, MJPEG or NV12: decodebin decodes MJPEG, videoconvert makes NV12.
# Environment: DEVICE (default /dev/video0), WIDTH/HEIGHT processed size (default 640x480),
#              TOONFLOW extra element properties, NUM_BUFFERS stop after that many frames,
#              SINK the sink (default autovideosink), SOURCE replaces the camera with another
#              source (e.g. SOURCE="videotestsrc is-live=true").
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
[[ -z ${GST_PLUGIN_PATH:-} && -f $here/target/release/libgsttoonflow.so ]] &&
  export GST_PLUGIN_PATH="$here/target/release"

source=${SOURCE:-v4l2src device=${DEVICE:-/dev/video0}}
# shellcheck disable=SC2086 # SOURCE, TOONFLOW and SINK are lists of words
exec gst-launch-1.0 -e \
  $source ${NUM_BUFFERS:+num-buffers=$NUM_BUFFERS} \
  ! decodebin ! videoconvert ! videoscale \
  ! "video/x-raw,format=NV12,width=${WIDTH:-640},height=${HEIGHT:-480}" \
  ! queue max-size-buffers=2 leaky=downstream \
  ! toonflow ${TOONFLOW:-} \
  ! videoconvert ! ${SINK:-autovideosink}
