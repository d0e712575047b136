//! How a submitted batch reaches its transports: its entries routed and planned a slice at a
//! time ([`slices`], [`Routing`]), each slice's parts started the moment they are planned
//! ([`Started`]), so that the copies of the first slice run while the host plans the next.

use super::route::{route_all, Routed};
use super::{BatchEngine, Blocks, Entry};
use crate::cuda::{Event, Poller};
use crate::error::{Error, RangeError, Result, Side};
use crate::memory::RegionUse;
use crate::peer::{Peer, PeerView};
use crate::transport::{Link, Notified, TransferPart};
use futures::future::BoxFuture;
use std::ops::Range;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

/// Entries in the first slice: a batch of fewer than twice this many is routed whole, as one
/// slice, so that small batches (a notification's latency counts there) take one pass.
const FIRST_SLICE: usize = 4096;

/// Entries in the largest slice: each slice after the first is twice the one before, up to
/// this, so that a long batch is a handful of launches and not hundreds.
const LARGEST_SLICE: usize = 16384;

/// The slices of a batch of `len` entries, in order, covering every entry once: the first
/// [`FIRST_SLICE`] entries, then slices twice as long as the one before up to
/// [`LARGEST_SLICE`]. A tail shorter than [`FIRST_SLICE`] joins the slice before it.
pub(super) fn slices(len: usize) -> impl Iterator<Item = Range<usize>> {
    let (mut start, mut size) = (0, FIRST_SLICE);
    std::iter::from_fn(move || {
        if start >= len && !(start == 0 && len == 0) {
            return None;
        }
        let mut end = start.saturating_add(size).min(len);
        if len - end < FIRST_SLICE {
            end = len;
        }
        let slice = start..end;
        // An empty batch is one empty slice, so that its block copies are still routed.
        start = end.max(1);
        size = (size * 2).min(LARGEST_SLICE);
        Some(slice)
    })
}

/// Routes the slices of one batch over the peer's view, fetching the peer's descriptor once
/// more (once per transfer) when a remote range lies outside every buffer the cached one
/// lists: it may be memory the peer registered since.
pub(super) struct Routing<'a> {
    engine: &'a dyn BatchEngine,
    peer: &'a Peer,
    view: Arc<PeerView>,
    refreshed: bool,
}

impl<'a> Routing<'a> {
    /// Routing over the view of `peer` the engine holds now.
    pub(super) fn new(engine: &'a dyn BatchEngine, peer: &'a Peer) -> Self {
        Routing {
            engine,
            peer,
            view: peer.view(),
            refreshed: false,
        }
    }

    /// Routes `entries` (the batch's from index `base` on) and `blocks`.
    pub(super) async fn route(
        &mut self,
        uses: &Arc<[Arc<RegionUse>]>,
        entries: (&[Entry], usize),
        blocks: &[Blocks],
    ) -> Result<Routed> {
        let transports = self.engine.transports();
        let name = self.peer.name();
        match route_all(transports, &self.view, uses, entries, blocks, name) {
            Err(Error::Range(
                RangeError::NotRegistered {
                    side: Side::Remote, ..
                }
                | RangeError::PoolNotRegistered {
                    side: Side::Remote, ..
                },
            )) if !self.refreshed => {
                self.refreshed = true;
                self.view = self.peer.refresh(self.engine.peer_context()).await?;
                route_all(transports, &self.view, uses, entries, blocks, name)
            }
            routed => routed,
        }
    }
}

/// The parts of a transfer that have started, and the outcomes of those that have ended.
pub(super) struct Started<'a> {
    running: Vec<BoxFuture<'a, Result<Notified>>>,
    ended: Vec<Result<Notified>>,
    /// How long the parts may take, from the first start.
    limit: Duration,
    /// When the parts must have ended: `limit` after the first start.
    deadline: Option<tokio::time::Instant>,
}

impl<'a> Started<'a> {
    /// No parts yet; the parts started later must end within `limit` of the first.
    pub(super) fn new(limit: Duration) -> Self {
        Started {
            running: Vec::new(),
            ended: Vec::new(),
            limit,
            deadline: None,
        }
    }

    /// True before any part started.
    pub(super) fn is_empty(&self) -> bool {
        self.running.is_empty() && self.ended.is_empty()
    }

