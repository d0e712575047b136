//! What this host offers for RDMA, as `ferry probe` prints it: each device's ports, or why
//! there is no RDMA here and what would provide it.

use std::fmt;

use crate::device::{DeviceInfo, LinkLayer, PortInfo, PortState};

/// The caveat every probe states, whatever it found.
const UNTESTED: &str = "RDMA: note: ferry's RDMA data path has been tested only against an \
                        in-memory verbs model, not on RDMA hardware";

/// Why a build without the `sideway` feature has no RDMA.
#[cfg(not(feature = "sideway"))]
const NOT_BUILT: &str = "this build has no RDMA support: rebuild with `--features rdma`";

/// What [`probe`] found. Its `Display` is the RDMA section of `ferry probe`: a table of devices
/// and ports, or one line `RDMA: unavailable: <reason>; transfers between hosts use TCP`; in
/// both cases followed by a line saying that ferry's RDMA data path has been tested only
/// against an in-memory verbs model, not on RDMA hardware.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaProbe {
    /// The devices rdma-core lists, with their ports and GID tables; or why RDMA cannot be used
    /// here, saying what is missing (a build without RDMA support, rdma-core, the kernel
    /// module, access to `/dev/infiniband`, a device) and what would provide it.
    pub devices: Result<Vec<DeviceInfo>, String>,
}

/// Asks rdma-core (through `SidewayVerbs`, in a build with the `sideway` feature) which RDMA
/// devices this host has. Never fails: a host without RDMA gets the reason in
/// [`RdmaProbe::devices`]. A build without the feature answers that it has no RDMA support.
pub fn probe() -> RdmaProbe {
    #[cfg(feature = "sideway")]
    let devices = crate::sideway::devices_or_reason();
    #[cfg(not(feature = "sideway"))]
    let devices = Err(NOT_BUILT.to_owned());
    RdmaProbe { devices }
}

impl fmt::Display for RdmaProbe {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.devices {
            Ok(devices) if !devices.is_empty() => {
                let count = devices.len();
                let plural = if count == 1 { "" } else { "s" };
                writeln!(formatter, "RDMA: {count} device{plural}")?;
                write_table(formatter, devices)?;
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

const HEADER: [&str; 8] = [
    "device", "port", "state", "link", "mtu", "lid", "gid", "max_sge",
];

/// One row per port (one per port-less device), columns padded to their widest cell.
fn write_table(formatter: &mut fmt::Formatter<'_>, devices: &[DeviceInfo]) -> fmt::Result {
    let mut rows: Vec<[String; 8]> = vec![HEADER.map(str::to_owned)];
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
                device.max_sge.to_string(),
            ]);
        }
        for port in &device.ports {
            rows.push(port_row(device, port));
        }
    }
    let mut widths = [0usize; 8];
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

fn port_row(device: &DeviceInfo, port: &PortInfo) -> [String; 8] {
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
            devices: Err("rdma-core's libibverbs is not installed".to_owned()),
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
        });
        let probe = RdmaProbe { devices: Ok(roce) };
        assert_eq!(
            lines(&probe),
            [
                "RDMA: 3 devices",
                "  device    port  state   link  mtu   lid  gid                    max_sge",
                "  mlx5_0    1     active  RoCE  4096  0    3 ::ffff:192.168.1.10  30",
                "  mlx5_1    1     down    IB    2048  7    0 fe80::7              30",
                "  bnxt_re0  -     -       -     -     -    -                      6",
                UNTESTED,
            ]
        );
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
        if let Err(reason) = &probe.devices {
            // The reason, not the error's "RDMA is not supported here" wrapper.
            assert!(reason.contains("rdma-core"), "{reason}");
            assert!(!reason.starts_with("RDMA"), "{reason}");
        }
    }
}
