//! Routing a submitted batch: the cheapest transport for every entry, block copy and signal.
//! [`crate::route`] lays the same choice open for tools.

use super::{Blocks, Entry, Work};
use crate::blocks::BlockOps;
use crate::descriptor::BufferDescriptor;
use crate::error::{Error, RangeError, Result, Side};
use crate::memory::RegionUse;
use crate::peer::{Peer, PeerView};
use crate::transport::{Reach, TransferOp, TransferOps, Transport};
use std::sync::Arc;

/// The ops of one batch for each transport (by index).
type Routed = (Vec<(usize, TransferOps)>, Vec<(usize, BlockOps)>);

/// Routes every entry and block copy of `work` over the buffers of `view`.
pub(super) fn route_all(
    transports: &[Arc<dyn Transport>],
    view: &PeerView,
    work: &Work,
    peer: &str,
) -> Result<Routed> {
    let groups = route(transports, view, &work.uses, &work.entries, peer)?;
    let blocks = route_blocks(transports, view, &work.uses, &work.blocks, peer)?;
    Ok((groups, blocks))
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
}

/// Picks the cheapest transport for every entry and turns entries into ops, merging entries
/// that continue each other on both sides. A remote range outside every buffer of `view` is
/// [`RangeError::NotRegistered`], naming the entry.
fn route(
    transports: &[Arc<dyn Transport>],
    view: &PeerView,
    uses: &Arc<[Arc<RegionUse>]>,
    entries: &[Entry],
    peer: &str,
) -> Result<Vec<(usize, TransferOps)>> {
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
                        index,
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
                };
                last = Some(route);
                route
            }
        };
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
    Ok(groups
        .into_iter()
        .enumerate()
        .filter(|(_, ops)| !ops.is_empty())
        .collect())
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
        for pool in pools {
            let local = &pool.region.entry;
            let transport = view.route(local, &pool.remote, || {
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
