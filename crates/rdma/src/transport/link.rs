//! An RDMA link to one peer: queue pairs ("lanes") between pairs of NICs, the work each has
//! queued and posted, and the completions that finish transfers.
//!
//! Any transfer waiting on the link drives it for all: it posts queued work while its lanes
//! have room, polls their completion queues, and credits completions to the transfers they
//! belong to. Work is striped over the lanes whose NICs hold both sides' keys; a lane's last
//! request of a transfer, every `signal_every`-th one, and the one that fills its queue are
//! signalled, and a signalled completion also completes the unsignalled requests before it
//! on its lane (RC completes in order).

use super::completion::{wc_error, Op};
use super::config::RdmaConfig;
use super::peers::PeerTable;
use super::plan::{plan, Piece, WorkItem};
use super::queue::QueuePair;
use super::registry::Registry;
use crate::verbs::Verbs;
use crate::work::{RemoteSegment, SendOpcode, SendRequest, Sge, WcStatus, WorkCompletion};
use crate::VerbsError;
use ferry_core::{BufferDescriptor, Direction, Error, Link, RegionUse, Result, TransferOps};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bits of a work request id that number it within its lane; the lane is above them.
const SEQ_BITS: u32 = 48;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// Completions taken from one completion queue per poll.
const POLL_BATCH: usize = 64;
/// After the busy-poll budget, a waiting transfer yields to the runtime for this long before
/// it sleeps between polls.
const YIELD_FOR: Duration = Duration::from_millis(2);

/// One queue pair of the link, between a local NIC and a peer NIC.
pub(crate) struct Lane<V: Verbs> {
    pub(crate) queue: QueuePair<V>,
    /// The transport's index of the local NIC.
    pub(crate) local_nic: usize,
    /// The link's index of the peer NIC.
    pub(crate) remote_nic: usize,
}

/// A request waiting for room on its lane.
struct Job {
    transfer: u64,
    request: SendRequest,
    op: Op,
    /// The transfer's last request on this lane: it must be signalled.
    last: bool,
}

/// A posted request whose completion is not known yet.
struct Posted {
    seq: u64,
    transfer: u64,
    op: Op,
}

#[derive(Default)]
struct LaneState {
    pending: VecDeque<Job>,
    posted: VecDeque<Posted>,
    next_seq: u64,
    since_signal: u32,
    /// Why the lane's queue pair failed; nothing more is posted to it.
    broken: Option<LaneFailure>,
}

/// Why a lane's queue pair stopped working: nothing more is posted to it, and later
/// transfers open a new link.
#[derive(Debug, thiserror::Error)]
enum LaneFailure {
    /// Polling its completion queue failed.
    #[error("polling its completion queue failed: {0}")]
    Poll(VerbsError),
    /// Posting to it failed.
    #[error("posting to it failed: {0}")]
    Post(VerbsError),
    /// A request completed with an error status.
    #[error("a request completed with {0}")]
    Completion(WcStatus),
}

