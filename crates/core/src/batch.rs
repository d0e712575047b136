//! Batches: many reads and writes to one peer, submitted together and completed as one.

use crate::blocks::{BlockCopy, BlockOps};
use crate::descriptor::BufferDescriptor;
use crate::engine::EngineInner;
use crate::error::{Error, RangeError, Result, Side};
use crate::memory::{Region, RegionEntry, RegionUse};
use crate::notify::MAX_NOTIFICATION_BYTES;
use crate::peer::{Peer, PeerView};
use crate::transport::{Direction, Reach, TransferOp};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tracing::Instrument;

struct Entry {
    direction: Direction,
    region: u32,
    offset: u64,
    remote_addr: u64,
    len: u64,
}

/// A batch being built: add entries with [`Batch::write`] and [`Batch::read`], then
/// [`Batch::submit`]. Made by [`crate::Engine::batch`].
///
/// Mistakes in the entries are reported by `submit`, before anything moves.
///
/// # What a destination holds
/// A destination range is undefined until its transfer is acknowledged (its [`Transfer`]
/// resolved with `Ok`). Bytes land as they arrive: a transfer that fails, times out or whose
/// peer goes away part-way may have written part of its destination, and it is always
/// reported as failed, never as a success. Resend the whole range after such a failure, and
/// do not read a write's destination (or a read's local region) before the transfer is `Ok`.
#[must_use = "a batch does nothing until it is submitted"]
pub struct Batch {
    engine: Arc<EngineInner>,
    peer: Peer,
    regions: Vec<Arc<RegionEntry>>,
    region_index: HashMap<usize, u32>,
    entries: Vec<Entry>,
    blocks: Vec<Blocks>,
    signal: Option<(u64, u32)>,
    notification: Option<Vec<u8>>,
    foreign_region: Option<usize>,
}

/// A block copy of a batch, with the batch's index of each pool's region.
struct Blocks {
    direction: Direction,
    copy: BlockCopy,
    regions: Vec<u32>,
}

impl Batch {
    pub(crate) fn new(engine: Arc<EngineInner>, peer: &Peer) -> Batch {
        Batch {
            engine,
            peer: peer.clone(),
            regions: Vec::new(),
            region_index: HashMap::new(),
            entries: Vec::new(),
            blocks: Vec::new(),
            signal: None,
            notification: None,
            foreign_region: None,
        }
    }

    /// The batch's index of `region`, added on first use.
    fn region_index(&mut self, region: &Arc<RegionEntry>, position: usize) -> u32 {
        // Consecutive entries mostly use one region: skip the map for a repeat.
        if let Some(last) = self.entries.last() {
            if Arc::ptr_eq(&self.regions[last.region as usize], region) {
                return last.region;
            }
        }
        if region.table_id != self.engine.table.id() && self.foreign_region.is_none() {
            self.foreign_region = Some(position);
        }
        let key = Arc::as_ptr(region) as usize;
        let next = self.regions.len() as u32;
        let index = *self.region_index.entry(key).or_insert(next);
        if index == next {
            self.regions.push(Arc::clone(region));
        }
        index
    }

    fn push(
        &mut self,
        direction: Direction,
        region: &Region,
        offset: u64,
        remote_addr: u64,
        len: u64,
    ) {
        let index = self.region_index(&region.entry, self.entries.len());
        self.entries.push(Entry {
            direction,
            region: index,
            offset,
            remote_addr,
            len,
        });
    }

    /// Adds a write of `len` bytes from `region` at `offset` to the peer's `remote_addr`.
    pub fn write(mut self, region: &Region, offset: u64, remote_addr: u64, len: u64) -> Self {
        self.push(Direction::Write, region, offset, remote_addr, len);
        self
    }

    /// Adds a read of `len` bytes from the peer's `remote_addr` into `region` at `offset`.
    pub fn read(mut self, region: &Region, offset: u64, remote_addr: u64, len: u64) -> Self {
        self.push(Direction::Read, region, offset, remote_addr, len);
        self
    }

