//! An in-memory model of verbs, for tests: several "hosts" in one process, each with RDMA
//! devices, memory and verbs objects, joined by a lossless fabric.
//!
//! It is faithful to what the transport relies on: the QP state machine (sends only in RTS,
//! receives from INIT; a failed request moves its QP to ERROR and flushes everything queued
//! with `IBV_WC_WR_FLUSH_ERR`; posting to an ERROR QP is accepted and flushed), send-queue
//! slots released only by polled completions (selective signalling), local lkey/PD/bounds
//! checks (`IBV_WC_LOC_PROT_ERR`), the port's maximum message size (`IBV_WC_LOC_LEN_ERR`), the
//! responder's QP and region access flags, rkey, PD and bounds checks (`IBV_WC_REM_ACCESS_ERR`),
//! WRITE_WITH_IMM consuming a posted receive (RNR: `IBV_WC_RNR_RETRY_EXC_ERR`, or waiting for
//! ever with `rnr_retry` 7; a malformed receive: `IBV_WC_REM_OP_ERR`), routing by GID (RoCE) or
//! LID (InfiniBand) with PSNs that must line up, and peers that die or links that go down
//! (`IBV_WC_RETRY_EXC_ERR`). Work runs at once by default; [`Fabric::set_auto_progress`] holds
//! it in the queues until [`Fabric::progress`]. Timing (retry timeouts, bandwidth) is not
//! modelled.
//!
//! Memory: each host has its own address space of owned `Vec<u8>` buffers at synthetic,
//! page-aligned virtual addresses ([`ModelVerbs::alloc`]), with an unmapped page between
//! buffers. Work requests carry plain `u64` addresses as real ones do; the model translates
//! them to (buffer, offset) and copies with slices. That keeps the model free of `unsafe`
//! (no raw pointer into a test's `Vec` can dangle or alias), makes two hosts' addresses
//! independent as across machines (the same address on two hosts is different memory), and
//! lets registration refuse memory that is not mapped, as `ibv_reg_mr` does with `EFAULT`.
#![forbid(unsafe_code)]

mod exec;
mod memory;
use self::memory::AddressSpace;
pub use self::memory::HostMemory;
mod state;
#[cfg(test)]
mod tests;

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use parking_lot::Mutex;

use self::state::{lkey_of, rkey_of, Cq, HostState, Qp, Region, State};
use crate::device::{DeviceInfo, Gid, GidEntry, GidType, LinkLayer, Mtu, PortInfo, PortState};
use crate::error::VerbsError;
use crate::memory::{AccessFlags, MrKeys};
use crate::qp::{Psn, QpCaps, QpState, QpTransition};
use crate::verbs::Verbs;
use crate::work::{RecvRequest, SendRequest, WorkCompletion};

/// The network joining the model's hosts. Cloning shares it.
#[derive(Debug, Clone)]
pub struct Fabric {
    state: Arc<Mutex<State>>,
}

impl Default for Fabric {
    fn default() -> Self {
        Self::new()
    }
}

impl Fabric {
    /// An empty fabric that runs posted work at once.
    pub fn new() -> Self {
        Fabric {
            state: Arc::new(Mutex::new(State {
                hosts: Vec::new(),
                auto_progress: true,
            })),
        }
    }

    /// Adds a host with memory of its own ([`ModelVerbs::alloc`]); the returned
    /// [`ModelVerbs`] is that host's verbs library.
    pub fn add_host(&self, config: HostConfig) -> ModelVerbs {
        self.add_host_with_memory(config, Box::new(AddressSpace::new()))
    }

    /// Adds a host whose NIC reads and writes `memory`, such as the registered regions of a
    /// real engine in this process.
    pub fn add_host_with_memory(
        &self,
        config: HostConfig,
        memory: Box<dyn HostMemory>,
    ) -> ModelVerbs {
        let mut state = self.state.lock();
        state
            .hosts
            .push(HostState::new(config.name, config.devices, memory));
        ModelVerbs {
            state: Arc::clone(&self.state),
            host: state.hosts.len() - 1,
        }
    }

    /// With `false`, posted work stays queued until [`progress`](Self::progress), so tests
    /// can act while it is in flight (kill a peer, move a QP to ERROR).
    pub fn set_auto_progress(&self, on: bool) {
        let mut state = self.state.lock();
        state.auto_progress = on;
        if on {
            exec::progress(&mut state);
        }
    }

