//! How GPU memory handed to `register` is described to peers: which GPU owns it and how
//! another process of the host can map it.

use super::region::Location;
use crate::cuda::{Context, DeviceInfo, Driver, IpcHandle};
use crate::descriptor::Export;
use crate::error::{Error, Result};

/// Describes `len` bytes of device memory at `addr` and exports its allocation.
///
/// # Errors
/// [`Error::Unsupported`] for memory this build cannot share yet (VMM memory, ranges over
/// several allocations), with what to do instead; [`Error::Cuda`] when a driver call fails.
pub(crate) fn export_device(
    addr: u64,
    len: u64,
    gpus: &[DeviceInfo],
) -> Result<(Location, Export)> {
    let pointer = Driver::get().device_pointer(addr)?;
    let allocation_end = pointer.allocation_base + pointer.allocation_size;
    if addr.checked_add(len).is_none_or(|end| end > allocation_end) {
        return Err(Error::Unsupported {
            memory: format!(
                "GPU memory spanning several allocations (the one at {:#x} ends {} bytes into the range)",
                pointer.allocation_base,
                allocation_end - addr
            ),
            addr,
            remedy: "register each allocation as its own region; ranges over back-to-back VMM allocations (PyTorch expandable segments) arrive with POSIX-fd export".into(),
        });
    }
    if !pointer.legacy_ipc && pointer.handle_types == 0 {
        return Err(Error::Unsupported {
            memory: "GPU memory that cannot be shared (a stream-ordered pool allocation from cudaMallocAsync, or VMM memory created without an exportable handle type)".into(),
            addr,
            remedy: "allocate it with cudaMalloc (PyTorch's default caching allocator does), or create VMM memory with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR".into(),
        });
    }
    if !pointer.legacy_ipc {
        return Err(Error::Unsupported {
            memory: format!("VMM GPU memory (cuMemCreate, handle types {:#x})", pointer.handle_types),
            addr,
            remedy: "this build shares cudaMalloc memory only; POSIX-fd export of VMM memory comes next. With PyTorch, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False meanwhile".into(),
        });
    }
    let gpu = gpus
        .iter()
        .find(|gpu| gpu.ordinal == pointer.ordinal)
        .ok_or_else(|| {
            Error::ApiMisuse(format!(
                "GPU ordinal {} of the pointer is not among the visible GPUs",
                pointer.ordinal
            ))
        })?;
    let context = Context::get(pointer.ordinal)?;
    let handle = IpcHandle::export(&context, pointer.allocation_base)?;
    Ok((
        Location::Device {
            gpu: gpu.uuid,
            ordinal: pointer.ordinal,
        },
        Export::CudaIpc {
            handle: handle.to_hex(),
            offset: addr - pointer.allocation_base,
        },
    ))
}
