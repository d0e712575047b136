//! RC queue pairs: creation, state and state transitions.

use std::sync::Arc;

use ::sideway::ibverbs::address::{AddressHandleAttribute, Gid as SidewayGid};
use ::sideway::ibverbs::completion::GenericCompletionQueue;
use ::sideway::ibverbs::queue_pair::{
    BasicQueuePair, CreateQueuePairErrorKind, ModifyQueuePairError, ModifyQueuePairErrorKind,
    QueryQueuePairErrorKind, QueuePair as _, QueuePairAttribute, QueuePairAttributeMask,
    QueuePairState, QueuePairType,
};
use parking_lot::Mutex;

use super::failure::{self, errno};
use super::handles::{QpInner, SidewayCq, SidewayPd, SidewayQp};
use super::raw;
use crate::error::VerbsError;
use crate::qp::{QpCaps, QpState, QpTransition};

/// Creates an RC QP in RESET on `pd`, completing into `send_cq` and `recv_cq` (which may be
/// the same CQ), each of which it takes for itself (see [`SidewayCq`]).
///
/// # Errors
/// [`VerbsError::ForeignHandle`] (CQs of another device), [`VerbsError::InvalidSize`] (zero
/// capacities, or more than the device allows), [`VerbsError::Unsupported`] (a CQ that already
/// serves another QP).
pub(super) fn create(
    pd: &SidewayPd,
    send_cq: &SidewayCq,
    recv_cq: &SidewayCq,
    caps: QpCaps,
) -> Result<SidewayQp, VerbsError> {
    if !Arc::ptr_eq(&pd.context, &send_cq.context) || !Arc::ptr_eq(&pd.context, &recv_cq.context) {
        return Err(VerbsError::ForeignHandle {
            kind: "completion queue",
        });
    }
    if caps.max_send_wr == 0 || caps.max_recv_wr == 0 {
        return Err(VerbsError::InvalidSize {
            what: "QP queue capacity",
            value: 0,
            remedy: "give both queues room for at least one work request",
        });
    }
    let shared_cq = || VerbsError::Unsupported {
        what: "a completion queue shared by several queue pairs".to_owned(),
        reason: "sideway's work completions do not carry the QP number, so each CQ serves one \
                 QP for its life: create a CQ for each QP (one CQ may be both its send and \
                 receive CQ)"
            .to_owned(),
    };
    let one_cq = std::ptr::eq(send_cq, recv_cq);
    if !send_cq.claim() {
        return Err(shared_cq());
    }
    if !one_cq && !recv_cq.claim() {
        send_cq.release();
        return Err(shared_cq());
    }
    let mut builder = pd.inner.create_qp_builder();
    builder
        .setup_qp_type(QueuePairType::ReliableConnection)
        .setup_max_send_wr(caps.max_send_wr)
        .setup_max_recv_wr(caps.max_recv_wr)
        .setup_max_send_sge(caps.max_send_sge)
        .setup_max_recv_sge(caps.max_recv_sge)
        .setup_max_inline_data(0)
        .setup_send_cq(GenericCompletionQueue::from(Arc::clone(&send_cq.inner)))
        .setup_recv_cq(GenericCompletionQueue::from(Arc::clone(&recv_cq.inner)));
    // Both CQs are set just above: `build`'s panic for a missing CQ cannot happen.
    let qp = match builder.build() {
        Ok(qp) => qp,
        Err(error) => {
            send_cq.release();
            if !one_cq {
                recv_cq.release();
            }
            let CreateQueuePairErrorKind::Ibverbs(io) = &error.0 else {
                return Err(failure::failed("ibv_create_qp", &error));
            };
            return Err(match io.raw_os_error() {
                Some(errno::EINVAL) => VerbsError::InvalidSize {
                    what: "QP capacities",
                    value: caps.max_send_wr.max(caps.max_recv_wr).into(),
                    remedy: "stay within the device's max_qp_wr and max_sge (`ferry probe` \
                             prints them)",
                },
                _ => failure::os("ibv_create_qp", &pd.device, io),
            });
        }
    };
    let qpn = qp.qp_number();
    send_cq.bind(qpn);
    recv_cq.bind(qpn);
    Ok(SidewayQp {
        device: pd.device.clone(),
        qpn,
        caps,
        inner: Mutex::new(QpInner { qp, port: 0 }),
    })
}

/// The `state` field libibverbs keeps in the `ibv_qp`: set by every successful
/// `ibv_modify_qp` and `ibv_query_qp`, so current after [`state`] queries it.
pub(super) fn cached_state(qp: &BasicQueuePair) -> u32 {
    // SAFETY: the pointer is the `ibv_qp` that `qp` owns and destroys only in its `Drop`, so it
    // is live for this borrow; the caller holds the QP's lock, so no `ibv_modify_qp` or
    // `ibv_query_qp` of this layer writes the field meanwhile, and nothing else does.
    unsafe { qp.qp().as_ref().state }
}

