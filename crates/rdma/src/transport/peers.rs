//! What the transport read from each peer's descriptor, once per descriptor generation: where
//! its side channel listens, its NICs, and each buffer's export parsed and checked. Routing
//! (`reach`, on every submit) and transfers look keys up here instead of parsing exports.

use super::export::{RdmaExport, RDMA};
use super::refusal::Refusal;
use ferry_core::{InstanceId, SegmentDescriptor};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// One peer descriptor, as this transport reads it.
#[derive(Debug)]
pub(crate) struct PeerExports {
    generation: u64,
    /// The side channel's `host:port`, or why there is none.
    pub(crate) side_channel: Result<String, Refusal>,
    /// The peer's NICs, from its buffers' exports, in first-seen order.
    pub(crate) nics: Vec<String>,
    /// Each buffer's export by the buffer's address, or why it cannot be used.
    buffers: HashMap<u64, Result<Arc<RdmaExport>, Refusal>>,
}

impl PeerExports {
    fn read(peer: &SegmentDescriptor) -> PeerExports {
        let mut nics: Vec<String> = Vec::new();
        let mut buffers = HashMap::with_capacity(peer.buffers.len());
        for buffer in &peer.buffers {
            let Some(export) = buffer.export(RDMA) else {
                continue;
            };
            let parsed = RdmaExport::from_export(export).map(Arc::new);
            if let Ok(export) = &parsed {
                for key in &export.keys {
                    if !nics.contains(&key.nic) {
                        nics.push(key.nic.clone());
                    }
                }
            }
            buffers.insert(buffer.addr, parsed);
        }
        PeerExports {
            generation: peer.generation,
            side_channel: side_channel(peer),
            nics,
            buffers,
        }
    }

    /// The export of the peer's buffer at `addr`.
    ///
    /// # Errors
    /// Why the buffer cannot be reached over RDMA: not registered with it, or a bad export.
    pub(crate) fn buffer(&self, addr: u64) -> Result<&Arc<RdmaExport>, Refusal> {
        match self.buffers.get(&addr) {
            Some(Ok(export)) => Ok(export),
            Some(Err(refusal)) => Err(refusal.clone()),
            None => Err(Refusal::NotRegistered),
        }
    }
}

/// The host peers dial for `peer`'s side channel: its `rdma` endpoint, whose host is the TCP
/// endpoint's when it publishes only `:port`.
fn side_channel(peer: &SegmentDescriptor) -> Result<String, Refusal> {
    let rdma = peer.endpoint(RDMA).ok_or(Refusal::NoRdma)?;
    if let Some(port) = rdma.strip_prefix(':') {
        let control = peer.endpoint(ferry_core::TCP).ok_or(Refusal::NoHost)?;
        let (host, _) = control
            .rsplit_once(':')
            .ok_or_else(|| Refusal::BadEndpoint {
                endpoint: control.to_owned(),
            })?;
        return Ok(format!("{host}:{port}"));
    }
    Ok(rdma.to_owned())
}

/// Every peer's [`PeerExports`], by engine instance.
#[derive(Debug, Default)]
pub(crate) struct PeerTable {
    peers: Mutex<HashMap<InstanceId, Arc<PeerExports>>>,
}

impl PeerTable {
    /// `peer` as read, reading it again only when its generation changed.
    pub(crate) fn of(&self, peer: &SegmentDescriptor) -> Arc<PeerExports> {
        let mut peers = self.peers.lock();
        match peers.get(&peer.instance) {
            Some(read) if read.generation == peer.generation => Arc::clone(read),
            _ => {
                let read = Arc::new(PeerExports::read(peer));
                peers.insert(peer.instance, Arc::clone(&read));
                read
            }
        }
    }

    /// The newest descriptor read of the engine `instance`.
    pub(crate) fn latest(&self, instance: InstanceId) -> Option<Arc<PeerExports>> {
        self.peers.lock().get(&instance).cloned()
    }
}
