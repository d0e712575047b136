//! Bytes of a registered region as the TCP transport moves them: host memory in place, GPU
//! memory through pinned staging memory (small spans share chunks, see `staging`) that the
//! GPU's copy engine fills or drains asynchronously (the socket work of other connections goes
//! on meanwhile).

use super::host::HostSpan;
use super::raw::{RawDestination, RawSource};
use super::region::{Location, RegionUse};
use super::staging::Staging;
use crate::cuda::{launch_all, Context, CudaError, Event, Launcher, Poller, Stream};
use crate::error::Error;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// A range of one registered region, valid while it lives.
pub(crate) enum Span {
    /// Host memory, read and written in place.
    Host(HostSpan),
    /// GPU memory, staged.
    Staged(StagedSpan),
}

impl Span {
    /// A span of `len` bytes at `addr`, or `None` when that is not inside the used region.
    /// GPU memory gets its staging buffer only when bytes move, so planned frames hold none.
    pub(crate) fn new(region: Arc<RegionUse>, addr: u64, len: u64) -> Option<Span> {
        match region.entry.info.location {
            Location::Host { .. } => HostSpan::new(region, addr, len).map(Span::Host),
            Location::Device { ordinal, .. } => {
                if !region.entry.contains(addr, len) {
                    return None;
                }
                Some(Span::Staged(StagedSpan {
                    addr,
                    len: usize::try_from(len).ok()?,
                    ordinal,
                    staging: None,
                    queued: false,
                    _use: region,
                }))
            }
        }
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            Span::Host(span) => span.len(),
            Span::Staged(span) => span.len,
        }
    }

    /// Makes the regions' current bytes readable through [`Span::source`]: the copies from
    /// the GPU of every staged span are queued together and awaited once.
    pub(crate) async fn load_all(spans: &mut [Span]) -> Result<(), Error> {
        copy_all(spans, CopyWay::FromGpu).await
    }

    /// Makes what was written through [`Span::destination`] land in the regions: the copies
    /// to the GPU of every staged span are queued together and awaited once. The bytes are
    /// visible in the regions when this returns.
    pub(crate) async fn store_all(spans: &mut [Span]) -> Result<(), Error> {
        copy_all(spans, CopyWay::ToGpu).await
    }

    /// The bytes to send (after [`Span::load_all`] for GPU memory): registered host memory in
    /// place, or the staging buffer (ferry's own pinned memory) of GPU memory.
    pub(crate) fn source(&self) -> RawSource<'_> {
        match self {
            Span::Host(span) => span.source(),
            Span::Staged(span) => RawSource::from_slice(span.staged()),
        }
    }

    /// Where received bytes go (then [`Span::store_all`] for GPU memory): registered host
    /// memory in place, or the staging buffer of GPU memory, taken on the first call.
    pub(crate) fn destination(&mut self) -> Result<RawDestination<'_>, Error> {
        match self {
            Span::Host(span) => Ok(span.destination()),
            Span::Staged(span) => Ok(RawDestination::from_slice(span.staged_mut()?)),
        }
    }
}

/// A range of registered GPU memory with the pinned memory that stands in for it.
pub(crate) struct StagedSpan {
    addr: u64,
    len: usize,
    ordinal: u32,
    /// Taken when bytes first move (small spans share a chunk); Drop hands it back.
    staging: Option<Staging>,
    /// A copy was queued and not yet seen finished: set by `queue`, cleared by `copy_all`
    /// once its copies ended. Still set on drop only when `copy_all` was dropped mid-way.
    queued: bool,
    /// Keeps the region registered, and so its memory valid, while the span exists.
    _use: Arc<RegionUse>,
}

#[derive(Clone, Copy)]
enum CopyWay {
    FromGpu,
    ToGpu,
}

impl StagedSpan {
    fn staged(&self) -> &[u8] {
        match &self.staging {
            Some(staging) => staging.bytes(self.len),
            None => &[],
        }
    }

    fn staging(&mut self) -> Result<&mut Staging, Error> {
        match self.staging {
            Some(ref mut staging) => Ok(staging),
            None => Ok(self.staging.insert(Staging::new(self.ordinal, self.len)?)),
        }
    }

    fn staged_mut(&mut self) -> Result<&mut [u8], Error> {
        let len = self.len;
        Ok(self.staging()?.bytes_mut(len))
    }

