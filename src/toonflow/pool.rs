//! A buffer pool of page-locked (pinned) host memory, so frames cross PCIe with asynchronous
//! copies at full speed and without a staging copy. Offered upstream in `propose_allocation`
//! and used for output buffers in `decide_allocation` when the CUDA backend runs.

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;

use crate::cuda::PinnedHostBuffer;

/// Lets a pinned allocation back a GstMemory.
struct PinnedSlice(PinnedHostBuffer);

impl AsMut<[u8]> for PinnedSlice {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl AsRef<[u8]> for PinnedSlice {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

mod imp {
    use super::*;
    use parking_lot::Mutex;

    #[derive(Default)]
    pub struct PinnedPool {
        pub(super) device_id: Mutex<usize>,
        pub(super) info: Mutex<Option<gst_video::VideoInfo>>,
    }

    #[glib::object_subclass]
    impl ObjectSubclass for PinnedPool {
        const NAME: &'static str = "GstToonflowPinnedPool";
        type Type = super::PinnedPool;
        type ParentType = gst::BufferPool;
    }

    impl ObjectImpl for PinnedPool {}
    impl GstObjectImpl for PinnedPool {}

    impl BufferPoolImpl for PinnedPool {
        fn options() -> &'static [&'static str] {
            static OPTIONS: [&str; 1] = ["GstBufferPoolOptionVideoMeta"];
            &OPTIONS
        }

        fn set_config(&self, config: &mut gst::BufferPoolConfigRef) -> bool {
            let Some((Some(caps), _size, _min, _max)) = config.params() else {
                return false;
            };
            let Ok(info) = gst_video::VideoInfo::from_caps(&caps) else {
                return false;
            };
            *self.info.lock() = Some(info);
            self.parent_set_config(config)
        }

        fn alloc_buffer(
            &self,
            _params: Option<&gst::BufferPoolAcquireParams>,
        ) -> Result<gst::Buffer, gst::FlowError> {
            let info = self
                .info
                .lock()
                .clone()
                .ok_or(gst::FlowError::NotNegotiated)?;
            let device_id = *self.device_id.lock();
            let pinned = PinnedHostBuffer::new(device_id, info.size()).map_err(|e| {
                gst::warning!(gst::CAT_RUST, imp = self, "pinned allocation failed: {e}");
                gst::FlowError::Error
            })?;
            let mut buffer = gst::Buffer::new();
            {
                let b = buffer.get_mut().unwrap();
                b.append_memory(gst::Memory::from_mut_slice(PinnedSlice(pinned)));
                gst_video::VideoMeta::add_full(
                    b,
                    gst_video::VideoFrameFlags::empty(),
                    info.format(),
                    info.width(),
                    info.height(),
                    info.offset(),
                    info.stride(),
                )
                .map_err(|_| gst::FlowError::Error)?;
            }
            Ok(buffer)
        }
    }
}

glib::wrapper! {
    pub struct PinnedPool(ObjectSubclass<imp::PinnedPool>) @extends gst::BufferPool, gst::Object;
}

impl PinnedPool {
    /// A pool of page-locked NV12 buffers for `caps`, registered with CUDA device `device_id`.
    pub fn configured(
        device_id: usize,
        caps: &gst::Caps,
        min: u32,
        max: u32,
    ) -> Result<(PinnedPool, u32), glib::BoolError> {
        let info = gst_video::VideoInfo::from_caps(caps)?;
        let pool: PinnedPool = glib::Object::new();
        *pool.imp().device_id.lock() = device_id;
        let size = info.size() as u32;
        let mut config = pool.config();
        config.set_params(Some(caps), size, min, max);
        config.add_option("GstBufferPoolOptionVideoMeta");
        pool.set_config(config)?;
        Ok((pool, size))
    }
}

/// propose_allocation: offers upstream a pinned pool for the query's caps, so upstream that
/// writes into these buffers saves the upload a staging copy. Returns the line to log at debug
/// level (`Ok`) or as a warning (`Err`).
pub fn offer_upstream(
    query: &mut gst::query::Allocation,
    device_id: usize,
) -> Result<Option<String>, String> {
    let (Some(caps), true) = query.get_owned() else {
        return Ok(None);
    };
    let (pool, size) = PinnedPool::configured(device_id, &caps, 2, 0)
        .map_err(|e| format!("no pinned pool for upstream: {e}"))?;
    query.add_allocation_pool(Some(&pool), size, 2, 0);
    Ok(Some(format!(
        "offering upstream a pinned pool of {size}-byte buffers"
    )))
}

/// decide_allocation: output buffers from a pinned pool, so downloads need no staging copy.
/// Returns the line to log at debug level (`Ok`) or as a warning (`Err`).
pub fn use_for_output(
    query: &mut gst::query::Allocation,
    device_id: usize,
) -> Result<Option<String>, String> {
    let (Some(caps), _) = query.get_owned() else {
        return Ok(None);
    };
    let min = query.allocation_pools().next().map_or(2, |p| p.2.max(2));
    let (pool, size) = PinnedPool::configured(device_id, &caps, min, 0)
        .map_err(|e| format!("no pinned output pool, downloads go through pageable memory: {e}"))?;
    if query.allocation_pools().len() == 0 {
        query.add_allocation_pool(Some(&pool), size, min, 0);
    } else {
        query.set_nth_allocation_pool(0, Some(&pool), size, min, 0);
    }
    Ok(Some(format!(
        "output buffers from a pinned pool ({size} bytes, min {min})"
    )))
}
