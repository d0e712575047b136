use super::device;
use super::error::CudaError;
use cudarc::driver::sys::{self, CUcontext};
use parking_lot::Mutex;
use std::sync::{Arc, OnceLock};

/// The first driver (CUDA 12.0) whose 64-bit stream writes need no opt-in.
const FIRST_64_BIT_STREAM_WRITES: u32 = 12000;

/// The primary context of one GPU, retained for the life of the process and made current on
/// whichever thread is about to call the driver.
#[derive(Debug)]
pub struct Context {
    raw: CUcontext,
    ordinal: u32,
}

// SAFETY: a CUcontext is a driver handle usable from any thread once made current there
// (`bind`); the primary context is never destroyed while the process runs.
unsafe impl Send for Context {}
// SAFETY: as above; `&Context` only ever passes the handle to thread-safe driver calls.
unsafe impl Sync for Context {}

impl Context {
    /// The primary context of GPU `ordinal`, retained once per process.
    pub fn get(ordinal: u32) -> Result<Arc<Context>, CudaError> {
        // Initialises the driver on first use, so a context can be had before any engine.
        super::Driver::get().ready()?;
        static CONTEXTS: OnceLock<Mutex<Vec<Arc<Context>>>> = OnceLock::new();
        let mut contexts = CONTEXTS.get_or_init(Mutex::default).lock();
        if let Some(context) = contexts.iter().find(|context| context.ordinal == ordinal) {
            return Ok(Arc::clone(context));
        }
        let device = device::handle(ordinal)?;
        let mut raw: CUcontext = std::ptr::null_mut();
        // SAFETY: `device` is valid and `raw` is a valid place for the context handle; the
        // retain is never released, so the context lives as long as the process.
        CudaError::check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, device)
        })?;
        let context = Arc::new(Context { raw, ordinal });
        contexts.push(Arc::clone(&context));
        Ok(context)
    }

    /// Makes this context current on the calling thread. Cheap; call it before driver work.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `raw` is a retained primary context, valid for the process's life.
        CudaError::check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }

    /// Lets this context's GPU read and write `peer`'s memory directly (over NVLink where
    /// present). Enabling it twice is not an error.
    pub fn enable_peer_access(&self, peer: &Context) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: both are retained primary contexts; this one is current; flags must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.raw, 0) } {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            other => CudaError::check("cuCtxEnablePeerAccess", other),
        }
    }

    /// The driver's handle, for the other wrappers of this layer.
    pub(super) fn raw(&self) -> CUcontext {
        self.raw
    }

    /// The GPU ordinal this context belongs to.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Whether streams of this GPU can queue 64-bit stores ([`super::Stream::write_value64`]):
    /// a driver of CUDA 12 or later that reports the GPU able to.
    pub fn can_write_values64(&self) -> Result<bool, CudaError> {
        if super::Driver::get().version() < FIRST_64_BIT_STREAM_WRITES {
            return Ok(false);
        }
        let able = device::attribute(
            self.ordinal,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
            "cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS)",
        )?;
        Ok(able != 0)
    }

    /// Number of streaming multiprocessors of this context's GPU (132 on an H100/H200 SXM).
    pub fn multiprocessors(&self) -> Result<u32, CudaError> {
        device::multiprocessors(self.ordinal)
    }
}