    /// Starts the parts of `routed`, each through its transport's link to `peer`, behind
    /// `after` when there is one, handing `handed` (the batch's notification) to a link that
    /// takes it; adds the transports' names to `names`.
    pub(super) async fn start(
        &mut self,
        engine: &dyn BatchEngine,
        peer: &Peer,
        (groups, block_groups): Routed,
        after: &Option<Arc<Event>>,
        handed: Option<&'a [u8]>,
        names: &mut Vec<&'static str>,
    ) -> Result<()> {
        for (transport, ops) in groups {
            let link = peer.link(engine.transports()[transport].as_ref()).await?;
            name(names, engine.transports()[transport].name());
            let after = after.clone();
            self.begin(Box::pin(async move {
                if let Some(event) = after {
                    Poller::global().wait(event).await?;
                }
                move_part(link.as_ref(), TransferPart::Ops(ops), handed).await
            }))
            .await;
        }
        for (transport, mut blocks) in block_groups {
            blocks.after = after.clone();
            let link = peer.link(engine.transports()[transport].as_ref()).await?;
            name(names, engine.transports()[transport].name());
            self.begin(Box::pin(async move {
                move_part(link.as_ref(), TransferPart::Blocks(blocks), handed).await
            }))
            .await;
        }
        Ok(())
    }

    /// Polls `part` once, on this task, so that it queues its copies now rather than when the
    /// transfer next waits; keeps it until it ends.
    pub(super) async fn begin(&mut self, mut part: BoxFuture<'a, Result<Notified>>) {
        let limit = self.limit;
        self.deadline
            .get_or_insert_with(|| tokio::time::Instant::now() + limit);
        let polled = std::future::poll_fn(|context| Poll::Ready(part.as_mut().poll(context))).await;
        match polled {
            Poll::Ready(outcome) => self.ended.push(outcome),
            Poll::Pending => self.running.push(part),
        }
    }

    /// Waits for every part to end and returns their outcomes, or `None` once the deadline
    /// passed: the peer is then closed, which makes its network parts fail at once, and the
    /// parts are still waited for, since a part dropped half-way would release its regions
    /// and mappings while a GPU may still be copying through them.
    pub(super) async fn finish(self, peer: &Peer) -> Option<Vec<Result<Notified>>> {
        let Started {
            running,
            mut ended,
            limit,
            deadline,
        } = self;
        let deadline = deadline.unwrap_or_else(|| tokio::time::Instant::now() + limit);
        let mut all = std::pin::pin!(futures::future::join_all(running));
        match tokio::time::timeout_at(deadline, &mut all).await {
            Ok(outcomes) => {
                ended.extend(outcomes);
                Some(ended)
            }
            Err(_) => {
                peer.close();
                all.await;
                None
            }
        }
    }
}

/// Adds `transport` to `names` once.
fn name(names: &mut Vec<&'static str>, transport: &'static str) {
    if !names.contains(&transport) {
        names.push(transport);
    }
}

/// Moves one part of a batch through `link`, handing it the batch's notification when there
/// is one to hand.
async fn move_part(link: &dyn Link, part: TransferPart, handed: Option<&[u8]>) -> Result<Notified> {
    match (part, handed) {
        (part, Some(payload)) => link.transfer_notifying(part, payload).await,
        (TransferPart::Ops(ops), None) => link.transfer(ops).await.map(|()| Notified::Left),
        (TransferPart::Blocks(blocks), None) => {
            link.transfer_blocks(blocks).await.map(|()| Notified::Left)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(len: usize) -> Vec<Range<usize>> {
        slices(len).collect()
    }

    #[test]
    fn a_batch_of_fewer_than_two_first_slices_is_one_slice() {
        assert_eq!(all(0), vec![0..0]);
        assert_eq!(all(1), vec![0..1]);
        assert_eq!(all(2 * FIRST_SLICE - 1), vec![0..2 * FIRST_SLICE - 1]);
    }

    #[test]
    fn slices_double_up_to_the_largest_and_cover_every_entry_once() {
        assert_eq!(
            all(40_960),
            vec![0..4096, 4096..12_288, 12_288..28_672, 28_672..40_960]
        );
        for len in [8192, 8193, 12_287, 100_000, 250_000] {
            let slices = all(len);
            assert_eq!(slices[0].start, 0);
            assert_eq!(slices.last().unwrap().end, len);
            for pair in slices.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
            }
            for (index, slice) in slices.iter().enumerate() {
                assert!(slice.len() >= FIRST_SLICE.min(len), "{len}: {slices:?}");
                if index + 1 < slices.len() {
                    assert!(slice.len() <= LARGEST_SLICE, "{len}: {slices:?}");
                }
            }
        }
    }
}
