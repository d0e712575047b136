//! dma-buf export of GPU memory (`cuMemGetHandleForAddressRange`): the file descriptor an RDMA
//! NIC registers with `ibv_reg_dmabuf_mr` to read and write GPU memory directly (GPUDirect
//! RDMA) without the nvidia-peermem kernel module.
//!
//! The driver exports only ranges that start and end on host pages and whose memory is on one
//! GPU with identical properties: one `cuMemAlloc` allocation, or VMM allocations mapped back
//! to back. [`export_dmabuf`] checks a range against that before asking, so that a refusal
//! names its cause instead of arriving as a bare `CUDA_ERROR_INVALID_VALUE`, and rounds the
//! range out to whole pages.
//!
//! Rounding out never reaches memory the checks did not cover, except inside a page that the
//! range's first or last allocation already occupies: VMM allocations and large `cuMemAlloc`
//! allocations start and end on page boundaries, while small `cuMemAlloc` allocations share
//! pages with their neighbours. Clamping to such an allocation would give an unaligned range
//! that the driver always refuses, so the whole page is exported, as NCCL does, and the driver
//! has the last word.

use super::context::Context;
use super::device;
use super::error::CudaError;
use super::pointer::{self, DevicePointer, MemoryKind};
use super::Driver;
use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUdevice_attribute, CUmemRangeHandleType};
use std::ffi::c_int;
use std::os::fd::{FromRawFd, OwnedFd};

/// The first driver version with `cuMemGetHandleForAddressRange` (CUDA 11.7). cudarc resolves
/// the symbol on first use and panics when the library lacks it, so older drivers must never
/// reach the call.
const FIRST_DMABUF_DRIVER: u32 = 11070;

/// A dma-buf for GPU memory: byte `k` of the buffer is device address `base + k`.
///
/// The memory must stay allocated (and, for VMM memory, mapped) while the descriptor, or a
/// memory registration made from it, is in use; after remapping, export again. Dropping the
/// descriptor does not free the memory, and a registration holds its own reference to the
/// buffer, so the descriptor may be closed once registered.
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf file descriptor, owned by this value and closed when it drops.
    pub fd: OwnedFd,
    /// Device address of the buffer's first byte; a multiple of the host page size.
    pub base: u64,
    /// Length of the buffer in bytes; a multiple of the host page size.
    pub len: u64,
    /// Ordinal (in this process) of the GPU that holds the memory.
    pub ordinal: u32,
}

/// Whether GPU `ordinal` can export its memory as dma-buf
/// (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`). False on drivers older than CUDA 11.7, which
/// lack the export call.
///
/// # Errors
/// [`CudaError`] when no driver is usable or there is no GPU `ordinal`.
pub fn dmabuf_supported(ordinal: u32) -> Result<bool, CudaError> {
    let driver = Driver::get();
    driver.ready()?;
    if driver.version() < FIRST_DMABUF_DRIVER {
        return Ok(false);
    }
    let supported = device::attribute(
        ordinal,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
        "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)",
    )?;
    Ok(supported != 0)
}

/// Exports GPU memory holding `len` bytes at `addr` as a dma-buf. The buffer covers at least
/// `addr..addr + len`, rounded out to host pages (see the module docs for the rounding).
///
/// The range must lie in one `cuMemAlloc` allocation, or in VMM allocations of one GPU mapped
/// back to back with the same handle types.
///
/// # Errors
/// - [`Error::ApiMisuse`] for `len == 0` or a range that wraps the address space;
/// - [`Error::Unsupported`] for memory that is not GPU memory (host memory, managed memory, an
///   address no allocation holds), for a range that runs past its GPU memory or over memory
///   of different kinds, and when the GPU, its driver or the kernel cannot export dma-buf
///   (the message names nvidia-peermem as the fallback);
/// - [`Error::Cuda`] when no driver is usable or a driver call fails, the export included.
pub fn export_dmabuf(addr: u64, len: u64) -> Result<DmaBuf> {
    Driver::get().ready()?;
    let end = requested_end(addr, len)?;
    let first = device_memory(addr)?;
    if !dmabuf_supported(first.ordinal)? {
        return Err(Error::Unsupported {
            memory: format!(
                "dma-buf export of GPU {} memory (the driver reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0)",
                first.ordinal
            ),
            addr,
            remedy: "dma-buf is not supported by this GPU, driver or kernel (it needs Linux 5.12 or later and NVIDIA's open kernel modules); the fallback is nvidia-peermem: load the nvidia_peermem kernel module and register the GPU memory directly".into(),
        });
    }
    check_mapped(addr, end, &first)?;
    let page = rustix::param::page_size() as u64;
    let (base, span) = page_span(addr, end, page).ok_or_else(|| {
        Error::ApiMisuse(format!(
            "export_dmabuf: {addr:#x}..{end:#x} rounded out to {page}-byte pages runs past the end of the address space; pass a range of GPU memory"
        ))
    })?;
    let size = usize::try_from(span).map_err(|_| {
        Error::ApiMisuse(format!(
            "export_dmabuf: {span} bytes do not fit this machine's size type; export a smaller range"
        ))
    })?;
    Context::get(first.ordinal)?.bind()?;
    let mut fd: c_int = -1;
    // SAFETY: the driver is initialised and the owning GPU's context is current; `base` and
    // `size` are page-aligned (page_span); for DMA_BUF_FD the driver writes one int into `fd`,
    // which outlives the call; flags 0 asks for the default mapping.
    CudaError::check("cuMemGetHandleForAddressRange(DMA_BUF_FD)", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut c_int).cast(),
            base,
            size,
            CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::Internal {
            what: format!(
                "cuMemGetHandleForAddressRange succeeded for {base:#x}+{span} but returned fd {fd}"
            ),
        });
    }
    // SAFETY: the export succeeded, so `fd` is a new descriptor that nothing else owns; it is
    // closed exactly once, when the OwnedFd drops.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(DmaBuf {
        fd,
        base,
        len: span,
        ordinal: first.ordinal,
    })
}

