//! The small part of libgstcuda-1.0 (gst-plugins-bad's CUDA library, GStreamer 1.22+) that
//! toonflow uses for zero-copy with nvcodec: the `GstCudaContext` shared through a `GstContext`
//! of type `gst.cuda.context`, `GstCudaMemory` recognition and the `GstCudaBufferPool`.
//!
//! No Rust bindings exist (the `gstreamer-cuda` crate is an empty placeholder), so the few
//! functions are declared here and resolved with `dlopen` at first use: where
//! libgstcuda-1.0.so.0 is absent the plugin still loads and runs in system memory
//! ([`api`] then says why). The declarations follow the 1.22 headers
//! (`gst/cuda/gstcudacontext.h`, `gstcudamemory.h`, `gstcudabufferpool.h`, `gstcudautils.h`).

use std::ffi::c_void;
use std::ptr::NonNull;

use cudarc::driver::sys::{CUcontext, CUdevice, CUdeviceptr};

pub use super::pipeline::DeviceNv12;
use gst::glib;
use gst::glib::translate::{FromGlibPtrFull, ToGlibPtr};
use gst::prelude::*;
use once_cell::sync::Lazy;

/// `GST_CUDA_CONTEXT_TYPE`: the GstContext type nvcodec elements share their context under.
pub const CONTEXT_TYPE: &str = "gst.cuda.context";
/// `GST_CAPS_FEATURE_MEMORY_CUDA_MEMORY`.
pub const CAPS_FEATURE_MEMORY_CUDA_MEMORY: &str = "memory:CUDAMemory";
/// `GST_MAP_CUDA` (`GST_MAP_FLAG_LAST << 1`): map a GstCudaMemory for CUDA access, the mapped
/// address is a `CUdeviceptr`.
pub const MAP_CUDA: u32 = gst::ffi::GST_MAP_FLAG_LAST << 1;
/// The library's file name (Debian 12: libgstreamer-plugins-bad1.0-0).
pub const LIBRARY: &str = "libgstcuda-1.0.so.0";

type GBoolean = glib::ffi::gboolean;
/// `GstCudaContext *` (a GstObject; its struct is private enough to stay opaque here).
type RawContext = *mut gst::ffi::GstObject;

/// The head of `struct _GstCudaMemory`: a GstMemory followed by its context (public fields).
#[repr(C)]
struct CudaMemoryHead {
    mem: gst::ffi::GstMemory,
    context: RawContext,
}

/// The resolved entry points. The library stays loaded for the life of the process.
pub struct Api {
    _library: libloading::Library,
    load_library: unsafe extern "C" fn() -> GBoolean,
    context_new: unsafe extern "C" fn(u32) -> RawContext,
    context_new_wrapped: unsafe extern "C" fn(CUcontext, CUdevice) -> RawContext,
    context_get_handle: unsafe extern "C" fn(RawContext) -> *mut c_void,
    memory_init_once: unsafe extern "C" fn(),
    is_cuda_memory: unsafe extern "C" fn(*mut gst::ffi::GstMemory) -> GBoolean,
    buffer_pool_new: unsafe extern "C" fn(RawContext) -> *mut gst::ffi::GstBufferPool,
    handle_set_context: unsafe extern "C" fn(
        *mut gst::ffi::GstElement,
        *mut gst::ffi::GstContext,
        i32,
        *mut RawContext,
    ) -> GBoolean,
    handle_context_query: unsafe extern "C" fn(
        *mut gst::ffi::GstElement,
        *mut gst::ffi::GstQuery,
        RawContext,
    ) -> GBoolean,
    context_new_cuda_context: unsafe extern "C" fn(RawContext) -> *mut gst::ffi::GstContext,
}

static API: Lazy<Result<Api, String>> = Lazy::new(load);

fn load() -> Result<Api, String> {
    // SAFETY: loading libgstcuda runs only its (GLib-style, side-effect free) initialisers; the
    // symbols below are resolved with the signatures of the 1.22 headers.
    unsafe {
        let library = libloading::Library::new(LIBRARY)
            .map_err(|e| format!("{LIBRARY} cannot be loaded: {e}"))?;
        macro_rules! sym {
            ($name:literal) => {
                *library
                    .get(concat!($name, "\0").as_bytes())
                    .map_err(|e| format!("{LIBRARY} has no {}: {e}", $name))?
            };
        }
        let api = Api {
            load_library: sym!("gst_cuda_load_library"),
            context_new: sym!("gst_cuda_context_new"),
            context_new_wrapped: sym!("gst_cuda_context_new_wrapped"),
            context_get_handle: sym!("gst_cuda_context_get_handle"),
            memory_init_once: sym!("gst_cuda_memory_init_once"),
            is_cuda_memory: sym!("gst_is_cuda_memory"),
            buffer_pool_new: sym!("gst_cuda_buffer_pool_new"),
            handle_set_context: sym!("gst_cuda_handle_set_context"),
            handle_context_query: sym!("gst_cuda_handle_context_query"),
            context_new_cuda_context: sym!("gst_context_new_cuda_context"),
            _library: library,
        };
        // libgstcuda calls the driver through its own loader: nothing works before it has
        // found libcuda (and it must not be asked to when there is none).
        if (api.load_library)() == glib::ffi::GFALSE {
            return Err(format!("{LIBRARY} cannot load the CUDA driver library"));
        }
        (api.memory_init_once)();
        Ok(api)
    }
}

