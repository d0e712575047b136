//! Queue pair state, the attributes of each transition, and what two peers exchange to
//! connect an RC pair.

use crate::device::{Gid, Mtu};
use crate::error::VerbsError;
use crate::memory::AccessFlags;
pub use crate::qp_state::QpState;

/// The sizes a QP is created with (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send work requests that may be outstanding (posted, slot not yet released by a polled
    /// completion of it or of a later request of the same QP).
    pub max_send_wr: u32,
    /// Receive work requests that may be posted and not yet completed.
    pub max_recv_wr: u32,
    /// Scatter-gather entries per send work request.
    pub max_send_sge: u32,
    /// Scatter-gather entries per receive work request.
    pub max_recv_sge: u32,
}

/// A packet sequence number: 24 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// The largest PSN.
    pub const MAX: u32 = (1 << 24) - 1;

    /// A PSN from its value.
    ///
    /// # Errors
    /// [`VerbsError::InvalidPsn`] when `value` does not fit in 24 bits.
    pub fn new(value: u32) -> Result<Self, VerbsError> {
        if value > Self::MAX {
            return Err(VerbsError::InvalidPsn { value });
        }
        Ok(Psn(value))
    }

    /// The PSN's value.
    pub fn value(self) -> u32 {
        self.0
    }

    /// The PSN `packets` further on, wrapping at 2^24.
    pub fn advance(self, packets: u32) -> Psn {
        Psn(self.0.wrapping_add(packets) & Self::MAX)
    }
}

/// What one side of an RC connection tells the other (over ferry's control connection), as
/// `ibv_rc_pingpong` exchanges it: the other side's RTR attributes are built from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpEndpoint {
    /// The QP's number: the peer's `dest_qpn`.
    pub qpn: u32,
    /// The first PSN this side sends: the peer's `rq_psn`.
    pub psn: Psn,
    /// The port's LID (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// The GID this side sends from: the peer's destination GID.
    pub gid: Gid,
}

/// Where packets of a connected QP go (`ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// The destination LID (InfiniBand; ignored on Ethernet).
    pub dest_lid: u16,
    /// The global route header; required on Ethernet (RoCE), optional on InfiniBand.
    pub global: Option<GlobalRoute>,
}

/// The global route of an address vector (`ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalRoute {
    /// The peer's GID.
    pub dest_gid: Gid,
    /// The index of the local GID to send from; it decides RoCE v1 or v2.
    pub sgid_index: u8,
    /// The IP TTL / hop limit.
    pub hop_limit: u8,
    /// The traffic class (DSCP and ECN bits).
    pub traffic_class: u8,
}

/// RESET -> INIT (`IBV_QP_STATE | PKEY_INDEX | PORT | ACCESS_FLAGS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitAttr {
    /// The port the QP uses, from 1.
    pub port: u8,
    /// The partition key index, 0 almost always.
    pub pkey_index: u16,
    /// What peers may do through this QP: [`AccessFlags::REMOTE_WRITE`] and/or
    /// [`AccessFlags::REMOTE_READ`], checked on top of each region's own flags.
    pub access: AccessFlags,
}

/// INIT -> RTR (`AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttr {
    /// The path MTU; at most the port's active MTU (and the peer's).
    pub path_mtu: Mtu,
    /// The peer QP's number.
    pub dest_qpn: u32,
    /// The first PSN expected from the peer: the peer's [`QpEndpoint::psn`].
    pub rq_psn: Psn,
    /// Where the peer is.
    pub address: AddressVector,
    /// RDMA READs the peer may have outstanding against this QP.
    pub max_dest_rd_atomic: u8,
    /// The RNR NAK timer code (0..=31) sent when no receive is posted.
    pub min_rnr_timer: u8,
}

/// RTR -> RTS (`TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttr {
    /// The first PSN this QP sends: this side's [`QpEndpoint::psn`].
    pub sq_psn: Psn,
    /// The local ACK timeout code (0..=31): 4.096 µs × 2^timeout.
    pub timeout: u8,
    /// Retransmissions before [`RetryExceeded`](crate::WcStatus::RetryExceeded) (0..=7).
    pub retry_count: u8,
    /// RNR retries before [`RnrRetryExceeded`](crate::WcStatus::RnrRetryExceeded) (0..=7;
    /// 7 means retry for ever).
    pub rnr_retry: u8,
    /// RDMA READs this QP may have outstanding.
    pub max_rd_atomic: u8,
}

/// One `ibv_modify_qp` call: the state to move to and the attributes that move needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpTransition {
    /// To [`QpState::Init`], from RESET (or INIT, to change the attributes).
    Init(InitAttr),
    /// To [`QpState::ReadyToReceive`], from INIT.
    ReadyToReceive(RtrAttr),
    /// To [`QpState::ReadyToSend`], from RTR.
    ReadyToSend(RtsAttr),
    /// To [`QpState::Reset`], from any state: outstanding work is dropped without completions.
    Reset,
    /// To [`QpState::Error`], from any state: outstanding work completes flushed.
    Error,
}

impl QpTransition {
    /// The state this transition moves to.
    pub fn target(&self) -> QpState {
        match self {
            QpTransition::Init(_) => QpState::Init,
            QpTransition::ReadyToReceive(_) => QpState::ReadyToReceive,
            QpTransition::ReadyToSend(_) => QpState::ReadyToSend,
            QpTransition::Reset => QpState::Reset,
            QpTransition::Error => QpState::Error,
        }
    }
}
