//! What this host offers for RDMA, as `ferry probe` prints it: each device's ports and the NIC
//! chosen for each GPU, or why there is no RDMA here and what would provide it.

use std::fmt;
use std::path::Path;

use crate::device::{DeviceInfo, LinkLayer, PortInfo, PortState};
use crate::error::VerbsError;
use crate::topology::Topology;

/// The caveat every probe states, whatever it found.
const UNTESTED: &str = "RDMA: note: ferry's RDMA data path has been tested only against an \
                        in-memory verbs model, not on RDMA hardware";

/// Why RDMA cannot be used on this host, or by this build ([`RdmaProbe::devices`]): what is
/// missing and what would provide it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaUnavailable {
    /// The build has no RDMA support (no `sideway` feature, which the facade's `rdma` turns on).
    #[error("this build has no RDMA support: rebuild with `--features rdma`")]
    NotBuilt,
    /// rdma-core, its kernel support, access to `/dev/infiniband` or a device is missing:
    /// the reason rdma-core's loader gives ([`VerbsError::Unsupported`] for "RDMA"), which
    /// names what is missing and what provides it.
    #[error("{reason}")]
    Missing {
        /// What is missing and what provides it.
        reason: String,
    },
    /// Listing or describing the devices failed otherwise.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
}

/// What [`probe`] found. Its `Display` is the RDMA section of `ferry probe`: a table of devices
/// and ports, then the NIC chosen for each GPU when there are GPUs; or one line
/// `RDMA: unavailable: <reason>; transfers between hosts use TCP`. In both cases a line
/// follows saying that ferry's RDMA data path has been tested only against an in-memory verbs
/// model, not on RDMA hardware.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaProbe {
    /// The devices rdma-core lists, with their ports and GID tables; or why RDMA cannot be used
    /// here, saying what is missing (a build without RDMA support, rdma-core, the kernel
    /// module, access to `/dev/infiniband`, a device) and what would provide it.
    pub devices: Result<Vec<DeviceInfo>, RdmaUnavailable>,
    /// The devices' places on the PCI tree and the NIC chosen for each GPU this process sees,
    /// in CUDA's order, as the transport chooses them (from sysfs under `/`); `None` when no
    /// device is listed or no GPU is seen.
    pub placement: Option<Topology>,
}

/// Asks rdma-core (through `SidewayVerbs`, in a build with the `sideway` feature) which RDMA
/// devices this host has. Never fails: a host without RDMA gets the reason in
/// [`RdmaProbe::devices`]. A build without the feature answers that it has no RDMA support.
pub fn probe() -> RdmaProbe {
    #[cfg(feature = "sideway")]
    let devices = crate::sideway::devices_or_reason();
    #[cfg(not(feature = "sideway"))]
    let devices: Result<Vec<DeviceInfo>, RdmaUnavailable> = Err(RdmaUnavailable::NotBuilt);
    let placement = match &devices {
        Ok(listed) if !listed.is_empty() => place(Path::new("/"), listed, &cuda_gpus()),
        _ => None,
    };
    RdmaProbe { devices, placement }
}

/// The PCI bus ids of the GPUs this process sees, in CUDA's order; none where CUDA lists none
/// or cannot list them.
fn cuda_gpus() -> Vec<String> {
    ferry_core::cuda::Driver::get()
        .devices()
        .map(|gpus| gpus.into_iter().map(|gpu| gpu.pci_bus_id).collect())
        .unwrap_or_default()
}

/// `devices` placed from sysfs under `root`, with a NIC chosen for each GPU of `gpus` (PCI bus
/// ids) in turn; `None` when either list is empty.
fn place(root: &Path, devices: &[DeviceInfo], gpus: &[String]) -> Option<Topology> {
    if devices.is_empty() || gpus.is_empty() {
        return None;
    }
    let names: Vec<String> = devices.iter().map(|device| device.name.clone()).collect();
    let mut topology = Topology::read(root, &names);
    for gpu in gpus {
        topology.nics_for_gpu(gpu);
    }
    Some(topology)
}

