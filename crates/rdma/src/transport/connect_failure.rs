//! Why the RDMA transport could not connect to a peer: the reason of the
//! [`Error::Unreachable`] that `open` returns, after "RDMA: ".

use super::handshake::MAX_QPS;
use super::refusal::Refusal;
use crate::VerbsError;
use ferry_core::Error;
use std::io;
use std::time::Duration;

/// Why connecting the queue pairs with a peer failed. Each message says what went wrong, and
/// where something can be done, what.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectFailure {
    /// What the peer published or answered does not hold up.
    #[error("{0}")]
    Refused(#[from] Refusal),
    /// Creating or connecting a local queue pair failed.
    #[error("{0}")]
    Verbs(#[from] VerbsError),
    /// The peer's exports name no NIC: it registered no buffer with RDMA.
    #[error("the peer has registered no buffer with RDMA")]
    NoBuffers,
    /// The peer's side channel does not take the connection.
    #[error("connecting to its side channel at {address}: {source}")]
    Connect {
        /// The side channel's address.
        address: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Writing the first byte (whether this engine authenticates) failed.
    #[error("writing to its side channel: {0}")]
    Write(#[source] io::Error),
    /// Every NIC pair's queue pairs would exceed what one connection may ask for.
    #[error("{local} local NICs x {remote} peer NICs x {per_pair} queue pairs each is {count} queue pairs, more than the {MAX_QPS} one connection may have: lower qps_per_nic_pair or list fewer devices")]
    TooManyQueuePairs {
        /// NICs on this side.
        local: usize,
        /// NICs on the peer's side.
        remote: usize,
        /// `qps_per_nic_pair`.
        per_pair: usize,
        /// Their product.
        count: usize,
    },
    /// Sending the offer failed.
    #[error("sending the queue pairs: {0}")]
    Send(#[source] io::Error),
    /// Reading the peer's answer failed, or it is not a valid answer.
    #[error("reading the answer: {0}")]
    Receive(#[source] io::Error),
    /// The peer refused the offer, in its words.
    #[error("the peer refused: {reason}")]
    PeerRefused {
        /// The peer's reason.
        reason: String,
    },
    /// The peer answered another number of queue pairs than offered.
    #[error("the peer answered {answered} queue pairs for the {offered} offered")]
    Answered {
        /// Queue pairs in the answer.
        answered: usize,
        /// Queue pairs offered.
        offered: usize,
    },
    /// The whole connection took longer than `connect_timeout`.
    #[error("connecting the queue pairs took longer than {0:?}")]
    Timeout(Duration),
}

impl ConnectFailure {
    /// ferry's error for `peer`, which this failure leaves unreachable over RDMA.
    pub(crate) fn unreachable(self, peer: &str) -> Error {
        Error::Unreachable {
            peer: peer.to_owned(),
            reason: format!("RDMA: {self}"),
        }
    }
}
