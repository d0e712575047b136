//! Batches: many reads and writes to one peer, submitted together and completed as one.
//!
//! This module builds and checks a batch ([`Batch`]); [`transfer`] runs a submitted one and
//! reports its [`Completion`]; [`route`] picks the transport of every entry.

mod overlap;
mod pipeline;
mod plan;
mod route;
mod spares;
mod transfer;

pub(crate) use spares::Spares;
pub use transfer::{Completion, Transfer};

use crate::blocks::BlockCopy;
use crate::cuda::Event;
use crate::error::{Error, RangeError, Result, Side};
use crate::memory::{Region, RegionEntry, RegionUse};
use crate::notify::MAX_NOTIFICATION_BYTES;
use crate::peer::{Peer, PeerContext};
use crate::transport::{Direction, Transport};
use overlap::read_overlap;
use rustc_hash::FxHashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

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
    /// Boxed, so chaining `write` after `write` moves a pointer, not the whole builder.
    state: Box<State>,
}

/// What a batch needs of the engine it belongs to. The engine implements it, so that batches
/// and their transfers reach no further into the engine than this.
pub(crate) trait BatchEngine: Send + Sync + 'static {
    /// The identity of the engine's region table: a region of another engine is refused.
    fn table_id(&self) -> u64;
    /// Entry lists of finished batches, for new ones to reuse.
    fn spares(&self) -> &Spares;
    /// The engine's transports, in its order of preference.
    fn transports(&self) -> &[Arc<dyn Transport>];
    /// How long a transfer may take before it fails.
    fn transfer_timeout(&self) -> Duration;
    /// Whether the engine is stopping: transfers that fail then fail as stopped.
    fn shutting_down(&self) -> bool;
    /// What the batch's peer needs of the engine.
    fn peer_context(&self) -> PeerContext<'_>;
    /// Runs `task` as one of the engine's tasks, its first step on this thread.
    fn run_task(self: Arc<Self>, task: Pin<Box<dyn Future<Output = ()> + Send>>);
}

/// What a [`Batch`] holds.
struct State {
    engine: Arc<dyn BatchEngine>,
    peer: Peer,
    regions: Vec<Arc<RegionEntry>>,
    region_index: FxHashMap<usize, u32>,
    entries: Vec<Entry>,
    blocks: Vec<Blocks>,
    signal: Option<(u64, u32)>,
    notification: Option<Vec<u8>>,
    foreign_region: Option<usize>,
    after: Option<Arc<Event>>,
}

impl State {
    /// The batch's index of `region`, added on first use.
    #[inline]
    fn region_index(&mut self, region: &Arc<RegionEntry>, position: usize) -> u32 {
        // Consecutive entries mostly use one region: skip the map for a repeat.
        if let Some(last) = self.entries.last() {
            if Arc::ptr_eq(&self.regions[last.region as usize], region) {
                return last.region;
            }
        }
        self.new_region_index(region, position)
    }