/// The QP's current state (`ibv_query_qp`).
///
/// # Errors
/// [`VerbsError::DeviceGone`] and others of [`failure::os`]; [`VerbsError::Failed`] for a state
/// ferry never moves a QP to (SQD, SQE) or one verbs does not define.
pub(super) fn state(qp: &SidewayQp) -> Result<QpState, VerbsError> {
    let inner = qp.inner.lock();
    // The returned attributes are not read: sideway's `state()` accessor on them converts with
    // a conversion that panics on unknown values. The query updates `cached_state` instead.
    inner
        .qp
        .query(QueuePairAttributeMask::State)
        .map_err(|error| match &error.0 {
            QueryQueuePairErrorKind::Ibverbs(io) => failure::os("ibv_query_qp", &qp.device, io),
            _ => failure::failed("ibv_query_qp", &error),
        })?;
    let raw_state = cached_state(&inner.qp);
    raw::qp_state(raw_state).ok_or_else(|| VerbsError::Failed {
        call: "ibv_query_qp",
        message: format!(
            "QP {} is in state {raw_state}, which ferry never moves a QP to; reset it",
            qp.qpn
        ),
    })
}

/// The checks of a transition's values that need no device, as the model makes them.
pub(super) fn check(qpn: u32, transition: &QpTransition) -> Result<(), VerbsError> {
    let refuse = |attribute, remedy| {
        Err(VerbsError::InvalidAttribute {
            qpn,
            attribute,
            remedy,
        })
    };
    match transition {
        QpTransition::Init(init) if init.port == 0 => {
            refuse("port", "name a port of the QP's device (numbered from 1)")
        }
        QpTransition::ReadyToReceive(rtr) if rtr.dest_qpn > 0xff_ffff => refuse(
            "dest_qpn",
            "QP numbers have 24 bits: pass the peer's QPN as it sent it",
        ),
        QpTransition::ReadyToReceive(rtr) if rtr.min_rnr_timer > 31 => {
            refuse("min_rnr_timer", "use a timer code from 0 to 31")
        }
        QpTransition::ReadyToSend(rts) if rts.timeout > 31 => {
            refuse("timeout", "use a timeout code from 0 to 31 (14 is common)")
        }
        QpTransition::ReadyToSend(rts) if rts.retry_count > 7 => {
            refuse("retry_count", "use 0 to 7 (7 is common)")
        }
        QpTransition::ReadyToSend(rts) if rts.rnr_retry > 7 => {
            refuse("rnr_retry", "use 0 to 7 (7 retries for ever)")
        }
        _ => Ok(()),
    }
}

/// The `ibv_modify_qp` attributes of `transition`; `port` is the QP's, from its INIT.
fn attributes(transition: &QpTransition, port: u8) -> QueuePairAttribute {
    let mut attr = QueuePairAttribute::new();
    match transition {
        QpTransition::Init(init) => {
            attr.setup_state(QueuePairState::Init)
                .setup_pkey_index(init.pkey_index)
                .setup_port(init.port)
                .setup_access_flags(raw::sideway_access(init.access));
        }
        QpTransition::ReadyToReceive(rtr) => {
            let mut address = AddressHandleAttribute::new();
            address
                .setup_port(port)
                .setup_dest_lid(rtr.address.dest_lid);
            if let Some(global) = rtr.address.global {
                let dest = SidewayGid {
                    raw: global.dest_gid.0,
                };
                address.setup_grh(
                    &dest,
                    0,
                    global.sgid_index,
                    global.hop_limit,
                    global.traffic_class,
                );
            }
            attr.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(raw::sideway_mtu(rtr.path_mtu))
                .setup_dest_qp_num(rtr.dest_qpn)
                .setup_rq_psn(rtr.rq_psn.value())
                .setup_max_dest_read_atomic(rtr.max_dest_rd_atomic)
                .setup_min_rnr_timer(rtr.min_rnr_timer)
                .setup_address_vector(&address);
        }
        QpTransition::ReadyToSend(rts) => {
            attr.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(rts.sq_psn.value())
                .setup_timeout(rts.timeout)
                .setup_retry_cnt(rts.retry_count)
                .setup_rnr_retry(rts.rnr_retry)
                .setup_max_read_atomic(rts.max_rd_atomic);
        }
        QpTransition::Reset => {
            attr.setup_state(QueuePairState::Reset);
        }
        QpTransition::Error => {
            attr.setup_state(QueuePairState::Error);
        }
    }
    attr
}

/// Moves the QP (`ibv_modify_qp`).
///
/// # Errors
/// [`VerbsError::InvalidTransition`], [`VerbsError::InvalidAttribute`] (a value out of range,
/// or one the device refused: a port it lacks, a path MTU above the port's, a GID index not in
/// its table, an unreachable peer GID), others of [`failure::os`].
pub(super) fn modify(qp: &SidewayQp, transition: &QpTransition) -> Result<(), VerbsError> {
    check(qp.qpn, transition)?;
    let mut inner = qp.inner.lock();
    let attr = attributes(transition, inner.port);
    if let Err(error) = inner.qp.modify(&attr) {
        let from = raw::qp_state(cached_state(&inner.qp));
        return Err(modify_error(qp, transition, from, &error));
    }
    if let QpTransition::Init(init) = transition {
        inner.port = init.port;
    }
    Ok(())
}