    /// Adds a paged copy from local pools to the peer's: see [`BlockCopy`].
    pub fn write_blocks(self, copy: BlockCopy) -> Self {
        self.push_blocks(Direction::Write, copy)
    }

    /// Adds a paged copy from the peer's pools into local ones: see [`BlockCopy`].
    pub fn read_blocks(self, copy: BlockCopy) -> Self {
        self.push_blocks(Direction::Read, copy)
    }

    fn push_blocks(mut self, direction: Direction, copy: BlockCopy) -> Self {
        let position = self.entries.len() + self.blocks.len();
        let regions = copy
            .regions()
            .map(|region| self.region_index(region, position))
            .collect::<Vec<_>>();
        self.blocks.push(Blocks {
            direction,
            copy,
            regions,
        });
        self
    }

    /// Writes the 32-bit `value` into the peer's GPU memory at `remote_addr` once every entry's
    /// data is visible there, so a stream of the peer can wait for the data on the GPU with no
    /// CPU round trip (`cuStreamWaitValue32` on that word, for example
    /// [`crate::cuda::Stream::wait_value32`]). Use increasing values per request on one word.
    ///
    /// The word must be 4-byte aligned inside a registered GPU buffer of the peer, and the
    /// batch must carry data from GPU memory over nvlink; the notification, if any, follows
    /// the signal.
    pub fn signal(mut self, remote_addr: u64, value: u32) -> Self {
        self.signal = Some((remote_addr, value));
        self
    }

    /// Sends `payload` to the peer once every entry's data is visible there (at most 64 KiB).
    pub fn notify(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.notification = Some(payload.into());
        self
    }

    /// Number of entries and block copies added so far.
    pub fn len(&self) -> usize {
        self.entries.len() + self.blocks.len()
    }