    /// [`State::region_index`] for a region other than the last entry's.
    #[cold]
    fn new_region_index(&mut self, region: &Arc<RegionEntry>, position: usize) -> u32 {
        if region.table_id != self.engine.table_id() && self.foreign_region.is_none() {
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

    #[inline]
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

    /// [`State::push`] for each of `entries`, all of `region`: the region is looked up once.
    fn push_all<I>(&mut self, direction: Direction, region: &Region, entries: I)
    where
        I: IntoIterator<Item = (u64, u64, u64)>,
    {
        let mut entries = entries.into_iter();
        // No entries, no region: an empty list leaves the batch as it was.
        let Some(first) = entries.next() else {
            return;
        };
        let index = self.region_index(&region.entry, self.entries.len());
        self.entries
            .extend(
                std::iter::once(first)
                    .chain(entries)
                    .map(|(offset, remote_addr, len)| Entry {
                        direction,
                        region: index,
                        offset,
                        remote_addr,
                        len,
                    }),
            );
    }
}

/// A block copy of a batch, with the batch's index of each pool's region.
struct Blocks {
    direction: Direction,
    copy: BlockCopy,
    regions: Vec<u32>,
    /// The highest remote block id, once [`BlockCopy::validate`] found it.
    remote_highest: u32,
}

impl Batch {
    pub(crate) fn new(engine: Arc<dyn BatchEngine>, peer: &Peer) -> Batch {
        let entries = engine.spares().take();
        Batch {
            state: Box::new(State {
                engine,
                peer: peer.clone(),
                regions: Vec::new(),
                region_index: FxHashMap::default(),
                entries,
                blocks: Vec::new(),
                signal: None,
                notification: None,
                foreign_region: None,
                after: None,
            }),
        }
    }

    /// Adds a write of `len` bytes from `region` at `offset` to the peer's `remote_addr`.
    #[inline]
    pub fn write(mut self, region: &Region, offset: u64, remote_addr: u64, len: u64) -> Self {
        self.state
            .push(Direction::Write, region, offset, remote_addr, len);
        self
    }

    /// Adds a read of `len` bytes from the peer's `remote_addr` into `region` at `offset`.
    #[inline]
    pub fn read(mut self, region: &Region, offset: u64, remote_addr: u64, len: u64) -> Self {
        self.state
            .push(Direction::Read, region, offset, remote_addr, len);
        self
    }

    /// Adds a write for each `(offset, remote_addr, len)` of `entries`, from `region`, in
    /// order: the same batch as [`Batch::write`] called once per entry, built without the
    /// per-call work. For callers that hold a request's entries as a list (a block or a run of
    /// blocks each, tens of thousands of them): the copies cannot start before
    /// [`Batch::submit`], so the time spent building the batch adds to the transfer's.
    pub fn write_entries<I>(mut self, region: &Region, entries: I) -> Self
    where
        I: IntoIterator<Item = (u64, u64, u64)>,
    {
        self.state.push_all(Direction::Write, region, entries);
        self
    }

    /// Adds a read for each `(offset, remote_addr, len)` of `entries`, into `region`, in order:
    /// the same batch as [`Batch::read`] called once per entry (see [`Batch::write_entries`]).
    pub fn read_entries<I>(mut self, region: &Region, entries: I) -> Self
    where
        I: IntoIterator<Item = (u64, u64, u64)>,
    {
        self.state.push_all(Direction::Read, region, entries);
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
        let state = &mut self.state;
        let position = state.entries.len() + state.blocks.len();
        let regions = copy.regions();
        // A copy over a pool per layer names hundreds of regions: grown once, not by doubling.
        state.region_index.reserve(regions.len());
        let regions = regions
            .map(|region| state.region_index(region, position))
            .collect::<Vec<_>>();
        state.blocks.push(Blocks {
            direction,
            copy,
            regions,
            remote_highest: 0,
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
        self.state.signal = Some((remote_addr, value));
        self
    }

    /// Holds every byte of the batch, and its signal and notification, back until `event` has
    /// fired: record it on the stream that produces the data (prefill's compute stream after a
    /// layer's attention, say), and submit at once; the host does not wait. Block copies that
    /// nvlink's copy kernel carries wait for it on the GPU (`cuStreamWaitEvent` before the
    /// launch, on a stream of their own, so other transfers over the link do not queue behind
    /// it), and start the moment the data is written; everything else waits for it on the
    /// host (the engine's event poller). A failure of the work before the event fails the
    /// transfer with its CUDA error.
    ///
    /// The event must fire. Work the GPU already holds cannot be taken back, so if the work
    /// before the event never finishes, neither does the transfer, whatever its timeout; and
    /// the event's stream must not itself wait for this transfer or a later one over the same
    /// link, or neither ends. The time spent waiting counts towards the transfer's timeout.
    pub fn after(mut self, event: Event) -> Self {
        self.state.after = Some(Arc::new(event));
        self
    }

    /// Sends `payload` to the peer once every entry's data is visible there (at most 64 KiB).
    pub fn notify(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.state.notification = Some(payload.into());
        self
    }

    /// Number of entries and block copies added so far.
    pub fn len(&self) -> usize {
        self.state.entries.len() + self.state.blocks.len()
    }

    /// True before any entry or block copy was added.
    pub fn is_empty(&self) -> bool {
        self.state.entries.is_empty() && self.state.blocks.is_empty()
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
    /// A read into bytes another entry uses ([`Error::ApiMisuse`]) or a read block copy that
    /// names a local block twice ([`Error::Range`]) is refused here for batches of fewer than
    /// 4,096 entries or ids; larger ones are checked while their bytes move and fail the
    /// transfer with the same error (their destinations are then undefined, as after any
    /// failure), so the check does not delay the copy.
    pub fn submit(self) -> Result<Transfer> {
        let empty = self.is_empty();
        let mut state = *self.state;
        if let Some(index) = state.foreign_region {
            return Err(RangeError::ForeignRegion { index }.into());
        }
        if empty && state.notification.is_none() {
            return Err(Error::ApiMisuse(
                "the batch has no entries and no notification; add at least one".into(),
            ));
        }
        if let Some(payload) = &state.notification {
            if payload.len() > MAX_NOTIFICATION_BYTES {
                return Err(Error::ApiMisuse(format!(
                    "a notification of {} bytes exceeds the {MAX_NOTIFICATION_BYTES}-byte limit; send the data in the batch and a short id in the notification",
                    payload.len()
                )));
            }
        }
        check_ranges(&state.entries, &state.regions)?;
        let mut later = Later::default();
        for (index, blocks) in state.blocks.iter_mut().enumerate() {
            blocks.remote_highest = blocks.copy.validate(index)?;
            if blocks.direction == Direction::Read {
                match blocks.copy.pairs() < CHECK_WHILE_MOVING {
                    true => blocks.copy.check_repeats(index)?,
                    false => later.blocks.push((index, blocks.copy.clone())),
                }
            }
        }
        if let Some((addr, _)) = state.signal {
            if addr % 4 != 0 {
                return Err(Error::ApiMisuse(format!(
                    "the signal word {addr:#x} is not 4-byte aligned; GPUs wait on aligned 32-bit words"
                )));
            }
            if empty {
                return Err(Error::ApiMisuse(
                    "a signal needs data in the batch to follow; add the entries it announces"
                        .into(),
                ));
            }
        }
        if state.entries.len() < CHECK_WHILE_MOVING {
            if let Some(index) = read_overlap(&state.entries) {
                return Err(overlap_error(index));
            }
        } else {
            later.entries = true;
        }
        let mut uses = Vec::with_capacity(state.regions.len());
        for (position, region) in state.regions.iter().enumerate() {
            let Some(guard) = region.acquire() else {
                let index = state
                    .entries
                    .iter()
                    .position(|entry| entry.region as usize == position)
                    .unwrap_or(state.entries.len());
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
        let State {
            engine,
            peer,
            entries,
            blocks,
            signal,
            notification,
            after,
            ..
        } = state;
        let work = Work {
            uses: uses.into(),
            entries,
            blocks,
            signal,
            after,
            later,
        };
        Ok(transfer::start(engine, peer, work, notification))
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

/// Batches of at least this many entries, and read block copies of at least this many ids,
/// are checked for reads that race while their bytes move rather than before: the check of a
/// large read takes a good part of the time its copy does, and a destination is undefined
/// until its transfer succeeded anyway, so a race found then fails the transfer with the
/// same error.
const CHECK_WHILE_MOVING: usize = 4096;

/// The checks of a submitted batch left to run while its bytes move ([`CHECK_WHILE_MOVING`]).
#[derive(Default)]
struct Later {
    /// Whether the entries are checked for a read overlapping another entry.
    entries: bool,
    /// Read block copies, with their index in the batch, checked for a local block read into
    /// twice.
    blocks: Vec<(usize, BlockCopy)>,
}

/// Entries and block pairs from which the checks left for later run on a thread of their own:
/// a large read's check then overlaps the routing and planning of its slices as well as its
/// copies, where on the submitting thread it would follow them (tens of nanoseconds an entry
/// on a slow host, as long as planning them). Below it, starting a thread costs more than
/// the check.
const CHECK_ON_A_THREAD: usize = 16384;

impl Later {
    fn is_empty(&self) -> bool {
        !self.entries && self.blocks.is_empty()
    }

    /// Starts the checks on `entries`, the batch's: on a thread of their own when they are
    /// many ([`CHECK_ON_A_THREAD`]), else here when the returned future is first polled. The
    /// future resolves to their outcome.
    fn start(self, entries: Arc<Vec<Entry>>) -> futures::future::BoxFuture<'static, Result<()>> {
        let work = usize::from(self.entries) * entries.len()
            + self
                .blocks
                .iter()
                .map(|(_, copy)| copy.pairs())
                .sum::<usize>();
        let later = Arc::new(self);
        if work >= CHECK_ON_A_THREAD {
            let (sender, receiver) = futures::channel::oneshot::channel();
            let (checking, checked) = (Arc::clone(&later), Arc::clone(&entries));
            let spawned = std::thread::Builder::new()
                .name("ferry-check".into())
                .spawn(move || {
                    let _ = sender.send(checking.run(&checked));
                });
            if spawned.is_ok() {
                return Box::pin(async move {
                    receiver.await.unwrap_or_else(|_| {
                        Err(Error::internal(
                            "the thread checking a batch ended without an outcome",
                        ))
                    })
                });
            }
        }
        Box::pin(async move { later.run(&entries) })
    }

    /// Runs the checks on `entries`, the batch's.
    fn run(&self, entries: &[Entry]) -> Result<()> {
        if self.entries {
            if let Some(index) = read_overlap(entries) {
                return Err(overlap_error(index));
            }
        }
        for (index, copy) in &self.blocks {
            copy.check_repeats(*index)?;
        }
        Ok(())
    }
}

/// The error of a read whose local range overlaps another entry's ([`read_overlap`]).
fn overlap_error(index: usize) -> Error {
    Error::ApiMisuse(format!(
        "entry {index} overlaps the local range of another entry, and one of them is a read into it; the bytes would race, so split the batch"
    ))
}

/// Checks that every entry moves at least one byte and stays inside its local region.
fn check_ranges(entries: &[Entry], regions: &[Arc<RegionEntry>]) -> Result<(), RangeError> {
    for (index, entry) in entries.iter().enumerate() {
        if entry.len == 0 {
            return Err(RangeError::ZeroLength { index });
        }
        let region_len = regions[entry.region as usize].info.len;
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
            });
        }
    }
    Ok(())
}

/// What a submitted batch moves.
struct Work {
    uses: Arc<[Arc<RegionUse>]>,
    entries: Vec<Entry>,
    blocks: Vec<Blocks>,
    signal: Option<(u64, u32)>,
    /// What every byte waits for ([`Batch::after`]).
    after: Option<Arc<Event>>,
    /// Checks that run while the bytes move.
    later: Later,
}

#[cfg(test)]
mod tests;