impl fmt::Display for RdmaProbe {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.devices {
            Ok(devices) if !devices.is_empty() => {
                let count = devices.len();
                let plural = if count == 1 { "" } else { "s" };
                writeln!(formatter, "RDMA: {count} device{plural}")?;
                write_table(formatter, devices)?;
                if let Some(topology) = &self.placement {
                    writeln!(formatter, "RDMA: NIC per GPU (PCI placement from sysfs):")?;
                    for line in topology.to_string().lines() {
                        writeln!(formatter, "  {line}")?;
                    }
                }
            }
            Ok(_) => writeln!(
                formatter,
                "RDMA: unavailable: rdma-core lists no device; transfers between hosts use TCP"
            )?,
            Err(reason) => writeln!(
                formatter,
                "RDMA: unavailable: {reason}; transfers between hosts use TCP"
            )?,
        }
        writeln!(formatter, "{UNTESTED}")
    }
}

const HEADER: [&str; 9] = [
    "device", "port", "state", "link", "rate", "mtu", "lid", "gid", "max_sge",
];

/// One row per port (one per port-less device), columns padded to their widest cell.
fn write_table(formatter: &mut fmt::Formatter<'_>, devices: &[DeviceInfo]) -> fmt::Result {
    let mut rows: Vec<[String; 9]> = vec![HEADER.map(str::to_owned)];
    for device in devices {
        if device.ports.is_empty() {
            let none = || "-".to_owned();
            rows.push([
                device.name.clone(),
                none(),
                none(),
                none(),
                none(),
                none(),
                none(),
                none(),
                device.max_sge.to_string(),
            ]);
        }
        for port in &device.ports {
            rows.push(port_row(device, port));
        }
    }
    let mut widths = [0usize; 9];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        writeln!(formatter, "  {}", cells.join("  ").trim_end())?;
    }
    Ok(())
}

fn port_row(device: &DeviceInfo, port: &PortInfo) -> [String; 9] {
    let index = port.preferred_gid_index();
    let gid = match port.gid(index) {
        Some(entry) => format!("{index} {}", entry.gid),
        None => format!("{index} (no entry)"),
    };
    [
        device.name.clone(),
        port.port_num.to_string(),
        state_name(port.state).to_owned(),
        match port.link_layer {
            LinkLayer::InfiniBand => "IB",
            LinkLayer::Ethernet => "RoCE",
        }
        .to_owned(),
        port.line_rate_mbps
            .map_or_else(|| "-".to_owned(), |mbps| format!("{}G", mbps / 1000)),
        port.active_mtu.bytes().to_string(),
        port.lid.to_string(),
        gid,
        device.max_sge.to_string(),
    ]
}

