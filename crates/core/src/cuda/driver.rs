use super::device::{self, DeviceInfo};
use super::error::CudaError;
use super::pointer::{self, DevicePointer, MemoryKind};
use cudarc::driver::sys;
use std::sync::OnceLock;

/// What the run-time probe found about the CUDA driver on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverStatus {
    /// The driver loaded and initialised; `devices` GPUs are visible.
    Ready {
        /// Number of visible CUDA devices.
        devices: u32,
    },
    /// No CUDA driver library could be loaded.
    NoLibrary,
    /// The library loaded but the driver could not be initialised (no GPU, for example).
    InitFailed(CudaError),
}

impl std::fmt::Display for DriverStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DriverStatus::Ready { devices } => write!(f, "CUDA driver ready, {devices} GPU(s)"),
            DriverStatus::NoLibrary => f.write_str("no CUDA driver library (libcuda) found"),
            DriverStatus::InitFailed(error) => {
                write!(f, "CUDA driver present but unusable: {error}")
            }
        }
    }
}

/// The process-wide CUDA driver handle: probed once, then shared.
#[derive(Debug)]
pub struct Driver {
    status: DriverStatus,
    /// `cuDriverGetVersion`, read once with the probe; 0 without a usable driver.
    version: u32,
}

impl Driver {
    /// Probes the driver once per process and returns the shared result. Never panics: a
    /// machine without libcuda or without a GPU gets a status that says so.
    pub fn get() -> &'static Driver {
        static DRIVER: OnceLock<Driver> = OnceLock::new();
        DRIVER.get_or_init(|| {
            let status = probe();
            let version = match status {
                DriverStatus::Ready { .. } => read_version(),
                _ => 0,
            };
            Driver { status, version }
        })
    }

    /// What the probe found.
    pub fn status(&self) -> &DriverStatus {
        &self.status
    }

    /// The CUDA version the driver implements, as `1000 * major + 10 * minor` (13000 for
    /// CUDA 13.0); 0 without a usable driver.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Whether `cuMemcpyBatchAsync` (its CUDA 13 form) can be called: drivers from 13.0 on.
    pub fn has_batched_copies(&self) -> bool {
        self.version() >= 13000
    }

    /// True when the driver initialised, so pointer queries and GPU transports can be used.
    pub fn is_ready(&self) -> bool {
        matches!(self.status, DriverStatus::Ready { .. })
    }

    /// What kind of memory `addr` points to. Without a usable driver every address is
    /// pageable host memory, since nothing else can exist in this process.
    pub fn memory_kind(&self, addr: u64) -> Result<MemoryKind, CudaError> {
        if !self.is_ready() {
            return Ok(MemoryKind::PageableHost);
        }
        pointer::memory_kind(addr)
    }
}

impl Driver {
    /// Describes device memory at `addr`: owning GPU, export kind, allocation bounds.
    pub fn device_pointer(&self, addr: u64) -> Result<DevicePointer, CudaError> {
        self.ready()?;
        pointer::device_pointer(addr)
    }

    /// Every GPU this process sees; empty without a usable driver.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, CudaError> {
        match self.status {
            DriverStatus::Ready { devices } => (0..devices).map(device::info).collect(),
            _ => Ok(Vec::new()),
        }
    }

    /// Whether GPU `from` can map memory of GPU `to` (ordinals of this process).
    pub fn can_access_peer(&self, from: u32, to: u32) -> Result<bool, CudaError> {
        self.ready()?;
        device::can_access_peer(from, to)
    }

    /// `Ok` when the driver initialised, else the reason it did not.
    pub(super) fn ready(&self) -> Result<(), CudaError> {
        match &self.status {
            DriverStatus::Ready { .. } => Ok(()),
            DriverStatus::InitFailed(error) => Err(error.clone()),
            DriverStatus::NoLibrary => Err(CudaError::no_driver("cuInit")),
        }
    }
}

fn read_version() -> u32 {
    let mut version: std::ffi::c_int = 0;
    // SAFETY: the driver is initialised (the probe succeeded) and `version` is a valid place.
    let outcome = CudaError::check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    });
    match outcome {
        Ok(()) => u32::try_from(version).unwrap_or(0),
        Err(_) => 0,
    }
}

fn probe() -> DriverStatus {
    // SAFETY: is_culib_present only tries to open the library by name and closes it again.
    if !unsafe { sys::is_culib_present() } {
        return DriverStatus::NoLibrary;
    }
    // SAFETY: the library is present (checked above), so resolving cuInit succeeds; the flags
    // argument must be 0.
    if let Err(error) = CudaError::check("cuInit", unsafe { sys::cuInit(0) }) {
        return DriverStatus::InitFailed(error);
    }
    let mut count: std::ffi::c_int = 0;
    // SAFETY: the driver is initialised and `count` is a valid place for one int.
    if let Err(error) = CudaError::check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    }) {
        return DriverStatus::InitFailed(error);
    }
    DriverStatus::Ready {
        devices: u32::try_from(count).unwrap_or(0),
    }
}
