//! Work requests (what is posted) and work completions (what the completion queue returns).

use std::fmt;

/// One scatter-gather entry (`ibv_sge`): a local range of a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sge {
    /// The first byte's address in this process.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The [`lkey`](crate::MrKeys::lkey) of a region covering the range.
    pub lkey: u32,
}

/// The peer's side of a one-sided operation: a range of the peer's registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteSegment {
    /// The first byte's address in the peer's process.
    pub addr: u64,
    /// The [`rkey`](crate::MrKeys::rkey) the peer exported for a region covering the range.
    pub rkey: u32,
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendOpcode {
    /// `IBV_WR_RDMA_WRITE`: the local SG list is written to the remote range.
    RdmaWrite,
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`: as a WRITE, then the peer's next posted receive completes
    /// with the immediate value (with no receive posted, the peer answers RNR NAK).
    RdmaWriteWithImm {
        /// The 32-bit immediate value the peer's receive completion carries.
        imm: u32,
    },
    /// `IBV_WR_RDMA_READ`: the remote range is read into the local SG list.
    RdmaRead,
}

/// A send work request (`ibv_send_wr`) for a one-sided operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendRequest {
    /// The caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// WRITE, WRITE_WITH_IMM or READ.
    pub opcode: SendOpcode,
    /// The local ranges, in order; their lengths add up to the message length.
    pub sg_list: Vec<Sge>,
    /// The peer's range: as long as the message.
    pub remote: RemoteSegment,
    /// `IBV_SEND_SIGNALED`: whether success produces a completion. Errors always do.
    pub signaled: bool,
}

/// A receive work request (`ibv_recv_wr`). A WRITE_WITH_IMM consumes one (its data goes to
/// the WRITE's remote range, not to the SG list, which may be empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvRequest {
    /// The caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// The receive buffers (for SENDs; unused by WRITE_WITH_IMM but still validated).
    pub sg_list: Vec<Sge>,
}

/// One completion (`ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's `wr_id`.
    pub wr_id: u64,
    /// How the work request ended.
    pub status: WcStatus,
    /// What completed. As in verbs, only meaningful when `status` is
    /// [`WcStatus::Success`].
    pub opcode: WcOpcode,
    /// Bytes moved (READ, and receives of WRITE_WITH_IMM); only meaningful on success.
    pub byte_len: u32,
    /// The immediate value of a WRITE_WITH_IMM, on its receive completion.
    pub imm: Option<u32>,
    /// The number of the QP the work request was posted to.
    pub qp_num: u32,
}

/// `ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// `IBV_WC_RDMA_WRITE` (also for WRITE_WITH_IMM on the sending side).
    RdmaWrite,
    /// `IBV_WC_RDMA_READ`.
    RdmaRead,
    /// `IBV_WC_RECV`: a receive request (flushed ones report this).
    Recv,
    /// `IBV_WC_RECV_RDMA_WITH_IMM`: a receive consumed by a peer's WRITE_WITH_IMM.
    RecvRdmaWithImm,
}

/// `ibv_wc_status`: how a work request ended. [`name`](Self::name) gives the verbs name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    Success,
    /// `IBV_WC_LOC_LEN_ERR`: the message is longer than the port's maximum message size (or a
    /// receive buffer is too short).
    LocalLengthError,
    /// `IBV_WC_LOC_QP_OP_ERR`: a malformed work request on this QP (e.g. a receive whose SG
    /// list names no valid region).
    LocalQpOperationError,
    /// `IBV_WC_LOC_PROT_ERR`: an SG entry names an unknown lkey, a region of another
    /// protection domain, bytes outside its region, or (READ) a region without LOCAL_WRITE.
    LocalProtectionError,
    /// `IBV_WC_WR_FLUSH_ERR`: the QP was in the error state; the request never ran.
    WrFlushError,
    /// `IBV_WC_MW_BIND_ERR`.
    MemoryWindowBindError,
    /// `IBV_WC_BAD_RESP_ERR`: an unexpected transport response.
    BadResponseError,
    /// `IBV_WC_LOC_ACCESS_ERR`: a local access error on an incoming operation.
    LocalAccessError,
    /// `IBV_WC_REM_INV_REQ_ERR`: the peer found the request invalid.
    RemoteInvalidRequestError,
    /// `IBV_WC_REM_ACCESS_ERR`: the peer refused the rkey, the range or the access (region or
    /// QP without REMOTE_WRITE / REMOTE_READ).
    RemoteAccessError,
    /// `IBV_WC_REM_OP_ERR`: the peer could not complete the request (e.g. its receive
    /// request was malformed).
    RemoteOperationError,
    /// `IBV_WC_RETRY_EXC_ERR`: no acknowledgement after `retry_count` retransmissions: the
    /// peer is gone, its QP is not connected, or the path is down.
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive posted, `rnr_retry` times.
    RnrRetryExceeded,
    /// `IBV_WC_REM_ABORT_ERR`: the peer aborted the operation.
    RemoteAbortError,
    /// `IBV_WC_FATAL_ERR`: the device failed.
    FatalError,
    /// `IBV_WC_GENERAL_ERR`: any other error.
    GeneralError,
}

impl WcStatus {
    /// The verbs name (`IBV_WC_REM_ACCESS_ERR`, ...), what logs and errors should show.
    pub fn name(self) -> &'static str {
        match self {
            WcStatus::Success => "IBV_WC_SUCCESS",
            WcStatus::LocalLengthError => "IBV_WC_LOC_LEN_ERR",
            WcStatus::LocalQpOperationError => "IBV_WC_LOC_QP_OP_ERR",
            WcStatus::LocalProtectionError => "IBV_WC_LOC_PROT_ERR",
            WcStatus::WrFlushError => "IBV_WC_WR_FLUSH_ERR",
            WcStatus::MemoryWindowBindError => "IBV_WC_MW_BIND_ERR",
            WcStatus::BadResponseError => "IBV_WC_BAD_RESP_ERR",
            WcStatus::LocalAccessError => "IBV_WC_LOC_ACCESS_ERR",
            WcStatus::RemoteInvalidRequestError => "IBV_WC_REM_INV_REQ_ERR",
            WcStatus::RemoteAccessError => "IBV_WC_REM_ACCESS_ERR",
            WcStatus::RemoteOperationError => "IBV_WC_REM_OP_ERR",
            WcStatus::RetryExceeded => "IBV_WC_RETRY_EXC_ERR",
            WcStatus::RnrRetryExceeded => "IBV_WC_RNR_RETRY_EXC_ERR",
            WcStatus::RemoteAbortError => "IBV_WC_REM_ABORT_ERR",
            WcStatus::FatalError => "IBV_WC_FATAL_ERR",
            WcStatus::GeneralError => "IBV_WC_GENERAL_ERR",
        }
    }

    /// Whether the work request succeeded.
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}
