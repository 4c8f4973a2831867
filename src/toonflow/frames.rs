//! Maps GStreamer buffers as NV12 planes for the engine, honouring strides and plane offsets
//! from video meta, and says clearly what is wrong with a buffer that does not fit the caps.

use gst_video::prelude::*;

use crate::pipeline::{FrameGeometry, Nv12Frame, Nv12FrameMut};

/// Runs `f` on `inbuf` and `outbuf` mapped as `geometry`-sized NV12 frames of `info`.
pub fn with_nv12<R>(
    inbuf: &gst::Buffer,
    outbuf: &mut gst::BufferRef,
    info: &gst_video::VideoInfo,
    geometry: FrameGeometry,
    f: impl FnOnce(&Nv12Frame, &mut Nv12FrameMut) -> R,
) -> Result<R, gst::ErrorMessage> {
    let in_frame = gst_video::VideoFrameRef::from_buffer_ref_readable(inbuf.as_ref(), info)
        .map_err(|_| {
            gst::error_msg!(
                gst::StreamError::Format,
                (
                    "Input buffer of {} bytes does not hold a {}x{} NV12 frame ({} bytes)",
                    inbuf.size(),
                    geometry.width,
                    geometry.height,
                    info.size()
                )
            )
        })?;
    let mut out_frame = gst_video::VideoFrameRef::from_buffer_ref_writable(outbuf, info)
        .map_err(|_| gst::error_msg!(gst::CoreError::Failed, ("Cannot map the output buffer")))?;
    let bad_input =
        |e: String| gst::error_msg!(gst::StreamError::Format, ("Bad input frame: {}", e));
    let input = Nv12Frame::new(
        geometry,
        in_frame
            .plane_data(0)
            .map_err(|e| bad_input(e.to_string()))?,
        in_frame.plane_stride()[0] as usize,
        in_frame
            .plane_data(1)
            .map_err(|e| bad_input(e.to_string()))?,
        in_frame.plane_stride()[1] as usize,
    )
    .map_err(bad_input)?;
    let strides = [
        out_frame.plane_stride()[0] as usize,
        out_frame.plane_stride()[1] as usize,
    ];
    let [y, uv, ..] = out_frame.planes_data_mut();
    let mut output = Nv12FrameMut::new(geometry, y, strides[0], uv, strides[1])
        .map_err(|e| gst::error_msg!(gst::CoreError::Failed, ("Bad output frame: {}", e)))?;
    Ok(f(&input, &mut output))
}