/// The end of `len` bytes at `addr`, refusing an empty range and one that wraps.
fn requested_end(addr: u64, len: u64) -> Result<u64> {
    if len == 0 {
        return Err(Error::ApiMisuse(
            "export_dmabuf: the length is 0; pass the length of the GPU memory to export".into(),
        ));
    }
    addr.checked_add(len).ok_or_else(|| {
        Error::ApiMisuse(format!(
            "export_dmabuf: {len} bytes at {addr:#x} run past the end of the address space; check the address and length"
        ))
    })
}

/// What the driver says about `addr`, refusing anything but GPU memory.
fn device_memory(addr: u64) -> Result<DevicePointer> {
    let memory = match pointer::memory_kind(addr)? {
        MemoryKind::Device => return Ok(pointer::device_pointer(addr)?),
        // The driver cannot tell pageable host memory from an address nothing holds.
        MemoryKind::PageableHost => "pageable host memory, or an address no allocation holds",
        MemoryKind::PinnedHost => "pinned host memory",
        MemoryKind::Managed => "CUDA managed memory",
    };
    Err(Error::Unsupported {
        memory: format!("{memory} (not GPU memory)"),
        addr,
        remedy: "dma-buf export is for GPU memory; register host memory with an ordinary memory registration, and pass GPU memory from cudaMalloc or VMM".into(),
    })
}

/// Checks that GPU memory of the same kind as `first` (which holds `addr`) is mapped without a
/// gap up to `end`, walking VMM pieces: for VMM memory `cuMemGetAddressRange` reports the one
/// piece that holds an address, not the whole mapping.
fn check_mapped(addr: u64, end: u64, first: &DevicePointer) -> Result<()> {
    let mut piece = *first;
    loop {
        let piece_end = piece.allocation_base.saturating_add(piece.allocation_size);
        if piece_end >= end {
            return Ok(());
        }
        let next = match pointer::memory_kind(piece_end)? {
            MemoryKind::Device => pointer::device_pointer(piece_end)?,
            _ => {
                return Err(Error::Unsupported {
                    memory: format!(
                        "a range ending at {end:#x}, past the end of its GPU memory at {piece_end:#x}"
                    ),
                    addr,
                    remedy: "export only ranges inside one allocation, or inside VMM allocations mapped back to back".into(),
                })
            }
        };
        if next.allocation_base != piece_end || !same_kind(&piece, &next) {
            return Err(Error::Unsupported {
                memory: format!(
                    "a range over GPU memory of different kinds or GPUs (at {piece_end:#x}, GPU {} follows GPU {})",
                    next.ordinal, piece.ordinal
                ),
                addr,
                remedy: "the driver exports one dma-buf only over memory of one GPU with identical properties; export each allocation on its own".into(),
            });
        }
        piece = next;
    }
}

/// Whether two allocations could share one dma-buf, as far as pointer attributes tell: same
/// GPU, same allocator, same handle types. The driver checks the rest.
fn same_kind(a: &DevicePointer, b: &DevicePointer) -> bool {
    a.ordinal == b.ordinal && a.legacy_ipc == b.legacy_ipc && a.handle_types == b.handle_types
}

/// `addr..end` rounded out to multiples of `page` (a power of two), as `(base, len)`; `None`
/// when rounding up passes the end of the address space.
fn page_span(addr: u64, end: u64, page: u64) -> Option<(u64, u64)> {
    let mask = page.checked_sub(1)?;
    let base = addr & !mask;
    let last = end.checked_add(mask)? & !mask;
    Some((base, last - base))
}

#[cfg(test)]
mod tests {
    use super::{page_span, requested_end};
    use crate::error::Error;

    #[test]
    fn spans_are_rounded_out_to_whole_pages() {
        const PAGE: u64 = 4096;
        assert_eq!(page_span(0x10000, 0x11000, PAGE), Some((0x10000, 0x1000)));
        assert_eq!(page_span(0x10001, 0x10002, PAGE), Some((0x10000, 0x1000)));
        assert_eq!(page_span(0x10fff, 0x11001, PAGE), Some((0x10000, 0x2000)));
        // 64 KiB pages, as on some aarch64 kernels (GH200).
        assert_eq!(
            page_span(0x2_0010, 0x3_0001, 0x1_0000),
            Some((0x2_0000, 0x2_0000))
        );
    }

    #[test]
    fn a_span_rounded_past_the_address_space_is_refused() {
        assert_eq!(page_span(u64::MAX - 10, u64::MAX, 4096), None);
        assert_eq!(
            page_span(u64::MAX - 8191, u64::MAX - 4095, 4096),
            Some((u64::MAX - 8191, 4096))
        );
    }

    #[test]
    fn empty_and_wrapping_ranges_are_caller_mistakes() {
        assert!(
            matches!(requested_end(0x1000, 0), Err(Error::ApiMisuse(message)) if message.contains("length is 0"))
        );
        assert!(
            matches!(requested_end(u64::MAX, 2), Err(Error::ApiMisuse(message)) if message.contains("past the end"))
        );
        assert_eq!(requested_end(0x1000, 0x10).ok(), Some(0x1010));
    }
}
