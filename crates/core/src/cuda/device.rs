use super::error::CudaError;
use cudarc::driver::sys::{self, CUdevice, CUuuid};
use std::ffi::{c_char, c_int, CStr};

/// A GPU's UUID: the same in every process, whatever `CUDA_VISIBLE_DEVICES` says. Written
/// as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` does.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GpuId(pub [u8; 16]);

impl std::fmt::Display for GpuId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let id = &self.0;
        write!(
            f,
            "GPU-{}-{}-{}-{}-{}",
            hex::encode(&id[0..4]),
            hex::encode(&id[4..6]),
            hex::encode(&id[6..8]),
            hex::encode(&id[8..10]),
            hex::encode(&id[10..16])
        )
    }
}

impl std::fmt::Debug for GpuId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::str::FromStr for GpuId {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad =
            || format!("{text:?} is not a GPU UUID like GPU-01234567-89ab-cdef-0123-456789abcdef");
        let digits: String = text
            .strip_prefix("GPU-")
            .ok_or_else(bad)?
            .split('-')
            .collect();
        if digits.len() != 32 || !digits.is_ascii() {
            return Err(bad());
        }
        let mut bytes = [0u8; 16];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&digits[index * 2..index * 2 + 2], 16).map_err(|_| bad())?;
        }
        Ok(GpuId(bytes))
    }
}

impl serde::Serialize for GpuId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for GpuId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// One visible GPU, identified so that processes with different `CUDA_VISIBLE_DEVICES` agree.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceInfo {
    /// Ordinal in this process (depends on `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
    /// The GPU's UUID, the same in every process.
    pub uuid: GpuId,
    /// PCI bus id, `0000:18:00.0`.
    pub pci_bus_id: String,
    /// Marketing name, `NVIDIA H200`.
    pub name: String,
}

pub(super) fn handle(ordinal: u32) -> Result<CUdevice, CudaError> {
    let mut device: CUdevice = 0;
    // SAFETY: the driver is initialised (Driver::get succeeded before any caller gets here);
    // `device` is a valid place for the result.
    CudaError::check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut device, ordinal as c_int)
    })?;
    Ok(device)
}

fn text(
    call: &'static str,
    device: CUdevice,
    read: unsafe fn(*mut c_char, c_int, CUdevice) -> sys::CUresult,
) -> Result<String, CudaError> {
    let mut buffer = [0 as c_char; 256];
    // SAFETY: `read` is cuDeviceGetName or cuDeviceGetPCIBusId, which write at most `len`
    // bytes including the terminating NUL into `buffer`.
    CudaError::check(call, unsafe {
        read(buffer.as_mut_ptr(), buffer.len() as c_int, device)
    })?;
    // SAFETY: the driver NUL-terminated the string inside `buffer`.
    Ok(unsafe { CStr::from_ptr(buffer.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

fn uuid(device: CUdevice) -> Result<GpuId, CudaError> {
    let mut uuid = CUuuid { bytes: [0; 16] };
    // SAFETY: `uuid` is a valid CUuuid for the driver to fill.
    CudaError::check("cuDeviceGetUuid_v2", unsafe {
        sys::cuDeviceGetUuid_v2(&mut uuid, device)
    })?;
    Ok(GpuId(uuid.bytes.map(|byte| byte as u8)))
}

/// Describes GPU `ordinal` of this process.
pub(super) fn info(ordinal: u32) -> Result<DeviceInfo, CudaError> {
    let device = handle(ordinal)?;
    Ok(DeviceInfo {
        ordinal,
        uuid: uuid(device)?,
        pci_bus_id: text("cuDeviceGetPCIBusId", device, sys::cuDeviceGetPCIBusId)?,
        name: text("cuDeviceGetName", device, sys::cuDeviceGetName)?,
    })
}

/// Reads one attribute of GPU `ordinal`; `call` names the query in errors.
pub(super) fn attribute(
    ordinal: u32,
    attribute: sys::CUdevice_attribute,
    call: &'static str,
) -> Result<c_int, CudaError> {
    let device = handle(ordinal)?;
    let mut value: c_int = 0;
    // SAFETY: `device` is valid and `value` is a valid place for the attribute.
    CudaError::check(call, unsafe {
        sys::cuDeviceGetAttribute(&mut value, attribute, device)
    })?;
    Ok(value)
}

/// Number of streaming multiprocessors of GPU `ordinal`.
pub(super) fn multiprocessors(ordinal: u32) -> Result<u32, CudaError> {
    let count = attribute(
        ordinal,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        "cuDeviceGetAttribute",
    )?;
    Ok(count.max(1) as u32)
}

/// Whether GPU `from` can map memory of GPU `to` (both ordinals of this process).
pub(super) fn can_access_peer(from: u32, to: u32) -> Result<bool, CudaError> {
    let mut can: c_int = 0;
    let (from, to) = (handle(from)?, handle(to)?);
    // SAFETY: both are valid device handles and `can` is a valid place for the answer.
    CudaError::check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, from, to)
    })?;
    Ok(can != 0)
}

#[cfg(test)]
mod tests {
    use super::GpuId;

    #[test]
    fn gpu_ids_print_and_parse_like_nvidia_smi() {
        let id = GpuId([
            0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0, 1, 2, 3, 4, 5, 6, 7,
        ]);
        let text = id.to_string();
        assert_eq!(text, "GPU-01234567-89ab-cdef-0001-020304050607");
        assert_eq!(text.parse::<GpuId>(), Ok(id));
        assert!("GPU-xyz".parse::<GpuId>().is_err());
        assert!("01234567-89ab-cdef-0001-020304050607"
            .parse::<GpuId>()
            .is_err());
    }
}
