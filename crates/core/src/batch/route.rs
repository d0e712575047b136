//! Routing a submitted batch: the cheapest transport for every entry, block copy and signal.
//! [`crate::route`] lays the same choice open for tools.

use super::plan::{self, Pairs, Piece, Shape};
use super::{Blocks, Entry};
use crate::blocks::{BlockOps, BlockPoolOp};
use crate::descriptor::BufferDescriptor;
use crate::error::{Error, RangeError, Result, Side};
use crate::memory::RegionUse;
use crate::peer::{Peer, PeerView};
use crate::transport::{Reach, TransferOp, TransferOps, Transport};
use std::sync::Arc;

/// The ops of one batch for each transport (by index).
pub(super) type Routed = (Vec<(usize, TransferOps)>, Vec<(usize, BlockOps)>);

/// Routes `entries` (the batch's from index `base` on) and the block copies `blocks` over the
/// buffers of `view`; entries of block shape bound for a transport that
/// [`Transport::prefers_blocks`] become block copies.
pub(super) fn route_all(
    transports: &[Arc<dyn Transport>],
    view: &PeerView,
    uses: &Arc<[Arc<RegionUse>]>,
    (entries, base): (&[Entry], usize),
    blocks: &[Blocks],
    peer: &str,
) -> Result<Routed> {
    let (groups, mut planned) = route(transports, view, uses, (entries, base), peer)?;
    planned.extend(route_blocks(transports, view, uses, blocks, peer)?);
    Ok((groups, planned))
}

/// How an entry was routed, kept for the entries after it.
#[derive(Clone, Copy)]
struct LastRoute {
    /// The batch's index of the local region.
    region: u32,
    /// The index of the remote buffer in the view's buffers.
    remote: u32,
    /// The remote buffer's first byte.
    remote_start: u64,
    /// The remote buffer's end (exclusive).
    remote_end: u64,
    /// The local region's first byte.
    local_base: u64,
    /// The chosen transport.
    transport: usize,
    /// Whether the entries of this route are collected for [`plan`].
    plans: bool,
}

/// Picks the cheapest transport for every entry and turns entries into ops, merging entries
/// that continue each other on both sides, or into block copies ([`plan`]) where the
/// transport prefers them and the entries have block shape. A remote range outside every
/// buffer of `view` is [`RangeError::NotRegistered`], naming the entry by its index in the
/// batch (`base` plus its index in `entries`).
fn route(
    transports: &[Arc<dyn Transport>],
    view: &PeerView,
    uses: &Arc<[Arc<RegionUse>]>,
    (entries, base): (&[Entry], usize),
    peer: &str,
) -> Result<Routed> {
    if u32::try_from(view.buffers().len()).is_err() {
        return Err(Error::Unavailable {
            local: "a batch".into(),
            peer: peer.to_owned(),
            reason:
                "the peer publishes more than 2^32 buffers; ask it to register fewer, larger ones"
                    .into(),
        });
    }
    let buffers = view.buffers();
    let mut groups: Vec<TransferOps> = transports
        .iter()
        .map(|_| TransferOps::new(Arc::clone(uses), Arc::clone(buffers), 0))
        .collect();
    let may_plan = entries.len() >= plan::MIN_ENTRIES && u32::try_from(entries.len()).is_ok();
    let mut pairs = Pairs::default();
    // Consecutive entries mostly share their region and remote buffer, so their route too:
    // an entry inside the previous entry's buffer skips the search and the choice.
    let mut last: Option<LastRoute> = None;
    for (index, entry) in entries.iter().enumerate() {
        let inside = |last: &LastRoute| {
            last.region == entry.region
                && entry.remote_addr >= last.remote_start
                && entry
                    .remote_addr
                    .checked_add(entry.len)
                    .is_some_and(|end| end <= last.remote_end)
        };
        let route = match last.filter(inside) {
            Some(route) => route,
            None => {
                let remote_index = view.covering_index(entry.remote_addr, entry.len).ok_or(
                    RangeError::NotRegistered {
                        index: base + index,
                        side: Side::Remote,
                        addr: entry.remote_addr,
                        len: entry.len,
                    },
                )?;
                let remote = &buffers[remote_index];
                let local = &uses[entry.region as usize].entry;
                let transport = view.route(local, remote, || {
                    choose(transports, &local.info, view, remote, peer)
                })?;
                let route = LastRoute {
                    region: entry.region,
                    // Checked above: every buffer index fits.
                    remote: remote_index as u32,
                    remote_start: remote.addr,
                    remote_end: remote.addr.saturating_add(remote.len),
                    local_base: local.info.addr,
                    transport,
                    plans: may_plan && transports[transport].prefers_blocks(),
                };
                last = Some(route);
                route
            }
        };
        if route.plans {
            // `may_plan` checked that every index fits.
            pairs.add(
                entry.direction,
                entry.region,
                route.remote,
                route.transport,
                index as u32,
            );
            continue;
        }
        let group = &mut groups[route.transport];
        if group.capacity() == 0 {
            // At most one op per entry left: a single transport's group never grows again.
            group.reserve_exact(entries.len() - index);
        }
        group.push_merged(TransferOp {
            direction: entry.direction,
            region: entry.region,
            local_addr: route.local_base + entry.offset,
            remote_addr: entry.remote_addr,
            remote: route.remote,
            len: entry.len,
        });
    }
    let planned = plan_pairs(pairs, entries, uses, buffers, &mut groups);
    let groups = groups
        .into_iter()
        .enumerate()
        .filter(|(_, ops)| !ops.is_empty())
        .collect();
    Ok((groups, planned))
}

