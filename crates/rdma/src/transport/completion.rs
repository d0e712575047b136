//! What a failed work completion means for the transfer it belonged to.

use crate::work::WcStatus;
use ferry_core::{Direction, Error};

/// What a work request moved, to name it when it fails.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Op {
    pub(crate) direction: Direction,
    pub(crate) len: u64,
    pub(crate) local_nic: usize,
    pub(crate) remote_nic: usize,
}

impl Op {
    pub(crate) fn verb(&self) -> &'static str {
        match self.direction {
            Direction::Write => "WRITE",
            Direction::Read => "READ",
        }
    }
}

/// What a status means, and what to do about it.
fn meaning(status: WcStatus) -> &'static str {
    match status {
        WcStatus::RetryExceeded => "the peer did not acknowledge: its host or NIC is down, its queue pair is gone, or the path between the NICs is broken",
        WcStatus::RnrRetryExceeded => "the peer had no receive posted; the peer's engine may be a different version",
        WcStatus::WrFlushError => "flushed: an earlier request on the same queue pair failed, or the link was closed (transfer timeout)",
        WcStatus::RemoteAccessError => "the peer's NIC refused the key or the range: the peer deregistered the buffer or restarted; refresh its descriptor",
        WcStatus::RemoteInvalidRequestError => "the peer's NIC found the request invalid (a length above its limit, say)",
        WcStatus::RemoteOperationError => "the peer's NIC could not complete the request",
        WcStatus::LocalProtectionError => "the local NIC refused the local range: the region was deregistered during the transfer",
        WcStatus::LocalLengthError => "the request is longer than the port allows: lower the RDMA slice size",
        _ => "the NIC reported an error; check the device with `ferry probe` and the kernel log",
    }
}

/// The error a transfer fails with when one of its work requests completed with `status`.
/// Statuses that say the peer is unreachable are [`Error::PeerGone`]; the others name the
/// refusal as an I/O error of the operation.
pub(crate) fn wc_error(
    peer: &str,
    status: WcStatus,
    op: &Op,
    local_nics: &[String],
    remote_nics: &[String],
) -> Error {
    let route = format!(
        "{} -> {}",
        local_nics.get(op.local_nic).map_or("?", String::as_str),
        remote_nics.get(op.remote_nic).map_or("?", String::as_str)
    );
    let what = format!("RDMA {} of {} bytes through {route}", op.verb(), op.len);
    let detail = format!("{what} completed with {status}: {}", meaning(status));
    match status {
        WcStatus::RetryExceeded | WcStatus::RnrRetryExceeded | WcStatus::WrFlushError => {
            Error::PeerGone {
                peer: peer.to_owned(),
                reason: detail,
            }
        }
        _ => Error::Io {
            what: format!("{what} with peer {peer}"),
            source: std::io::Error::other(format!("{status}: {}", meaning(status))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY_ERROR: [WcStatus; 15] = [
        WcStatus::LocalLengthError,
        WcStatus::LocalQpOperationError,
        WcStatus::LocalProtectionError,
        WcStatus::WrFlushError,
        WcStatus::MemoryWindowBindError,
        WcStatus::BadResponseError,
        WcStatus::LocalAccessError,
        WcStatus::RemoteInvalidRequestError,
        WcStatus::RemoteAccessError,
        WcStatus::RemoteOperationError,
        WcStatus::RetryExceeded,
        WcStatus::RnrRetryExceeded,
        WcStatus::RemoteAbortError,
        WcStatus::FatalError,
        WcStatus::GeneralError,
    ];

    #[test]
    fn every_error_completion_fails_its_transfer_naming_the_status_the_route_and_the_op() {
        let nics = |name: &str| vec![name.to_owned()];
        for status in EVERY_ERROR {
            let op = Op {
                direction: Direction::Read,
                len: 4096,
                local_nic: 0,
                remote_nic: 0,
            };
            let error = wc_error("decode:1", status, &op, &nics("mlx5_0"), &nics("mlx5_3"));
            let message = error.to_string();
            assert!(message.contains(status.name()), "{message}");
            assert!(
                message.contains("READ of 4096 bytes through mlx5_0 -> mlx5_3"),
                "{message}"
            );
            assert!(message.contains("decode:1"), "{message}");
            let gone = matches!(error, Error::PeerGone { .. });
            let expected_gone = matches!(
                status,
                WcStatus::RetryExceeded | WcStatus::RnrRetryExceeded | WcStatus::WrFlushError
            );
            assert_eq!(gone, expected_gone, "{status}: {error:?}");
        }
    }
}
