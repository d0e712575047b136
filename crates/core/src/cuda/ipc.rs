use super::context::Context;
use super::error::CudaError;
use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUipcMemHandle, CUipcMem_flags};
use std::sync::Arc;

/// Size of a legacy CUDA IPC memory handle.
pub const IPC_HANDLE_LEN: usize = 64;

/// A legacy IPC handle naming a `cudaMalloc` allocation, valid in other processes of the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; IPC_HANDLE_LEN]);

impl IpcHandle {
    /// Exports the allocation that starts at `base` (an allocation base, not an inner pointer).
    pub fn export(context: &Context, base: u64) -> Result<IpcHandle, CudaError> {
        context.bind()?;
        let mut handle = CUipcMemHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        // SAFETY: the context is current and `handle` is a valid place for the result; the
        // driver validates `base` and fails for memory it cannot export.
        CudaError::check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base)
        })?;
        Ok(IpcHandle(handle.reserved.map(|byte| byte as u8)))
    }

    /// The handle as lowercase hex, for descriptors.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses [`Self::to_hex`]'s output (either case); `None` for anything else.
    pub fn from_hex(text: &str) -> Option<IpcHandle> {
        let mut bytes = [0u8; IPC_HANDLE_LEN];
        hex::decode_to_slice(text, &mut bytes).ok()?;
        Some(IpcHandle(bytes))
    }
}

/// Another process's allocation mapped into this one; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    base: u64,
    /// Bytes mapped from `base`, as the driver reports the opened allocation's range.
    len: u64,
    context: Arc<Context>,
}

impl IpcMapping {
    /// Maps the allocation `handle` names, in `context`, with peer access enabled lazily, and
    /// asks the driver how large the mapped allocation really is ([`IpcMapping::len`]).
    ///
    /// # Errors
    /// The driver's error; [`Error::Internal`] when the driver reports an allocation range
    /// that does not hold the address it just mapped.
    pub fn open(context: Arc<Context>, handle: &IpcHandle) -> Result<IpcMapping> {
        context.bind()?;
        let raw = CUipcMemHandle {
            reserved: handle.0.map(|byte| byte as _),
        };
        let mut base = 0u64;
        // SAFETY: the context is current, `base` is a valid place for the mapped address, and
        // the driver validates the handle (garbage fails with an error).
        CudaError::check("cuIpcOpenMemHandle_v2", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                raw,
                CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        // From here on, Drop closes the handle, also when the size query below fails.
        let mut mapping = IpcMapping {
            base,
            len: 0,
            context,
        };
        let mut range_base = 0u64;
        let mut range_len = 0usize;
        // SAFETY: the context is still current (nothing rebound it since the open); `base` is
        // the device address the open just returned; both outputs are valid places.
        CudaError::check("cuMemGetAddressRange_v2", unsafe {
            sys::cuMemGetAddressRange_v2(&mut range_base, &mut range_len, base)
        })?;
        mapping.len = mapped_from(base, range_base, range_len as u64)?;
        Ok(mapping)
    }

    /// Where the allocation's first byte is mapped in this process.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes mapped from [`IpcMapping::base`]: the size of the exporter's whole allocation, as
    /// the driver reports it, whatever the exporter's descriptor claims.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty mapping (the driver never maps one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let outcome = self.context.bind().and_then(|()| {
            // SAFETY: `base` came from cuIpcOpenMemHandle_v2 and is closed exactly once, here.
            CudaError::check("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(self.base)
            })
        });
        if let Err(error) = outcome {
            tracing::warn!(%error, "unmapping a peer's IPC allocation failed");
        }
    }
}

/// Bytes from `base` to the end of the range `range_base..+range_len` that holds it;
/// [`Error::Internal`] when the range does not hold `base` or wraps.
fn mapped_from(base: u64, range_base: u64, range_len: u64) -> Result<u64> {
    range_base
        .checked_add(range_len)
        .filter(|&end| range_base <= base && base < end)
        .map(|end| end - base)
        .ok_or_else(|| {
            Error::internal(format!(
                "cuMemGetAddressRange_v2 reported the range {range_base:#x}..+{range_len}, which does not hold the IPC mapping at {base:#x} it was asked about"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mapped_length_runs_from_the_base_to_the_end_of_the_reported_range() {
        assert_eq!(mapped_from(0x1000, 0x1000, 0x2000).unwrap(), 0x2000);
        assert_eq!(mapped_from(0x1800, 0x1000, 0x2000).unwrap(), 0x1800);
    }

    #[test]
    fn a_reported_range_that_misses_the_mapping_is_an_internal_error_naming_both() {
        for (base, range_base, range_len) in [
            (0x3000, 0x1000, 0x2000),
            (0x0fff, 0x1000, 0x2000),
            (0x1000, 0x1000, 0),
            (u64::MAX, u64::MAX - 1, 4),
        ] {
            match mapped_from(base, range_base, range_len) {
                Err(Error::Internal { what }) => {
                    assert!(
                        what.contains(&format!("{range_base:#x}..+{range_len}")),
                        "{what}"
                    );
                    assert!(what.contains(&format!("{base:#x}")), "{what}");
                }
                other => panic!("expected an internal error, got {other:?}"),
            }
        }
    }

    #[test]
    fn handles_round_trip_through_hex_and_refuse_junk() {
        let mut bytes = [0u8; IPC_HANDLE_LEN];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = (index * 37) as u8;
        }
        let handle = IpcHandle(bytes);
        assert_eq!(IpcHandle::from_hex(&handle.to_hex()), Some(handle));
        assert_eq!(IpcHandle::from_hex("abc"), None);
        assert_eq!(IpcHandle::from_hex(&"zz".repeat(IPC_HANDLE_LEN)), None);
        assert_eq!(IpcHandle::from_hex(&"é".repeat(IPC_HANDLE_LEN)), None);
        assert_eq!(IpcHandle::from_hex(&"+f".repeat(IPC_HANDLE_LEN)), None);
    }
}
