//! A buffer pool of page-locked (pinned) host memory, so frames cross PCIe with asynchronous
//! copies at full speed and without a staging copy. Offered upstream in `propose_allocation`
//! and used for output buffers in `decide_allocation` when the CUDA backend runs and downstream
//! brings no pool of its own (downstream's own buffers are registered instead, see hostmem.rs).
//! The memory is portable (page-locked for every context), so a pipeline running in a context
//! adopted from nvcodec gets it too.

use std::sync::Arc;

use cudarc::driver::CudaContext;
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
        pub(super) ctx: Mutex<Option<Arc<CudaContext>>>,
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
            let ctx = self
                .ctx
                .lock()
                .clone()
                .ok_or(gst::FlowError::NotNegotiated)?;
            let pinned = PinnedHostBuffer::in_context(ctx, info.size()).map_err(|e| {
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
    /// A pool of page-locked NV12 buffers for `caps`, allocated in `ctx`.
    pub fn configured(
        ctx: Arc<CudaContext>,
        caps: &gst::Caps,
        min: u32,
        max: u32,
    ) -> Result<(PinnedPool, u32), glib::BoolError> {
        let info = gst_video::VideoInfo::from_caps(caps)?;
        let pool: PinnedPool = glib::Object::new();
        *pool.imp().ctx.lock() = Some(ctx);
        let size = info.size() as u32;
        let mut config = pool.config();
        config.set_params(Some(caps), size, min, max);
        config.add_option("GstBufferPoolOptionVideoMeta");
        pool.set_config(config)?;
        Ok((pool, size))
    }
}

/// Puts `pool` first in `query` (the one upstream and base classes take), in place of any pool
/// already there.
fn put_first(query: &mut gst::query::Allocation, pool: &PinnedPool, size: u32, min: u32) {
    if query.allocation_pools().len() == 0 {
        query.add_allocation_pool(Some(pool), size, min, 0);
    } else {
        query.set_nth_allocation_pool(0, Some(pool), size, min, 0);
    }
}

/// propose_allocation: offers upstream a pinned pool for the query's caps, so upstream that
/// writes into these buffers saves the upload a staging copy. It replaces the plain video pool
/// GstVideoFilter's default proposes: upstream elements such as videotestsrc take the first
/// pool of the answer, and with ours second they never wrote into pinned memory. Returns the
/// line to log at debug level (`Ok`) or as a warning (`Err`).
pub fn offer_upstream(
    query: &mut gst::query::Allocation,
    ctx: Arc<CudaContext>,
) -> Result<Option<String>, String> {
    let (Some(caps), true) = query.get_owned() else {
        return Ok(None);
    };
    let (pool, size) = PinnedPool::configured(ctx, &caps, 2, 0)
        .map_err(|e| format!("no pinned pool for upstream: {e}"))?;
    put_first(query, &pool, size, 2);
    Ok(Some(format!(
        "offering upstream a pinned pool of {size}-byte buffers"
    )))
}

/// Whether `pool` hands out plain system memory, which can be registered with the driver: a
/// generic or video buffer pool with the default allocator (special pools, e.g. a sink's shared
/// memory or dmabuf pool, are replaced by the pinned pool as before).
fn is_system_memory_pool(pool: &gst::BufferPool, query: &gst::query::Allocation) -> bool {
    let plain = pool.type_() == gst::BufferPool::static_type()
        || pool.type_() == gst_video::VideoBufferPool::static_type();
    let sysmem = gst::Allocator::find(Some("SystemMemory"));
    let default_allocator = query
        .allocation_params()
        .next()
        .is_none_or(|(allocator, _)| allocator.is_none_or(|a| Some(&a) == sysmem.as_ref()));
    plain && default_allocator
}

/// decide_allocation: output buffers from downstream's own pool when it brings one (videoconvert
/// does: its buffers are registered with the driver on reuse, see hostmem.rs), otherwise from a
/// pinned pool (x264enc, fakesink, appsink bring none). Returns the line to log at debug level
/// (`Ok`) or as a warning (`Err`).
pub fn use_for_output(
    query: &mut gst::query::Allocation,
    ctx: Arc<CudaContext>,
) -> Result<Option<String>, String> {
    let (Some(caps), _) = query.get_owned() else {
        return Ok(None);
    };
    if let Some((Some(pool), size, min, _)) = query.allocation_pools().next()
        && is_system_memory_pool(&pool, query)
    {
        return Ok(Some(format!(
            "output buffers from downstream's pool ({size} bytes, min {min}), registered on reuse"
        )));
    }
    let min = query.allocation_pools().next().map_or(2, |p| p.2.max(2));
    let (pool, size) = PinnedPool::configured(ctx, &caps, min, 0)
        .map_err(|e| format!("no pinned output pool, downloads go through pageable memory: {e}"))?;
    put_first(query, &pool, size, min);
    Ok(Some(format!(
        "output buffers from a pinned pool ({size} bytes, min {min})"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query_with(pool: &gst::BufferPool) -> gst::query::Allocation<gst::Query> {
        let caps = gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, 64, 32)
            .build()
            .unwrap()
            .to_caps()
            .unwrap();
        let mut query = gst::query::Allocation::new(Some(&caps), true);
        query.add_allocation_pool(Some(pool), 3072, 2, 0);
        query
    }

    #[test]
    fn only_plain_system_memory_pools_of_downstream_are_kept() {
        gst::init().unwrap();
        let video = gst_video::VideoBufferPool::new().upcast::<gst::BufferPool>();
        assert!(is_system_memory_pool(&video, &query_with(&video)));
        let plain = gst::BufferPool::new();
        assert!(is_system_memory_pool(&plain, &query_with(&plain)));
        // A pool of another kind (here toonflow's own type stands for a sink's special pool).
        let special = glib::Object::new::<PinnedPool>().upcast::<gst::BufferPool>();
        assert!(!is_system_memory_pool(&special, &query_with(&special)));
        // A video pool whose memory comes from another allocator.
        let mut query = query_with(&video);
        // gstreamer-rs's allocator of wrapped Rust memory: not the system memory one.
        let other = gst::Memory::from_slice([0u8; 4])
            .allocator()
            .unwrap()
            .clone();
        query.add_allocation_param(Some(&other), gst::AllocationParams::default());
        assert!(!is_system_memory_pool(&video, &query));
        let mut query = query_with(&video);
        query.add_allocation_param(
            gst::Allocator::find(Some("SystemMemory")).as_ref(),
            gst::AllocationParams::default(),
        );
        assert!(is_system_memory_pool(&video, &query));
    }
}
