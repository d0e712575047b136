//! Finds paged block copies in flat entries: the one planner every door into the engine
//! shares (`Batch::write`/`read`, and through them the Mooncake and NIXL layers).
//!
//! Servers describe a request's KV as one entry per block, or per run of consecutive blocks,
//! of per-layer pools: tens of thousands of `(local offset, remote offset, length)` triples of
//! one local region and one peer buffer. Moved as they are, each is a copy of its own; moved as
//! block ids of a [`crate::BlockCopy`]-like shape, a transport that takes paged copies computes
//! the addresses itself (the nvlink kernel does, on the GPU). This module infers that shape from
//! the entries of one (local region, peer buffer) pair: the block length is the greatest
//! common divisor of the lengths, the block stride and offset follow from where the entries
//! start. Pairs whose entries fit no such shape stay flat. Pure functions, no I/O.

use crate::transport::Direction;
use std::collections::HashMap;
use std::sync::Arc;

/// Fewer entries than this in a pair stay flat: a handful of copies costs less as they are.
pub(super) const MIN_ENTRIES: usize = 8;

/// Blocks shorter than this stay flat entries: each block is at least one item of a kernel,
/// and pieces this small are mostly a sign of odd lengths, not of a paged cache.
const MIN_BLOCK: u64 = 64;

/// At most this many blocks per entry on average: runs of consecutive blocks are split into
/// their blocks, but a few long entries with one odd short one are left flat rather than cut
/// into a flood of tiny blocks.
const MAX_BLOCKS_PER_ENTRY: u64 = 1024;

/// One entry of a pair: its offset into the local region, its offset into the peer's buffer
/// and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    pub(super) local: u64,
    pub(super) remote: u64,
    pub(super) len: u64,
}

/// How one side's blocks lie in its pool, which starts at the region's (or buffer's) first
/// byte: block `id` is `[id * stride + offset, + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SideShape {
    pub(super) stride: u64,
    pub(super) offset: u64,
}

/// The paged shape of a pair's entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shape {
    /// Bytes per block.
    pub(super) len: u64,
    pub(super) local: SideShape,
    pub(super) remote: SideShape,
    /// Whether some entry holds several blocks.
    pub(super) runs: bool,
    /// Blocks of all entries.
    pub(super) blocks: u64,
    /// The highest remote block id.
    pub(super) remote_highest: u32,
}

/// A pair's entries as block ids: block `local[i]` here to or from `remote[i]` there.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Ids {
    pub(super) local: Arc<[u32]>,
    pub(super) remote: Arc<[u32]>,
}

/// The entries of one direction, local region and peer buffer, by their index in the batch.
#[derive(Debug)]
pub(super) struct Pair {
    pub(super) direction: Direction,
    /// The batch's index of the local region.
    pub(super) region: u32,
    /// The index of the peer's buffer.
    pub(super) remote: u32,
    /// The transport that carries the pair.
    pub(super) transport: usize,
    /// The entries' indices in the batch (an index, not a copy: a large batch's entries
    /// copied once more cost more than planning them).
    pub(super) entries: Vec<u32>,
}

/// Collects entries into pairs, in the order pairs are first seen.
#[derive(Default)]
pub(super) struct Pairs {
    pairs: Vec<Pair>,
    index: HashMap<(Direction, u32, u32), usize>,
    last: Option<((Direction, u32, u32), usize)>,
}

impl Pairs {
    /// Adds entry `entry` to the pair `(direction, region, remote)`, carried by `transport`.
    #[inline]
    pub(super) fn add(
        &mut self,
        direction: Direction,
        region: u32,
        remote: u32,
        transport: usize,
        entry: u32,
    ) {
        let key = (direction, region, remote);
        // Callers list one tensor's blocks one after another: the last pair usually takes the
        // next entry too, which spares the map.
        let slot = match self.last {
            Some((last, slot)) if last == key => slot,
            _ => {
                let pairs = &mut self.pairs;
                let slot = *self.index.entry(key).or_insert_with(|| {
                    pairs.push(Pair {
                        direction,
                        region,
                        remote,
                        transport,
                        entries: Vec::new(),
                    });
                    pairs.len() - 1
                });
                self.last = Some((key, slot));
                slot
            }
        };
        self.pairs[slot].entries.push(entry);
    }

    /// The pairs, in the order first seen.
    pub(super) fn into_pairs(self) -> Vec<Pair> {
        self.pairs
    }
}

/// The greatest common divisor; `gcd(0, b) == b`.
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// `gcd(divisor, value)`, cheap when `divisor` already divides `value` (the usual case).
#[inline]
pub(super) fn fold(divisor: u64, value: u64) -> u64 {
    if divisor != 0 && divisor.is_power_of_two() {
        if value & (divisor - 1) == 0 {
            return divisor;
        }
    } else if divisor != 0 && value % divisor == 0 {
        return divisor;
    }
    gcd(divisor, value)
}

