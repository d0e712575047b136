//! One reliable-connected queue pair with its own completion queue, brought from RESET to
//! RTS, and destroyed when dropped.

use super::config::RdmaConfig;
use super::nic::Nic;
use crate::error::VerbsError;
use crate::memory::AccessFlags;
use crate::qp::{InitAttr, Psn, QpCaps, QpEndpoint, QpTransition, RtrAttr, RtsAttr};
use crate::verbs::Verbs;
use crate::Mtu;
use std::sync::Arc;

/// RDMA READs a queue pair may have in flight, each way; devices allow at least 16.
const RD_ATOMIC: u8 = 16;
/// The RNR NAK timer code (about 0.64 ms); ferry posts no receives, so it never waits.
const MIN_RNR_TIMER: u8 = 12;

/// A queue pair on one NIC, with the completion queue its send side reports to.
pub(crate) struct QueuePair<V: Verbs> {
    verbs: Arc<V>,
    pub(crate) nic: Arc<Nic<V>>,
    qp: Option<V::QueuePair>,
    pub(crate) cq: V::CompletionQueue,
    psn: Psn,
    /// Work requests it may have outstanding.
    pub(crate) depth: u32,
    /// SG entries one of its work requests may carry.
    pub(crate) max_sge: u32,
}

impl<V: Verbs> QueuePair<V> {
    /// A queue pair in INIT on `nic`, letting peers WRITE and READ through it.
    ///
    /// # Errors
    /// The verbs call that failed.
    pub(crate) fn create(
        verbs: &Arc<V>,
        nic: &Arc<Nic<V>>,
        config: &RdmaConfig,
    ) -> Result<Self, VerbsError> {
        let depth = config.max_outstanding.min(nic.max_qp_wr.max(2));
        let max_sge = config.max_sge.min(nic.max_sge.max(1));
        let cq = verbs.create_cq(&nic.context, depth + 1)?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: 1,
            max_send_sge: max_sge,
            max_recv_sge: 1,
        };
        let qp = verbs.create_qp(&nic.pd, &cq, &cq, caps)?;
        let queue = QueuePair {
            verbs: Arc::clone(verbs),
            nic: Arc::clone(nic),
            qp: Some(qp),
            cq,
            psn: Psn::new(fastrand::u32(..=Psn::MAX))?,
            depth,
            max_sge,
        };
        queue.modify(&QpTransition::Init(InitAttr {
            port: nic.port.port_num,
            pkey_index: 0,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        }))?;
        Ok(queue)
    }

    /// The verbs queue pair; present from `create` until drop.
    pub(crate) fn qp(&self) -> Result<&V::QueuePair, VerbsError> {
        self.qp
            .as_ref()
            .ok_or(VerbsError::StaleHandle { kind: "queue pair" })
    }

    /// What the peer needs to connect to this queue pair.
    pub(crate) fn endpoint(&self) -> Result<QpEndpoint, VerbsError> {
        Ok(self.nic.endpoint(self.verbs.qp_num(self.qp()?), self.psn))
    }

    /// Connects to the peer's `remote` endpoint, whose port runs `remote_mtu`: RTR, then RTS.
    ///
    /// # Errors
    /// The transition verbs refused.
    pub(crate) fn connect(
        &self,
        remote: &QpEndpoint,
        remote_mtu: Mtu,
        config: &RdmaConfig,
    ) -> Result<(), VerbsError> {
        self.modify(&QpTransition::ReadyToReceive(RtrAttr {
            path_mtu: self.nic.path_mtu(remote_mtu),
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            address: self.nic.address(remote),
            max_dest_rd_atomic: RD_ATOMIC,
            min_rnr_timer: MIN_RNR_TIMER,
        }))?;
        self.modify(&QpTransition::ReadyToSend(RtsAttr {
            sq_psn: self.psn,
            timeout: config.ack_timeout,
            retry_count: config.retry_count,
            rnr_retry: 7,
            max_rd_atomic: RD_ATOMIC,
        }))
    }

    /// Moves the queue pair to ERROR: whatever is outstanding completes flushed.
    pub(crate) fn fail(&self) {
        if let Ok(qp) = self.qp() {
            if let Err(error) = self.verbs.modify_qp(qp, &QpTransition::Error) {
                tracing::debug!(%error, nic = %self.nic.name, "moving a queue pair to ERROR failed");
            }
        }
    }

    fn modify(&self, transition: &QpTransition) -> Result<(), VerbsError> {
        self.verbs.modify_qp(self.qp()?, transition)
    }
}

impl<V: Verbs> Drop for QueuePair<V> {
    fn drop(&mut self) {
        if let Some(qp) = self.qp.take() {
            if let Err(error) = self.verbs.destroy_qp(qp) {
                tracing::debug!(%error, nic = %self.nic.name, "destroying a queue pair failed");
            }
        }
    }
}