    /// Runs queued work until nothing more can run; returns how many requests completed.
    pub fn progress(&self) -> usize {
        exec::progress(&mut self.state.lock())
    }
}

/// A host to add to a [`Fabric`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostConfig {
    /// The host's name, shown in errors.
    pub name: String,
    /// Its RDMA devices.
    pub devices: Vec<DeviceInfo>,
}

impl HostConfig {
    /// A host with one RoCE device `mlx5_0`: port 1 active, Ethernet, 4096-byte MTU (jumbo
    /// frames), 1 GiB maximum message, and the usual GID table: link-local v1 and v2 at 0 and
    /// 1, the IPv4-mapped address as v1 and v2 at 2 and 3.
    pub fn roce(name: &str, ipv4: [u8; 4]) -> Self {
        let link_local = Gid::link_local([0x02, 0, ipv4[0], ipv4[1], 0xfe, 0xff, ipv4[2], ipv4[3]]);
        let mapped = Gid::from_ipv4(ipv4);
        let gids = vec![
            GidEntry {
                index: 0,
                gid: link_local,
                kind: GidType::RoceV1,
            },
            GidEntry {
                index: 1,
                gid: link_local,
                kind: GidType::RoceV2,
            },
            GidEntry {
                index: 2,
                gid: mapped,
                kind: GidType::RoceV1,
            },
            GidEntry {
                index: 3,
                gid: mapped,
                kind: GidType::RoceV2,
            },
        ];
        Self::one_port(name, LinkLayer::Ethernet, 0, gids)
    }

    /// A host with one InfiniBand device `mlx5_0`: port 1 active with `lid`, 4096-byte MTU.
    pub fn infiniband(name: &str, lid: u16) -> Self {
        let mut raw = [0u8; 16];
        raw[0] = 0xfe;
        raw[1] = 0x80;
        raw[14..].copy_from_slice(&lid.to_be_bytes());
        let gids = vec![GidEntry {
            index: 0,
            gid: Gid(raw),
            kind: GidType::Ib,
        }];
        Self::one_port(name, LinkLayer::InfiniBand, lid, gids)
    }

    fn one_port(name: &str, link_layer: LinkLayer, lid: u16, gids: Vec<GidEntry>) -> Self {
        let port = PortInfo {
            port_num: 1,
            state: PortState::Active,
            link_layer,
            active_mtu: Mtu::Mtu4096,
            lid,
            max_msg_size: 1 << 30,
            // NDR, 4 lanes: a 400 Gb/s port.
            line_rate_mbps: Some(400_000),
            gids,
        };
        HostConfig {
            name: name.to_owned(),
            devices: vec![DeviceInfo {
                name: "mlx5_0".to_owned(),
                ports: vec![port],
                max_sge: 30,
                max_qp_wr: 32768,
                max_rd_atomic: 16,
            }],
        }
    }
}

/// One host's verbs, in the model. Also gives tests the host's memory and its faults.
#[derive(Debug, Clone)]
pub struct ModelVerbs {
    state: Arc<Mutex<State>>,
    host: usize,
}

/// An open device of the model.
#[derive(Debug)]
pub struct ModelContext {
    host: usize,
    device: usize,
}

/// A protection domain of the model.
#[derive(Debug)]
pub struct ModelPd {
    host: usize,
    device: usize,
    pd: u32,
}

/// A registered region of the model.
#[derive(Debug)]
pub struct ModelMr {
    host: usize,
    index: u32,
    keys: MrKeys,
}

/// A completion queue of the model.
#[derive(Debug)]
pub struct ModelCq {
    host: usize,
    device: usize,
    index: usize,
}

/// A queue pair of the model.
#[derive(Debug)]
pub struct ModelQp {
    host: usize,
    qpn: u32,
}

impl ModelVerbs {
    /// Runs `call` on this host's state after checking the host is alive and the handle is
    /// this host's; runs queued work afterwards when the fabric does so at once.
    fn with_host<T>(
        &self,
        handle_host: usize,
        kind: &'static str,
        call: impl FnOnce(&mut HostState) -> Result<T, VerbsError>,
    ) -> Result<T, VerbsError> {
        if handle_host != self.host {
            return Err(VerbsError::ForeignHandle { kind });
        }
        let mut state = self.state.lock();
        let host = &mut state.hosts[self.host];
        host.check_alive()?;
        let result = call(host)?;
        if state.auto_progress {
            exec::progress(&mut state);
        }
        Ok(result)
    }

