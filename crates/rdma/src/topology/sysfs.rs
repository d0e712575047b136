//! What the topology needs from sysfs under a root path (`/` in production, a fake tree in
//! tests). Nothing here fails: what cannot be read is kept with the reason ([`SysfsProblem`]),
//! so that a container with a partial `/sys` still gets an answer, and `ferry probe` can say
//! why.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why sysfs says nothing about a device, or nothing about its ports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum SysfsProblem {
    /// The RDMA device name would read outside its sysfs directory (empty, `.`, `..`, a slash).
    #[error("{name:?} is not an RDMA device name")]
    NotADeviceName {
        /// The name given.
        name: String,
    },
    /// The GPU's PCI address is not one.
    #[error("{text:?} is not a PCI bus id like 0000:18:00.0")]
    NotABusId {
        /// The text given.
        text: String,
    },
    /// A device's sysfs link does not resolve (the entry is missing, or `/sys` is partial).
    #[error("{} cannot be resolved ({source})", link.display())]
    Unresolved {
        /// The link.
        link: PathBuf,
        /// Why.
        #[source]
        source: SharedIoError,
    },
    /// A device's `ports` directory cannot be listed.
    #[error("{} cannot be read ({source})", dir.display())]
    Unreadable {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: SharedIoError,
    },
    /// The `ports` directory holds no readable port state.
    #[error("no port state under {}", dir.display())]
    NoPortState {
        /// The directory.
        dir: PathBuf,
    },
}

/// An I/O error that can be cloned and compared, as the topology that keeps it is: equal when
/// kind, OS error code and words are.
#[derive(Debug, Clone)]
pub(super) struct SharedIoError(Arc<io::Error>);

impl From<io::Error> for SharedIoError {
    fn from(error: io::Error) -> Self {
        SharedIoError(Arc::new(error))
    }
}

impl PartialEq for SharedIoError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.kind() == other.0.kind()
                && self.0.raw_os_error() == other.0.raw_os_error()
                && self.0.to_string() == other.0.to_string())
    }
}

impl Eq for SharedIoError {}

impl fmt::Display for SharedIoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedIoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Whether an RDMA device has a port that can carry traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PortState {
    /// At least one port is ACTIVE.
    Active,
    /// Every port state was read and none is ACTIVE; the states as read.
    Down(String),
    /// No port state could be read; why.
    Unknown(SysfsProblem),
}

/// One RDMA device as sysfs describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct NicInfo {
    /// The verbs device name (`mlx5_0`).
    pub(super) name: String,
    /// The canonical path of its PCI device, or why it is unknown.
    pub(super) path: Result<PathBuf, SysfsProblem>,
    /// Its NUMA node, when the kernel knows it.
    pub(super) numa: Option<u32>,
    /// Its ports' states.
    pub(super) port: PortState,
}

/// A GPU as sysfs describes it.
#[derive(Debug, Clone)]
pub(super) struct GpuInfo {
    /// The canonical path of its PCI device, or why it is unknown.
    pub(super) path: Result<PathBuf, SysfsProblem>,
    /// Its NUMA node, when the kernel knows it.
    pub(super) numa: Option<u32>,
}

/// Reads RDMA device `name`: `<root>/sys/class/infiniband/<name>/device` leads to its PCI
/// device, which holds `numa_node`; `ports/<n>/state` says whether a port is up.
pub(super) fn nic(root: &Path, name: &str) -> NicInfo {
    // A name with a slash would read outside the device directory.
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        let why = SysfsProblem::NotADeviceName {
            name: name.to_owned(),
        };
        return NicInfo {
            name: name.to_owned(),
            path: Err(why.clone()),
            numa: None,
            port: PortState::Unknown(why),
        };
    }
    let dir = root.join("sys/class/infiniband").join(name);
    let path = canonical(&dir.join("device"));
    NicInfo {
        name: name.to_owned(),
        numa: path.as_deref().ok().and_then(numa_node),
        path,
        port: ports(&dir.join("ports")),
    }
}

