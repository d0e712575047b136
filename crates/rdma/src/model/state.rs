//! The model's state: hosts, their devices, regions, CQs and QPs.

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::memory::HostMemory;
use crate::device::{DeviceInfo, Mtu, PortInfo};
use crate::error::VerbsError;
use crate::memory::AccessFlags;
use crate::qp::{AddressVector, Psn, QpCaps, QpState};
use crate::work::{RecvRequest, SendRequest, WorkCompletion};

/// Everything the model knows, behind the fabric's lock.
#[derive(Debug)]
pub(super) struct State {
    pub(super) hosts: Vec<HostState>,
    /// Run posted work at once (as if the NIC were infinitely fast); tests that look at work
    /// in flight turn it off and call `Fabric::progress`.
    pub(super) auto_progress: bool,
}

/// One machine: its devices, memory and verbs objects.
#[derive(Debug)]
pub(super) struct HostState {
    pub(super) name: String,
    pub(super) alive: bool,
    pub(super) devices: Vec<DeviceInfo>,
    pub(super) memory: Box<dyn HostMemory>,
    pub(super) next_pd: u32,
    /// Regions by key index (see `lkey_of` / `rkey_of`).
    pub(super) regions: HashMap<u32, Region>,
    pub(super) next_region: u32,
    pub(super) cqs: Vec<Cq>,
    /// QPs by number; numbers are unique per host.
    pub(super) qps: BTreeMap<u32, Qp>,
    pub(super) next_qpn: u32,
}

/// The low byte of every lkey and rkey; the rest is the region's index. Distinct values, so
/// passing an lkey where an rkey belongs fails as it may on hardware.
const LKEY_TAG: u32 = 0x11;
const RKEY_TAG: u32 = 0x22;

pub(super) fn lkey_of(index: u32) -> u32 {
    (index << 8) | LKEY_TAG
}

pub(super) fn rkey_of(index: u32) -> u32 {
    (index << 8) | RKEY_TAG
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Region {
    pub(super) device: usize,
    pub(super) pd: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) access: AccessFlags,
}

impl Region {
    /// Whether `len` bytes at `addr` lie inside the region.
    pub(super) fn covers(&self, addr: u64, len: u64) -> bool {
        let end = addr.checked_add(len);
        let region_end = self.addr.checked_add(self.len);
        matches!((end, region_end), (Some(end), Some(region_end)) if addr >= self.addr && end <= region_end)
    }
}

#[derive(Debug)]
pub(super) struct Cq {
    pub(super) capacity: u32,
    pub(super) entries: VecDeque<Cqe>,
    pub(super) overrun: bool,
}

/// A completion, with the send slot it releases when polled.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cqe {
    pub(super) completion: WorkCompletion,
    pub(super) send_slot: Option<u64>,
}

#[derive(Debug)]
pub(super) struct PendingSend {
    pub(super) seq: u64,
    pub(super) request: SendRequest,
}

#[derive(Debug)]
pub(super) struct Qp {
    pub(super) device: usize,
    pub(super) pd: u32,
    pub(super) send_cq: usize,
    pub(super) recv_cq: usize,
    pub(super) caps: QpCaps,
    pub(super) state: QpState,
    pub(super) port: u8,
    pub(super) access: AccessFlags,
    pub(super) path_mtu: Mtu,
    pub(super) dest_qpn: u32,
    pub(super) address: Option<AddressVector>,
    /// The next PSN expected from the peer.
    pub(super) rq_psn: Psn,
    /// The next PSN sent.
    pub(super) sq_psn: Psn,
    pub(super) rnr_retry: u8,
    pub(super) sq: VecDeque<PendingSend>,
    pub(super) rq: VecDeque<RecvRequest>,
    /// Send requests ever posted, and those whose slots were released by a polled completion.
    pub(super) sq_posted: u64,
    pub(super) sq_released: u64,
    /// Send requests that completed successfully.
    pub(super) executed: u64,
}

impl HostState {
    pub(super) fn new(name: String, devices: Vec<DeviceInfo>, memory: Box<dyn HostMemory>) -> Self {
        HostState {
            name,
            alive: true,
            devices,
            memory,
            next_pd: 1,
            regions: HashMap::new(),
            next_region: 1,
            cqs: Vec::new(),
            qps: BTreeMap::new(),
            next_qpn: 0x100,
        }
    }

    /// Refuses every call once the host died.
    pub(super) fn check_alive(&self) -> Result<(), VerbsError> {
        if self.alive {
            Ok(())
        } else {
            Err(VerbsError::DeviceGone {
                device: self.name.clone(),
            })
        }
    }

    pub(super) fn port(&self, device: usize, port: u8) -> Option<&PortInfo> {
        self.devices
            .get(device)?
            .ports
            .iter()
            .find(|info| info.port_num == port)
    }

    /// The region an lkey names, if it belongs to `device` and `pd`.
    pub(super) fn region_by_lkey(&self, lkey: u32, device: usize, pd: u32) -> Option<Region> {
        (lkey & 0xff == LKEY_TAG)
            .then(|| self.regions.get(&(lkey >> 8)))
            .flatten()
            .filter(|region| region.device == device && region.pd == pd)
            .copied()
    }

    /// The region an rkey names, if it belongs to `device` and `pd`.
    pub(super) fn region_by_rkey(&self, rkey: u32, device: usize, pd: u32) -> Option<Region> {
        (rkey & 0xff == RKEY_TAG)
            .then(|| self.regions.get(&(rkey >> 8)))
            .flatten()
            .filter(|region| region.device == device && region.pd == pd)
            .copied()
    }

    /// Queues a completion; a full CQ overruns (and stays overrun), as hardware's does.
    pub(super) fn push_cqe(
        &mut self,
        cq: usize,
        completion: WorkCompletion,
        send_slot: Option<u64>,
    ) {
        if let Some(cq) = self.cqs.get_mut(cq) {
            if cq.entries.len() >= cq.capacity as usize {
                cq.overrun = true;
            } else {
                cq.entries.push_back(Cqe {
                    completion,
                    send_slot,
                });
            }
        }
    }
}
