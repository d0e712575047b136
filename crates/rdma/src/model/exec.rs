//! Running posted work: what the NICs and the wire do between `post_send` and `poll_cq`.

use super::state::{HostState, State};
use crate::device::{LinkLayer, PortState};
use crate::memory::AccessFlags;
use crate::qp::QpState;
use crate::work::{SendOpcode, SendRequest, Sge, WcOpcode, WcStatus, WorkCompletion};

/// How one send request ended, or that it waits (RNR with infinite retry).
enum Outcome {
    Complete(WcStatus, u32),
    Blocked,
}

/// Runs posted work until nothing more can run; returns how many requests completed.
pub(super) fn progress(state: &mut State) -> usize {
    let mut total = 0;
    loop {
        let mut moved = 0;
        for host in 0..state.hosts.len() {
            let qpns: Vec<u32> = state.hosts[host].qps.keys().copied().collect();
            for qpn in qpns {
                while let Some(count) = step(state, host, qpn) {
                    moved += count;
                }
            }
        }
        if moved == 0 {
            return total;
        }
        total += moved;
    }
}

/// Runs the QP's next send request (or flushes an errored QP); `None` when nothing ran.
fn step(state: &mut State, host: usize, qpn: u32) -> Option<usize> {
    let qp = state.hosts[host].qps.get(&qpn)?;
    if qp.state == QpState::Error {
        let flushed = flush(&mut state.hosts[host], qpn);
        return (flushed > 0).then_some(flushed);
    }
    if qp.state != QpState::ReadyToSend {
        return None;
    }
    let request = qp.sq.front()?.request.clone();
    let (status, byte_len) = match execute(state, host, qpn, &request) {
        Outcome::Blocked => return None,
        Outcome::Complete(status, byte_len) => (status, byte_len),
    };
    let host_state = &mut state.hosts[host];
    let qp = host_state.qps.get_mut(&qpn)?;
    let pending = qp.sq.pop_front()?;
    let send_cq = qp.send_cq;
    if !status.is_success() {
        qp.state = QpState::Error;
    }
    if request.signaled || !status.is_success() {
        let completion = WorkCompletion {
            wr_id: request.wr_id,
            status,
            opcode: send_opcode(request.opcode),
            byte_len,
            imm: None,
            qp_num: qpn,
        };
        host_state.push_cqe(send_cq, completion, Some(pending.seq));
    }
    Some(1)
}

fn send_opcode(opcode: SendOpcode) -> WcOpcode {
    match opcode {
        SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
        SendOpcode::RdmaRead => WcOpcode::RdmaRead,
    }
}

/// Completes everything queued on an errored QP with `IBV_WC_WR_FLUSH_ERR`.
pub(super) fn flush(host: &mut HostState, qpn: u32) -> usize {
    let Some(qp) = host.qps.get_mut(&qpn) else {
        return 0;
    };
    let sends: Vec<_> = qp.sq.drain(..).collect();
    let recvs: Vec<_> = qp.rq.drain(..).collect();
    let (send_cq, recv_cq) = (qp.send_cq, qp.recv_cq);
    let count = sends.len() + recvs.len();
    let flushed = |wr_id, opcode| WorkCompletion {
        wr_id,
        status: WcStatus::WrFlushError,
        opcode,
        byte_len: 0,
        imm: None,
        qp_num: qpn,
    };
    for pending in sends {
        let completion = flushed(pending.request.wr_id, send_opcode(pending.request.opcode));
        host.push_cqe(send_cq, completion, Some(pending.seq));
    }
    for recv in recvs {
        host.push_cqe(recv_cq, flushed(recv.wr_id, WcOpcode::Recv), None);
    }
    count
}