fn state_name(state: PortState) -> &'static str {
    match state {
        PortState::Down => "down",
        PortState::Init => "init",
        PortState::Armed => "armed",
        PortState::Active => "active",
        PortState::ActiveDefer => "active-defer",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Mtu;
    use crate::model::HostConfig;

    fn lines(probe: &RdmaProbe) -> Vec<String> {
        probe.to_string().lines().map(str::to_owned).collect()
    }

    #[test]
    fn unavailable_is_one_line_with_the_reason_and_the_fallback_then_the_caveat() {
        let probe = RdmaProbe {
            devices: Err(RdmaUnavailable::Missing {
                reason: "rdma-core's libibverbs is not installed".to_owned(),
            }),
            placement: None,
        };
        assert_eq!(
            lines(&probe),
            [
                "RDMA: unavailable: rdma-core's libibverbs is not installed; transfers between \
                 hosts use TCP",
                UNTESTED,
            ]
        );
        assert!(UNTESTED.contains("tested only against an in-memory verbs model"));
        assert!(UNTESTED.contains("not on RDMA hardware"));
    }

    #[test]
    fn an_empty_list_is_unavailable_too() {
        let probe = RdmaProbe {
            devices: Ok(Vec::new()),
            placement: None,
        };
        let text = probe.to_string();
        assert!(text.starts_with("RDMA: unavailable: "), "{text}");
        assert!(text.contains("transfers between hosts use TCP"), "{text}");
        assert!(text.contains(UNTESTED), "{text}");
    }

    #[test]
    fn devices_are_a_table_of_ports_with_the_preferred_gid() {
        let mut roce = HostConfig::roce("a", [192, 168, 1, 10]).devices;
        let mut infiniband = HostConfig::infiniband("b", 7).devices;
        infiniband[0].name = "mlx5_1".to_owned();
        infiniband[0].ports[0].state = PortState::Down;
        infiniband[0].ports[0].active_mtu = Mtu::Mtu2048;
        roce.append(&mut infiniband);
        roce.push(DeviceInfo {
            name: "bnxt_re0".to_owned(),
            ports: Vec::new(),
            max_sge: 6,
            max_qp_wr: 1024,
            max_rd_atomic: 8,
        });
        let probe = RdmaProbe {
            devices: Ok(roce),
            placement: None,
        };
        assert_eq!(
            lines(&probe),
            [
                "RDMA: 3 devices",
                "  device    port  state   link  rate  mtu   lid  gid                    max_sge",
                "  mlx5_0    1     active  RoCE  400G  4096  0    3 ::ffff:192.168.1.10  30",
                "  mlx5_1    1     down    IB    400G  2048  7    0 fe80::7              30",
                "  bnxt_re0  -     -       -     -     -     -    -                      6",
                UNTESTED,
            ]
        );
    }

    #[test]
    fn each_gpu_is_shown_with_the_nic_chosen_for_it() {
        let sysfs = crate::topology::tests::switch_and_root_port();
        let gpu = crate::topology::tests::GPU;
        let mut devices = HostConfig::roce("a", [192, 168, 1, 10]).devices;
        let mut second = devices[0].clone();
        second.name = "mlx5_1".to_owned();
        devices.push(second);
        let placement = place(sysfs.root(), &devices, &[gpu.to_owned()]);
        assert!(placement.is_some());
        let probe = RdmaProbe {
            devices: Ok(devices),
            placement,
        };
        let lines = lines(&probe);
        let at = lines
            .iter()
            .position(|line| line == "RDMA: NIC per GPU (PCI placement from sysfs):")
            .unwrap_or_else(|| panic!("no placement heading in {lines:#?}"));
        assert_eq!(
            lines[at + 1..],
            [
                "  mlx5_0: PCI 0000:05:00.0, NUMA node 0, port active".to_owned(),
                "  mlx5_1: PCI 0000:06:00.0, NUMA node 0, port active".to_owned(),
                format!("  GPU {gpu} -> mlx5_0 (PIX, distance 4)"),
                UNTESTED.to_owned(),
            ]
        );
    }

    #[test]
    fn without_gpus_or_devices_nothing_is_placed() {
        let sysfs = crate::topology::tests::switch_and_root_port();
        let gpu = crate::topology::tests::GPU.to_owned();
        let devices = HostConfig::roce("a", [192, 168, 1, 10]).devices;
        assert_eq!(place(sysfs.root(), &devices, &[]), None);
        assert_eq!(place(sysfs.root(), &[], &[gpu]), None);
        let probe = RdmaProbe {
            devices: Ok(devices),
            placement: None,
        };
        assert!(!probe.to_string().contains("NIC per GPU"), "{probe}");
    }

    #[cfg(not(feature = "sideway"))]
    #[test]
    fn a_build_without_rdma_says_how_to_get_it() {
        let text = probe().to_string();
        assert!(
            text.starts_with(
                "RDMA: unavailable: this build has no RDMA support: rebuild with \
                 `--features rdma`; transfers between hosts use TCP\n"
            ),
            "{text}"
        );
        assert!(text.contains(UNTESTED), "{text}");
    }

    #[cfg(feature = "sideway")]
    #[test]
    fn a_build_with_rdma_asks_rdma_core() {
        let probe = probe();
        let text = probe.to_string();
        assert!(text.contains(UNTESTED), "{text}");
        if let Err(unavailable) = &probe.devices {
            let reason = unavailable.to_string();
            // The reason, not the error's "RDMA is not supported here" wrapper.
            assert!(reason.contains("rdma-core"), "{reason}");
            assert!(!reason.starts_with("RDMA"), "{reason}");
        }
    }
}