    /// Maps `len` zeroed bytes of this host's memory; returns their address, to register and
    /// to name in work requests.
    ///
    /// # Errors
    /// [`VerbsError::InvalidSize`] for zero or absurd lengths.
    pub fn alloc(&self, len: u64) -> Result<u64, VerbsError> {
        self.state.lock().hosts[self.host].memory.alloc(len)
    }

    /// Writes `bytes` into this host's memory at `addr`.
    ///
    /// # Errors
    /// [`VerbsError::BadAddress`] when the range is not mapped.
    pub fn write_memory(&self, addr: u64, bytes: &[u8]) -> Result<(), VerbsError> {
        let len = bytes.len() as u64;
        self.state.lock().hosts[self.host]
            .memory
            .write(addr, bytes)
            .ok_or(VerbsError::BadAddress { addr, len })
    }

    /// Reads `len` bytes of this host's memory at `addr`.
    ///
    /// # Errors
    /// [`VerbsError::BadAddress`] when the range is not mapped.
    pub fn read_memory(&self, addr: u64, len: u64) -> Result<Vec<u8>, VerbsError> {
        self.state.lock().hosts[self.host]
            .memory
            .read(addr, len)
            .ok_or(VerbsError::BadAddress { addr, len })
    }

    /// The send requests each live QP of this host completed successfully, by device name:
    /// `(device, qpn, requests)`, in QP-number order. Tests read how work was spread.
    pub fn executed(&self) -> Vec<(String, u32, u64)> {
        let state = self.state.lock();
        let host = &state.hosts[self.host];
        host.qps
            .iter()
            .map(|(qpn, qp)| {
                let device = host
                    .devices
                    .get(qp.device)
                    .map_or_else(String::new, |device| device.name.clone());
                (device, *qpn, qp.executed)
            })
            .collect()
    }

    /// Fault injection: the host dies. Its QPs are gone (peers' requests to them end in
    /// `IBV_WC_RETRY_EXC_ERR`) and its own verbs calls fail with [`VerbsError::DeviceGone`].
    pub fn die(&self) {
        let mut state = self.state.lock();
        let host = &mut state.hosts[self.host];
        host.alive = false;
        host.qps.clear();
        if state.auto_progress {
            exec::progress(&mut state);
        }
    }

    /// Fault injection: sets a port's state (a link that goes down stops carrying traffic).
    ///
    /// # Errors
    /// [`VerbsError::NoSuchDevice`], [`VerbsError::NoSuchPort`].
    pub fn set_port_state(
        &self,
        device: &str,
        port: u8,
        port_state: PortState,
    ) -> Result<(), VerbsError> {
        let mut state = self.state.lock();
        let host = &mut state.hosts[self.host];
        let info = host
            .devices
            .iter_mut()
            .find(|info| info.name == device)
            .ok_or_else(|| VerbsError::NoSuchDevice {
                name: device.to_owned(),
            })?;
        let port_info = info
            .ports
            .iter_mut()
            .find(|info| info.port_num == port)
            .ok_or_else(|| VerbsError::NoSuchPort {
                device: device.to_owned(),
                port,
            })?;
        port_info.state = port_state;
        if state.auto_progress {
            exec::progress(&mut state);
        }
        Ok(())
    }
}

fn qp_mut(host: &mut HostState, qpn: u32) -> Result<&mut Qp, VerbsError> {
    host.qps
        .get_mut(&qpn)
        .ok_or(VerbsError::StaleHandle { kind: "queue pair" })
}

impl Verbs for ModelVerbs {
    type Context = ModelContext;
    type ProtectionDomain = ModelPd;
    type MemoryRegion = ModelMr;
    type CompletionQueue = ModelCq;
    type QueuePair = ModelQp;

    fn devices(&self) -> Result<Vec<DeviceInfo>, VerbsError> {
        self.with_host(self.host, "host", |host| Ok(host.devices.clone()))
    }

    fn open(&self, name: &str) -> Result<ModelContext, VerbsError> {
        let device = self.with_host(self.host, "host", |host| {
            host.devices
                .iter()
                .position(|info| info.name == name)
                .ok_or_else(|| VerbsError::NoSuchDevice {
                    name: name.to_owned(),
                })
        })?;
        Ok(ModelContext {
            host: self.host,
            device,
        })
    }

