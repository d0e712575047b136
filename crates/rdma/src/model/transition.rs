//! `modify_qp` in the model: which moves are allowed and which attributes are checked.

use super::state::HostState;
use crate::device::LinkLayer;
use crate::error::VerbsError;
use crate::qp::{QpState, QpTransition};

pub(super) fn apply(
    host: &mut HostState,
    qpn: u32,
    transition: &QpTransition,
) -> Result<(), VerbsError> {
    let qp = host
        .qps
        .get(&qpn)
        .ok_or(VerbsError::StaleHandle { kind: "queue pair" })?;
    let from = qp.state;
    let to = transition.target();
    let allowed = match transition {
        QpTransition::Init(_) => matches!(from, QpState::Reset | QpState::Init),
        QpTransition::ReadyToReceive(_) => from == QpState::Init,
        QpTransition::ReadyToSend(_) => from == QpState::ReadyToReceive,
        QpTransition::Reset | QpTransition::Error => true,
    };
    if !allowed {
        return Err(VerbsError::InvalidTransition { qpn, from, to });
    }
    let refuse = |attribute, remedy| VerbsError::InvalidAttribute {
        qpn,
        attribute,
        remedy,
    };
    let device = qp.device;
    let current_port = qp.port;
    match transition {
        QpTransition::Init(attr) => {
            if host.port(device, attr.port).is_none() {
                return Err(refuse(
                    "port",
                    "name a port of the QP's device (numbered from 1)",
                ));
            }
            let qp = host
                .qps
                .get_mut(&qpn)
                .ok_or(VerbsError::StaleHandle { kind: "queue pair" })?;
            qp.port = attr.port;
            qp.access = attr.access;
        }
        QpTransition::ReadyToReceive(attr) => {
            let port = host
                .port(device, current_port)
                .ok_or_else(|| refuse("port", "move the QP to INIT with a port first"))?;
            if attr.path_mtu > port.active_mtu {
                return Err(refuse(
                    "path_mtu",
                    "use at most the port's active MTU (and the peer's)",
                ));
            }
            if attr.dest_qpn > 0xff_ffff {
                return Err(refuse(
                    "dest_qpn",
                    "QP numbers have 24 bits: pass the peer's QPN as it sent it",
                ));
            }
            if attr.min_rnr_timer > 31 {
                return Err(refuse("min_rnr_timer", "use a timer code from 0 to 31"));
            }
            match attr.address.global {
                None if port.link_layer == LinkLayer::Ethernet => {
                    return Err(refuse(
                        "address.global",
                        "RoCE needs a global route: set the peer's GID and a RoCE v2 sgid_index",
                    ))
                }
                Some(global) if port.gid(global.sgid_index).is_none() => {
                    return Err(refuse(
                        "address.global.sgid_index",
                        "name an entry of the port's GID table",
                    ))
                }
                _ => {}
            }
            let qp = host
                .qps
                .get_mut(&qpn)
                .ok_or(VerbsError::StaleHandle { kind: "queue pair" })?;
            qp.path_mtu = attr.path_mtu;
            qp.dest_qpn = attr.dest_qpn;
            qp.rq_psn = attr.rq_psn;
            qp.address = Some(attr.address);
        }
        QpTransition::ReadyToSend(attr) => {
            if attr.timeout > 31 {
                return Err(refuse(
                    "timeout",
                    "use a timeout code from 0 to 31 (14 is common)",
                ));
            }
            if attr.retry_count > 7 {
                return Err(refuse("retry_count", "use 0 to 7 (7 is common)"));
            }
            if attr.rnr_retry > 7 {
                return Err(refuse("rnr_retry", "use 0 to 7 (7 retries for ever)"));
            }
            let qp = host
                .qps
                .get_mut(&qpn)
                .ok_or(VerbsError::StaleHandle { kind: "queue pair" })?;
            qp.sq_psn = attr.sq_psn;
            qp.rnr_retry = attr.rnr_retry;
        }
        QpTransition::Reset => {
            let qp = host
                .qps
                .get_mut(&qpn)
                .ok_or(VerbsError::StaleHandle { kind: "queue pair" })?;
            qp.sq.clear();
            qp.rq.clear();
            qp.sq_released = qp.sq_posted;
            qp.address = None;
        }
        QpTransition::Error => {}
    }
    if let Some(qp) = host.qps.get_mut(&qpn) {
        qp.state = to;
    }
    Ok(())
}