    /// True before any entry or block copy was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.blocks.is_empty()
    }

    /// Checks every entry and starts the transfer.
    ///
    /// The returned [`Transfer`] resolves when all bytes are visible at their destinations and
    /// the notification, if any, was accepted by the peer (it reaches the peer's notification stream right after).
    ///
    /// # Errors
    /// Before anything moves: [`Error::Range`] for an empty entry, a local range past its
    /// region's end, or a region of another engine; [`Error::ApiMisuse`] for a batch with
    /// nothing in it or an oversized notification. Remote ranges are checked by the transfer.
    pub fn submit(self) -> Result<Transfer> {
        if let Some(index) = self.foreign_region {
            return Err(RangeError::ForeignRegion { index }.into());
        }
        if self.is_empty() && self.notification.is_none() {
            return Err(Error::ApiMisuse(
                "the batch has no entries and no notification; add at least one".into(),
            ));
        }
        if let Some(payload) = &self.notification {
            if payload.len() > MAX_NOTIFICATION_BYTES {
                return Err(Error::ApiMisuse(format!(
                    "a notification of {} bytes exceeds the {MAX_NOTIFICATION_BYTES}-byte limit; send the data in the batch and a short id in the notification",
                    payload.len()
                )));
            }
        }
        for (index, entry) in self.entries.iter().enumerate() {
            if entry.len == 0 {
                return Err(RangeError::ZeroLength { index }.into());
            }
            let region_len = self.regions[entry.region as usize].info.len;
            if entry
                .offset
                .checked_add(entry.len)
                .is_none_or(|end| end > region_len)
            {
                return Err(RangeError::PastRegionEnd {
                    index,
                    offset: entry.offset,
                    len: entry.len,
                    region_len,
                }
                .into());
            }
        }
        for (index, blocks) in self.blocks.iter().enumerate() {
            blocks.copy.validate(index, blocks.direction)?;
        }
        if let Some((addr, _)) = self.signal {
            if addr % 4 != 0 {
                return Err(Error::ApiMisuse(format!(
                    "the signal word {addr:#x} is not 4-byte aligned; GPUs wait on aligned 32-bit words"
                )));
            }
            if self.is_empty() {
                return Err(Error::ApiMisuse(
                    "a signal needs data in the batch to follow; add the entries it announces"
                        .into(),
                ));
            }
        }
        if let Some(index) = read_overlap(&self.entries) {
            return Err(Error::ApiMisuse(format!(
                "entry {index} overlaps the local range of another entry, and one of them is a read into it; the bytes would race, so split the batch"
            )));
        }
        let mut uses = Vec::with_capacity(self.regions.len());
        for (position, region) in self.regions.iter().enumerate() {
            let Some(guard) = region.acquire() else {
                let index = self
                    .entries
                    .iter()
                    .position(|entry| entry.region as usize == position)
                    .unwrap_or(self.entries.len());
                return Err(RangeError::NotRegistered {
                    index,
                    side: Side::Local,
                    addr: region.info.addr,
                    len: region.info.len,
                }
                .into());
            };
            uses.push(Arc::new(guard));
        }
        let (sender, receiver) = oneshot::channel();
        let Batch {
            engine,
            peer,
            entries,
            blocks,
            signal,
            notification,
            ..
        } = self;
        let handle = engine.handle.clone();
        let span = crate::telemetry::transfer_span(peer.name(), notification.as_deref());
        let mut task = Box::pin(async move {
            let work = Work {
                uses,
                entries,
                blocks,
                signal,
            };
            let ran = run(&engine, &peer, work, notification)
                .instrument(span)
                .await;
            let outcome = match ran {
                Err(error) if engine.shutting_down.load(Ordering::Acquire) => {
                    Err(Error::Shutdown {
                        what: format!("the transfer (it stopped with: {error})"),
                    })
                }
                outcome => outcome,
            };
            crate::telemetry::transfer_finished(&peer.shared_name(), &outcome);
            let _ = sender.send(outcome);
        });
        // Route and launch on the caller's thread, so the copies start without waiting for a
        // runtime worker to wake; the runtime then drives the rest (its first poll registers
        // the real wakers in place of this no-op one).
        let first = {
            let _runtime = handle.enter();
            task.as_mut()
                .poll(&mut Context::from_waker(std::task::Waker::noop()))
        };
        if first.is_pending() {
            handle.spawn(task);
        }
        Ok(Transfer { receiver })
    }

    /// Submits and blocks the calling thread until the transfer completes; for callers without
    /// an async runtime.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] on a thread of a tokio runtime, before anything is submitted
    /// (await [`Batch::submit`]'s transfer there); otherwise as [`Batch::submit`], then as
    /// the [`Transfer`].
    pub fn submit_blocking(self) -> Result<Completion> {
        crate::blocking::refuse_on_runtime("Batch::submit_blocking", "Batch::submit()")?;
        self.submit()?.wait()
    }
}

/// The index of an entry whose local range overlaps another's where at least one of the two
/// reads into it, if any. Writes may share source bytes freely.
fn read_overlap(entries: &[Entry]) -> Option<usize> {
    if entries
        .iter()
        .all(|entry| entry.direction == Direction::Write)
    {
        return None;
    }
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by_key(|&index| (entries[index].region, entries[index].offset));
    // The entry reaching furthest so far in the current region: any entry starting before its
    // end overlaps it, and an earlier read overlapping a later entry is always found here.
    let mut furthest: Option<(u32, u64, bool)> = None;
    for index in order {
        let entry = &entries[index];
        let read = entry.direction == Direction::Read;
        let end = entry.offset + entry.len;
        match furthest {
            Some((region, reach, reach_read)) if region == entry.region && entry.offset < reach => {
                if read || reach_read {
                    return Some(index);
                }
                if end > reach {
                    furthest = Some((region, end, read));
                }
            }
            _ => furthest = Some((entry.region, end, read)),
        }
    }
    None
}

/// What a finished transfer did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Bytes moved.
    pub bytes: u64,
    /// The transports that carried them.
    pub transports: Vec<&'static str>,
    /// From the start of the transfer to its completion.
    pub elapsed: Duration,
}

