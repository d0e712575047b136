//! The NICs a transport uses: each opened once, with its protection domain, the port it
//! sends from and the GID index it addresses peers with.

use super::config::RdmaConfig;
use crate::device::{DeviceInfo, LinkLayer, PortInfo, PortState};
use crate::qp::{AddressVector, GlobalRoute, Psn, QpEndpoint};
use crate::verbs::Verbs;
use crate::{Mtu, VerbsError};

/// Why an [`RdmaTransport`](crate::RdmaTransport) has no NIC to use, so that it reaches
/// nothing ([`RdmaTransport::unavailable`](crate::RdmaTransport::unavailable)). Each message
/// says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoUsableNic {
    /// Listing the devices, opening one or allocating its protection domain failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The device list names a device this host does not have.
    #[error("RDMA device {name:?} does not exist here (devices: {known:?}): fix the device list")]
    NoSuchDevice {
        /// The name in the device list.
        name: String,
        /// The devices this host has.
        known: Vec<String>,
    },
    /// A device of the device list has no active port.
    #[error("RDMA device {device:?} has no active port: check its cable and link (`ibstat`), or leave it out of the device list")]
    NoActivePort {
        /// The device.
        device: String,
    },
    /// An Ethernet (RoCE) port has no GID at the index to send from.
    #[error("RDMA device {device:?} port {port} has no GID at index {gid_index}: pick an index from `ferry probe`, or configure the NIC's IP address")]
    NoGid {
        /// The device.
        device: String,
        /// Its port.
        port: u8,
        /// The GID index configured, or the port's preferred one.
        gid_index: u8,
    },
    /// No device has an active port (with no device list given).
    #[error("no RDMA device has an active port: check the links (`ibstat`)")]
    NoneActive,
}

/// One opened NIC port.
pub(crate) struct Nic<V: Verbs> {
    pub(crate) name: String,
    pub(crate) port: PortInfo,
    pub(crate) gid_index: u8,
    pub(crate) max_sge: u32,
    pub(crate) max_qp_wr: u32,
    /// RDMA READs a queue pair on this NIC may have in flight each way (at least 1).
    pub(crate) max_rd_atomic: u8,
    pub(crate) context: V::Context,
    pub(crate) pd: V::ProtectionDomain,
}

impl<V: Verbs> Nic<V> {
    /// This side of a new QP on this NIC, to send to the peer.
    pub(crate) fn endpoint(&self, qpn: u32, psn: Psn) -> QpEndpoint {
        let gid = self
            .port
            .gid(self.gid_index)
            .map(|entry| entry.gid)
            .unwrap_or_default();
        QpEndpoint {
            qpn,
            psn,
            lid: self.port.lid,
            gid,
        }
    }

    /// How to address the peer's `remote` endpoint from this NIC: by LID on InfiniBand, by
    /// GID with a global route on Ethernet (RoCE cannot route without one).
    pub(crate) fn address(&self, remote: &QpEndpoint, traffic_class: u8) -> AddressVector {
        let global = match self.port.link_layer {
            LinkLayer::InfiniBand => None,
            LinkLayer::Ethernet => Some(GlobalRoute {
                dest_gid: remote.gid,
                sgid_index: self.gid_index,
                hop_limit: 255,
                traffic_class,
            }),
        };
        AddressVector {
            dest_lid: remote.lid,
            global,
        }
    }

    /// The path MTU for a connection to a peer port whose active MTU is `remote`.
    pub(crate) fn path_mtu(&self, remote: Mtu) -> Mtu {
        self.port.active_mtu.min(remote)
    }
}

