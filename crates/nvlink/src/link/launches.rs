//! How a transfer's launches queue work on a GPU's streams: the copy kernels, batched and
//! single copies, the signal store, each checked before (see the parent module), and the run
//! that waits for all of it through [`launch_all`].

use super::{GpuLane, NvlinkLink};
use crate::kernels::THREADS_PER_BLOCK;
use crate::plan::{self, Launch};
use ferry_core::cuda::{launch_all, Event, Kernel, KernelArg, Launcher, Poller, Stream};
use ferry_core::{Error, Notified, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

impl NvlinkLink {
    /// Launches `kernel` on the lane's stream `stream` with its large arguments in a pinned
    /// buffer of `arg_bytes` bytes, which `fill` writes (given the buffer's address) before
    /// returning the launch's arguments. Returns the event recorded right after the launch.
    ///
    /// The caller vouches that the returned arguments match `kernel`'s parameters and that
    /// every range they name was checked against live registrations reachable from this GPU.
    fn launch_kernel(
        &self,
        lane: &GpuLane,
        stream: usize,
        kernel: &Kernel,
        grid: u32,
        arg_bytes: usize,
        fill: impl FnOnce(&mut [u8], u64) -> Vec<KernelArg>,
    ) -> Result<Arc<Event>> {
        // SAFETY: the caller matched the arguments to the kernel and checked every range they
        // name (the transfer keeps the local registrations and the peer mappings until every
        // stream it gave work has finished).
        unsafe {
            lane.args
                .launch(&lane.streams[stream], kernel, grid, arg_bytes, fill)
        }
    }

    /// Queues one launch of a transfer on `lane`; for a kernel, returns the event recorded
    /// right after it.
    fn launch(&self, lane: &GpuLane, work: &Work) -> Result<Option<Arc<Event>>> {
        match work {
            Work::Copies(Launch::Kernel(entries)) => {
                let kernels = lane
                    .kernels
                    .as_ref()
                    .ok_or_else(|| self.refused("the copy kernels are not loaded"))?;
                let count = entries.len() as u64;
                let shifted = plan::any_shifted(entries);
                let kernel = match shifted {
                    true => &kernels.list_shifted,
                    false => &kernels.list,
                };
                self.launch_kernel(
                    lane,
                    0,
                    kernel,
                    kernels.grid(count, &self.config, shifted),
                    entries.len() * plan::ENTRY_BYTES,
                    |args, base| {
                        plan::write_entries(entries, args);
                        vec![KernelArg::U64(base), KernelArg::U64(count)]
                    },
                )
                .map(Some)
            }
            Work::Copies(Launch::Batch { stream, copies }) => {
                let dsts: Vec<u64> = copies.iter().map(|copy| copy.dst).collect();
                let srcs: Vec<u64> = copies.iter().map(|copy| copy.src).collect();
                let sizes = copies
                    .iter()
                    .map(|copy| self.host_len(copy.len))
                    .collect::<Result<Vec<_>>>()?;
                // SAFETY: as for the single copies below, for every copy of the list.
                unsafe { lane.streams[*stream].copy_batch(&dsts, &srcs, &sizes)? };
                Ok(None)
            }
            Work::Copies(Launch::Single { stream, copy }) => {
                let len = self.host_len(copy.len)?;
                // SAFETY: the engine checked the local range against a live registration and
                // the remote range against the peer's buffer, which was checked against the
                // size the driver reports for its mapping (`copies`); the transfer keeps both
                // (the ops' RegionUses, the held mappings) until every stream it gave work has
                // finished; the two belong to different registrations, so they do not overlap.
                unsafe { lane.streams[*stream].copy(copy.dst, copy.src, len)? };
                Ok(None)
            }
            Work::Paged(paged) => {
                let kernels = lane
                    .kernels
                    .as_ref()
                    .ok_or_else(|| self.refused("the copy kernels are not loaded"))?;
                let (src, dst, layout) = (&paged.src, &paged.dst, paged.layout);
                if let Some(event) = &paged.after {
                    lane.streams[paged.stream].wait_event(event)?;
                }
                let kernel = match paged.shifted {
                    true => &kernels.paged_shifted,
                    false => &kernels.paged,
                };
                self.launch_kernel(
                    lane,
                    paged.stream,
                    kernel,
                    paged.grid,
                    layout.bytes(),
                    |args, base| {
                        layout.write(args, &src.bases, &dst.bases, &src.ids, &dst.ids);
                        vec![
                            KernelArg::U64(base + layout.src_bases),
                            KernelArg::U64(base + layout.dst_bases),
                            KernelArg::U32(paged.pools),
                            KernelArg::U64(base + layout.src_ids),
                            KernelArg::U64(base + layout.dst_ids),
                            KernelArg::U32(paged.ids),
                            KernelArg::U64(src.stride),
                            KernelArg::U64(dst.stride),
                            KernelArg::U64(src.offset),
                            KernelArg::U64(dst.offset),
                            KernelArg::U64(paged.len),
                            KernelArg::U64(paged.chunk),
                        ]
                    },
                )
                .map(Some)
            }
            Work::CopyPublish {
                stream,
                copy,
                addr,
                position,
            } => {
                let kernels = lane
                    .kernels
                    .as_ref()
                    .ok_or_else(|| self.refused("the copy kernels are not loaded"))?;
                let args = [
                    KernelArg::U64(copy.src),
                    KernelArg::U64(copy.dst),
                    KernelArg::U64(copy.len),
                    KernelArg::U64(*addr),
                    KernelArg::U64(*position),
                ];
                // SAFETY: the arguments match ferry_copy_publish; the copy's ranges were
                // checked as for a single copy below, and this GPU's kernels reach both; `addr`
                // is the ring's word as for `Work::Publish` below; the transfer keeps all of
                // them until the stream has finished.
                unsafe {
                    kernels
                        .publish
                        .launch(&lane.streams[*stream], 1, THREADS_PER_BLOCK, &args)?
                };
                Ok(None)
            }
            Work::Publish {
                stream,
                addr,
                position,
            } => {
                // SAFETY: `addr` is the device address of word 0 of the message ring's first
                // page, which the sender registered with CUDA and keeps registered as long as
                // the link lives; the transfer borrows the link until the stream has finished.
                unsafe { lane.streams[*stream].write_value64(*addr, *position)? };
                Ok(None)
            }
            Work::Signal { addr, value } => {
                // SAFETY: the engine checked that the word lies inside the peer's registered
                // buffer and is 4-byte aligned, and `write_value` translated it through the
                // buffer's checked mapping, which this GPU reaches; the transfer holds the
                // mapping until the stream has finished.
                unsafe { lane.streams[0].write_value32(*addr, *value)? };
                Ok(None)
            }
        }
    }

    /// Queues `work` (each with the index of its lane in `lanes`) and waits for everything it
    /// queued, also when a launch failed part-way, before dropping `keep`; then fails if the
    /// link was closed meanwhile.
    pub(super) async fn run<K>(
        &self,
        lanes: Vec<Arc<GpuLane>>,
        work: Vec<(usize, Work)>,
        keep: K,
    ) -> Result<()> {
        self.run_publishing(lanes, work, keep, &AtomicBool::new(false))
            .await
    }

    /// [`Self::run`], then `payload` into the peer's inbox: where the transfer is one launch
    /// and its GPU can store into the message ring, the record is written before the launch
    /// and the GPU publishes it right after the copies ([`Notified::Sent`]); otherwise
    /// [`Notified::Left`] for the engine to send.
    pub(super) async fn run_notifying<K>(
        &self,
        lanes: Vec<Arc<GpuLane>>,
        mut work: Vec<(usize, Work)>,
        keep: K,
        payload: &[u8],
    ) -> Result<Notified> {
        let (Ok(sender), [(lane, only)]) = (&self.messages, work.as_slice()) else {
            self.run(lanes, work, keep).await?;
            return Ok(Notified::Left);
        };
        let (lane, stream) = (*lane, only.stream());
        // A copy held back by the caller's event could hold the ring, and every notification
        // after it, for as long as the caller's stream takes: its notification waits for it
        // on the host instead.
        let releasable = match only {
            Work::Copies(_) => true,
            Work::Paged(paged) => paged.after.is_none(),
            Work::CopyPublish { .. } | Work::Publish { .. } | Work::Signal { .. } => false,
        };
        let word = releasable
            .then(|| sender.device_word(lanes[lane].streams[stream].context()))
            .flatten();
        let Some((addr, unpublished)) =
            word.and_then(|addr| Some((addr, sender.write_unpublished(payload)?)))
        else {
            self.run(lanes, work, keep).await?;
            return Ok(Notified::Left);
        };
        let position = unpublished.position();
        // A short copy the kernels reach and its notification go in one launch; anything
        // else is followed by a stream write of the position.
        let copy = match only {
            Work::Copies(launch) => plan::publishing_copy(launch, self.config.copy_path),
            _ => None,
        }
        .filter(|_| lanes[lane].kernels.is_some());
        match copy {
            Some(copy) => {
                work[0].1 = Work::CopyPublish {
                    stream,
                    copy,
                    addr,
                    position,
                }
            }
            None => work.push((
                lane,
                Work::Publish {
                    stream,
                    addr,
                    position,
                },
            )),
        }
        let queued = AtomicBool::new(false);
        match self.run_publishing(lanes, work, keep, &queued).await {
            Ok(()) => unpublished.published().await.map(|()| Notified::Sent),
            Err(error) => {
                match queued.load(Ordering::Acquire) {
                    true => unpublished.abandon(&error.to_string()),
                    false => unpublished.withdraw(),
                }
                Err(error)
            }
        }
    }

    /// [`Self::run`], setting `published` once a [`Work::Publish`] store or a
    /// [`Work::CopyPublish`] launch is queued.
    async fn run_publishing<K>(
        &self,
        lanes: Vec<Arc<GpuLane>>,
        work: Vec<(usize, Work)>,
        keep: K,
        published: &AtomicBool,
    ) -> Result<()> {
        let launches = Launches {
            link: self,
            streams: self.config.streams_per_gpu.max(1) + 1,
            lanes,
            work,
            last_kernels: Vec::new(),
            published,
        };
        let wait = |event: Arc<Event>| Poller::global().wait(event);
        launch_all(launches, wait, keep).await?;
        self.still_alive()
    }
}

/// One side of a paged copy, as the kernel takes it.
pub(super) struct Side {
    pub(super) bases: Vec<u64>,
    pub(super) ids: Arc<[u32]>,
    pub(super) stride: u64,
    pub(super) offset: u64,
}

/// A paged copy planned as one kernel launch, every address checked.
pub(super) struct Paged {
    pub(super) layout: plan::PagedArgs,
    pub(super) grid: u32,
    pub(super) pools: u32,
    pub(super) ids: u32,
    pub(super) src: Side,
    pub(super) dst: Side,
    pub(super) len: u64,
    pub(super) chunk: u64,
    /// Whether the `_shifted` build copies the blocks: their ends may disagree modulo 16 and
    /// they are long enough to gain from it ([`plan::DEEP_SHIFT_FROM`]).
    pub(super) shifted: bool,
    /// The lane's stream it queues on: the waiting stream when `after` is set, else 0.
    pub(super) stream: usize,
    /// The launch waits on the GPU for this event first ([`ferry_core::Batch::after`]).
    pub(super) after: Option<Arc<Event>>,
}

/// What one launch of a transfer queues.
pub(super) enum Work {
    Copies(Launch),
    Paged(Paged),
    /// One copy by one block of the kernel (`ferry_copy_publish`), which then publishes
    /// like [`Work::Publish`]: one launch instead of a copy and a stream write.
    CopyPublish {
        stream: usize,
        copy: plan::Copy,
        addr: u64,
        position: u64,
    },
    /// The store of `position` into the message ring's word 0 at `addr` (this GPU's address
    /// for it) that publishes a notification after the launch before it on `stream`.
    Publish {
        stream: usize,
        addr: u64,
        position: u64,
    },
    /// A 32-bit store into the peer's memory at `addr` (mapped here), on stream 0.
    Signal {
        addr: u64,
        value: u32,
    },
}

impl Work {
    fn stream(&self) -> usize {
        match self {
            Work::Copies(launch) => launch.stream(),
            Work::Paged(paged) => paged.stream,
            Work::CopyPublish { stream, .. } | Work::Publish { stream, .. } => *stream,
            Work::Signal { .. } => 0,
        }
    }
}

/// The launches of one transfer over the lanes of its GPUs.
pub(super) struct Launches<'a> {
    pub(super) link: &'a NvlinkLink,
    /// Streams of every lane: a stream's number in the transfer is lane * streams + stream.
    pub(super) streams: usize,
    pub(super) lanes: Vec<Arc<GpuLane>>,
    pub(super) work: Vec<(usize, Work)>,
    /// Streams whose last launch was a kernel, with the event recorded right after it: that
    /// event is already the stream's fence, and recording another costs a few microseconds.
    pub(super) last_kernels: Vec<(usize, Arc<Event>)>,
    /// Set once a [`Work::Publish`] store or a [`Work::CopyPublish`] launch is queued.
    pub(super) published: &'a AtomicBool,
}