fn modify_error(
    qp: &SidewayQp,
    transition: &QpTransition,
    from: Option<QpState>,
    error: &ModifyQueuePairError,
) -> VerbsError {
    let refused = |attribute, remedy| VerbsError::InvalidAttribute {
        qpn: qp.qpn,
        attribute,
        remedy,
    };
    match (&error.0, from) {
        (ModifyQueuePairErrorKind::InvalidTransition { .. }, Some(from)) => {
            VerbsError::InvalidTransition {
                qpn: qp.qpn,
                from,
                to: transition.target(),
            }
        }
        (
            ModifyQueuePairErrorKind::ResolveRouteTimedout { .. }
            | ModifyQueuePairErrorKind::NetworkUnreachable { .. },
            _,
        ) => refused(
            "address.global",
            "the peer's GID cannot be reached from this source GID: pick a RoCE v2 GID index \
             whose address is on the NIC's network (`ferry probe`) and check the route to the \
             peer",
        ),
        (ModifyQueuePairErrorKind::Ibverbs(io), _) if io.raw_os_error() == Some(errno::EINVAL) => {
            refused(
                match transition {
                    QpTransition::Init(_) => "port, pkey_index or access",
                    QpTransition::ReadyToReceive(_) => "path_mtu, address or max_dest_rd_atomic",
                    QpTransition::ReadyToSend(_) => "max_rd_atomic",
                    QpTransition::Reset | QpTransition::Error => "state",
                },
                "the device refused a value: compare the port, its active MTU and GID table \
                 with `ferry probe`, and keep read atomics within the device's limits",
            )
        }
        (ModifyQueuePairErrorKind::Ibverbs(io), _) => failure::os("ibv_modify_qp", &qp.device, io),
        // A mask sideway's table rejects is this layer's bug, and a transition from a state
        // ferry has no name for is not one it asked for: report either as it is.
        _ => failure::failed("ibv_modify_qp", error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Gid;
    use crate::memory::AccessFlags;
    use crate::qp::{AddressVector, InitAttr, Psn, RtrAttr, RtsAttr};

    fn rtr(dest_qpn: u32, min_rnr_timer: u8) -> QpTransition {
        QpTransition::ReadyToReceive(RtrAttr {
            path_mtu: crate::Mtu::Mtu4096,
            dest_qpn,
            rq_psn: Psn::default(),
            address: AddressVector {
                dest_lid: 0,
                global: Some(crate::GlobalRoute {
                    dest_gid: Gid::from_ipv4([10, 0, 0, 2]),
                    sgid_index: 3,
                    hop_limit: 255,
                    traffic_class: 0,
                }),
            },
            max_dest_rd_atomic: 1,
            min_rnr_timer,
        })
    }

    fn rts(timeout: u8, retry_count: u8, rnr_retry: u8) -> QpTransition {
        QpTransition::ReadyToSend(RtsAttr {
            sq_psn: Psn::default(),
            timeout,
            retry_count,
            rnr_retry,
            max_rd_atomic: 1,
        })
    }

    fn refused_attribute(transition: QpTransition) -> &'static str {
        match check(9, &transition) {
            Err(VerbsError::InvalidAttribute {
                qpn: 9, attribute, ..
            }) => attribute,
            other => panic!("{transition:?} gave {other:?}"),
        }
    }

    #[test]
    fn values_out_of_range_are_refused_before_verbs_sees_them() {
        let init = |port| {
            QpTransition::Init(InitAttr {
                port,
                pkey_index: 0,
                access: AccessFlags::REMOTE_WRITE,
            })
        };
        assert_eq!(refused_attribute(init(0)), "port");
        assert_eq!(refused_attribute(rtr(1 << 24, 12)), "dest_qpn");
        assert_eq!(refused_attribute(rtr(5, 32)), "min_rnr_timer");
        assert_eq!(refused_attribute(rts(32, 7, 7)), "timeout");
        assert_eq!(refused_attribute(rts(14, 8, 7)), "retry_count");
        assert_eq!(refused_attribute(rts(14, 7, 8)), "rnr_retry");
    }

    #[test]
    fn values_in_range_pass() {
        for transition in [
            QpTransition::Init(InitAttr {
                port: 1,
                pkey_index: 0,
                access: AccessFlags::REMOTE_READ,
            }),
            rtr(0xff_ffff, 31),
            rts(31, 7, 7),
            QpTransition::Reset,
            QpTransition::Error,
        ] {
            assert_eq!(check(9, &transition), Ok(()), "{transition:?}");
        }
    }
}
