//! One reliable-connected queue pair with its own completion queue, brought from RESET to
//! RTS, and destroyed when dropped.

use super::config::RdmaConfig;
use super::handshake::{RemoteQp, WireEndpoint};
use super::nic::Nic;
use crate::error::VerbsError;
use crate::memory::AccessFlags;
use crate::qp::{InitAttr, Psn, QpCaps, QpTransition, RtrAttr, RtsAttr};
use crate::verbs::Verbs;
use std::sync::Arc;

/// RDMA READs a queue pair has in flight at most, each way, whatever the device allows.
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

    /// What the peer needs to connect to this queue pair, as the handshake carries it.
    pub(crate) fn wire_endpoint(&self) -> Result<WireEndpoint, VerbsError> {
        let endpoint = self.nic.endpoint(self.verbs.qp_num(self.qp()?), self.psn);
        Ok(WireEndpoint::new(
            &endpoint,
            self.nic.port.active_mtu,
            self.rd_atomic(),
        ))
    }

    /// READs this queue pair answers at once: what the peer's initiator depth may reach.
    fn rd_atomic(&self) -> u8 {
        self.nic.max_rd_atomic.min(RD_ATOMIC)
    }

    /// Connects to the peer's queue pair `remote`: RTR, then RTS, with as many READs in
    /// flight as both sides allow.
    ///
    /// # Errors
    /// The transition verbs refused.
    pub(crate) fn connect(&self, remote: &RemoteQp, config: &RdmaConfig) -> Result<(), VerbsError> {
        let endpoint = &remote.endpoint;
        self.modify(&QpTransition::ReadyToReceive(RtrAttr {
            path_mtu: self.nic.path_mtu(remote.mtu),
            dest_qpn: endpoint.qpn,
            rq_psn: endpoint.psn,
            address: self.nic.address(endpoint, config.traffic_class),
            max_dest_rd_atomic: self.rd_atomic(),
            min_rnr_timer: MIN_RNR_TIMER,
        }))?;
        self.modify(&QpTransition::ReadyToSend(RtsAttr {
            sq_psn: self.psn,
            timeout: config.ack_timeout,
            retry_count: config.retry_count,
            rnr_retry: 7,
            max_rd_atomic: self.rd_atomic().min(remote.rd_atomic).max(1),
        }))
    }

    /// Moves the queue pair to ERROR: whatever is outstanding completes flushed.
    ///
    /// # Errors
    /// When the NIC refused (a device that died or was reset): then no flush completion
    /// will come, and the caller must give up on what is outstanding itself.
    pub(crate) fn fail(&self) -> Result<(), VerbsError> {
        self.modify(&QpTransition::Error)
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
