//! The NICs a transport uses: each opened once, with its protection domain, the port it
//! sends from and the GID index it addresses peers with.

use super::config::RdmaConfig;
use crate::device::{DeviceInfo, LinkLayer, PortInfo, PortState};
use crate::qp::{AddressVector, GlobalRoute, Psn, QpEndpoint};
use crate::verbs::Verbs;
use crate::Mtu;

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
/// Why nothing can be used: a named device that does not exist or has no active port, or no
/// device with an active port at all.
pub(crate) fn choose(
    devices: &[DeviceInfo],
    config: &RdmaConfig,
) -> Result<Vec<(DeviceInfo, PortInfo, u8)>, String> {
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
                    .ok_or_else(|| {
                        let known: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
                        format!("RDMA device {name:?} does not exist here (devices: {known:?}): fix the device list")
                    })
            })
            .collect::<Result<_, _>>()?,
        None => devices.iter().collect(),
    };
    let mut chosen = Vec::new();
    for device in wanted {
        let Some(port) = active(device) else {
            if config.devices.is_some() {
                return Err(format!(
                    "RDMA device {:?} has no active port: check its cable and link (`ibstat`), or leave it out of the device list",
                    device.name
                ));
            }
            continue;
        };
        let gid_index = config
            .gid_index
            .unwrap_or_else(|| port.preferred_gid_index());
        if port.link_layer == LinkLayer::Ethernet && port.gid(gid_index).is_none() {
            return Err(format!(
                "RDMA device {:?} port {} has no GID at index {gid_index}: pick an index from `ferry probe`, or configure the NIC's IP address",
                device.name, port.port_num
            ));
        }
        chosen.push((device.clone(), port, gid_index));
    }
    if chosen.is_empty() {
        return Err("no RDMA device has an active port: check the links (`ibstat`)".to_owned());
    }
    Ok(chosen)
}

/// Opens the NICs [`choose`] picked: a context and a protection domain each.
///
/// # Errors
/// Why a NIC could not be opened.
pub(crate) fn open<V: Verbs>(verbs: &V, config: &RdmaConfig) -> Result<Vec<Nic<V>>, String> {
    let devices = verbs.devices().map_err(|error| error.to_string())?;
    choose(&devices, config)?
        .into_iter()
        .map(|(device, port, gid_index)| {
            let context = verbs
                .open(&device.name)
                .map_err(|error| error.to_string())?;
            let pd = verbs
                .alloc_pd(&context)
                .map_err(|error| error.to_string())?;
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
