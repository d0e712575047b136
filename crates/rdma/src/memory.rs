//! Access flags and the keys a memory registration hands out.

use std::fmt;
use std::ops::BitOr;

/// `ibv_access_flags`, as given to `ibv_reg_mr` (what the NIC may do with a region) and to a
/// QP's INIT transition (what remote peers may do through the QP). Combine with `|`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// No access beyond local reads by the NIC (the region can only be a WRITE's source).
    pub const NONE: AccessFlags = AccessFlags(0);
    /// `IBV_ACCESS_LOCAL_WRITE`: the NIC may write the region locally (a READ's destination,
    /// a receive buffer). Verbs requires it with [`REMOTE_WRITE`](Self::REMOTE_WRITE).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(1);
    /// `IBV_ACCESS_REMOTE_WRITE`: peers may RDMA WRITE into the region.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(1 << 1);
    /// `IBV_ACCESS_REMOTE_READ`: peers may RDMA READ from the region.
    pub const REMOTE_READ: AccessFlags = AccessFlags(1 << 2);
    /// `IBV_ACCESS_RELAXED_ORDERING`: the NIC may reorder its PCIe writes to the region,
    /// which GPU memory behind a PCIe switch needs for full bandwidth. Optional: a device
    /// that cannot relax ordering ignores it. The completion of a request still means all
    /// its bytes are in place.
    pub const RELAXED_ORDERING: AccessFlags = AccessFlags(1 << 20);

    /// The raw `ibv_access_flags` bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// The flags of `self` and `other` together (`|` in const contexts).
    pub const fn union(self, other: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | other.0)
    }

    /// Whether every flag of `other` is set in `self`.
    pub fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for AccessFlags {
    type Output = AccessFlags;

    fn bitor(self, other: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | other.0)
    }
}

impl fmt::Debug for AccessFlags {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (AccessFlags::LOCAL_WRITE, "LOCAL_WRITE"),
            (AccessFlags::REMOTE_WRITE, "REMOTE_WRITE"),
            (AccessFlags::REMOTE_READ, "REMOTE_READ"),
            (AccessFlags::RELAXED_ORDERING, "RELAXED_ORDERING"),
        ];
        let set: Vec<&str> = names
            .iter()
            .filter(|(flag, _)| self.contains(*flag))
            .map(|(_, name)| *name)
            .collect();
        if set.is_empty() {
            formatter.write_str("NONE")
        } else {
            formatter.write_str(&set.join(" | "))
        }
    }
}

/// The keys of a registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrKeys {
    /// Names the region in this process's scatter-gather entries.
    pub lkey: u32,
    /// Names the region to peers: it goes in the region's export, and a peer's one-sided
    /// WRITE/READ carries it.
    pub rkey: u32,
}
