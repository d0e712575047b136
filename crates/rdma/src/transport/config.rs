//! How the RDMA transport uses its NICs and queue pairs.

use std::path::PathBuf;
use std::time::Duration;

/// Settings of the RDMA transport. The defaults suit one 200-400 Gb/s NIC per GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// The devices to use, in order of preference (as Mooncake's `device_name` list); `None`
    /// uses every device with an active port.
    pub devices: Option<Vec<String>>,
    /// The GID index to address peers with on Ethernet (RoCE); `None` picks the first RoCE v2
    /// entry holding an IPv4 address.
    pub gid_index: Option<u8>,
    /// The IP traffic class (DSCP << 2 | ECN) of RoCE v2 packets. Lossless fabrics map one
    /// DSCP to the priority with PFC: set it to that class (106 for DSCP 26, a common
    /// choice), or the traffic lands in a lossy queue and retransmits under incast.
    pub traffic_class: u8,
    /// Reliable-connected queue pairs per pair of NICs (local, peer); work is striped over them.
    pub qps_per_nic_pair: usize,
    /// Entries longer than this are sliced into work requests of this size.
    pub slice_bytes: u64,
    /// Work requests a queue pair may have outstanding.
    pub max_outstanding: u32,
    /// Every this many unsignalled work requests on a queue pair, one is signalled, so its
    /// completion frees their send-queue slots.
    pub signal_every: u32,
    /// Scatter-gather entries packed into one work request at most (capped by the device's).
    pub max_sge: u32,
    /// How long a waiting transfer polls completions before it sleeps between polls.
    pub busy_poll: Duration,
    /// The local ACK timeout exponent: a lost packet is retried after 4.096 us * 2^timeout.
    pub ack_timeout: u8,
    /// Retransmissions before a work request fails with `IBV_WC_RETRY_EXC_ERR` (at most 7).
    pub retry_count: u8,
    /// The address the connection side channel listens on (`host:port`; port 0 picks one).
    pub listen: String,
    /// The host peers dial for the side channel; `None` uses the host of the engine's TCP
    /// endpoint, as the peer sees it.
    pub advertise: Option<String>,
    /// How long connecting a peer's queue pairs may take.
    pub connect_timeout: Duration,
    /// Where sysfs is read to place NICs and GPUs on the PCI tree: `/`, unless a container
    /// mounts the host's sysfs elsewhere.
    pub sysfs_root: PathBuf,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            devices: None,
            gid_index: None,
            traffic_class: 0,
            qps_per_nic_pair: 2,
            slice_bytes: 256 * 1024,
            max_outstanding: 128,
            signal_every: 16,
            max_sge: 16,
            busy_poll: Duration::from_micros(50),
            ack_timeout: 14,
            retry_count: 7,
            listen: "0.0.0.0:0".to_owned(),
            advertise: None,
            connect_timeout: Duration::from_secs(5),
            sysfs_root: PathBuf::from("/"),
        }
    }
}

impl RdmaConfig {
    /// The settings with impossible values raised to the least that works: at least one
    /// queue pair, one outstanding request, one SG entry, a 4 KiB slice; at most 7 retries.
    pub(crate) fn sanitized(mut self) -> Self {
        self.qps_per_nic_pair = self.qps_per_nic_pair.max(1);
        self.slice_bytes = self.slice_bytes.clamp(4096, 1 << 30);
        self.max_outstanding = self.max_outstanding.max(2);
        self.signal_every = self.signal_every.clamp(1, self.max_outstanding / 2);
        self.max_sge = self.max_sge.max(1);
        self.retry_count = self.retry_count.min(7);
        self.ack_timeout = self.ack_timeout.min(31);
        self
    }
}
