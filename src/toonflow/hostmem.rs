//! Frames in other elements' host memory at page-locked speed: each buffer's memory is looked up
//! in the process's registration registry (`crate::cuda::hostreg`, the policy), whose record of a
//! block lives as qdata on the block's root GstMemory, so it is dropped (and the block
//! unregistered) when GStreamer frees that memory, before the memory goes.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use gst::glib;
use gst::glib::translate::IntoGlib;
use parking_lot::Mutex;

use crate::cuda::hostreg::{DriverRegistrar, HostBlock, Registry, Sighting, Verdict};

/// Allocators whose memory stays at one host address for its whole life (system memory, and
/// Rust slices such as toonflow's pinned pool): only these are registered.
const STABLE_MEMORY_TYPES: [&str; 2] = ["SystemMemory", "RustGlobalAllocatorMemory"];

type Record = Mutex<Option<Sighting>>;

fn quark() -> glib::ffi::GQuark {
    static QUARK: once_cell::sync::Lazy<glib::ffi::GQuark> = once_cell::sync::Lazy::new(|| {
        glib::Quark::from_str("toonflow-host-registration").into_glib()
    });
    *QUARK
}

unsafe extern "C" fn drop_record(record: glib::ffi::gpointer) {
    // SAFETY: `record` is the `Box<Record>` leaked by `record_of` for this memory; GStreamer
    // calls this once, when the memory is finalised (before it is freed) and never again.
    let record = unsafe { Box::from_raw(record as *mut Record) };
    // A panic must not cross into C: the registration's drop only unregisters.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(record)));
}

/// The record kept on `root` (created empty the first time).
fn record_of(root: &gst::MemoryRef) -> &Record {
    // Two elements may see one memory at once (a tee): one creates its record.
    static INSERT: Mutex<()> = Mutex::new(());
    let _insert = INSERT.lock();
    let object = root.as_ptr() as *mut gst::ffi::GstMiniObject;
    // SAFETY: `object` is a live GstMemory (borrowed from a buffer for this call); qdata calls
    // are thread-safe in GStreamer. The record stays until the memory is finalised, which
    // cannot happen while `root` is borrowed, so the returned reference outlives no use of it.
    unsafe {
        let found = gst::ffi::gst_mini_object_get_qdata(object, quark()) as *const Record;
        if !found.is_null() {
            return &*found;
        }
        let record = Box::into_raw(Box::new(Record::new(None)));
        gst::ffi::gst_mini_object_set_qdata(
            object,
            quark(),
            record as glib::ffi::gpointer,
            Some(drop_record),
        );
        &*record
    }
}

/// The root of `memory` (a sub-memory's allocation) and the block it spans.
fn block_of(memory: &gst::MemoryRef) -> Option<(&gst::MemoryRef, HostBlock)> {
    let mut root = memory;
    while let Some(parent) = root.parent() {
        root = parent;
    }
    if !STABLE_MEMORY_TYPES.iter().any(|t| root.is_type(*t)) {
        return None;
    }
    let map = root.map_readable().ok()?;
    let addr = (map.as_ptr() as usize).checked_sub(root.offset())?;
    Some((
        root,
        HostBlock {
            addr,
            len: root.maxsize(),
        },
    ))
}

/// Looks every memory of `buffer` up (registering it when the policy says so) and returns the
/// buffer's verdict: fast only when all its memory is page-locked.
pub fn prepare(buffer: &gst::BufferRef, frame_bytes: usize, ctx: &Arc<CudaContext>) -> Verdict {
    let registry = Registry::global();
    let mut verdict = Verdict::Fast;
    for memory in buffer.iter_memories() {
        let Some((root, block)) = block_of(memory) else {
            return Verdict::Refused;
        };
        let mut record = record_of(root).lock();
        let v = registry.observe(
            &mut record,
            block,
            frame_bytes,
            || crate::cuda::is_page_locked(block.addr as *const u8),
            || Some(DriverRegistrar::shared(ctx.clone())),
        );
        if !v.is_fast() || verdict == Verdict::Fast {
            verdict = v;
        }
    }
    verdict
}
