#!/usr/bin/env bash
# rtmp-relay.sh IN_URL OUT_URL — restyle a live RTMP stream (e.g. from OBS) and push it on.
#
#   ./pipelines/rtmp-relay.sh rtmp://127.0.0.1/live/obs rtmp://a.rtmp.youtube.com/live2/KEY
#
# Video: FLV → decoded → NV12 → toonflow → x264enc (tune=zerolatency) → FLV.
# Audio: the AAC track is passed through untouched (aacparse, no re-encode). The input must
#        carry H.264 (or another decodable codec) video and AAC audio, as OBS sends.
# RTMP: rtmp2src/rtmp2sink (GStreamer's own RTMP client, gst-plugins-bad) rather than the
#       librtmp-based rtmpsrc/rtmpsink: rtmp2src ends the stream when the publisher stops, and
#       stops at once on Ctrl-C; rtmpsrc does neither (it blocks in recv() until its timeout).
# Needs: gstreamer1.0-tools, -plugins-base/-good (flvdemux, flvmux), -plugins-bad (rtmp2src,
#        rtmp2sink), -libav (H.264 decoder), -plugins-ugly (x264enc); the toonflow plugin on
#        GST_PLUGIN_PATH (when that is unset, this script uses the repository's target/release).
# Waits for the publisher if it has not started yet; ends (EOS, exit 0) when the publisher
# stops, or on Ctrl-C (exit status 1 when no stream had started).
# Environment: WIDTH/HEIGHT scale before stylizing (default: keep the size),
#              TOONFLOW extra element properties, BITRATE kbit/s (default 4000),
#              KEYINT keyframe interval in frames (default 60).
set -euo pipefail
if (($# != 2)); then
  echo "usage: $0 IN_URL OUT_URL" >&2
  exit 2
fi
in=$1 out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
[[ -z ${GST_PLUGIN_PATH:-} && -f $here/target/release/libgsttoonflow.so ]] &&
  export GST_PLUGIN_PATH="$here/target/release"

size=${WIDTH:+,width=$WIDTH}${HEIGHT:+,height=$HEIGHT}

# shellcheck disable=SC2086 # TOONFLOW is a list of property=value words
exec gst-launch-1.0 -e \
  rtmp2src location="$in" ! flvdemux name=demux \
  demux.video ! queue ! decodebin ! videoconvert ! videoscale ! "video/x-raw,format=NV12$size" \
  ! toonflow ${TOONFLOW:-} \
  ! x264enc tune=zerolatency speed-preset=veryfast bitrate="${BITRATE:-4000}" \
  key-int-max="${KEYINT:-60}" ! h264parse ! queue ! mux. \
  demux.audio ! queue ! aacparse ! queue ! mux. \
  flvmux name=mux streamable=true ! rtmp2sink location="$out"