/// A submitted batch; resolves once every byte is visible at its destination.
///
/// Until it resolves with `Ok`, the destination ranges are undefined: a transfer that fails
/// may have written part of them (see [`Batch`]).
///
/// # Cancel safety
/// Dropping it does not stop the transfer: the bytes keep moving, and the regions it uses stay
/// registered (dropping a [`Region`] waits) until it ends or times out.
#[must_use = "a transfer reports its errors only when awaited"]
#[derive(Debug)]
pub struct Transfer {
    receiver: oneshot::Receiver<Result<Completion>>,
}

impl Transfer {
    /// Blocks the calling thread until the transfer completes; for callers without an async
    /// runtime.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] on a thread of a tokio runtime (await the transfer there; the
    /// refused transfer goes on as if dropped); otherwise as awaiting the transfer.
    pub fn wait(self) -> Result<Completion> {
        crate::blocking::refuse_on_runtime("Transfer::wait", "the Transfer")?;
        // The engine's runtime drives the transfer and sends its outcome down a oneshot, which
        // needs no runtime to receive: the thread parks until the sender wakes it.
        futures::executor::block_on(self)
    }
}

impl Future for Transfer {
    type Output = Result<Completion>;

    fn poll(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.receiver).poll(context).map(|outcome| {
            outcome.unwrap_or_else(|_| {
                Err(Error::Shutdown {
                    what: "the transfer".into(),
                })
            })
        })
    }
}

/// What a submitted batch moves.
struct Work {
    uses: Vec<Arc<RegionUse>>,
    entries: Vec<Entry>,
    blocks: Vec<Blocks>,
    signal: Option<(u64, u32)>,
}

/// The ops of one batch for each transport (by index).
type Routed = (Vec<(usize, Vec<TransferOp>)>, Vec<(usize, BlockOps)>);

fn route_all(engine: &EngineInner, view: &PeerView, work: &Work, peer: &str) -> Result<Routed> {
    let groups = route(engine, view, &work.uses, &work.entries, peer)?;
    let blocks = route_blocks(engine, view, &work.uses, &work.blocks, peer)?;
    Ok((groups, blocks))
}