    fn alloc_pd(&self, context: &ModelContext) -> Result<ModelPd, VerbsError> {
        let pd = self.with_host(context.host, "device context", |host| {
            host.next_pd += 1;
            Ok(host.next_pd)
        })?;
        Ok(ModelPd {
            host: context.host,
            device: context.device,
            pd,
        })
    }

    fn reg_mr(
        &self,
        pd: &ModelPd,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<ModelMr, VerbsError> {
        self.with_host(pd.host, "protection domain", |host| {
            crate::checks::registration(access, len)?;
            if !host.memory.is_mapped(addr, len) {
                return Err(VerbsError::BadAddress { addr, len });
            }
            let index = host.next_region;
            host.next_region += 1;
            host.regions.insert(
                index,
                Region {
                    device: pd.device,
                    pd: pd.pd,
                    addr,
                    len,
                    access,
                },
            );
            Ok(ModelMr {
                host: pd.host,
                index,
                keys: MrKeys {
                    lkey: lkey_of(index),
                    rkey: rkey_of(index),
                },
            })
        })
    }

    fn mr_keys(&self, mr: &ModelMr) -> MrKeys {
        mr.keys
    }

    /// The model has no GPUs: a dma-buf stands for memory of the host at `iova`. The fd must
    /// be open and at least `offset + len` bytes long (a memfd serves in tests), as a real
    /// importer checks the range against the dma-buf's size.
    fn reg_dmabuf_mr(
        &self,
        pd: &ModelPd,
        dmabuf: BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
        access: AccessFlags,
    ) -> Result<ModelMr, VerbsError> {
        let size = dmabuf
            .try_clone_to_owned()
            .map(std::fs::File::from)
            .and_then(|file| file.metadata())
            .map(|metadata| metadata.len())
            .map_err(|error| VerbsError::Failed {
                call: "ibv_reg_dmabuf_mr",
                message: format!("the dma-buf fd cannot be read: {error}"),
            })?;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(VerbsError::BadAddress { addr: iova, len });
        }
        self.reg_mr(pd, iova, len, access)
    }

    fn dereg_mr(&self, mr: ModelMr) -> Result<(), VerbsError> {
        self.with_host(mr.host, "memory region", |host| {
            host.regions
                .remove(&mr.index)
                .map(|_| ())
                .ok_or(VerbsError::StaleHandle {
                    kind: "memory region",
                })
        })
    }

    fn create_cq(&self, context: &ModelContext, capacity: u32) -> Result<ModelCq, VerbsError> {
        let index = self.with_host(context.host, "device context", |host| {
            if capacity == 0 {
                return Err(VerbsError::InvalidSize {
                    what: "CQ capacity",
                    value: 0,
                    remedy: "make room for every outstanding work request of the CQ's QPs",
                });
            }
            let cq = Cq {
                capacity,
                entries: Default::default(),
                overrun: false,
            };
            host.cqs.push(cq);
            Ok(host.cqs.len() - 1)
        })?;
        Ok(ModelCq {
            host: context.host,
            device: context.device,
            index,
        })
    }

    fn create_qp(
        &self,
        pd: &ModelPd,
        send_cq: &ModelCq,
        recv_cq: &ModelCq,
        caps: QpCaps,
    ) -> Result<ModelQp, VerbsError> {
        if send_cq.host != pd.host
            || recv_cq.host != pd.host
            || send_cq.device != pd.device
            || recv_cq.device != pd.device
        {
            return Err(VerbsError::ForeignHandle {
                kind: "completion queue",
            });
        }
        let qpn = self.with_host(pd.host, "protection domain", |host| {
            if caps.max_send_wr == 0 || caps.max_recv_wr == 0 {
                return Err(VerbsError::InvalidSize {
                    what: "QP queue capacity",
                    value: 0,
                    remedy: "give both queues room for at least one work request",
                });
            }
            let qpn = host.next_qpn;
            host.next_qpn += 1;
            let qp = Qp {
                device: pd.device,
                pd: pd.pd,
                send_cq: send_cq.index,
                recv_cq: recv_cq.index,
                caps,
                state: QpState::Reset,
                port: 0,
                access: AccessFlags::NONE,
                path_mtu: Mtu::Mtu256,
                dest_qpn: 0,
                address: None,
                rq_psn: Psn::default(),
                sq_psn: Psn::default(),
                rnr_retry: 0,
                sq: Default::default(),
                rq: Default::default(),
                sq_posted: 0,
                sq_released: 0,
                executed: 0,
            };
            host.qps.insert(qpn, qp);
            Ok(qpn)
        })?;
        Ok(ModelQp { host: pd.host, qpn })
    }

