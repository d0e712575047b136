use super::context::Context;
use super::error::CudaError;
use super::stream::Stream;
use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUfunction, CUmodule};
use std::ffi::{c_void, CString};
use std::sync::Arc;

/// First driver version with `cuFuncLoad` (CUDA 12.4).
const FUNC_LOAD_FROM: u32 = 12040;

/// GPU code loaded into one GPU's context from PTX text (JIT-compiled by the driver for that
/// GPU); unloaded on drop, after every [`Kernel`] taken from it is gone.
#[derive(Debug)]
pub struct Module {
    raw: CUmodule,
    context: Arc<Context>,
}

// SAFETY: a CUmodule is a driver handle usable from any thread with its context current; every
// method binds the context first.
unsafe impl Send for Module {}
// SAFETY: as above; lookups and unloading are thread-safe driver calls.
unsafe impl Sync for Module {}

impl Module {
    /// Loads `ptx` into `context`.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when `ptx` holds a NUL byte; the driver's error when the PTX is
    /// malformed or newer than the driver understands.
    pub fn load(context: Arc<Context>, ptx: &str) -> Result<Arc<Module>> {
        let text = CString::new(ptx).map_err(|error| {
            Error::ApiMisuse(format!(
                "Module::load: the PTX text holds a NUL byte at {}; pass PTX text without NUL bytes",
                error.nul_position()
            ))
        })?;
        context.bind()?;
        let mut raw: CUmodule = std::ptr::null_mut();
        // SAFETY: the context is current, `text` is NUL-terminated PTX that outlives the call,
        // and `raw` is a valid place for the handle.
        CudaError::check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut raw, text.as_ptr().cast())
        })?;
        Ok(Arc::new(Module { raw, context }))
    }

    /// The kernel called `name` (an `extern "C"` entry point of the PTX).
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when `name` holds a NUL byte; the driver's error when the module
    /// has no such kernel.
    pub fn kernel(self: &Arc<Module>, name: &str) -> Result<Kernel> {
        let symbol = CString::new(name).map_err(|_| {
            Error::ApiMisuse(format!(
                "Module::kernel: the kernel name {name:?} holds a NUL byte; pass the entry point's name as written in the PTX"
            ))
        })?;
        self.context.bind()?;
        let mut raw: CUfunction = std::ptr::null_mut();
        // SAFETY: the module is loaded, `symbol` is NUL-terminated, `raw` is a valid place.
        CudaError::check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut raw, self.raw, symbol.as_ptr())
        })?;
        // Under lazy loading (the default from CUDA 12.2) a kernel is put on the GPU at its
        // first launch, which may wait for the whole context to idle: that never happens while
        // another stream of this process waits for a signal this very launch's transfer would
        // set. Loading it now keeps launches free of that wait.
        if super::Driver::get().version() >= FUNC_LOAD_FROM {
            // SAFETY: `raw` is a function of this loaded module, and its context is current.
            CudaError::check("cuFuncLoad", unsafe { sys::cuFuncLoad(raw) })?;
        }
        Ok(Kernel {
            raw,
            module: Arc::clone(self),
        })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let outcome = self.context.bind().and_then(|()| {
            // SAFETY: the module is loaded and unloaded exactly once, here; no Kernel of it
            // is left (each holds an Arc of the module).
            CudaError::check("cuModuleUnload", unsafe { sys::cuModuleUnload(self.raw) })
        });
        if let Err(error) = outcome {
            tracing::warn!(%error, "unloading a CUDA module failed");
        }
    }
}

/// One kernel argument, passed by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelArg {
    /// A 32-bit integer (`unsigned int`).
    U32(u32),
    /// A 64-bit integer or a device pointer (`unsigned long long`, `T*`).
    U64(u64),
}

/// A kernel of a loaded [`Module`].
#[derive(Debug)]
pub struct Kernel {
    raw: CUfunction,
    module: Arc<Module>,
}

// SAFETY: a CUfunction is a handle into its module, usable from any thread with the module's
// context current; `launch` binds it.
unsafe impl Send for Kernel {}
// SAFETY: cuLaunchKernel is thread-safe.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Queues the kernel on `stream` with `grid` blocks of `block` threads.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when `stream` belongs to another GPU than the kernel's module;
    /// else the driver's error.
    ///
    /// # Safety
    /// 1. `args` must match the kernel's parameters in number, order and width.
    /// 2. Every address the kernel reads or writes with these arguments must stay valid for
    ///    this GPU until the launch completes (an event recorded after it has fired).
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        grid: u32,
        block: u32,
        args: &[KernelArg],
    ) -> Result<()> {
        if !Arc::ptr_eq(stream.context(), &self.module.context) {
            return Err(Error::ApiMisuse(format!(
                "Kernel::launch: the stream belongs to GPU {}, the kernel's module to GPU {}; launch on a stream of the module's GPU",
                stream.context().ordinal(),
                self.module.context.ordinal()
            )));
        }
        self.module.context.bind()?;
        let mut values: Vec<KernelArg> = args.to_vec();
        let mut pointers: Vec<*mut c_void> = values
            .iter_mut()
            .map(|value| match value {
                KernelArg::U32(inner) => (inner as *mut u32).cast(),
                KernelArg::U64(inner) => (inner as *mut u64).cast(),
            })
            .collect();
        // SAFETY: the kernel and stream share the current context (checked above); `pointers`
        // holds one pointer per argument into `values`, both alive across the call, which
        // copies the values; the caller vouches for the signature (1) and the memory (2).
        Ok(CudaError::check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.raw,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream.raw(),
                pointers.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?)
    }
}
