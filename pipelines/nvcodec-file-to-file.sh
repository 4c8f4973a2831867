#!/usr/bin/env bash
# nvcodec-file-to-file.sh IN OUT.mp4 — restyle an H.264 or H.265 file on an NVIDIA GPU with the
# frames staying in GPU memory: NVDEC decodes into CUDA memory, toonflow reads and writes CUDA
# memory in the same CUDA context, NVENC encodes from it. No frame crosses PCIe.
#
# Cards without NVENC (H100, H200, A100, A30) encode with x264 after one cudadownload per frame
# (the only copy of the frame to the host). ENCODER=x264 forces that path.
#
# Needs: gstreamer1.0-tools, -plugins-base/-good (qtdemux/matroskademux, mp4mux), -plugins-bad
#        (nvcodec: nvh264dec/nvh265dec, cudadownload, nvh264enc, cudaconvert where present;
#        libgstcuda-1.0),
#        -plugins-ugly (x264enc, only without NVENC); the NVIDIA driver with NVDEC/NVENC
#        (libnvcuvid, libnvidia-encode); the toonflow plugin on GST_PLUGIN_PATH (when that is
#        unset, this script uses the repository's target/release).
# Environment: CODEC=h264|h265 (default h264), TOONFLOW="levels=6 device-id=0" extra element
#              properties, BITRATE H.264 kbit/s (default 6000), ENCODER=auto|nvenc|x264,
#              STATS=N print toonflow's statistics every N frames (upload-bytes and
#              download-bytes stay 0 on the zero-copy path).
set -euo pipefail
if (($# != 2)); then
  echo "usage: $0 IN OUT.mp4" >&2
  exit 2
fi
in=$1 out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
[[ -z ${GST_PLUGIN_PATH:-} && -f $here/target/release/libgsttoonflow.so ]] &&
  export GST_PLUGIN_PATH="$here/target/release"

# (gst-inspect's --exists alone also asks for GStreamer's version, which toonflow's 0.x is not.)
have() { gst-inspect-1.0 "$1" >/dev/null 2>&1; }

case ${CODEC:-h264} in
  h264) dec=nvh264dec ;;
  h265 | hevc) dec=nvh265dec ;;
  *) echo "$0: CODEC must be h264 or h265" >&2 && exit 2 ;;
esac
for e in "$dec" cudadownload toonflow; do
  if ! have "$e"; then
    echo "$0: no $e element (nvcodec needs an NVIDIA driver with NVDEC; toonflow its plugin)" >&2
    exit 1
  fi
done

bitrate=${BITRATE:-6000}
encoder=${ENCODER:-auto}
if [[ $encoder != x264 ]] && have nvh264enc; then
  echo "$0: NVENC (nvh264enc): decode, toonflow and encode all in CUDA memory" >&2
  enc=(nvh264enc bitrate="$bitrate")
elif [[ $encoder == nvenc ]]; then
  echo "$0: ENCODER=nvenc but this card or driver has no NVENC (no nvh264enc element)" >&2
  exit 1
else
  echo "$0: no NVENC here: x264enc after cudadownload (one download per frame)" >&2
  enc=(cudadownload ! video/x-raw,format=NV12 ! x264enc speed-preset=veryfast bitrate="$bitrate")
fi

stats=()
[[ -n ${STATS:-} ]] && stats=(stats-interval="$STATS")
# cudaconvert (registered where GStreamer finds NVRTC) passes 8-bit NV12 through untouched and
# converts 10-bit or 4:4:4 on the GPU; without it the input must decode to 8-bit 4:2:0.
convert=()
have cudaconvert && convert=(cudaconvert !)
# shellcheck disable=SC2086 # TOONFLOW is a list of property=value words
exec gst-launch-1.0 -e ${STATS:+-m} \
  filesrc location="$in" ! parsebin ! "$dec" \
  ! "${convert[@]}" "video/x-raw(memory:CUDAMemory),format=NV12" \
  ! toonflow ${TOONFLOW:-} "${stats[@]}" \
  ! "${enc[@]}" ! h264parse ! queue ! mp4mux ! filesink location="$out"
