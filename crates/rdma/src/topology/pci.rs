//! PCI path distance and the kind of path between two devices, from their sysfs paths alone.

use std::fmt;
use std::path::{Component, Path};

/// The kind of PCIe path between a GPU and a NIC, named as NCCL and `nvidia-smi topo -m` name
/// them; the first is the best for GPUDirect RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathClass {
    /// Through at most one PCIe switch (or bridge): the NIC sits next to the GPU.
    Pix,
    /// Through several PCIe switches, without reaching the CPU's host bridge.
    Pxb,
    /// Through the CPU's PCIe host bridge (one root complex).
    Phb,
    /// Between root complexes of one NUMA node.
    Node,
    /// Between NUMA nodes, over the CPUs' interconnect (or NUMA nodes unknown).
    Sys,
}

impl fmt::Display for PathClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PathClass::Pix => "PIX",
            PathClass::Pxb => "PXB",
            PathClass::Phb => "PHB",
            PathClass::Node => "NODE",
            PathClass::Sys => "SYS",
        })
    }
}

/// The distance between two devices' canonical sysfs paths (path components after their
/// longest common prefix, both sides summed) and the kind of path. `same_numa` says whether
/// the two are on one NUMA node, when known; it only tells NODE from SYS.
pub(super) fn between(a: &Path, b: &Path, same_numa: Option<bool>) -> (u32, PathClass) {
    let a: Vec<Component<'_>> = a.components().collect();
    let b: Vec<Component<'_>> = b.components().collect();
    let common = a.iter().zip(&b).take_while(|(a, b)| a == b).count();
    let (below_a, below_b) = (a.len() - common, b.len() - common);
    let distance = u32::try_from(below_a + below_b).unwrap_or(u32::MAX);
    let class = match root_complex(&a) {
        // The root complex (`pci0000:00`) is shared: the path stays below the host bridge...
        Some(root) if root < common => {
            if root + 1 == common {
                // ...but the two part at the root complex itself, so they cross it.
                PathClass::Phb
            } else if below_a <= 2 && below_b <= 2 {
                // Each side is at most a downstream port and the device: one switch.
                PathClass::Pix
            } else {
                PathClass::Pxb
            }
        }
        _ if same_numa == Some(true) => PathClass::Node,
        _ => PathClass::Sys,
    };
    (distance, class)
}

/// Index of the root-complex component (`pci0000:00`, `pci0000:80`) of a sysfs device path.
fn root_complex(path: &[Component<'_>]) -> Option<usize> {
    path.iter().position(|component| {
        component
            .as_os_str()
            .to_str()
            .and_then(|name| name.strip_prefix("pci"))
            .is_some_and(|bus| bus.contains(':'))
    })
}

#[cfg(test)]
mod tests {
    use super::{between, PathClass};
    use std::path::Path;

    const GPU: &str = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0";

    fn class(nic: &str, same_numa: Option<bool>) -> (u32, PathClass) {
        between(Path::new(GPU), Path::new(nic), same_numa)
    }

    #[test]
    fn a_nic_on_the_same_switch_is_pix() {
        let nic = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:04.0/0000:05:00.0";
        assert_eq!(class(nic, None), (4, PathClass::Pix));
    }

    #[test]
    fn a_nic_behind_another_switch_of_the_same_root_port_is_pxb() {
        let nic = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:06:00.0/0000:07:00.0/0000:08:00.0";
        assert_eq!(class(nic, None), (6, PathClass::Pxb));
    }

    #[test]
    fn a_nic_on_another_root_port_is_phb() {
        let nic = "/sys/devices/pci0000:00/0000:00:02.0/0000:09:00.0";
        assert_eq!(class(nic, Some(true)), (6, PathClass::Phb));
    }

    #[test]
    fn a_nic_in_another_root_complex_is_node_or_sys_by_numa_node() {
        let nic = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0";
        assert_eq!(class(nic, Some(true)), (8, PathClass::Node));
        assert_eq!(class(nic, Some(false)), (8, PathClass::Sys));
        assert_eq!(class(nic, None), (8, PathClass::Sys));
    }

    #[test]
    fn a_device_outside_the_pci_tree_is_sys() {
        let nic = "/sys/devices/virtual/net/eth0";
        assert_eq!(class(nic, None), (8, PathClass::Sys));
    }
}