async fn run(
    engine: &EngineInner,
    peer: &Peer,
    work: Work,
    notification: Option<Vec<u8>>,
) -> Result<Completion> {
    let started = Instant::now();
    // A remote range the cached descriptor does not cover may be memory the peer registered
    // since: fetch its descriptor once more before refusing.
    let (groups, block_groups) = match route_all(engine, &peer.view(), &work, peer.name()) {
        Err(Error::Range(
            RangeError::NotRegistered {
                side: Side::Remote, ..
            }
            | RangeError::PoolNotRegistered {
                side: Side::Remote, ..
            },
        )) => {
            let view = peer.refresh(engine).await?;
            route_all(engine, &view, &work, peer.name())?
        }
        routed => routed?,
    };
    let bytes = work.entries.iter().map(|entry| entry.len).sum::<u64>()
        + work
            .blocks
            .iter()
            .map(|blocks| blocks.copy.bytes())
            .sum::<u64>();
    crate::telemetry::transfer_routed(bytes);
    let signal = match work.signal {
        Some((addr, value)) => Some(signal_route(engine, peer, &work.uses, addr, value)?),
        None => None,
    };
    let remote_ranges: Vec<(u64, u64)> = work
        .entries
        .iter()
        .map(|entry| (entry.remote_addr, entry.len))
        .collect();
    drop(work);
    let mut transports = Vec::with_capacity(groups.len());
    let mut pending: Vec<futures::future::BoxFuture<'_, Result<()>>> =
        Vec::with_capacity(groups.len() + block_groups.len());
    for (transport, ops) in groups {
        let link = peer.link(engine.transports[transport].as_ref()).await?;
        transports.push(engine.transports[transport].name());
        pending.push(Box::pin(async move { link.transfer(ops).await }));
    }
    for (transport, blocks) in block_groups {
        let link = peer.link(engine.transports[transport].as_ref()).await?;
        let name = engine.transports[transport].name();
        if !transports.contains(&name) {
            transports.push(name);
        }
        pending.push(Box::pin(async move { link.transfer_blocks(blocks).await }));
    }
    let limit = engine.transfer_timeout;
    // Every part runs to its end, even after another failed or the time ran out: a part
    // dropped half-way would release its regions and mappings while a GPU may still be
    // copying through them. Closing the peer makes the network parts fail at once.
    let mut moved = std::pin::pin!(futures::future::join_all(pending));
    let outcomes = match tokio::time::timeout(limit, &mut moved).await {
        Ok(outcomes) => outcomes,
        Err(_) => {
            peer.close();
            moved.await;
            return Err(Error::Timeout {
                what: format!("a transfer of {bytes} bytes to {}", peer.name()),
                after: limit,
            });
        }
    };
    if outcomes
        .iter()
        .any(|outcome| matches!(outcome, Err(Error::Protocol { .. })))
    {
        // A peer that sent what the protocol forbids (a descriptor that does not fit its
        // memory, for one) is trusted with nothing further: every link to it closes.
        peer.close();
    }
    outcomes
        .into_iter()
        .collect::<Result<Vec<()>>>()
        .map_err(|error| error.in_batch(&remote_ranges))?;
    if let Some((transport, remote, addr, value, gpu)) = signal {
        let link = peer.link(engine.transports[transport].as_ref()).await?;
        // As for the copies: a signal store that was queued runs to its end before its
        // mapping is released, also when the time ran out.
        let mut signalled = std::pin::pin!(link.write_value(remote, addr, value, gpu));
        match tokio::time::timeout(limit, &mut signalled).await {
            Ok(outcome) => outcome?,
            Err(_) => {
                peer.close();
                let _ = signalled.await;
                return Err(Error::Timeout {
                    what: format!("the signal to {}", peer.name()),
                    after: limit,
                });
            }
        }
    }
    if let Some(payload) = notification {
        let control = peer.control(engine).await?;
        tokio::time::timeout(limit, control.notify(&payload))
            .await
            .map_err(|_| Error::Timeout {
                what: format!("a notification to {}", peer.name()),
                after: limit,
            })??;
        crate::telemetry::notification_sent();
    }
    Ok(Completion {
        bytes,
        transports,
        elapsed: started.elapsed(),
    })
}

/// Picks the cheapest transport for every entry and turns entries into ops, merging entries
/// that continue each other on both sides. A remote range outside every buffer of `view` is
/// [`RangeError::NotRegistered`], naming the entry.
fn route(
    engine: &EngineInner,
    view: &PeerView,
    uses: &[Arc<RegionUse>],
    entries: &[Entry],
    peer: &str,
) -> Result<Vec<(usize, Vec<TransferOp>)>> {
    let mut groups: Vec<Vec<TransferOp>> = engine.transports.iter().map(|_| Vec::new()).collect();
    let mut choice_cache: HashMap<(u32, u64), usize> = HashMap::new();
    let mut last_choice: Option<((u32, u64), usize)> = None;
    for (index, entry) in entries.iter().enumerate() {
        let region = &uses[entry.region as usize];
        let local = region.entry.info;
        let remote = view.covering(entry.remote_addr, entry.len).cloned().ok_or(
            RangeError::NotRegistered {
                index,
                side: Side::Remote,
                addr: entry.remote_addr,
                len: entry.len,
            },
        )?;
        let key = (entry.region, remote.addr);
        let transport = match last_choice {
            Some((last, transport)) if last == key => transport,
            _ => {
                let transport = match choice_cache.get(&key) {
                    Some(&transport) => transport,
                    None => {
                        let transport = choose(engine, &local, view, &remote, peer)?;
                        choice_cache.insert(key, transport);
                        transport
                    }
                };
                last_choice = Some((key, transport));
                transport
            }
        };
        let local_addr = local.addr + entry.offset;
        TransferOp::push_merged(
            &mut groups[transport],
            TransferOp {
                direction: entry.direction,
                region: Arc::clone(region),
                local_addr,
                remote_addr: entry.remote_addr,
                remote,
                len: entry.len,
            },
        );
    }
    Ok(groups
        .into_iter()
        .enumerate()
        .filter(|(_, ops)| !ops.is_empty())
        .collect())
}

