//! The CUDA layer: loads the driver at run time, so one binary serves machines with and without
//! GPUs. Every `unsafe` driver call of ferry lives below this module, wrapped once.
//!
//! The ladder is `cudarc::driver::sys` (raw symbols) -> one thin function per driver call here
//! (returning [`CudaError`]) -> the safe RAII types exported below ([`Context`], [`Stream`],
//! [`Event`], [`IpcMapping`], [`DmaBuf`], [`HostRegistration`]) and the [`Poller`] that turns finished events into
//! futures.

mod buffer;
mod context;
mod device;
mod dmabuf;
mod driver;
mod error;
mod event;
mod fabric;
mod ipc;
mod launch;
mod module;
mod pinned;
mod pointer;
mod poller;
mod registered;
mod stream;
mod transfer;
mod vmm;

pub use buffer::DeviceBuffer;
pub use context::Context;
pub use device::{DeviceInfo, GpuId};
pub use dmabuf::{dmabuf_supported, export_dmabuf, DmaBuf};
pub use driver::{Driver, DriverStatus};
pub use error::CudaError;
pub use event::Event;
pub use fabric::try_fabric_allocation;
pub use ipc::{IpcHandle, IpcMapping, IPC_HANDLE_LEN};
pub use launch::{launch_all, Launcher};
pub use module::{Kernel, KernelArg, Module};
#[cfg(test)]
pub(crate) use pinned::place;
pub use pinned::{PinnedBuffer, PinnedChunk, PinnedSlice};
pub use pointer::{DevicePointer, MemoryKind};
pub use poller::{Completed, Pollable, Poller};
pub use registered::HostRegistration;
pub use stream::Stream;
pub use transfer::{download, upload};
pub use vmm::{
    create_vmm, AllocationHandle, VmmMapping, FABRIC_HANDLE, FABRIC_HANDLE_LEN, POSIX_FD_HANDLE,
};
