#!/usr/bin/env bash
# rtmp-relay.sh [--once] IN_URL OUT_URL — restyle a live RTMP stream (e.g. from OBS) and push it on.
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
#
# Live: the delay never builds up. Decoded frames wait in a leaky queue of QUEUE_FRAMES frames
#       in front of toonflow: when toonflow (or the encoder) is slower than the input, the oldest
#       waiting frame is dropped, so a frame leaves at most a few frame times after it came in
#       (the output then has fewer frames per second, at the input's timestamps).
# Publisher gone: by default the relay waits for the publisher, relays until it stops (cleanly
#       or killed: the output gets a proper end), waits for it to come back and relays again to
#       the same OUT_URL (a new stream there, with a fresh toonflow: the temporal history
#       starts anew), until Ctrl-C or SIGTERM, which end the stream being relayed (EOS) and
#       exit 0 (stopped while waiting, gst-launch reports that its pipeline did not preroll:
#       nothing was being relayed). RELAY_ONCE=1 (or --once) keeps the one-shot behaviour:
#       one publish is relayed, the script ends (EOS, exit 0) when the publisher stops, or on
#       Ctrl-C (exit status 1 when no stream had started).
# Environment: WIDTH/HEIGHT scale before stylizing (default: keep the size),
#              TOONFLOW extra element properties, BITRATE kbit/s (default 4000),
#              KEYINT keyframe interval in frames (default 60), QUEUE_FRAMES decoded frames
#              waiting for toonflow (default 2), RELAY_ONCE=1 one-shot, RETRY_DELAY seconds
#              between two attempts to connect after a failure (default 1).
set -euo pipefail
once=${RELAY_ONCE:-0}
if [[ ${1:-} == --once ]]; then
  once=1
  shift
fi
if (($# != 2)); then
  echo "usage: $0 [--once] IN_URL OUT_URL" >&2
  exit 2
fi
in=$1 out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
[[ -z ${GST_PLUGIN_PATH:-} && -f $here/target/release/libgsttoonflow.so ]] &&
  export GST_PLUGIN_PATH="$here/target/release"

size=${WIDTH:+,width=$WIDTH}${HEIGHT:+,height=$HEIGHT}
# A queue that holds at most N buffers and drops the oldest when full.
leaky() { echo "queue leaky=downstream max-size-buffers=$1 max-size-bytes=0 max-size-time=0"; }

# shellcheck disable=SC2086,SC2046 # TOONFLOW is a list of property=value words; leaky's words
pipeline=(
  rtmp2src location="$in" ! flvdemux name=demux
  demux.video ! queue ! decodebin ! $(leaky "${QUEUE_FRAMES:-2}")
  ! videoconvert ! videoscale ! "video/x-raw,format=NV12$size"
  ! toonflow ${TOONFLOW:-}
  ! x264enc tune=zerolatency speed-preset=veryfast bitrate="${BITRATE:-4000}"
  key-int-max="${KEYINT:-60}" ! h264parse ! queue ! mux.
  demux.audio ! queue ! aacparse ! queue max-size-buffers=0 max-size-bytes=0
  max-size-time=3000000000 leaky=downstream ! mux.
  flvmux name=mux streamable=true ! rtmp2sink location="$out"
)

if ((once)); then
  exec gst-launch-1.0 -e "${pipeline[@]}"
fi

if ! gst-inspect-1.0 toonflow >/dev/null 2>&1; then
  echo "$0: no toonflow element (build the plugin, or set GST_PLUGIN_PATH)" >&2
  exit 1
fi

# Each publish is relayed by one gst-launch in its own process group (set -m), so that a
# Ctrl-C in the terminal reaches only this script, which then asks gst-launch once for a clean
# end (SIGINT: gst-launch -e sends EOS down the pipeline).
set -m
stopping=0 child=
stop() {
  stopping=1
  if [[ -n $child ]]; then kill -INT "$child" 2>/dev/null || true; fi
}
trap stop INT TERM
session=0
while ((!stopping)); do
  session=$((session + 1))
  echo "rtmp-relay: session $session: waiting for $in" >&2
  started=$SECONDS
  gst-launch-1.0 -e "${pipeline[@]}" &
  child=$!
  status=0
  # wait returns early (above 128) when a trapped signal arrives; wait on until gst-launch has
  # ended, killing it if the clean end takes more than 10 s.
  while kill -0 "$child" 2>/dev/null; do
    wait "$child" && status=0 || status=$?
    if ((stopping)) && kill -0 "$child" 2>/dev/null; then
      for _ in $(seq 100); do
        kill -0 "$child" 2>/dev/null || break
        sleep 0.1
      done
      kill -KILL "$child" 2>/dev/null || true
    fi
  done
  child=
  ((stopping)) && break
  echo "rtmp-relay: session $session ended (status $status) after $((SECONDS - started)) s" >&2
  # A session that failed (server unreachable, refused) is retried after a pause; one that ended
  # because the publisher stopped starts waiting for the next publish at once.
  ((status != 0)) && sleep "${RETRY_DELAY:-1}"
done
echo "rtmp-relay: stopped" >&2
exit 0