/// The transport, remote buffer and local GPU of a batch's signal: the transport that moves
/// the batch's first region to the signal's buffer.
fn signal_route(
    engine: &EngineInner,
    peer: &Peer,
    uses: &[Arc<RegionUse>],
    addr: u64,
    value: u32,
) -> Result<(usize, Arc<BufferDescriptor>, u64, u32, u32)> {
    let view = peer.view();
    let remote = view
        .covering(addr, 4)
        .cloned()
        .ok_or(RangeError::NotRegistered {
            index: 0,
            side: Side::Remote,
            addr,
            len: 4,
        })?;
    let local = uses
        .first()
        .map(|region| region.entry.info)
        .ok_or_else(|| Error::ApiMisuse("a signal needs data in the batch".into()))?;
    let crate::memory::Location::Device { ordinal, .. } = local.location else {
        return Err(Error::ApiMisuse(
            "a signal is written by the GPU that moves the batch; its data is in host memory, so rely on the notification".into(),
        ));
    };
    let transport = choose(engine, &local, &view, &remote, peer.name())?;
    Ok((transport, remote, addr, value, ordinal))
}

/// Resolves every block copy's pools and groups them by the cheapest transport of each pool.
fn route_blocks(
    engine: &EngineInner,
    view: &PeerView,
    uses: &[Arc<RegionUse>],
    blocks: &[Blocks],
    peer: &str,
) -> Result<Vec<(usize, BlockOps)>> {
    let mut routed = Vec::new();
    for (index, blocks) in blocks.iter().enumerate() {
        let pool_uses: Vec<Arc<RegionUse>> = blocks
            .regions
            .iter()
            .map(|&region| Arc::clone(&uses[region as usize]))
            .collect();
        let pools = blocks.copy.resolve(index, &pool_uses, |addr, len| {
            view.covering(addr, len).cloned()
        })?;
        let mut by_transport: Vec<(usize, Vec<_>)> = Vec::new();
        // Pools mostly share a region and a remote buffer: ask the transports once per pair.
        let mut chosen: Vec<(*const RegionUse, *const BufferDescriptor, usize)> = Vec::new();
        for pool in pools {
            let key = (Arc::as_ptr(&pool.region), Arc::as_ptr(&pool.remote));
            let known = chosen
                .iter()
                .find(|(region, remote, _)| (*region, *remote) == key)
                .map(|&(_, _, transport)| transport);
            let transport = match known {
                Some(transport) => transport,
                None => {
                    let transport =
                        choose(engine, &pool.region.entry.info, view, &pool.remote, peer)?;
                    chosen.push((key.0, key.1, transport));
                    transport
                }
            };
            match by_transport
                .iter_mut()
                .find(|(known, _)| *known == transport)
            {
                Some((_, group)) => group.push(pool),
                None => by_transport.push((transport, vec![pool])),
            }
        }
        for (transport, pools) in by_transport {
            routed.push((transport, blocks.copy.ops(blocks.direction, pools)));
        }
    }
    Ok(routed)
}

fn choose(
    engine: &EngineInner,
    local: &crate::memory::RegionInfo,
    view: &PeerView,
    remote: &BufferDescriptor,
    peer: &str,
) -> Result<usize> {
    let mut best: Option<(u32, usize)> = None;
    let mut reasons = Vec::new();
    for (index, transport) in engine.transports.iter().enumerate() {
        match transport.reach(local, &view.descriptor, remote) {
            Reach::Yes { cost } if best.is_none_or(|(best_cost, _)| cost < best_cost) => {
                best = Some((cost, index));
            }
            Reach::Yes { .. } => {}
            Reach::No { reason } => reasons.push(format!("{}: {reason}", transport.name())),
        }
    }
    best.map(|(_, index)| index)
        .ok_or_else(|| Error::Unavailable {
            local: local.location.to_string(),
            peer: peer.to_owned(),
            reason: reasons.join("; "),
        })
}