/// Turns each pair of block shape into a block copy, joining pairs that move the same ids
/// in the same shape (every layer of a request) into one copy of many pools; the entries of
/// the other pairs go to their transport's `groups` as ops.
fn plan_pairs(
    pairs: Pairs,
    entries: &[Entry],
    uses: &[Arc<RegionUse>],
    buffers: &[Arc<BufferDescriptor>],
    groups: &mut [TransferOps],
) -> Vec<(usize, BlockOps)> {
    let mut planned: Vec<(usize, Shape, BlockOps)> = Vec::new();
    for pair in pairs.into_pairs() {
        let region = &uses[pair.region as usize];
        let remote = &buffers[pair.remote as usize];
        let pieces = pair.entries.iter().map(|&index| {
            let entry = &entries[index as usize];
            Piece {
                local: entry.offset,
                remote: entry.remote_addr - remote.addr,
                len: entry.len,
            }
        });
        let Some(shape) = plan::shape(pieces.clone()) else {
            let group = &mut groups[pair.transport];
            for piece in pieces {
                group.push_merged(TransferOp {
                    direction: pair.direction,
                    region: pair.region,
                    local_addr: region.entry.info.addr + piece.local,
                    remote_addr: remote.addr + piece.remote,
                    remote: pair.remote,
                    len: piece.len,
                });
            }
            continue;
        };
        let ids = plan::ids(pieces, shape);
        let pool = BlockPoolOp {
            region: Arc::clone(region),
            local_base: region.entry.info.addr,
            remote: Arc::clone(remote),
            remote_base: remote.addr,
        };
        // Pairs that move the same ids come one after another (the layers of a request):
        // comparing with the last copy spares hashing the id lists.
        if let Some((transport, last_shape, blocks)) = planned.last_mut() {
            if *transport == pair.transport
                && *last_shape == shape
                && blocks.direction == pair.direction
                && *blocks.local_ids == *ids.local
                && *blocks.remote_ids == *ids.remote
            {
                blocks.pools.push(pool);
                continue;
            }
        }
        planned.push((
            pair.transport,
            shape,
            BlockOps {
                direction: pair.direction,
                pools: vec![pool],
                len: shape.len,
                local_stride: shape.local.stride,
                local_offset: shape.local.offset,
                remote_stride: shape.remote.stride,
                remote_offset: shape.remote.offset,
                local_ids: ids.local,
                remote_ids: ids.remote,
                remote_highest: shape.remote_highest,
                after: None,
            },
        ));
    }
    planned
        .into_iter()
        .map(|(transport, _, blocks)| (transport, blocks))
        .collect()
}

/// The transport, remote buffer and local GPU of a batch's signal: the transport that moves
/// the batch's first region to the signal's buffer.
pub(super) fn signal_route(
    transports: &[Arc<dyn Transport>],
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
        .map(|region| &region.entry)
        .ok_or_else(|| Error::ApiMisuse("a signal needs data in the batch".into()))?;
    let crate::memory::Location::Device { ordinal, .. } = local.info.location else {
        return Err(Error::ApiMisuse(
            "a signal is written by the GPU that moves the batch; its data is in host memory, so rely on the notification".into(),
        ));
    };
    let transport = view.route(local, &remote, || {
        choose(transports, &local.info, &view, &remote, peer.name())
    })?;
    Ok((transport, remote, addr, value, ordinal))
}

/// Resolves every block copy's pools and groups them by the cheapest transport of each pool.
fn route_blocks(
    transports: &[Arc<dyn Transport>],
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
        let mut routes = view.routes();
        for pool in pools {
            let local = &pool.region.entry;
            let transport = routes.route(local, &pool.remote, || {
                choose(transports, &local.info, view, &pool.remote, peer)
            })?;
            match by_transport
                .iter_mut()
                .find(|(known, _)| *known == transport)
            {
                Some((_, group)) => group.push(pool),
                None => by_transport.push((transport, vec![pool])),
            }
        }
        drop(routes);
        for (transport, pools) in by_transport {
            routed.push((
                transport,
                blocks
                    .copy
                    .ops(blocks.direction, pools, blocks.remote_highest),
            ));
        }
    }
    Ok(routed)
}

fn choose(
    transports: &[Arc<dyn Transport>],
    local: &crate::memory::RegionInfo,
    view: &PeerView,
    remote: &BufferDescriptor,
    peer: &str,
) -> Result<usize> {
    let mut best: Option<(u32, usize)> = None;
    let mut reasons = Vec::new();
    for (index, transport) in transports.iter().enumerate() {
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

#[cfg(test)]
#[path = "route_tests.rs"]
mod tests;