/// Why one work request of a lane fails its transfer without an error completion of its own.
#[derive(Debug, thiserror::Error)]
enum RequestFailure<'a> {
    /// Posted, but its queue pair could not be moved to ERROR to flush it.
    #[error("abandoned: the NIC could not flush its queue pair ({0})")]
    Abandoned(&'a VerbsError),
    /// Posting it (with its batch) failed.
    #[error("{0}")]
    NotPosted(&'a LaneFailure),
    /// Queued on a lane that failed before it was posted.
    #[error("not sent: its queue pair failed earlier ({0})")]
    NotSent(&'a LaneFailure),
}

struct TransferState {
    outstanding: usize,
    error: Option<Error>,
}

#[derive(Default)]
struct Progress {
    lanes: Vec<LaneState>,
    transfers: HashMap<u64, TransferState>,
    next_transfer: u64,
    next_lane: usize,
}

impl Progress {
    fn settle(&mut self, transfer: u64, error: Option<Error>) {
        if let Some(state) = self.transfers.get_mut(&transfer) {
            state.outstanding = state.outstanding.saturating_sub(1);
            if let Some(error) = error {
                state.error.get_or_insert(error);
            }
        }
    }
}

/// An open RDMA path to one peer.
pub(crate) struct RdmaLink<V: Verbs> {
    shared: Arc<Shared<V>>,
    watcher: tokio::task::AbortHandle,
}

pub(crate) struct Shared<V: Verbs> {
    pub(crate) peer: String,
    pub(crate) verbs: Arc<V>,
    pub(crate) keys: KeySource,
    pub(crate) local_nics: Vec<String>,
    pub(crate) remote_nics: Vec<String>,
    pub(crate) lanes: Vec<Lane<V>>,
    pub(crate) config: RdmaConfig,
    pub(crate) alive: AtomicBool,
    /// Scatter-gather entries one work request may carry on every lane.
    max_sge: usize,
    progress: Mutex<Progress>,
}

impl<V: Verbs> Shared<V> {
    pub(crate) fn new(
        peer: String,
        verbs: Arc<V>,
        keys: KeySource,
        local_nics: Vec<String>,
        remote_nics: Vec<String>,
        lanes: Vec<Lane<V>>,
        config: RdmaConfig,
    ) -> Self {
        let progress = Progress {
            lanes: lanes.iter().map(|_| LaneState::default()).collect(),
            ..Progress::default()
        };
        let max_sge = lanes
            .iter()
            .map(|lane| lane.queue.max_sge)
            .min()
            .unwrap_or(1) as usize;
        Shared {
            peer,
            verbs,
            keys,
            local_nics,
            remote_nics,
            lanes,
            config,
            alive: AtomicBool::new(true),
            max_sge,
            progress: Mutex::new(progress),
        }
    }

    /// Fails everything in flight: the queue pairs move to ERROR, so posted work completes
    /// flushed, and the link is dead for later transfers.
    pub(crate) fn close(&self) {
        self.alive.store(false, Ordering::SeqCst);
        for (index, lane) in self.lanes.iter().enumerate() {
            if let Err(error) = lane.queue.fail() {
                let mut progress = self.progress.lock();
                self.abandon(&mut progress, index, &error);
            }
        }
    }

    /// Settles everything the lane has posted as failed: its NIC refused to flush it (a
    /// device that died or was reset), so no completion will ever come for it.
    fn abandon(&self, progress: &mut Progress, lane: usize, reason: &VerbsError) {
        let posted: Vec<Posted> = progress.lanes[lane].posted.drain(..).collect();
        for posted in posted {
            let error = self.lane_error(lane, posted.op, RequestFailure::Abandoned(reason));
            progress.settle(posted.transfer, Some(error));
        }
    }
}

impl<V: Verbs + 'static> RdmaLink<V> {
    pub(crate) fn new(shared: Arc<Shared<V>>, watcher: tokio::task::AbortHandle) -> Self {
        RdmaLink { shared, watcher }
    }
}

impl<V: Verbs> Drop for RdmaLink<V> {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// Where a link finds keys: the local regions' registrations, and the peer's exports as the
/// transport last read its descriptor.
pub(crate) struct KeySource {
    pub(crate) registry: Arc<Registry>,
    pub(crate) peers: Arc<PeerTable>,
    /// The peer engine's instance, its entry in `peers`.
    pub(crate) peer: ferry_core::InstanceId,
}

/// The keys of one (local region, peer buffer) pair: lkeys by the transport's NIC index,
/// rkeys by the link's peer NIC index.
struct KeySet {
    lkeys: Arc<[Option<u32>]>,
    rkeys: Vec<Option<u32>>,
}

impl<V: Verbs> Shared<V> {
    /// The pieces of `ops` with their key sets.
    fn pieces(&self, ops: &TransferOps) -> Result<(Vec<Piece>, Vec<KeySet>)> {
        let mut sets: Vec<KeySet> = Vec::new();
        let mut index: HashMap<(u64, usize), usize> = HashMap::new();
        let mut pieces = Vec::with_capacity(ops.len());
        for op in ops {
            let region = ops.region(op).info().addr;
            let remote = Arc::as_ptr(ops.remote(op)) as usize;
            let keys = match index.get(&(region, remote)) {
                Some(keys) => *keys,
                None => {
                    sets.push(self.key_set(ops.region(op), ops.remote(op))?);
                    index.insert((region, remote), sets.len() - 1);
                    sets.len() - 1
                }
            };
            pieces.push(Piece {
                direction: op.direction,
                local: op.local_addr,
                remote: op.remote_addr,
                len: op.len,
                keys,
            });
        }
        Ok((pieces, sets))
    }

    fn key_set(&self, region: &RegionUse, remote: &BufferDescriptor) -> Result<KeySet> {
        let info = region.info();
        let lkeys = self
            .keys
            .registry
            .lkeys(info.addr)
            .map_err(|refusal| self.unavailable(refusal.to_string()))?;
        let exports = self
            .keys
            .peers
            .latest(self.keys.peer)
            .ok_or_else(|| Error::Internal {
                what: format!(
                    "the RDMA link to {} has no read of its peer's descriptor",
                    self.peer
                ),
            })?;
        let export = exports
            .buffer(remote.addr)
            .map_err(|refusal| self.unavailable(refusal.to_string()))?;
        let rkeys = self
            .remote_nics
            .iter()
            .map(|nic| export.rkey(nic))
            .collect();
        Ok(KeySet { lkeys, rkeys })
    }

    fn unavailable(&self, reason: String) -> Error {
        Error::Unavailable {
            local: "a registered region".into(),
            peer: self.peer.clone(),
            reason,
        }
    }

    /// Queues the work of `items` on the lanes and returns the transfer's id.
    fn enqueue(&self, items: Vec<WorkItem>, sets: &[KeySet]) -> Result<u64> {
        let mut progress = self.progress.lock();
        let mut placed: Vec<(usize, Job)> = Vec::with_capacity(items.len());
        let transfer = progress.next_transfer;
        for item in items {
            let keys = &sets[item.keys];
            let usable = |lane: &Lane<V>| {
                keys.lkeys.get(lane.local_nic).copied().flatten().is_some()
                    && keys.rkeys.get(lane.remote_nic).copied().flatten().is_some()
            };
            let count = self.lanes.len();
            let start = progress.next_lane;
            let lane = (0..count)
                .map(|step| (start + step) % count)
                .find(|&lane| usable(&self.lanes[lane]) && progress.lanes[lane].broken.is_none())
                .ok_or_else(|| {
                    self.unavailable(format!(
                        "no working queue pair joins a NIC holding the local region ({:?}) to one holding the peer's buffer ({:?})",
                        self.local_nics, self.remote_nics
                    ))
                })?;
            progress.next_lane = lane + 1;
            let lane_info = &self.lanes[lane];
            let lkey = keys.lkeys[lane_info.local_nic].unwrap_or_default();
            let rkey = keys.rkeys[lane_info.remote_nic].unwrap_or_default();
            let opcode = match item.direction {
                Direction::Write => SendOpcode::RdmaWrite,
                Direction::Read => SendOpcode::RdmaRead,
            };
            let request = SendRequest {
                wr_id: 0,
                opcode,
                sg_list: item
                    .sges
                    .iter()
                    .map(|&(addr, len)| Sge { addr, len, lkey })
                    .collect(),
                remote: RemoteSegment {
                    addr: item.remote,
                    rkey,
                },
                signaled: false,
            };
            let op = Op {
                direction: item.direction,
                len: item.len,
                local_nic: lane_info.local_nic,
                remote_nic: lane_info.remote_nic,
            };
            placed.push((
                lane,
                Job {
                    transfer,
                    request,
                    op,
                    last: false,
                },
            ));
        }
        // Only now, with every request placed, does the transfer exist: a refusal above left
        // nothing queued.
        progress.next_transfer += 1;
        let mut seen = vec![false; self.lanes.len()];
        for (lane, job) in placed.iter_mut().rev() {
            if !seen[*lane] {
                seen[*lane] = true;
                job.last = true;
            }
        }
        progress.transfers.insert(
            transfer,
            TransferState {
                outstanding: placed.len(),
                error: None,
            },
        );
        for (lane, job) in placed {
            progress.lanes[lane].pending.push_back(job);
        }
        Ok(transfer)
    }

    /// Posts what fits, polls completions, and returns the transfer's outcome once it has one.
    fn step(&self, transfer: u64) -> Option<Result<()>> {
        let mut progress = self.progress.lock();
        let mut completions = Vec::new();
        for lane in 0..self.lanes.len() {
            self.post(&mut progress, lane);
            completions.clear();
            let polled =
                self.verbs
                    .poll_cq(&self.lanes[lane].queue.cq, POLL_BATCH, &mut completions);
            match polled {
                Ok(_) => {
                    for completion in &completions {
                        self.complete(&mut progress, lane, completion);
                    }
                }
                Err(error) => self.break_lane(&mut progress, lane, LaneFailure::Poll(error)),
            }
        }
        let done = progress
            .transfers
            .get(&transfer)
            .is_none_or(|state| state.outstanding == 0);
        if !done {
            return None;
        }
        let state = progress.transfers.remove(&transfer);
        Some(match state.and_then(|state| state.error) {
            Some(error) => Err(error),
            None => Ok(()),
        })
    }

    /// Posts the lane's queued requests while its queue has room.
    fn post(&self, progress: &mut Progress, lane: usize) {
        let queue = &self.lanes[lane].queue;
        let state = &mut progress.lanes[lane];
        if state.broken.is_some() || state.pending.is_empty() {
            return;
        }
        let room = (queue.depth as usize).saturating_sub(state.posted.len());
        let count = room.min(state.pending.len());
        if count == 0 {
            return;
        }
        let mut batch = Vec::with_capacity(count);
        let mut posted = Vec::with_capacity(count);
        for position in 0..count {
            let Some(mut job) = state.pending.pop_front() else {
                break;
            };
            let seq = state.next_seq + position as u64;
            let fills = state.posted.len() + position + 1 == queue.depth as usize;
            state.since_signal += 1;
            // The end of a lane's queue is always some transfer's last request there, so a post
            // that does not fill the queue ends signalled, and one that fills it is signalled
            // by `fills`: the queue never holds only unsignalled requests.
            let signaled = job.last || fills || state.since_signal >= self.config.signal_every;
            if signaled {
                state.since_signal = 0;
            }
            job.request.wr_id = ((lane as u64) << SEQ_BITS) | seq;
            job.request.signaled = signaled;
            batch.push(job.request);
            posted.push(Posted {
                seq,
                transfer: job.transfer,
                op: job.op,
            });
        }
        match queue.qp().and_then(|qp| self.verbs.post_send(qp, &batch)) {
            Ok(()) => {
                state.next_seq += batch.len() as u64;
                state.posted.extend(posted);
            }
            Err(error) => {
                let reason = LaneFailure::Post(error);
                for job in posted {
                    let error = self.lane_error(lane, job.op, RequestFailure::NotPosted(&reason));
                    progress.settle(job.transfer, Some(error));
                }
                self.break_lane(progress, lane, reason);
            }
        }
    }

    /// Credits one completion of `lane`.
    fn complete(&self, progress: &mut Progress, lane: usize, completion: &WorkCompletion) {
        let seq = completion.wr_id & SEQ_MASK;
        let success = completion.status.is_success();
        loop {
            let state = &mut progress.lanes[lane];
            let Some(front) = state.posted.front() else {
                break;
            };
            if front.seq > seq {
                break;
            }
            let Some(posted) = state.posted.pop_front() else {
                break;
            };
            let error = (posted.seq == seq && !success).then(|| {
                wc_error(
                    &self.peer,
                    completion.status,
                    &posted.op,
                    &self.local_nics,
                    &self.remote_nics,
                )
            });
            progress.settle(posted.transfer, error);
        }
        if !success {
            self.break_lane(progress, lane, LaneFailure::Completion(completion.status));
        }
    }

    /// Marks the lane failed: its queue pair is in ERROR (or unusable), what it has queued
    /// fails, and the link is dead for later transfers, which open a new one.
    fn break_lane(&self, progress: &mut Progress, lane: usize, reason: LaneFailure) {
        self.alive.store(false, Ordering::SeqCst);
        let pending: Vec<Job> = progress.lanes[lane].pending.drain(..).collect();
        for job in pending {
            let error = self.lane_error(lane, job.op, RequestFailure::NotSent(&reason));
            progress.settle(job.transfer, Some(error));
        }
        if progress.lanes[lane].broken.is_none() {
            tracing::warn!(peer = %self.peer, lane, %reason, "an RDMA queue pair failed; later transfers use a new connection");
            progress.lanes[lane].broken = Some(reason);
            if let Err(error) = self.lanes[lane].queue.fail() {
                self.abandon(progress, lane, &error);
            }
        }
    }

    fn lane_error(&self, lane: usize, op: Op, reason: RequestFailure<'_>) -> Error {
        let lane = &self.lanes[lane];
        Error::PeerGone {
            peer: self.peer.clone(),
            reason: format!(
                "RDMA {} of {} bytes through {} -> {}: {reason}",
                op.verb(),
                op.len,
                self.local_nics
                    .get(lane.local_nic)
                    .map_or("?", String::as_str),
                self.remote_nics
                    .get(lane.remote_nic)
                    .map_or("?", String::as_str),
            ),
        }
    }
}

#[async_trait::async_trait]
impl<V: Verbs + 'static> Link for RdmaLink<V> {
    async fn transfer(&self, ops: TransferOps) -> Result<()> {
        let shared = &self.shared;
        if !shared.alive.load(Ordering::SeqCst) {
            return Err(shared
                .unavailable("the RDMA connection failed earlier; the engine reconnects".into()));
        }
        let (pieces, sets) = shared.pieces(&ops)?;
        let items = plan(&pieces, shared.config.slice_bytes, shared.max_sge);
        if items.is_empty() {
            return Ok(());
        }
        let transfer = shared.enqueue(items, &sets)?;
        let started = Instant::now();
        loop {
            if let Some(outcome) = shared.step(transfer) {
                return outcome;
            }
            let waited = started.elapsed();
            if waited < shared.config.busy_poll {
                std::hint::spin_loop();
            } else if waited < shared.config.busy_poll + YIELD_FOR {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    fn is_alive(&self) -> bool {
        self.shared.alive.load(Ordering::SeqCst)
    }

    fn close(&self) {
        self.shared.close();
    }
}
