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

/// Blocks shorter than this whose entries continue each other in runs of at least
/// [`FLAT_RUN_BLOCKS`] on average stay flat: a token-granular cache (an MLA latent of about
/// 1 KiB a token) cut into its blocks is hundreds of thousands of tiny paged copies, while
/// its runs, merged as flat entries, are a few thousand copies of tens of KiB.
const FLAT_RUNS_BELOW: u64 = 16 << 10;

/// The average run, in blocks, from which runs of blocks shorter than [`FLAT_RUNS_BELOW`]
/// stay flat.
const FLAT_RUN_BLOCKS: u64 = 4;

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

/// The greatest common divisor of the values folded into it, with a test that costs a
/// multiplication, not a division, for the usual value: one its divisor already divides.
/// Offsets of a token-granular cache are multiples of an odd-sized token (1,152 bytes, say),
/// where a division per value and side was most of the planner's time.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Gcd {
    value: u64,
    /// `value` as `odd << shift`.
    shift: u32,
    /// The inverse of the odd part modulo 2^64.
    inverse: u64,
    /// `u64::MAX / odd`: a multiple `x` of the odd part has `x * inverse <= limit`.
    limit: u64,
}

impl Gcd {
    /// The gcd of nothing yet: 0, which every fold replaces.
    pub(super) fn new(value: u64) -> Gcd {
        if value == 0 {
            return Gcd::default();
        }
        let shift = value.trailing_zeros();
        let odd = value >> shift;
        // Newton's iteration doubles the correct low bits each step: 3 bits from `odd`
        // itself (odd * odd = 1 mod 8), then 6, 12, 24, 48, 96.
        let mut inverse = odd;
        for _ in 0..5 {
            inverse = inverse.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(inverse)));
        }
        Gcd {
            value,
            shift,
            inverse,
            limit: u64::MAX / odd,
        }
    }

    /// The gcd so far.
    #[inline]
    pub(super) fn value(self) -> u64 {
        self.value
    }

    /// Whether the gcd so far divides `x` (0 divides only 0).
    #[inline]
    pub(super) fn divides(self, x: u64) -> bool {
        if self.value == 0 {
            return x == 0;
        }
        x.trailing_zeros() >= self.shift
            && (x >> self.shift).wrapping_mul(self.inverse) <= self.limit
    }

    /// `x / self` for an `x` the gcd divides (see [`Gcd::divides`]): exact, so a shift and
    /// a multiplication by the inverse give it.
    #[inline]
    pub(super) fn quotient(self, x: u64) -> u64 {
        debug_assert!(self.divides(x));
        (x >> self.shift).wrapping_mul(self.inverse)
    }

    /// Folds `x` in: the gcd becomes `gcd(self, x)`.
    #[inline]
    pub(super) fn fold(&mut self, x: u64) {
        if !self.divides(x) {
            *self = Gcd::new(gcd(self.value, x));
        }
    }
}

/// The paged shape of `pieces`, or `None` when they are better left flat: too few, blocks too
/// short, short blocks in long runs (which move best merged, as flat entries), entries that
/// do not start on one block grid on both sides, too many blocks, or ids past 32 bits.
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
    let mut len = Gcd::new(first.len);
    let (mut local_step, mut remote_step) = (Gcd::default(), Gcd::default());
    let (mut local_end, mut remote_end) = (first.local + first.len, first.remote + first.len);
    let mut runs = false;
    // Entries that do not continue the one before on both sides: the runs they merge into.
    let mut merged = 1;
    let mut last = first;
    for piece in rest {
        if piece.local != last.local + last.len || piece.remote != last.remote + last.len {
            merged += 1;
        }
        last = piece;
        if piece.len != first.len {
            runs = true;
            len.fold(piece.len);
        }
        local_step.fold(piece.local.abs_diff(first.local));
        remote_step.fold(piece.remote.abs_diff(first.remote));
        local_end = local_end.max(piece.local + piece.len);
        remote_end = remote_end.max(piece.remote + piece.len);
    }
    let len = len.value();
    if len < MIN_BLOCK {
        return None;
    }
    // An entry of several blocks steps through them by the block length, so the grid can be
    // no coarser than a block.
    if runs {
        local_step.fold(len);
        remote_step.fold(len);
    }
    let (local_step, remote_step) = (local_step.value(), remote_step.value());
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
            let divisor = Gcd::new(len);
            pieces.map(|piece| divisor.quotient(piece.len)).sum()
        }
        false => count,
    };
    if blocks > MAX_BLOCKS_PER_ENTRY.saturating_mul(count) || usize::try_from(blocks).is_err() {
        return None;
    }
    if len < FLAT_RUNS_BELOW && blocks >= FLAT_RUN_BLOCKS * merged {
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
    let local = Gcd::new(shape.local.stride);
    let remote = Gcd::new(shape.remote.stride);
    // `shape` put every piece's start on its side's grid and every id below 2^32.
    let local_id = move |piece: &Piece| local.quotient(piece.local - shape.local.offset) as u32;
    let remote_id = move |piece: &Piece| remote.quotient(piece.remote - shape.remote.offset) as u32;
    if !shape.runs {
        // One id a piece: collected straight into the shared lists, one allocation each.
        return Ids {
            local: pieces.clone().map(|piece| local_id(&piece)).collect(),
            remote: pieces.map(|piece| remote_id(&piece)).collect(),
        };
    }
    let len = Gcd::new(shape.len);
    let (mut locals, mut remotes) = (
        Vec::with_capacity(shape.blocks as usize),
        Vec::with_capacity(shape.blocks as usize),
    );
    for piece in pieces {
        // `blocks >= 1`: every piece is at least a block long.
        let blocks = len.quotient(piece.len) as u32 - 1;
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