/// Whether every SG entry names a region of the QP's protection domain that covers it (and
/// allows local writes where the NIC writes).
fn sg_list_valid(
    host: &HostState,
    device: usize,
    pd: u32,
    sg_list: &[Sge],
    local_write: bool,
) -> bool {
    sg_list.iter().all(|sge| {
        host.region_by_lkey(sge.lkey, device, pd)
            .is_some_and(|region| {
                region.covers(sge.addr, u64::from(sge.len))
                    && (!local_write || region.access.contains(AccessFlags::LOCAL_WRITE))
            })
    })
}

/// One send request from local checks through the responder and back.
fn execute(state: &mut State, host: usize, qpn: u32, request: &SendRequest) -> Outcome {
    use Outcome::Complete;
    let requester = &state.hosts[host];
    let Some(qp) = requester.qps.get(&qpn) else {
        return Complete(WcStatus::GeneralError, 0);
    };
    let (device, pd, sq_psn, rnr_retry, path_mtu) =
        (qp.device, qp.pd, qp.sq_psn, qp.rnr_retry, qp.path_mtu);
    let Some(local_port) = requester.port(device, qp.port) else {
        return Complete(WcStatus::GeneralError, 0);
    };

    // Requester checks: length, then every SG entry against the QP's protection domain.
    let total: u64 = request.sg_list.iter().map(|sge| u64::from(sge.len)).sum();
    let Ok(byte_len) = u32::try_from(total) else {
        return Complete(WcStatus::LocalLengthError, 0);
    };
    if byte_len > local_port.max_msg_size {
        return Complete(WcStatus::LocalLengthError, 0);
    }
    let is_read = request.opcode == SendOpcode::RdmaRead;
    if !sg_list_valid(requester, device, pd, &request.sg_list, is_read) {
        return Complete(WcStatus::LocalProtectionError, 0);
    }
    let payload = if is_read {
        Vec::new()
    } else {
        let mut bytes = Vec::with_capacity(total as usize);
        for sge in &request.sg_list {
            match requester.memory.read(sge.addr, u64::from(sge.len)) {
                Some(chunk) => bytes.extend_from_slice(&chunk),
                None => return Complete(WcStatus::LocalProtectionError, 0),
            }
        }
        bytes
    };

    // The wire: an unreachable, dead or unconnected peer never acknowledges.
    let Some((remote_host, remote_qpn)) = route(state, host, qpn) else {
        return Complete(WcStatus::RetryExceeded, 0);
    };
    let responder = &mut state.hosts[remote_host];
    let Some(remote_qp) = responder.qps.get(&remote_qpn) else {
        return Complete(WcStatus::RetryExceeded, 0);
    };
    if remote_qp.rq_psn != sq_psn {
        // A PSN the responder does not expect is NAKed or dropped; retransmissions of it never
        // line up, so the requester runs out of retries.
        return Complete(WcStatus::RetryExceeded, 0);
    }

    // Responder checks: the QP's and the region's access flags, the rkey, the range.
    let needed = if is_read {
        AccessFlags::REMOTE_READ
    } else {
        AccessFlags::REMOTE_WRITE
    };
    let (remote_device, remote_pd, remote_recv_cq) =
        (remote_qp.device, remote_qp.pd, remote_qp.recv_cq);
    let region_ok = responder
        .region_by_rkey(request.remote.rkey, remote_device, remote_pd)
        .is_some_and(|region| {
            region.covers(request.remote.addr, total) && region.access.contains(needed)
        });
    if !remote_qp.access.contains(needed) || !region_ok {
        return Complete(WcStatus::RemoteAccessError, 0);
    }
    let imm = match request.opcode {
        SendOpcode::RdmaWriteWithImm { imm } => Some(imm),
        _ => None,
    };
    if imm.is_some() {
        let Some(recv) = remote_qp.rq.front() else {
            // No receive posted: RNR NAK. rnr_retry 7 retries for ever, so the request waits.
            return if rnr_retry == 7 {
                Outcome::Blocked
            } else {
                Complete(WcStatus::RnrRetryExceeded, 0)
            };
        };
        if !sg_list_valid(responder, remote_device, remote_pd, &recv.sg_list, true) {
            // A malformed receive: the responder's QP fails, the requester hears REM_OP_ERR.
            let wr_id = recv.wr_id;
            if let Some(remote_qp) = responder.qps.get_mut(&remote_qpn) {
                remote_qp.rq.pop_front();
                remote_qp.state = QpState::Error;
            }
            let completion = WorkCompletion {
                wr_id,
                status: WcStatus::LocalQpOperationError,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                qp_num: remote_qpn,
            };
            responder.push_cqe(remote_recv_cq, completion, None);
            return Complete(WcStatus::RemoteOperationError, 0);
        }
    }

    // The data moves.
    let read_data = if is_read {
        match responder.memory.read(request.remote.addr, total) {
            Some(bytes) => bytes,
            None => return Complete(WcStatus::RemoteAccessError, 0),
        }
    } else {
        if responder
            .memory
            .write(request.remote.addr, &payload)
            .is_none()
        {
            return Complete(WcStatus::RemoteAccessError, 0);
        }
        Vec::new()
    };
    let packets = byte_len.div_ceil(path_mtu.bytes()).max(1);
    let Some(remote_qp) = responder.qps.get_mut(&remote_qpn) else {
        return Complete(WcStatus::RetryExceeded, 0);
    };
    remote_qp.rq_psn = remote_qp.rq_psn.advance(packets);
    if let Some(imm) = imm {
        if let Some(recv) = remote_qp.rq.pop_front() {
            let completion = WorkCompletion {
                wr_id: recv.wr_id,
                status: WcStatus::Success,
                opcode: WcOpcode::RecvRdmaWithImm,
                byte_len,
                imm: Some(imm),
                qp_num: remote_qpn,
            };
            responder.push_cqe(remote_recv_cq, completion, None);
        }
    }

    // Back at the requester: a READ's data lands in the SG list.
    let requester = &mut state.hosts[host];
    let mut offset = 0usize;
    for sge in request.sg_list.iter().filter(|_| is_read) {
        let end = offset + sge.len as usize;
        let Some(chunk) = read_data.get(offset..end) else {
            return Complete(WcStatus::LocalProtectionError, 0);
        };
        if requester.memory.write(sge.addr, chunk).is_none() {
            return Complete(WcStatus::LocalProtectionError, 0);
        }
        offset = end;
    }
    if let Some(qp) = requester.qps.get_mut(&qpn) {
        qp.sq_psn = qp.sq_psn.advance(packets);
        qp.executed += 1;
    }
    Complete(WcStatus::Success, byte_len)
}

