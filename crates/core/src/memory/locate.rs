//! Which GPU owns device memory handed to `register`.

use super::region::Location;
use crate::cuda::{DeviceInfo, Driver};
use crate::error::{Error, Result};

/// The location of the device memory at `addr`: the GPU, by UUID and by this process's
/// ordinal, among the `gpus` this process sees.
///
/// # Errors
/// [`Error::Cuda`] when the driver cannot say; [`Error::ApiMisuse`] when the pointer's GPU is
/// not among `gpus`.
pub(crate) fn device_location(addr: u64, gpus: &[DeviceInfo]) -> Result<Location> {
    let pointer = Driver::get().device_pointer(addr)?;
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
