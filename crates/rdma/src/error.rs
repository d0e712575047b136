//! The errors verbs calls return (as opposed to error completions, which are
//! [`WcStatus`](crate::WcStatus) values on the completion queue).

use crate::memory::AccessFlags;
use crate::qp_state::QpState;

/// Why a verbs call was refused. Each message ends with what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No device has this name.
    #[error(
        "no RDMA device named {name:?}: pick one from the device list (`ferry probe` prints it)"
    )]
    NoSuchDevice {
        /// The name asked for.
        name: String,
    },
    /// The device has no such port.
    #[error("RDMA device {device:?} has no port {port}: ports are numbered from 1; pick one from the device list")]
    NoSuchPort {
        /// The device.
        device: String,
        /// The port asked for.
        port: u8,
    },
    /// The device stopped answering (its host died, or it was removed).
    #[error("RDMA device {device:?} is gone: close what was opened on it and open another device")]
    DeviceGone {
        /// The device.
        device: String,
    },
    /// A handle created through another device context (or another verbs instance) was passed.
    #[error("this {kind} belongs to another device context: pass objects created on the same device and protection domain")]
    ForeignHandle {
        /// What kind of object: "protection domain", "completion queue", ...
        kind: &'static str,
    },
    /// A handle whose object no longer exists (deregistered or destroyed) was passed.
    #[error("this {kind} no longer exists: it was deregistered or destroyed; create a new one")]
    StaleHandle {
        /// What kind of object.
        kind: &'static str,
    },
    /// The access flags are not a combination verbs accepts.
    #[error("access flags {access:?} refused: {remedy}")]
    InvalidAccess {
        /// The flags given.
        access: AccessFlags,
        /// What to change.
        remedy: &'static str,
    },
    /// The range to register is not mapped memory of this process (`EFAULT`).
    #[error("cannot register {len} bytes at {addr:#x}: the range is not allocated memory of this process; register memory that is mapped for its whole length")]
    BadAddress {
        /// The range's start.
        addr: u64,
        /// The range's length.
        len: u64,
    },
    /// The QP cannot move from its state to the one asked for.
    #[error("QP {qpn} cannot move from {from:?} to {to:?}: connect through RESET -> INIT -> RTR -> RTS, or reset the QP first")]
    InvalidTransition {
        /// The QP.
        qpn: u32,
        /// Its state.
        from: QpState,
        /// The state asked for.
        to: QpState,
    },
    /// An attribute of a transition is out of range or does not fit the port.
    #[error("QP {qpn}: attribute {attribute} refused: {remedy}")]
    InvalidAttribute {
        /// The QP.
        qpn: u32,
        /// The attribute's name.
        attribute: &'static str,
        /// What to change.
        remedy: &'static str,
    },
    /// Sends were posted to a QP that is not ready to send.
    #[error("QP {qpn} is in state {state:?} and cannot take {queue} work requests: bring it to {needed} with modify_qp first")]
    QpNotReady {
        /// The QP.
        qpn: u32,
        /// Its state.
        state: QpState,
        /// "send" or "receive".
        queue: &'static str,
        /// The state needed.
        needed: &'static str,
    },
    /// A work request has more scatter-gather entries than the QP was created for.
    #[error("work request {index} of the list has {count} scatter-gather entries, QP {qpn} takes at most {max}; nothing of the list was posted: split it")]
    TooManySge {
        /// The QP.
        qpn: u32,
        /// The request's position in the posted list.
        index: usize,
        /// Its entries.
        count: usize,
        /// The QP's limit.
        max: u32,
    },
    /// Posting would exceed the queue's capacity.
    #[error("QP {qpn}'s {queue} queue is full ({outstanding} outstanding, {requested} more asked, capacity {capacity}); nothing was posted: poll completions (signal a send at least every capacity requests) and post again")]
    QueueFull {
        /// The QP.
        qpn: u32,
        /// "send" or "receive".
        queue: &'static str,
        /// Requests holding slots.
        outstanding: u32,
        /// Requests in the refused list.
        requested: usize,
        /// The queue's capacity.
        capacity: u32,
    },
    /// The completion queue overflowed and lost completions.
    #[error("completion queue overrun (capacity {capacity}): completions were lost; create the CQ with room for every outstanding work request of its QPs and reset those QPs")]
    CqOverrun {
        /// The CQ's capacity.
        capacity: u32,
    },
    /// A PSN wider than 24 bits.
    #[error("PSN {value:#x} does not fit in 24 bits: take a random value below 2^24")]
    InvalidPsn {
        /// The value given.
        value: u32,
    },
    /// A size given to create an object is zero or above the device's limits.
    #[error("{what} of {value} refused: {remedy}")]
    InvalidSize {
        /// The size's name.
        what: &'static str,
        /// The value given.
        value: u64,
        /// What to change.
        remedy: &'static str,
    },
    /// The device, the kernel or the installed rdma-core cannot do this at all.
    #[error("{what} is not supported here: {reason}")]
    Unsupported {
        /// What was asked for.
        what: String,
        /// Why it cannot be done, and what would make it possible.
        reason: String,
    },
    /// A verbs call failed with an operating-system error the other variants do not name.
    #[error("{call} failed: {message}; check the device with `ferry probe` and the kernel log")]
    Failed {
        /// The verbs call.
        call: &'static str,
        /// The error it returned.
        message: String,
    },
}
