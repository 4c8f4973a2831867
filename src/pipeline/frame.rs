//! NV12 frame geometry and borrowed views of frame memory with explicit strides.

/// Size of an NV12 frame and of its planes. Width and height are even (the caps enforce it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameGeometry {
    pub width: usize,
    pub height: usize,
}

impl FrameGeometry {
    /// Smallest plane the filters handle: one chroma sample per axis (2x2 luma).
    pub const MIN_SIZE: usize = 2;
    pub const MAX_SIZE: usize = 8192;

    /// Validates a size against what the element supports.
    pub fn new(width: usize, height: usize) -> Result<FrameGeometry, String> {
        let range = Self::MIN_SIZE..=Self::MAX_SIZE;
        if !range.contains(&width) || !range.contains(&height) {
            return Err(format!(
                "frame size {width}x{height} is outside {}x{} to {}x{}",
                Self::MIN_SIZE,
                Self::MIN_SIZE,
                Self::MAX_SIZE,
                Self::MAX_SIZE
            ));
        }
        if !width.is_multiple_of(2) || !height.is_multiple_of(2) {
            return Err(format!(
                "frame size {width}x{height} must have even width and height"
            ));
        }
        Ok(FrameGeometry { width, height })
    }

    pub fn luma_pixels(&self) -> usize {
        self.width * self.height
    }
    pub fn chroma_width(&self) -> usize {
        self.width / 2
    }
    pub fn chroma_height(&self) -> usize {
        self.height / 2
    }
    pub fn chroma_pixels(&self) -> usize {
        self.chroma_width() * self.chroma_height()
    }
    /// Bytes of a tightly packed NV12 frame.
    pub fn nv12_bytes(&self) -> usize {
        self.luma_pixels() + 2 * self.chroma_pixels()
    }
}

/// A read-only NV12 frame: a Y plane and an interleaved UV plane, each with its own stride.
#[derive(Debug, Clone, Copy)]
pub struct Nv12Frame<'a> {
    pub geometry: FrameGeometry,
    pub y: &'a [u8],
    pub y_stride: usize,
    pub uv: &'a [u8],
    pub uv_stride: usize,
}

/// A writable NV12 frame.
#[derive(Debug)]
pub struct Nv12FrameMut<'a> {
    pub geometry: FrameGeometry,
    pub y: &'a mut [u8],
    pub y_stride: usize,
    pub uv: &'a mut [u8],
    pub uv_stride: usize,
}

fn check_plane(
    name: &str,
    len: usize,
    stride: usize,
    row_bytes: usize,
    rows: usize,
) -> Result<(), String> {
    if stride < row_bytes {
        return Err(format!(
            "{name} stride {stride} is shorter than a row ({row_bytes} bytes)"
        ));
    }
    let needed = stride * (rows - 1) + row_bytes;
    if len < needed {
        return Err(format!(
            "{name} plane holds {len} bytes, the frame needs {needed}"
        ));
    }
    Ok(())
}

impl<'a> Nv12Frame<'a> {
    /// Checks that the planes hold the whole frame, so no access can run past their end.
    pub fn new(
        geometry: FrameGeometry,
        y: &'a [u8],
        y_stride: usize,
        uv: &'a [u8],
        uv_stride: usize,
    ) -> Result<Self, String> {
        let frame = Nv12Frame {
            geometry,
            y,
            y_stride,
            uv,
            uv_stride,
        };
        frame.check()?;
        Ok(frame)
    }

    /// Checks again that the planes hold the whole frame (the fields are public).
    pub fn check(&self) -> Result<(), String> {
        check_plane(
            "Y",
            self.y.len(),
            self.y_stride,
            self.geometry.width,
            self.geometry.height,
        )?;
        check_plane(
            "UV",
            self.uv.len(),
            self.uv_stride,
            self.geometry.width,
            self.geometry.chroma_height(),
        )
    }

    /// A tightly packed frame (Y then UV) in one slice.
    pub fn packed(geometry: FrameGeometry, data: &'a [u8]) -> Result<Self, String> {
        if data.len() < geometry.nv12_bytes() {
            return Err(format!(
                "buffer holds {} bytes, a {}x{} NV12 frame needs {}",
                data.len(),
                geometry.width,
                geometry.height,
                geometry.nv12_bytes()
            ));
        }
        let (y, uv) = data.split_at(geometry.luma_pixels());
        Self::new(geometry, y, geometry.width, uv, geometry.width)
    }
}

impl<'a> Nv12FrameMut<'a> {
    /// Checks again that the planes hold the whole frame (the fields are public).
    pub fn check(&self) -> Result<(), String> {
        Nv12Frame {
            geometry: self.geometry,
            y: self.y,
            y_stride: self.y_stride,
            uv: self.uv,
            uv_stride: self.uv_stride,
        }
        .check()
    }

    pub fn new(
        geometry: FrameGeometry,
        y: &'a mut [u8],
        y_stride: usize,
        uv: &'a mut [u8],
        uv_stride: usize,
    ) -> Result<Self, String> {
        check_plane("Y", y.len(), y_stride, geometry.width, geometry.height)?;
        check_plane(
            "UV",
            uv.len(),
            uv_stride,
            geometry.width,
            geometry.chroma_height(),
        )?;
        Ok(Nv12FrameMut {
            geometry,
            y,
            y_stride,
            uv,
            uv_stride,
        })
    }

    pub fn packed(geometry: FrameGeometry, data: &'a mut [u8]) -> Result<Self, String> {
        if data.len() < geometry.nv12_bytes() {
            return Err(format!(
                "buffer holds {} bytes, a {}x{} NV12 frame needs {}",
                data.len(),
                geometry.width,
                geometry.height,
                geometry.nv12_bytes()
            ));
        }
        let (y, uv) = data.split_at_mut(geometry.luma_pixels());
        let w = geometry.width;
        Self::new(geometry, y, w, uv, w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_rejects_odd_tiny_and_huge_sizes() {
        assert!(FrameGeometry::new(16, 16).is_ok());
        assert!(FrameGeometry::new(18, 14).is_ok());
        assert!(FrameGeometry::new(2, 2).is_ok());
        assert!(FrameGeometry::new(17, 16).is_err());
        assert!(FrameGeometry::new(16, 15).is_err());
        assert!(FrameGeometry::new(0, 16).is_err());
        assert!(FrameGeometry::new(8194, 16).is_err());
        assert!(FrameGeometry::new(8192, 8192).is_ok());
    }

    #[test]
    fn short_planes_are_refused() {
        let g = FrameGeometry::new(16, 16).unwrap();
        let data = vec![0u8; g.nv12_bytes() - 1];
        assert!(Nv12Frame::packed(g, &data).is_err());
        let y = vec![0u8; 32 * 15 + 16];
        let uv = vec![0u8; 32 * 8];
        assert!(Nv12Frame::new(g, &y, 32, &uv, 32).is_ok());
        assert!(Nv12Frame::new(g, &y[..y.len() - 1], 32, &uv, 32).is_err());
        assert!(Nv12Frame::new(g, &y, 8, &uv, 32).is_err());
    }

    #[test]
    fn nv12_size() {
        let g = FrameGeometry::new(1920, 1080).unwrap();
        assert_eq!(g.nv12_bytes(), 1920 * 1080 * 3 / 2);
    }
}
