//! What a device and its ports report: the table `ferry probe` prints and connection set-up
//! reads (link layer, active MTU, LID, GID table).

use std::fmt;
use std::net::Ipv6Addr;

/// One RDMA device (an HCA or RoCE NIC, `ibv_device`) and its ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The kernel's device name, e.g. `mlx5_0`.
    pub name: String,
    /// The device's ports, numbered from 1 as in verbs.
    pub ports: Vec<PortInfo>,
    /// Scatter-gather entries one work request may carry (`max_sge`).
    pub max_sge: u32,
    /// Work requests one queue may hold (`max_qp_wr`).
    pub max_qp_wr: u32,
    /// RDMA READs one queue pair may have in flight, as initiator and as responder: the
    /// smaller of `max_qp_init_rd_atom` and `max_qp_rd_atom`.
    pub max_rd_atomic: u8,
}

/// One port of a device (`ibv_query_port` plus its GID table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// The port number, from 1.
    pub port_num: u8,
    /// The logical port state; only [`PortState::Active`] ports carry traffic.
    pub state: PortState,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// The MTU the port negotiated; a QP's path MTU may not exceed it.
    pub active_mtu: Mtu,
    /// The port's LID (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// The largest message one work request may carry, in bytes (`max_msg_sz`).
    pub max_msg_size: u32,
    /// The link's data rate in Mb/s (lanes x per-lane rate of the active speed), or `None`
    /// when the port reports a speed or width verbs does not define.
    pub line_rate_mbps: Option<u64>,
    /// The populated entries of the port's GID table.
    pub gids: Vec<GidEntry>,
}

impl PortInfo {
    /// The GID entry at `index`, if the table has one there.
    pub fn gid(&self, index: u8) -> Option<&GidEntry> {
        self.gids.iter().find(|entry| entry.index == index)
    }

    /// The index to address peers with: on Ethernet the first RoCE v2 entry whose GID is an
    /// IPv4-mapped address (routable, as rdma-core's tools pick), else the first RoCE v2 entry
    /// that is not link-local, else index 0; on InfiniBand index 0.
    pub fn preferred_gid_index(&self) -> u8 {
        if self.link_layer == LinkLayer::InfiniBand {
            return 0;
        }
        let v2 = || {
            self.gids
                .iter()
                .filter(|entry| entry.kind == GidType::RoceV2)
        };
        v2().find(|entry| entry.gid.is_ipv4_mapped())
            .or_else(|| v2().find(|entry| !entry.gid.is_link_local()))
            .map_or(0, |entry| entry.index)
    }
}

/// `ibv_port_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PortState {
    /// `IBV_PORT_DOWN`: no link.
    Down,
    /// `IBV_PORT_INIT`: link up, not configured by the subnet manager.
    Init,
    /// `IBV_PORT_ARMED`: configured, not yet active.
    Armed,
    /// `IBV_PORT_ACTIVE`: carries traffic.
    Active,
    /// `IBV_PORT_ACTIVE_DEFER`: active, deferring errors.
    ActiveDefer,
}

/// The port's link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// InfiniBand: peers are addressed by LID (a GRH is optional).
    InfiniBand,
    /// Ethernet (RoCE): peers are addressed by GID; every QP needs a global route.
    Ethernet,
}

/// `ibv_mtu`: path and port MTUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            Mtu::Mtu256 => 256,
            Mtu::Mtu512 => 512,
            Mtu::Mtu1024 => 1024,
            Mtu::Mtu2048 => 2048,
            Mtu::Mtu4096 => 4096,
        }
    }
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GidEntry {
    /// The entry's index, what a QP's `sgid_index` names.
    pub index: u8,
    /// The GID itself.
    pub gid: Gid,
    /// What the GID is for: InfiniBand, RoCE v1 (Ethernet frames) or RoCE v2 (UDP/IP).
    pub kind: GidType,
}

/// The type of a GID table entry (`ibv_gid_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GidType {
    /// An InfiniBand GID.
    Ib,
    /// RoCE v1: layer-2 only, not routable across IP subnets.
    RoceV1,
    /// RoCE v2: UDP/IP, routable; what RoCE deployments should use.
    RoceV2,
}

/// A 128-bit global identifier (`ibv_gid`), shown as an IPv6 address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4-mapped GID (`::ffff:a.b.c.d`) that RoCE v2 uses for an IPv4 address.
    pub fn from_ipv4(address: [u8; 4]) -> Self {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&address);
        Gid(raw)
    }

    /// The link-local GID `fe80::<interface id>` built from an 8-byte interface identifier.
    pub fn link_local(interface_id: [u8; 8]) -> Self {
        let mut raw = [0u8; 16];
        raw[0] = 0xfe;
        raw[1] = 0x80;
        raw[8..].copy_from_slice(&interface_id);
        Gid(raw)
    }

    /// Whether the GID is an IPv6 link-local address (`fe80::/10`), which routers do not
    /// forward.
    pub fn is_link_local(&self) -> bool {
        self.0[0] == 0xfe && self.0[1] & 0xc0 == 0x80
    }

    /// Whether the GID is an IPv4 address mapped into IPv6 (`::ffff:a.b.c.d`).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10].iter().all(|byte| *byte == 0) && self.0[10] == 0xff && self.0[11] == 0xff
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        Ipv6Addr::from(self.0).fmt(formatter)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "Gid({self})")
    }
}