/// Reads the GPU at PCI address `bdf` (as [`bus_id`] writes it) from
/// `<root>/sys/bus/pci/devices/<bdf>`.
pub(super) fn gpu(root: &Path, bdf: &str) -> GpuInfo {
    let path = canonical(&root.join("sys/bus/pci/devices").join(bdf));
    GpuInfo {
        numa: path.as_deref().ok().and_then(numa_node),
        path,
    }
}

/// A PCI address as sysfs names it: lowercase, with a domain of at least four digits, so
/// that CUDA's `0000:18:00.0`, nvidia-smi's `00000000:18:00.0` and a bare `18:00.0` all give
/// `0000:18:00.0`. `None` for text that is not a PCI address.
pub(super) fn bus_id(text: &str) -> Option<String> {
    let text = text.trim().to_ascii_lowercase();
    let (domain, rest) = match text.matches(':').count() {
        1 => ("0", text.as_str()),
        2 => text.split_once(':')?,
        _ => return None,
    };
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |part: &str, most: usize| {
        !part.is_empty() && part.len() <= most && part.bytes().all(|b| b.is_ascii_hexdigit())
    };
    if !hex(domain, 8) || !hex(bus, 2) || !hex(device, 2) || !hex(function, 1) {
        return None;
    }
    let domain = domain.trim_start_matches('0');
    Some(format!("{domain:0>4}:{bus:0>2}:{device:0>2}.{function}"))
}

/// `link` with every symbolic link resolved, or why it cannot be.
fn canonical(link: &Path) -> Result<PathBuf, SysfsProblem> {
    fs::canonicalize(link).map_err(|error| SysfsProblem::Unresolved {
        link: link.to_owned(),
        source: error.into(),
    })
}

/// The NUMA node in `<pci device>/numa_node`; the kernel writes -1 when it does not know.
fn numa_node(device: &Path) -> Option<u32> {
    let text = fs::read_to_string(device.join("numa_node")).ok()?;
    u32::try_from(text.trim().parse::<i64>().ok()?).ok()
}

/// The state of the ports under `dir` (`ports/<n>/state` holds `4: ACTIVE`).
fn ports(dir: &Path) -> PortState {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) => {
            return PortState::Unknown(SysfsProblem::Unreadable {
                dir: dir.to_owned(),
                source: error.into(),
            })
        }
    };
    let mut ports: Vec<PathBuf> = entries.flatten().map(|entry| entry.path()).collect();
    ports.sort();
    let mut states = Vec::new();
    for port in ports {
        let Ok(state) = fs::read_to_string(port.join("state")) else {
            continue;
        };
        let state = state.trim();
        let (number, name) = state.split_once(':').unwrap_or((state, state));
        if number.trim() == "4" || name.trim() == "ACTIVE" {
            return PortState::Active;
        }
        let port = port.file_name().unwrap_or_default().to_string_lossy();
        states.push(format!("port {port} {}", name.trim()));
    }
    match states.is_empty() {
        true => PortState::Unknown(SysfsProblem::NoPortState {
            dir: dir.to_owned(),
        }),
        false => PortState::Down(states.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::bus_id;

    #[test]
    fn bus_ids_are_written_as_sysfs_names_them() {
        let sysfs = Some("0000:1a:00.0".to_owned());
        assert_eq!(bus_id("0000:1A:00.0"), sysfs);
        assert_eq!(bus_id("00000000:1a:00.0"), sysfs);
        assert_eq!(bus_id("1a:00.0"), sysfs);
        assert_eq!(bus_id(" 0000:1a:00.0\n"), sysfs);
        assert_eq!(bus_id("10000:01:00.0").as_deref(), Some("10000:01:00.0"));
        assert_eq!(bus_id("0000:1a:00"), None);
        assert_eq!(bus_id("../../etc:00.0"), None);
        assert_eq!(bus_id("GPU-0123"), None);
    }
}