impl Launches<'_> {
    fn stream_of(&self, stream: usize) -> &Stream {
        &self.lanes[stream / self.streams].streams[stream % self.streams]
    }
}

impl Launcher for Launches<'_> {
    type Fence = Arc<Event>;
    type Error = Error;

    fn count(&self) -> usize {
        self.work.len()
    }

    fn stream(&self, index: usize) -> usize {
        let (lane, work) = &self.work[index];
        lane * self.streams + work.stream()
    }

    fn launch(&mut self, index: usize) -> Result<()> {
        let stream = self.stream(index);
        self.last_kernels
            .retain(|(kernel_stream, _)| *kernel_stream != stream);
        let (lane, work) = &self.work[index];
        if let Some(fence) = self.link.launch(&self.lanes[*lane], work)? {
            self.last_kernels.push((stream, fence));
        }
        if matches!(work, Work::Publish { .. } | Work::CopyPublish { .. }) {
            self.published.store(true, Ordering::Release);
        }
        Ok(())
    }

    fn fence(&mut self, stream: usize) -> Result<Arc<Event>> {
        match self
            .last_kernels
            .iter()
            .position(|(kernel_stream, _)| *kernel_stream == stream)
        {
            Some(index) => Ok(self.last_kernels.swap_remove(index).1),
            None => Ok(Arc::new(Event::record(self.stream_of(stream))?)),
        }
    }

    fn drain(&mut self, stream: usize) -> Result<()> {
        Ok(self.stream_of(stream).synchronize()?)
    }
}
