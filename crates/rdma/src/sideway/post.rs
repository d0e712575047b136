//! Posting work requests: `ibv_post_send` and `ibv_post_recv`.

use ::sideway::ibverbs::queue_pair::{
    PostRecvError, PostSendError, PostSendGuard as _, QueuePair as _, SetScatterGatherEntry as _,
    WorkRequestFlags,
};
use rdma_mummy_sys::ibv_sge;

use super::failure;
use super::handles::SidewayQp;
use super::queue_pair::cached_state;
use super::raw;
use crate::error::VerbsError;
use crate::qp::QpState;
use crate::work::{RecvRequest, SendOpcode, SendRequest, Sge};

fn sge_list(sg_list: &[Sge]) -> Vec<ibv_sge> {
    sg_list
        .iter()
        .map(|sge| ibv_sge {
            addr: sge.addr,
            length: sge.len,
            lkey: sge.lkey,
        })
        .collect()
}

/// The refusal of a post, with what `ibv_post_send`/`ibv_post_recv` may already have done.
fn post_error(call: &'static str, error: &dyn std::error::Error, full: bool) -> VerbsError {
    let mut message = failure::chain(error);
    if full {
        message.push_str(" (the queue is full: poll completions, then post again)");
    }
    message.push_str(
        "; work requests of the list before the refused one may have been posted and will \
         complete (verbs stops at the first request it refuses and sideway does not say which)",
    );
    VerbsError::Failed { call, message }
}

/// Posts `requests` to the send queue as one `ibv_post_send`.
///
/// Not quite all or nothing: this layer refuses the whole list before posting anything when
/// the QP is not in RTS (or ERROR) or a request has too many SG entries, but a list the
/// provider refuses part-way (`ENOMEM`: the queue is full; `EINVAL`) has had the requests
/// before the refused one posted, and sideway does not say which one that was.
///
/// # Errors
/// [`VerbsError::QpNotReady`], [`VerbsError::TooManySge`], [`VerbsError::Failed`].
pub(super) fn send(qp: &SidewayQp, requests: &[SendRequest]) -> Result<(), VerbsError> {
    // sideway would hand verbs a dangling pointer for an empty list.
    if requests.is_empty() {
        return Ok(());
    }
    let mut inner = qp.inner.lock();
    // RTS posts; ERROR takes the requests and flushes them, as verbs does.
    if let Some(state @ (QpState::Reset | QpState::Init | QpState::ReadyToReceive)) =
        raw::qp_state(cached_state(&inner.qp))
    {
        return Err(VerbsError::QpNotReady {
            qpn: qp.qpn,
            state,
            queue: "send",
            needed: "RTS",
        });
    }
    crate::checks::sge_counts(
        qp.qpn,
        requests.iter().map(|request| request.sg_list.len()),
        qp.caps.max_send_sge,
    )?;
    let mut guard = inner.qp.start_post_send();
    for request in requests {
        let flags = match request.signaled {
            true => WorkRequestFlags::Signaled,
            false => WorkRequestFlags::none(),
        };
        let handle = guard.construct_wr(request.wr_id, flags);
        let remote = request.remote;
        let buffers = match request.opcode {
            SendOpcode::RdmaWrite => handle.setup_write(remote.rkey, remote.addr),
            // Verbs carries the immediate in network byte order.
            SendOpcode::RdmaWriteWithImm { imm } => {
                handle.setup_write_imm(remote.rkey, remote.addr, imm.to_be())
            }
            SendOpcode::RdmaRead => handle.setup_read(remote.rkey, remote.addr),
        };
        let sges = sge_list(&request.sg_list);
        // SAFETY: sideway marks SG entries unsafe because the NIC will read (WRITE) or write
        // (READ) the ranges after this call returns. The guard copies the entries, so `sges`
        // may go; the NIC reaches memory only through the registration each lkey names, whose
        // pages the kernel pinned and whose bounds and access the NIC checks (a bad entry
        // completes with IBV_WC_LOC_PROT_ERR instead of touching other memory), and nothing in
        // this process dereferences the addresses. That the ranges hold what the caller means
        // while the work is in flight is the caller's contract.
        unsafe { buffers.setup_sge_list(&sges) };
    }
    guard.post().map_err(|error| {
        let full = matches!(error, PostSendError::NotEnoughResources(_));
        post_error("ibv_post_send", &error, full)
    })
}

/// Posts `requests` to the receive queue as one `ibv_post_recv`; as [`send`] about
/// refusals part-way.
///
/// # Errors
/// [`VerbsError::QpNotReady`] (the QP is in RESET), [`VerbsError::TooManySge`],
/// [`VerbsError::Failed`].
pub(super) fn recv(qp: &SidewayQp, requests: &[RecvRequest]) -> Result<(), VerbsError> {
    if requests.is_empty() {
        return Ok(());
    }
    let mut inner = qp.inner.lock();
    if raw::qp_state(cached_state(&inner.qp)) == Some(QpState::Reset) {
        return Err(VerbsError::QpNotReady {
            qpn: qp.qpn,
            state: QpState::Reset,
            queue: "receive",
            needed: "INIT",
        });
    }
    crate::checks::sge_counts(
        qp.qpn,
        requests.iter().map(|request| request.sg_list.len()),
        qp.caps.max_recv_sge,
    )?;
    let mut guard = inner.qp.start_post_recv();
    for request in requests {
        let handle = guard.construct_wr(request.wr_id);
        let sges = sge_list(&request.sg_list);
        // SAFETY: as for `send`: the guard copies the entries, and the NIC writes received
        // data only into registered, pinned memory that each lkey names, within its bounds.
        unsafe { handle.setup_sge_list(&sges) };
    }
    guard.post().map_err(|error| {
        let full = matches!(error, PostRecvError::NotEnoughResources(_));
        post_error("ibv_post_recv", &error, full)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sg_entries_keep_their_fields() {
        let sges = sge_list(&[Sge {
            addr: 0x1000,
            len: 64,
            lkey: 7,
        }]);
        assert_eq!(sges.len(), 1);
        assert_eq!(
            (sges[0].addr, sges[0].length, sges[0].lkey),
            (0x1000, 64, 7)
        );
    }
}
