//! The states a queue pair moves through, which both the QP and its errors name.

/// `ibv_qp_state`, as far as RC connection set-up goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpState {
    /// Just created or reset: nothing may be posted.
    Reset,
    /// Port and access flags set: receives may be posted, sends not yet.
    Init,
    /// Ready to receive: connected to its peer's QPN; sends still refused.
    ReadyToReceive,
    /// Ready to send: both directions work.
    ReadyToSend,
    /// A work request failed (or the QP was moved here): everything posted completes with
    /// [`WcStatus::WrFlushError`](crate::WcStatus::WrFlushError) until the QP is reset.
    Error,
}
