//! How GPU memory handed to `register` is described to peers: which GPU owns it and how
//! another process of the host can map it.

use super::region::Location;
use crate::cuda::{
    AllocationHandle, Context, DeviceInfo, DevicePointer, Driver, IpcHandle, FABRIC_HANDLE,
    POSIX_FD_HANDLE,
};
use crate::descriptor::Export;
use crate::error::{Error, Result};

/// Describes `len` bytes of device memory at `addr` and exports it: `cudaMalloc` memory with a
/// legacy IPC handle; VMM memory (one or several allocations back to back) by FABRIC handles
/// when it allows them, else through the engine's fd socket `fd_socket`, in which case the
/// retained allocation handles the socket exports are returned.
///
/// # Errors
/// [`Error::Unsupported`] for memory that cannot be shared (pool memory, VMM memory without a
/// POSIX-fd handle, a `cudaMalloc` range over several allocations), with what to do instead;
/// [`Error::Cuda`] when a driver call fails.
pub(crate) fn export_device(
    addr: u64,
    len: u64,
    gpus: &[DeviceInfo],
    fd_socket: Option<&str>,
) -> Result<(Location, Export, Vec<AllocationHandle>)> {
    let pointer = Driver::get().device_pointer(addr)?;
    let location = location_of(&pointer, gpus)?;
    if !pointer.legacy_ipc && pointer.handle_types & FABRIC_HANDLE != 0 {
        let (pieces, handles) = vmm_pieces(addr, len, pointer, FABRIC_HANDLE)?;
        let fabric = handles
            .iter()
            .map(|handle| handle.export_fabric().map(|bytes| hex(&bytes)))
            .collect::<Result<Vec<_>, _>>()?;
        let export = Export::Fabric {
            handles: fabric,
            offset: addr - pointer.allocation_base,
            pieces,
        };
        return Ok((location, export, Vec::new()));
    }
    if !pointer.legacy_ipc && pointer.handle_types & POSIX_FD_HANDLE != 0 {
        let socket = fd_socket.ok_or_else(|| Error::Unsupported {
            memory: "VMM GPU memory".into(),
            addr,
            remedy: "the engine's fd-passing socket could not be opened (see the log); VMM memory cannot be shared without it".into(),
        })?;
        let (pieces, handles) = vmm_pieces(addr, len, pointer, POSIX_FD_HANDLE)?;
        let export = Export::VmmFd {
            socket: socket.to_owned(),
            region: addr,
            offset: addr - pointer.allocation_base,
            pieces,
        };
        return Ok((location, export, handles));
    }
    if !pointer.legacy_ipc {
        return Err(Error::Unsupported {
            memory: "GPU memory that cannot be shared (a stream-ordered pool allocation from cudaMallocAsync, or VMM memory created without a POSIX-fd handle type)".into(),
            addr,
            remedy: "allocate it with cudaMalloc (PyTorch's default caching allocator does), or create VMM memory with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch's expandable segments do)".into(),
        });
    }
    let allocation_end = pointer.allocation_base + pointer.allocation_size;
    if addr.checked_add(len).is_none_or(|end| end > allocation_end) {
        return Err(Error::Unsupported {
            memory: format!(
                "cudaMalloc memory spanning several allocations (the one at {:#x} ends {} bytes into the range)",
                pointer.allocation_base,
                allocation_end - addr
            ),
            addr,
            remedy: "register each allocation as its own region".into(),
        });
    }
    let context = Context::get(pointer.ordinal)?;
    let handle = IpcHandle::export(&context, pointer.allocation_base)?;
    let export = Export::CudaIpc {
        handle: handle.to_hex(),
        offset: addr - pointer.allocation_base,
    };
    Ok((location, export, Vec::new()))
}

fn location_of(pointer: &DevicePointer, gpus: &[DeviceInfo]) -> Result<Location> {
    let gpu = gpus
        .iter()
        .find(|gpu| gpu.ordinal == pointer.ordinal)
        .ok_or_else(|| {
            Error::ApiMisuse(format!(
                "GPU ordinal {} of the pointer is not among the visible GPUs",
                pointer.ordinal
            ))
        })?;
    Ok(Location::Device {
        gpu: gpu.uuid,
        ordinal: pointer.ordinal,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Walks the VMM allocations mapped back to back under `addr..addr+len`, each of which must
/// allow `handle_type`, and retains each (the fd server exports POSIX-fd ones on request for
/// as long as the region is registered). Returns their sizes and handles in mapping order.
fn vmm_pieces(
    addr: u64,
    len: u64,
    first: DevicePointer,
    handle_type: u32,
) -> Result<(Vec<u64>, Vec<AllocationHandle>)> {
    let end = addr
        .checked_add(len)
        .ok_or_else(|| Error::ApiMisuse("the range wraps".into()))?;
    let mut pieces = Vec::new();
    let mut handles = Vec::new();
    let mut piece = first;
    loop {
        let piece_end = piece.allocation_base + piece.allocation_size;
        handles.push(AllocationHandle::retain(piece.allocation_base)?);
        pieces.push(piece.allocation_size);
        if piece_end >= end {
            return Ok((pieces, handles));
        }
        piece = Driver::get()
            .device_pointer(piece_end)
            .map_err(|error| Error::Unsupported {
                memory: format!("a range with no GPU memory mapped at {piece_end:#x} ({error})"),
                addr,
                remedy: "register only ranges that are mapped from end to end".into(),
            })?;
        if piece.allocation_base != piece_end || piece.handle_types & handle_type == 0 {
            return Err(Error::Unsupported {
                memory: format!("a range whose allocation at {piece_end:#x} is not a VMM allocation of the same handle type continuing the previous one"),
                addr,
                remedy: "register each allocation on its own".into(),
            });
        }
    }
}