/// libgstcuda and the driver through it, or why not (loaded once per process).
pub fn api() -> Result<&'static Api, String> {
    API.as_ref().map_err(Clone::clone)
}

/// A `GstCudaContext` (one reference, released on drop).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GstCudaContext(glib::Object);

// SAFETY: GstCudaContext is a GstObject, thread safe like every GstObject; its CUcontext is
// shared by design.
unsafe impl Send for GstCudaContext {}
// SAFETY: as above.
unsafe impl Sync for GstCudaContext {}

impl GstCudaContext {
    /// # Safety
    /// `raw` is a valid `GstCudaContext *` whose reference the caller gives away.
    unsafe fn from_full(raw: RawContext) -> Option<Self> {
        let raw = NonNull::new(raw)?;
        // SAFETY: the caller gives a full reference to a GObject.
        Some(GstCudaContext(unsafe {
            glib::Object::from_glib_full(raw.as_ptr() as *mut glib::gobject_ffi::GObject)
        }))
    }

    fn raw(&self) -> RawContext {
        self.0.as_ptr() as RawContext
    }

    /// A GstCudaContext around `ctx` (`gst_cuda_context_new_wrapped`): it does not own the
    /// CUDA context.
    ///
    /// # Safety
    /// `ctx` is a live context of `device` that outlives the result (toonflow's primary
    /// contexts live for the process).
    pub unsafe fn wrap(ctx: CUcontext, device: CUdevice) -> Result<Self, String> {
        let api = api()?;
        // SAFETY: `ctx` is a live context of `device` (caller); the result is a full reference.
        unsafe { Self::from_full((api.context_new_wrapped)(ctx, device)) }
            .ok_or_else(|| "gst_cuda_context_new_wrapped failed".into())
    }

    /// A new GstCudaContext owning a new CUDA context on `device_id` (`gst_cuda_context_new`,
    /// what an nvcodec element makes when the pipeline has none).
    pub fn new_owned(device_id: u32) -> Result<Self, String> {
        let api = api()?;
        // SAFETY: plain constructor; the result is a full reference or NULL.
        unsafe { Self::from_full((api.context_new)(device_id)) }
            .ok_or_else(|| format!("gst_cuda_context_new({device_id}) failed"))
    }

    /// The `CUcontext` it wraps (owned by the GstCudaContext or by whoever wrapped it).
    pub fn handle(&self) -> CUcontext {
        let api = api().expect("a GstCudaContext exists only once libgstcuda is loaded");
        // SAFETY: `self` is a valid GstCudaContext.
        unsafe { (api.context_get_handle)(self.raw()) as CUcontext }
    }

    /// Its `cuda-device-id` property.
    pub fn device_id(&self) -> u32 {
        self.0.property::<u32>("cuda-device-id")
    }

    /// A `gst.cuda.context` GstContext holding it (persistent, as nvcodec makes them).
    pub fn to_context(&self) -> gst::Context {
        let api = api().expect("a GstCudaContext exists only once libgstcuda is loaded");
        // SAFETY: `self` is valid; the result is a full reference to a new GstContext.
        unsafe { gst::Context::from_glib_full((api.context_new_cuda_context)(self.raw())) }
    }

    /// The GstCudaContext `context` carries when it is a `gst.cuda.context` for `device_id`
    /// (`gst_cuda_handle_set_context` semantics: another device's context is not taken).
    pub fn from_context(
        element: &gst::Element,
        context: &gst::Context,
        device_id: u32,
    ) -> Option<Self> {
        let api = api().ok()?;
        if context.context_type() != CONTEXT_TYPE {
            return None;
        }
        let mut raw: RawContext = std::ptr::null_mut();
        // SAFETY: valid element and context; `raw` starts NULL so the helper fills it with a
        // full reference when the device matches.
        let found = unsafe {
            (api.handle_set_context)(
                element.to_glib_none().0,
                context.to_glib_none().0,
                device_id as i32,
                &mut raw,
            )
        };
        if found == glib::ffi::GFALSE {
            return None;
        }
        // SAFETY: on success `raw` holds a full reference.
        unsafe { Self::from_full(raw) }
    }