/// The device and port to use for each NIC `config` asks for (all with an active port when it
/// names none), with the GID index to send from.
///
/// # Errors
/// Why nothing can be used: a named device that does not exist or has no active port, a RoCE
/// port without the GID index, or no device with an active port at all.
pub(crate) fn choose(
    devices: &[DeviceInfo],
    config: &RdmaConfig,
) -> Result<Vec<(DeviceInfo, PortInfo, u8)>, NoUsableNic> {
    let active = |device: &DeviceInfo| {
        device
            .ports
            .iter()
            .find(|port| matches!(port.state, PortState::Active | PortState::ActiveDefer))
            .cloned()
    };
    let wanted: Vec<&DeviceInfo> = match &config.devices {
        Some(names) => names
            .iter()
            .map(|name| {
                devices
                    .iter()
                    .find(|device| &device.name == name)
                    .ok_or_else(|| NoUsableNic::NoSuchDevice {
                        name: name.clone(),
                        known: devices.iter().map(|device| device.name.clone()).collect(),
                    })
            })
            .collect::<Result<_, _>>()?,
        None => devices.iter().collect(),
    };
    let mut chosen = Vec::new();
    for device in wanted {
        let Some(port) = active(device) else {
            if config.devices.is_some() {
                return Err(NoUsableNic::NoActivePort {
                    device: device.name.clone(),
                });
            }
            continue;
        };
        let gid_index = config
            .gid_index
            .unwrap_or_else(|| port.preferred_gid_index());
        if port.link_layer == LinkLayer::Ethernet && port.gid(gid_index).is_none() {
            return Err(NoUsableNic::NoGid {
                device: device.name.clone(),
                port: port.port_num,
                gid_index,
            });
        }
        chosen.push((device.clone(), port, gid_index));
    }
    if chosen.is_empty() {
        return Err(NoUsableNic::NoneActive);
    }
    Ok(chosen)
}

/// Opens the NICs [`choose`] picked: a context and a protection domain each.
///
/// # Errors
/// Why a NIC could not be opened.
pub(crate) fn open<V: Verbs>(verbs: &V, config: &RdmaConfig) -> Result<Vec<Nic<V>>, NoUsableNic> {
    let devices = verbs.devices()?;
    choose(&devices, config)?
        .into_iter()
        .map(|(device, port, gid_index)| {
            let context = verbs.open(&device.name)?;
            let pd = verbs.alloc_pd(&context)?;
            Ok(Nic {
                name: device.name,
                port,
                gid_index,
                max_sge: device.max_sge,
                max_qp_wr: device.max_qp_wr,
                max_rd_atomic: device.max_rd_atomic.max(1),
                context,
                pd,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{choose, NoUsableNic};
    use crate::device::PortState;
    use crate::model::HostConfig;
    use crate::transport::config::RdmaConfig;

    fn listing(names: &[&str]) -> RdmaConfig {
        RdmaConfig {
            devices: Some(names.iter().map(|name| (*name).to_owned()).collect()),
            ..RdmaConfig::default()
        }
    }

    #[test]
    fn each_reason_to_use_no_nic_says_what_to_fix() {
        let mut devices = HostConfig::roce("a", [192, 168, 1, 10]).devices;
        let mut down = HostConfig::infiniband("b", 7).devices;
        down[0].name = "mlx5_1".to_owned();
        down[0].ports[0].state = PortState::Down;
        devices.append(&mut down);

        let missing = choose(&devices, &listing(&["mlx5_9"])).expect_err("no such device");
        assert_eq!(
            missing.to_string(),
            r#"RDMA device "mlx5_9" does not exist here (devices: ["mlx5_0", "mlx5_1"]): fix the device list"#
        );
        let inactive = choose(&devices, &listing(&["mlx5_1"])).expect_err("its port is down");
        assert_eq!(
            inactive.to_string(),
            "RDMA device \"mlx5_1\" has no active port: check its cable and link (`ibstat`), or \
             leave it out of the device list"
        );
        let no_gid = RdmaConfig {
            gid_index: Some(9),
            ..listing(&["mlx5_0"])
        };
        let no_gid = choose(&devices, &no_gid).expect_err("no GID 9");
        assert_eq!(
            no_gid,
            NoUsableNic::NoGid {
                device: "mlx5_0".to_owned(),
                port: 1,
                gid_index: 9
            }
        );
        assert_eq!(
            no_gid.to_string(),
            "RDMA device \"mlx5_0\" port 1 has no GID at index 9: pick an index from `ferry \
             probe`, or configure the NIC's IP address"
        );
        let none = choose(&devices[1..], &RdmaConfig::default()).expect_err("none active");
        assert_eq!(
            none.to_string(),
            "no RDMA device has an active port: check the links (`ibstat`)"
        );
        assert_eq!(
            choose(&devices, &RdmaConfig::default()).map(|c| c.len()),
            Ok(1)
        );
    }
}