    fn destroy_qp(&self, qp: ModelQp) -> Result<(), VerbsError> {
        self.with_host(qp.host, "queue pair", |host| {
            host.qps
                .remove(&qp.qpn)
                .map(|_| ())
                .ok_or(VerbsError::StaleHandle { kind: "queue pair" })
        })
    }

    fn qp_num(&self, qp: &ModelQp) -> u32 {
        qp.qpn
    }

    fn qp_state(&self, qp: &ModelQp) -> Result<QpState, VerbsError> {
        self.with_host(
            qp.host,
            "queue pair",
            |host| Ok(qp_mut(host, qp.qpn)?.state),
        )
    }

    fn modify_qp(&self, qp: &ModelQp, transition: &QpTransition) -> Result<(), VerbsError> {
        self.with_host(qp.host, "queue pair", |host| {
            transition::apply(host, qp.qpn, transition)
        })
    }

    fn post_send(&self, qp: &ModelQp, requests: &[SendRequest]) -> Result<(), VerbsError> {
        self.with_host(qp.host, "queue pair", |host| {
            let entry = qp_mut(host, qp.qpn)?;
            if !matches!(entry.state, QpState::ReadyToSend | QpState::Error) {
                return Err(VerbsError::QpNotReady {
                    qpn: qp.qpn,
                    state: entry.state,
                    queue: "send",
                    needed: "RTS",
                });
            }
            crate::checks::sge_counts(
                qp.qpn,
                requests.iter().map(|request| request.sg_list.len()),
                entry.caps.max_send_sge,
            )?;
            let outstanding = entry.sq_posted - entry.sq_released;
            if outstanding + requests.len() as u64 > u64::from(entry.caps.max_send_wr) {
                return Err(VerbsError::QueueFull {
                    qpn: qp.qpn,
                    queue: "send",
                    outstanding: outstanding as u32,
                    requested: requests.len(),
                    capacity: entry.caps.max_send_wr,
                });
            }
            for request in requests {
                let seq = entry.sq_posted;
                entry.sq_posted += 1;
                entry.sq.push_back(state::PendingSend {
                    seq,
                    request: request.clone(),
                });
            }
            Ok(())
        })
    }

    fn post_recv(&self, qp: &ModelQp, requests: &[RecvRequest]) -> Result<(), VerbsError> {
        self.with_host(qp.host, "queue pair", |host| {
            let entry = qp_mut(host, qp.qpn)?;
            if entry.state == QpState::Reset {
                return Err(VerbsError::QpNotReady {
                    qpn: qp.qpn,
                    state: entry.state,
                    queue: "receive",
                    needed: "INIT",
                });
            }
            crate::checks::sge_counts(
                qp.qpn,
                requests.iter().map(|request| request.sg_list.len()),
                entry.caps.max_recv_sge,
            )?;
            if entry.rq.len() + requests.len() > entry.caps.max_recv_wr as usize {
                return Err(VerbsError::QueueFull {
                    qpn: qp.qpn,
                    queue: "receive",
                    outstanding: entry.rq.len() as u32,
                    requested: requests.len(),
                    capacity: entry.caps.max_recv_wr,
                });
            }
            entry.rq.extend(requests.iter().cloned());
            Ok(())
        })
    }

    fn poll_cq(
        &self,
        cq: &ModelCq,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, VerbsError> {
        self.with_host(cq.host, "completion queue", |host| {
            let queue = host.cqs.get_mut(cq.index).ok_or(VerbsError::StaleHandle {
                kind: "completion queue",
            })?;
            if queue.overrun {
                return Err(VerbsError::CqOverrun {
                    capacity: queue.capacity,
                });
            }
            let count = max.min(queue.entries.len());
            let polled: Vec<_> = queue.entries.drain(..count).collect();
            for entry in polled {
                if let (Some(slot), Some(qp)) =
                    (entry.send_slot, host.qps.get_mut(&entry.completion.qp_num))
                {
                    qp.sq_released = qp.sq_released.max(slot + 1);
                }
                out.push(entry.completion);
            }
            Ok(count)
        })
    }
}

mod transition;