/// The responder a connected QP's packets reach: `(host, qpn)`, or `None` when no live,
/// connected QP answers there (dead host, link down, wrong GID/LID/QPN, QP not in RTR/RTS).
fn route(state: &State, host: usize, qpn: u32) -> Option<(usize, u32)> {
    let requester = &state.hosts[host];
    let qp = requester.qps.get(&qpn)?;
    let local_port = requester.port(qp.device, qp.port)?;
    if local_port.state != PortState::Active {
        return None;
    }
    let address = qp.address?;
    for (index, remote) in state.hosts.iter().enumerate() {
        if !remote.alive {
            continue;
        }
        let Some(remote_qp) = remote.qps.get(&qp.dest_qpn) else {
            continue;
        };
        let Some(port) = remote.port(remote_qp.device, remote_qp.port) else {
            continue;
        };
        let reached = match address.global {
            Some(global) => port.gids.iter().any(|entry| entry.gid == global.dest_gid),
            None => port.link_layer == LinkLayer::InfiniBand && port.lid == address.dest_lid,
        };
        let ready = matches!(
            remote_qp.state,
            QpState::ReadyToReceive | QpState::ReadyToSend
        );
        if reached && ready && port.state == PortState::Active {
            return Some((index, qp.dest_qpn));
        }
    }
    None
}