    /// Queues the copy between the GPU range and the staging buffer on `stream`.
    ///
    /// The caller must keep the span (and so its buffer) untouched until an event recorded on
    /// `stream` after this call has fired.
    fn queue(&mut self, way: CopyWay, stream: &Stream) -> Result<(), Error> {
        let (addr, len) = (self.addr, self.len);
        let staging = self.staging()?.addr();
        self.queued = true;
        let (dst, src) = match way {
            CopyWay::FromGpu => (staging, addr),
            CopyWay::ToGpu => (addr, staging),
        };
        // SAFETY: the GPU range lies inside a registered region (checked in `Span::new`) that
        // the held RegionUse keeps registered; the pinned staging memory holds at least `len`
        // bytes that no other span shares and is owned by this span, which `copy_all` keeps
        // borrowed until the event after this copy has fired; GPU memory and pinned host
        // memory never overlap.
        Ok(unsafe { stream.copy(dst, src, len) }?)
    }
}

/// Queues the copies of every staged span (one stream per GPU) and waits for all of them:
/// also when queueing one failed, every copy queued before it has finished before this returns
/// and the spans may be dropped.
async fn copy_all(spans: &mut [Span], way: CopyWay) -> Result<(), Error> {
    let mut streams: Vec<(u32, Arc<Stream>)> = Vec::new();
    let mut staged = Vec::new();
    for span in spans.iter_mut() {
        let Span::Staged(span) = span else { continue };
        let stream = match streams
            .iter()
            .position(|(ordinal, _)| *ordinal == span.ordinal)
        {
            Some(index) => index,
            None => {
                streams.push((span.ordinal, staging_stream(span.ordinal)?));
                streams.len() - 1
            }
        };
        staged.push((span, stream));
    }
    let copies = StagingCopies {
        way,
        streams,
        staged,
    };
    let outcome = launch_all(copies, |event| Poller::global().wait(event), ()).await;
    for span in spans.iter_mut() {
        if let Span::Staged(span) = span {
            span.queued = false;
        }
    }
    outcome
}

/// The staging copies of one frame, as launches: one per staged span, on its GPU's stream.
struct StagingCopies<'a> {
    way: CopyWay,
    streams: Vec<(u32, Arc<Stream>)>,
    /// Each span with the index of its stream in `streams`.
    staged: Vec<(&'a mut StagedSpan, usize)>,
}

impl Launcher for StagingCopies<'_> {
    type Fence = Event;
    type Error = Error;

    fn count(&self) -> usize {
        self.staged.len()
    }

    fn stream(&self, index: usize) -> usize {
        self.staged[index].1
    }

    fn launch(&mut self, index: usize) -> Result<(), Error> {
        let (span, stream) = &mut self.staged[index];
        span.queue(self.way, &self.streams[*stream].1)
    }

    fn fence(&mut self, stream: usize) -> Result<Event, Error> {
        Ok(Event::record(&self.streams[stream].1)?)
    }

    fn drain(&mut self, stream: usize) -> Result<(), Error> {
        Ok(self.streams[stream].1.synchronize()?)
    }
}

impl Drop for StagedSpan {
    fn drop(&mut self) {
        let Some(staging) = self.staging.take() else {
            return;
        };
        if self.queued {
            // Dropped while its copy may still run (the task moving it was aborted mid-way):
            // the staging memory and the region stay held until the stream is past the copy.
            release_after_copies(self.ordinal, staging, Arc::clone(&self._use));
        } else {
            staging.release();
        }
    }
}

/// Releases `staging` and `region` once everything queued so far on GPU `ordinal`'s staging
/// stream has finished, waiting from a task of the current runtime; without a runtime, or when
/// no event can be recorded, blocks on the stream instead. A stream that reports an error has
/// failed for good and runs nothing more, so the memory is released then too.
fn release_after_copies(ordinal: u32, staging: Staging, region: Arc<RegionUse>) {
    let stream = staging_stream(ordinal);
    let fence = stream
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|stream| Event::record(stream));
    match (fence, tokio::runtime::Handle::try_current()) {
        (Ok(event), Ok(runtime)) => {
            runtime.spawn(async move {
                if let Err(error) = Poller::global().wait(event).await {
                    tracing::warn!(%error, "a staging copy abandoned mid-way failed");
                }
                staging.release();
                drop(region);
            });
        }
        _ => {
            if let Err(error) = stream.and_then(|stream| stream.synchronize()) {
                tracing::warn!(%error, "waiting for a staging copy abandoned mid-way failed");
            }
            staging.release();
        }
    }
}

/// The stream of GPU `ordinal` that staging copies queue on.
fn staging_stream(ordinal: u32) -> Result<Arc<Stream>, CudaError> {
    static STREAMS: OnceLock<Mutex<HashMap<u32, Arc<Stream>>>> = OnceLock::new();
    let mut streams = STREAMS.get_or_init(Mutex::default).lock();
    if let Some(stream) = streams.get(&ordinal) {
        return Ok(Arc::clone(stream));
    }
    let stream = Arc::new(Stream::new(Context::get(ordinal)?)?);
    streams.insert(ordinal, Arc::clone(&stream));
    Ok(stream)
}
