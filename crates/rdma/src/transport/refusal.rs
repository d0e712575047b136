//! Why the RDMA transport will not use a peer, one of its buffers or a connection request:
//! something the peer published or sent that does not hold up, or something this engine
//! cannot do for it. Each message says what to do.

use super::export::EXPORT_VERSION;
use super::handshake::{HANDSHAKE_VERSION, MAX_QPS};
use crate::VerbsError;

/// Why a peer, a buffer or a request is refused; the text goes into the log line, `reach`'s
/// answer or the refusal sent back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// The peer's export comes from a build that writes another version.
    #[error("the peer's rdma export has version {version}, this build reads version {EXPORT_VERSION}: run the same ferry version on both sides")]
    ExportVersion {
        /// The version it carries.
        version: u32,
    },
    /// The peer's export does not parse.
    #[error("the peer's rdma export is not valid: {reason}")]
    ExportInvalid {
        /// The parser's words.
        reason: String,
    },
    /// The peer's export lists no NIC, or more than any host has.
    #[error("the peer's rdma export lists {count} NICs, expected 1 to {most}")]
    ExportNics {
        /// How many it lists.
        count: usize,
        /// The most accepted.
        most: usize,
    },
    /// The peer's export names a NIC by an empty or overlong name.
    #[error("the peer's rdma export names a NIC of {len} bytes, expected 1 to {most}")]
    NicName {
        /// The name's length.
        len: usize,
        /// The longest accepted.
        most: usize,
    },
    /// The peer did not register this buffer with RDMA.
    #[error("the peer did not register this buffer with RDMA")]
    NotRegistered,
    /// The peer publishes no RDMA side channel.
    #[error("the peer runs without RDMA (its `ferry probe` says why)")]
    NoRdma,
    /// The peer's side channel is `:port` and it publishes no TCP endpoint to take the host from.
    #[error("the peer publishes no TCP endpoint to find its host by")]
    NoHost,
    /// The peer's TCP endpoint is not `host:port`.
    #[error("the peer's TCP endpoint {endpoint:?} is not host:port")]
    BadEndpoint {
        /// The endpoint it publishes.
        endpoint: String,
    },
    /// A queue pair endpoint answers no RDMA READ.
    #[error("the peer answers no RDMA READ at all (READ depth 0)")]
    NoReads,
    /// A queue pair endpoint names an MTU verbs lacks.
    #[error("the peer sent MTU {mtu}, not one verbs has")]
    Mtu {
        /// The MTU sent.
        mtu: u32,
    },
    /// A connection request speaks another handshake version.
    #[error("the peer speaks RDMA handshake version {version}, this engine version {HANDSHAKE_VERSION}: run the same ferry version on both sides")]
    HandshakeVersion {
        /// The version it speaks.
        version: u32,
    },
    /// A connection request asks for no queue pair, or more than any link uses.
    #[error("the peer asked for {count} queue pairs, expected 1 to {MAX_QPS}")]
    QueuePairs {
        /// How many it asked for.
        count: usize,
    },
    /// A connection request names a NIC this engine does not use.
    #[error("this engine does not use RDMA device {nic:?}")]
    UnknownNic {
        /// The NIC named.
        nic: String,
    },
    /// A verbs call refused what the peer sent, or failed here.
    #[error("{0}")]
    Verbs(#[from] VerbsError),
}