    /// The GstCudaContext a `gst.cuda.context` GstContext holds, whatever its device.
    pub fn in_context(context: &gst::Context) -> Option<Self> {
        if context.context_type() != CONTEXT_TYPE {
            return None;
        }
        let object = context.structure().get::<glib::Object>(CONTEXT_TYPE).ok()?;
        Some(GstCudaContext(object))
    }

    /// Answers a `gst.cuda.context` context query with this context; false for other types.
    pub fn answer_query(&self, element: &gst::Element, query: &mut gst::QueryRef) -> bool {
        let Ok(api) = api() else { return false };
        // SAFETY: valid element, writable query (BaseTransform hands queries out writable) and
        // context; the helper only sets the query's context.
        unsafe {
            (api.handle_context_query)(element.to_glib_none().0, query.as_mut_ptr(), self.raw())
                != glib::ffi::GFALSE
        }
    }

    /// A new `GstCudaBufferPool` allocating GstCudaMemory in this context (not yet configured).
    pub fn buffer_pool(&self) -> Result<gst::BufferPool, String> {
        let api = api()?;
        // SAFETY: `self` is valid; the pool comes back ref-sunk (a full reference) or NULL.
        let raw = unsafe { (api.buffer_pool_new)(self.raw()) };
        if raw.is_null() {
            return Err("gst_cuda_buffer_pool_new failed".into());
        }
        // SAFETY: non-NULL full reference to a GstBufferPool.
        Ok(unsafe { gst::BufferPool::from_glib_full(raw) })
    }
}

/// The CUDA context a memory lives in, when it is a GstCudaMemory.
pub fn memory_context(mem: &gst::MemoryRef) -> Option<CUcontext> {
    let api = api().ok()?;
    let raw = mem.as_ptr() as *mut gst::ffi::GstMemory;
    // SAFETY: `raw` is a valid GstMemory; gst_is_cuda_memory only reads its allocator.
    if unsafe { (api.is_cuda_memory)(raw) } == glib::ffi::GFALSE {
        return None;
    }
    // SAFETY: a GstCudaMemory starts with `CudaMemoryHead`; its context is set at allocation
    // and held (a reference) as long as the memory.
    let context = unsafe { (*(raw as *const CudaMemoryHead)).context };
    if context.is_null() {
        return None;
    }
    // SAFETY: `context` is a valid GstCudaContext.
    Some(unsafe { (api.context_get_handle)(context) as CUcontext })
}

/// A buffer mapped for CUDA access as a video frame (`gst_video_frame_map` with
/// `GST_MAP_CUDA`), unmapped on drop.
pub struct MappedCudaFrame {
    frame: gst_video::ffi::GstVideoFrame,
    pub planes: DeviceNv12,
}

impl MappedCudaFrame {
    /// Maps `buffer` (NV12 GstCudaMemory described by `info` and its video meta) for the
    /// device: no host copy; a pending host write is uploaded first by the memory itself.
    ///
    /// # Safety
    /// `buffer` stays alive and unmodified by others until the returned value is dropped, and
    /// is writable when `write` is true.
    pub unsafe fn map(
        buffer: *mut gst::ffi::GstBuffer,
        info: &gst_video::VideoInfo,
        write: bool,
    ) -> Result<Self, String> {
        if info.format() != gst_video::VideoFormat::Nv12 {
            return Err(format!("{:?} is not NV12", info.format()));
        }
        let access = if write {
            gst::ffi::GST_MAP_WRITE
        } else {
            gst::ffi::GST_MAP_READ
        };
        let mut frame = std::mem::MaybeUninit::<gst_video::ffi::GstVideoFrame>::zeroed();
        // SAFETY: valid info and buffer (caller); the frame is written by the call.
        let ok = unsafe {
            gst_video::ffi::gst_video_frame_map(
                frame.as_mut_ptr(),
                info.to_glib_none().0 as *mut _,
                buffer,
                access | MAP_CUDA,
            )
        };
        if ok == glib::ffi::GFALSE {
            return Err("the buffer cannot be mapped for CUDA access".into());
        }
        // SAFETY: mapped successfully, so the frame is initialised.
        let frame = unsafe { frame.assume_init() };
        let planes = DeviceNv12 {
            y: frame.data[0] as CUdeviceptr,
            y_pitch: frame.info.stride[0] as usize,
            uv: frame.data[1] as CUdeviceptr,
            uv_pitch: frame.info.stride[1] as usize,
        };
        Ok(MappedCudaFrame { frame, planes })
    }
}

impl Drop for MappedCudaFrame {
    fn drop(&mut self) {
        // SAFETY: mapped in `map`, unmapped once here.
        unsafe { gst_video::ffi::gst_video_frame_unmap(&mut self.frame) };
    }
}

/// Whether `pool` is a GstCudaBufferPool (its type is registered once libgstcuda has made one).
pub fn is_cuda_pool(pool: &gst::BufferPool) -> bool {
    pool.type_().name() == "GstCudaBufferPool"
}