/// Divides by one divisor many times: a shift for powers of two, a division otherwise.
#[derive(Clone, Copy)]
struct Divisor {
    value: u64,
    shift: Option<u32>,
}

impl Divisor {
    fn new(value: u64) -> Divisor {
        Divisor {
            value,
            shift: value.is_power_of_two().then(|| value.trailing_zeros()),
        }
    }

    #[inline]
    fn divide(self, dividend: u64) -> u64 {
        match self.shift {
            Some(shift) => dividend >> shift,
            None => dividend / self.value,
        }
    }
}

/// The paged shape of `pieces`, or `None` when they are better left flat: too few, blocks too
/// short, entries that do not start on one block grid on both sides, too many blocks, or ids
/// past 32 bits.
pub(super) fn shape<I>(pieces: I) -> Option<Shape>
where
    I: ExactSizeIterator<Item = Piece> + Clone,
{
    let count = pieces.len() as u64;
    if count < MIN_ENTRIES as u64 {
        return None;
    }
    let mut rest = pieces.clone();
    let first = rest.next()?;
    let mut len = first.len;
    let (mut local_step, mut remote_step) = (0, 0);
    let (mut local_end, mut remote_end) = (first.local + first.len, first.remote + first.len);
    let mut runs = false;
    for piece in rest {
        if piece.len != len {
            runs = true;
            len = fold(len, piece.len);
        }
        local_step = fold(local_step, piece.local.abs_diff(first.local));
        remote_step = fold(remote_step, piece.remote.abs_diff(first.remote));
        local_end = local_end.max(piece.local + piece.len);
        remote_end = remote_end.max(piece.remote + piece.len);
    }
    if len < MIN_BLOCK {
        return None;
    }
    // An entry of several blocks steps through them by the block length, so the grid can be
    // no coarser than a block.
    if runs {
        local_step = fold(len, local_step);
        remote_step = fold(len, remote_step);
    }
    let side = |step: u64, start: u64| {
        let stride = if step == 0 { len } else { step };
        (stride >= len).then_some(SideShape {
            stride,
            offset: start % stride,
        })
    };
    let (local, remote) = (
        side(local_step, first.local)?,
        side(remote_step, first.remote)?,
    );
    // The furthest block on each side starts a block before the furthest end, on the grid.
    let highest =
        |end: u64, side: SideShape| u32::try_from((end - len - side.offset) / side.stride);
    let (Ok(_), Ok(remote_highest)) = (highest(local_end, local), highest(remote_end, remote))
    else {
        return None;
    };
    let blocks = match runs {
        true => {
            let divisor = Divisor::new(len);
            pieces.map(|piece| divisor.divide(piece.len)).sum()
        }
        false => count,
    };
    if blocks > MAX_BLOCKS_PER_ENTRY.saturating_mul(count) || usize::try_from(blocks).is_err() {
        return None;
    }
    Some(Shape {
        len,
        local,
        remote,
        runs,
        blocks,
        remote_highest,
    })
}

/// The block ids of `pieces` in `shape` (from [`shape`], which checked that they fit).
pub(super) fn ids<I>(pieces: I, shape: Shape) -> Ids
where
    I: ExactSizeIterator<Item = Piece> + Clone,
{
    let local = Divisor::new(shape.local.stride);
    let remote = Divisor::new(shape.remote.stride);
    // `shape` put every piece's start on its side's grid and every id below 2^32.
    let local_id = move |piece: &Piece| local.divide(piece.local - shape.local.offset) as u32;
    let remote_id = move |piece: &Piece| remote.divide(piece.remote - shape.remote.offset) as u32;
    if !shape.runs {
        // One id a piece: collected straight into the shared lists, one allocation each.
        return Ids {
            local: pieces.clone().map(|piece| local_id(&piece)).collect(),
            remote: pieces.map(|piece| remote_id(&piece)).collect(),
        };
    }
    let len = Divisor::new(shape.len);
    let (mut locals, mut remotes) = (
        Vec::with_capacity(shape.blocks as usize),
        Vec::with_capacity(shape.blocks as usize),
    );
    for piece in pieces {
        // `blocks >= 1`: every piece is at least a block long.
        let blocks = len.divide(piece.len) as u32 - 1;
        let (local, remote) = (local_id(&piece), remote_id(&piece));
        locals.extend(local..=local + blocks);
        remotes.extend(remote..=remote + blocks);
    }
    Ids {
        local: locals.into(),
        remote: remotes.into(),
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
