use super::context::Context;
use super::error::CudaError;
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
        self.0.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    /// Parses [`Self::to_hex`]'s output.
    pub fn from_hex(text: &str) -> Option<IpcHandle> {
        if text.len() != IPC_HANDLE_LEN * 2 || !text.is_ascii() {
            return None;
        }
        let mut bytes = [0u8; IPC_HANDLE_LEN];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[index * 2..index * 2 + 2], 16).ok()?;
        }
        Some(IpcHandle(bytes))
    }
}

/// Another process's allocation mapped into this one; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    base: u64,
    context: Arc<Context>,
}

impl IpcMapping {
    /// Maps the allocation `handle` names, in `context`, with peer access enabled lazily.
    pub fn open(context: Arc<Context>, handle: &IpcHandle) -> Result<IpcMapping, CudaError> {
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
        Ok(IpcMapping { base, context })
    }

    /// Where the allocation's first byte is mapped in this process.
    pub fn base(&self) -> u64 {
        self.base
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
