//! Memory registration: `ibv_reg_mr` and `ibv_reg_dmabuf_mr`, the two `unsafe` calls of
//! sideway this layer makes on the caller's behalf.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use ::sideway::ibverbs::memory_region::{RegisterMemoryRegionError, RegisterMemoryRegionErrorKind};

use super::failure::{self, errno};
use super::handles::{SidewayMr, SidewayPd};
use super::raw;
use crate::error::VerbsError;
use crate::memory::AccessFlags;

/// The checks verbs makes before it looks at memory, made here so they name the fault as the
/// model does.
fn check(access: AccessFlags, len: u64) -> Result<usize, VerbsError> {
    crate::checks::registration(access, len)?;
    usize::try_from(len).map_err(|_| VerbsError::InvalidSize {
        what: "region length",
        value: len,
        remedy: "register at most the address space's size",
    })
}

/// Registers `len` bytes at `addr` of this process.
///
/// # Errors
/// [`VerbsError::InvalidAccess`], [`VerbsError::InvalidSize`], [`VerbsError::BadAddress`]
/// (`EFAULT`: part of the range is not mapped), [`VerbsError::Failed`] (`ENOMEM` says to raise
/// the locked-memory limit).
pub(super) fn register(
    pd: &SidewayPd,
    addr: u64,
    len: u64,
    access: AccessFlags,
) -> Result<SidewayMr, VerbsError> {
    let length = check(access, len)?;
    let start = usize::try_from(addr).map_err(|_| VerbsError::BadAddress { addr, len })?;
    // SAFETY: sideway asks that the range be valid memory for as long as the region exists.
    // That is not needed for soundness here: `ibv_reg_mr` passes the range to the kernel, which
    // pins its pages and refuses (EFAULT) a range that is not mapped, and nothing in this
    // process ever dereferences it through the region; only the NIC reads and writes it, by
    // DMA, into the pinned pages, and if the process unmaps the range those pages stay pinned
    // until deregistration, so no other memory can be reached. What the NIC writes into memory
    // the caller still uses is the caller's contract, as for every registration.
    let registered = unsafe { pd.inner.reg_mr(start, length, raw::sideway_access(access)) };
    registered
        .map(|inner| SidewayMr { inner })
        .map_err(|error| registration_error("ibv_reg_mr", pd, addr, len, &error))
}

/// Registers `len` bytes of the dma-buf `dmabuf` from `offset`, addressed as `iova`.
///
/// # Errors
/// As [`register`]; [`VerbsError::Unsupported`] when the installed rdma-core (before v34) or
/// the device's driver cannot import dma-bufs.
pub(super) fn register_dmabuf(
    pd: &SidewayPd,
    dmabuf: BorrowedFd<'_>,
    offset: u64,
    len: u64,
    iova: u64,
    access: AccessFlags,
) -> Result<SidewayMr, VerbsError> {
    let length = check(access, len)?;
    // SAFETY: `dmabuf` is borrowed, so the fd stays open for the whole call; the kernel checks
    // that it is a dma-buf and that `offset + len` lies inside it (EINVAL/EFAULT otherwise), and
    // the region holds its own reference to the buffer, so closing the fd afterwards is fine.
    // Nothing in this process dereferences `iova`: it is the address peers and SG entries use,
    // translated by the NIC.
    let registered = unsafe {
        pd.inner.reg_dmabuf_mr(
            offset,
            length,
            iova,
            dmabuf.as_raw_fd(),
            raw::sideway_access(access),
        )
    };
    registered
        .map(|inner| SidewayMr { inner })
        .map_err(|error| match os_error(&error) {
            Some(io) if io.raw_os_error() == Some(errno::EOPNOTSUPP) => VerbsError::Unsupported {
                what: "dma-buf memory registration".to_owned(),
                reason: format!(
                    "ibv_reg_dmabuf_mr on {} answered {io}: rdma-core before v34 lacks it, and \
                     the kernel (5.12 or newer) and the device's driver (mlx5 with dma-buf \
                     support) must import dma-bufs; register through nvidia-peermem or stage \
                     through host memory instead",
                    pd.device
                ),
            },
            _ => registration_error("ibv_reg_dmabuf_mr", pd, iova, len, &error),
        })
}

fn os_error(error: &RegisterMemoryRegionError) -> Option<&io::Error> {
    match &error.0 {
        RegisterMemoryRegionErrorKind::Ibverbs(io) => Some(io),
        _ => None,
    }
}

fn registration_error(
    call: &'static str,
    pd: &SidewayPd,
    addr: u64,
    len: u64,
    error: &RegisterMemoryRegionError,
) -> VerbsError {
    let Some(io) = os_error(error) else {
        return failure::failed(call, error);
    };
    match io.raw_os_error() {
        Some(errno::EFAULT) => VerbsError::BadAddress { addr, len },
        Some(errno::ENOMEM) => VerbsError::Failed {
            call,
            message: format!(
                "{io}: the pages could not be pinned; raise the locked-memory limit (`ulimit -l \
                 unlimited`, or `--ulimit memlock=-1` for a container) or register less"
            ),
        },
        _ => failure::os(call, &pd.device, io),
    }
}
