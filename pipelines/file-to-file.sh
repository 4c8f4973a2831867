#!/usr/bin/env bash
# file-to-file.sh IN OUT.mp4 — restyle a video file with toonflow, write H.264 in MP4.
#
# Needs: gstreamer1.0-tools, -plugins-base/-good/-bad (demuxers, decodebin), -libav (decoders),
#        -plugins-ugly (x264enc); the toonflow plugin on GST_PLUGIN_PATH (when that is unset, this script
#        uses the repository's target/release).
# IN is anything the installed plugins decode (MP4, MKV, WebM, AVI, FLV, MPEG-TS, ...). Video
# only by default; AUDIO=1 also re-encodes the first audio stream to AAC (the input must have one).
# Environment: TOONFLOW="levels=6 edge-strength=0.8" extra element properties,
#              WIDTH/HEIGHT scale before stylizing (default: keep the size),
#              BITRATE H.264 kbit/s (default 4000), NUM_BUFFERS stop after that many frames.
set -euo pipefail
if (($# != 2)); then
  echo "usage: $0 IN OUT.mp4" >&2
  exit 2
fi
in=$1 out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
[[ -z ${GST_PLUGIN_PATH:-} && -f $here/target/release/libgsttoonflow.so ]] &&
  export GST_PLUGIN_PATH="$here/target/release"

size=${WIDTH:+,width=$WIDTH}${HEIGHT:+,height=$HEIGHT}
audio=()
if [[ ${AUDIO:-0} == 1 ]]; then
  aac=avenc_aac
  gst-inspect-1.0 --exists avenc_aac || aac=voaacenc
  audio=(dec. ! queue ! audioconvert ! audioresample ! "$aac" ! aacparse ! queue ! mux.)
fi
# shellcheck disable=SC2086 # TOONFLOW is a list of property=value words
exec gst-launch-1.0 -e \
  filesrc location="$in" ! decodebin name=dec \
  dec. ! queue ! videoconvert ! videoscale ! "video/x-raw,format=NV12$size" \
  ! ${NUM_BUFFERS:+identity eos-after=$((NUM_BUFFERS + 1)) !} \
  toonflow ${TOONFLOW:-} \
  ! x264enc speed-preset=veryfast bitrate="${BITRATE:-4000}" ! h264parse ! queue \
  ! mp4mux name=mux ! filesink location="$out" \
  "${audio[@]}"
