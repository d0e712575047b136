//! A prepared transfer (`make_prepped_xfer`): descriptor pairs from two prepared lists,
//! planned once into ferry's moves, and posted as often as the caller likes.
//!
//! Lists given in NIXL's strided form are pools of blocks: each pair of descriptors becomes a
//! block id of its row on each side, and rows that move the same ids share one paged copy, so
//! vLLM's ids (`region * blocks + block`, the same blocks in every region) become one copy
//! over every layer. Other lists become flat entries, which the engine's planner still turns
//! into paged copies where they are whole blocks of registered memory.

use super::dlist::{DescList, Place};
use super::errors::NixlError;
use crate::compat::paged::{Grouper, PagedCopy, Pool};
use crate::compat::session::Entry;

/// How a prepared transfer moves its descriptors.
#[derive(Debug)]
pub(crate) enum Moves {
    /// Paged copies, from strided lists.
    Paged(Vec<PagedCopy>),
    /// Flat entries: local address, peer address, length.
    Flat(Vec<Entry>),
}

/// One side's descriptor indices, read in place from the caller's native-endian `i64`s: a
/// request names tens of thousands, and a copy of them costs as much as planning them.
/// Negative indices read as `u64`s past any list's end, so every look-up refuses them.
#[derive(Clone, Copy)]
pub(crate) struct Indices<'a> {
    bytes: &'a [u8],
    side: &'static str,
}

impl<'a> Indices<'a> {
    /// The indices in the first `len` bytes of `bytes`, of the `side` (`"local"` or
    /// `"remote"`) of a transfer.
    pub(crate) fn new(bytes: &'a [u8], len: usize, side: &'static str) -> Result<Self, NixlError> {
        if len % 8 != 0 || len > bytes.len() {
            return Err(NixlError::InvalidParam(format!(
                "the {side} indices are {len} bytes of a {}-byte buffer, not whole 64-bit integers inside it",
                bytes.len()
            )));
        }
        Ok(Indices {
            bytes: &bytes[..len],
            side,
        })
    }

    /// How many indices there are.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len() / 8
    }

    /// Index `position`.
    fn get(&self, position: usize) -> u64 {
        word(&self.bytes[position * 8..position * 8 + 8])
    }

    /// Whether index `a.start + i` equals index `b.start + i` plus `delta` (wrapping) for
    /// every `i`; the ranges are of one length and inside the indices.
    fn shifted_equal(
        &self,
        a: std::ops::Range<usize>,
        b: std::ops::Range<usize>,
        delta: u64,
    ) -> bool {
        let (a, b) = (
            &self.bytes[a.start * 8..a.end * 8],
            &self.bytes[b.start * 8..b.end * 8],
        );
        // A fold over every pair rather than a search that stops at the first difference: the
        // compiler turns it into vector instructions, and twins, the usual case, are read whole.
        a.chunks_exact(8)
            .zip(b.chunks_exact(8))
            .fold(0, |differ, (x, y)| {
                differ | (word(x) ^ word(y).wrapping_add(delta))
            })
            == 0
    }

    /// Indices `range`, in order.
    fn range(&self, range: std::ops::Range<usize>) -> impl Iterator<Item = u64> + 'a {
        self.bytes[range.start * 8..range.end * 8]
            .chunks_exact(8)
            .map(word)
    }
}

/// The native-endian `u64` in an 8-byte chunk.
#[inline]
fn word(chunk: &[u8]) -> u64 {
    let mut value = [0u8; 8];
    value.copy_from_slice(chunk);
    u64::from_ne_bytes(value)
}

/// Plans descriptors `local_ids[i]` of `local` with `remote_ids[i]` of `remote`.
pub(crate) fn plan(
    local: &DescList,
    local_ids: Indices<'_>,
    remote: &DescList,
    remote_ids: Indices<'_>,
) -> Result<(Moves, u64), NixlError> {
    if local_ids.len() != remote_ids.len() {
        return Err(NixlError::InvalidParam(format!(
            "{} local indices against {} remote ones; pass one remote descriptor per local one",
            local_ids.len(),
            remote_ids.len()
        )));
    }
    if local_ids.len() == 0 {
        return Err(NixlError::InvalidParam(
            "the transfer names no descriptors; pass at least one index on each side".into(),
        ));
    }
    if local.strided && remote.strided {
        let (copies, bytes) = plan_paged(local, local_ids, remote, remote_ids)?;
        return Ok((Moves::Paged(copies), bytes));
    }
    let mut flat = Vec::with_capacity(local_ids.len());
    let mut bytes = 0u64;
    let (mut local_hint, mut remote_hint) = (0, 0);
    let pairs = local_ids
        .range(0..local_ids.len())
        .zip(remote_ids.range(0..remote_ids.len()));
    for (position, (li, ri)) in pairs.enumerate() {
        let lp = find(local, local_ids, li, local_hint, position)?;
        let rp = find(remote, remote_ids, ri, remote_hint, position)?;
        (local_hint, remote_hint) = (lp.row, rp.row);
        let (local_addr, len) = local.descriptor(lp);
        let (remote_addr, remote_len) = remote.descriptor(rp);
        check_lengths(li, len, ri, remote_len)?;
        bytes += len;
        flat.push((local_addr, remote_addr, len));
    }
    Ok((Moves::Flat(flat), bytes))
}

/// Plans pairs of strided lists: the pairs are cut into runs that stay in one row on each
/// side (vLLM's ids are a whole row's blocks, region after region), and each run's ids go to
/// the copy of its pool pair at once. A run that moves the blocks of the run before it in
/// other rows of the same shape (the next layer) is recognised in one pass over its ids.
fn plan_paged(
    local: &DescList,
    local_ids: Indices<'_>,
    remote: &DescList,
    remote_ids: Indices<'_>,
) -> Result<(Vec<PagedCopy>, u64), NixlError> {
    let mut grouper = Grouper::default();
    let mut bytes = 0u64;
    let (mut local_hint, mut remote_hint) = (0, 0);
    let mut last: Option<Run> = None;
    let mut start = 0;
    while start < local_ids.len() {
        let (first_local, first_remote) = (local_ids.get(start), remote_ids.get(start));
        let lp = find(local, local_ids, first_local, local_hint, start)?;
        let rp = find(remote, remote_ids, first_remote, remote_hint, start)?;
        (local_hint, remote_hint) = (lp.row, rp.row);
        let (local_row, remote_row) = (&local.rows()[lp.row], &remote.rows()[rp.row]);
        check_lengths(first_local, local_row.len, first_remote, remote_row.len)?;
        let run = Run {
            start,
            end: start + 1,
            local_first: first_local - lp.k,
            remote_first: first_remote - rp.k,
            local_row: lp.row,
            remote_row: rp.row,
        };
        let (local_pool, remote_pool) = (pool(local, lp.row)?, pool(remote, rp.row)?);
        let twin = last
            .and_then(|previous| run.twin_of(&previous, (local, local_ids), (remote, remote_ids)));
        let run = match twin {
            Some(twin) => {
                grouper.add_twin(local_pool, remote_pool);
                twin
            }
            None => {
                let end = run_end(
                    start,
                    (local_ids, run.local_first, local_row.count),
                    (remote_ids, run.remote_first, remote_row.count),
                );
                // Ids inside a row of at most u32::MAX descriptors fit 32 bits (see `pool`).
                grouper.add(
                    local_pool,
                    local_ids
                        .range(start..end)
                        .map(|id| (id - run.local_first) as u32),
                    remote_pool,
                    remote_ids
                        .range(start..end)
                        .map(|id| (id - run.remote_first) as u32),
                    local_row.len,
                );
                Run { end, ..run }
            }
        };
        bytes += local_row.len * (run.end - run.start) as u64;
        last = Some(run);
        start = run.end;
    }
    Ok((grouper.copies(), bytes))
}

/// Where the run of pairs from `start` ends: the first pair whose local or remote id leaves its
/// side's row (`(ids, the row's first id, the row's count)`), or the end.
fn run_end(start: usize, local: (Indices<'_>, u64, u64), remote: (Indices<'_>, u64, u64)) -> usize {
    const CHUNK: usize = 64;
    let inside = |id: u64, first: u64, count: u64| id.wrapping_sub(first) < count;
    let len = local.0.len();
    let mut end = start + 1;
    // Whole chunks first, each checked with a fold the compiler vectorizes; the chunk that
    // leaves the rows is then walked pair by pair.
    while end + CHUNK <= len {
        let range = end..end + CHUNK;
        let leaves = local
            .0
            .range(range.clone())
            .zip(remote.0.range(range))
            .fold(false, |out, (l, r)| {
                out | !inside(l, local.1, local.2) | !inside(r, remote.1, remote.2)
            });
        if leaves {
            break;
        }
        end += CHUNK;
    }
    while end < len
        && inside(local.0.get(end), local.1, local.2)
        && inside(remote.0.get(end), remote.1, remote.2)
    {
        end += 1;
    }
    end
}

/// Pairs `start..end` of a transfer that stay in one row on each side.
#[derive(Clone, Copy)]
struct Run {
    start: usize,
    end: usize,
    local_first: u64,
    remote_first: u64,
    local_row: usize,
    remote_row: usize,
}

impl Run {
    /// This run (of which only the first pair is known) taken as long as `previous`, the run
    /// just before it, when it moves the same blocks between other rows of the same shape:
    /// the next layer of a request, as vLLM lists them. Its ids then lie inside its rows
    /// because `previous`'s lay inside rows of the same count.
    fn twin_of(
        &self,
        previous: &Run,
        (local, local_ids): (&DescList, Indices<'_>),
        (remote, remote_ids): (&DescList, Indices<'_>),
    ) -> Option<Run> {
        let len = previous.end - previous.start;
        let end = self.start.checked_add(len)?;
        let same_row_shape = |list: &DescList, a: usize, b: usize| {
            let (a, b) = (&list.rows()[a], &list.rows()[b]);
            a.len == b.len && a.stride == b.stride && a.count == b.count
        };
        let same_ids = |ids: Indices<'_>, first: u64, previous_first: u64| {
            ids.shifted_equal(
                self.start..end,
                previous.start..previous.end,
                first.wrapping_sub(previous_first),
            )
        };
        let twin = end <= local_ids.len()
            && (self.local_row, self.remote_row) != (previous.local_row, previous.remote_row)
            && same_row_shape(local, self.local_row, previous.local_row)
            && same_row_shape(remote, self.remote_row, previous.remote_row)
            && same_ids(local_ids, self.local_first, previous.local_first)
            && same_ids(remote_ids, self.remote_first, previous.remote_first);
        twin.then_some(Run { end, ..*self })
    }
}

/// Where descriptor `index` (at `position` of `ids`) of `list` is, or an error naming it.
fn find(
    list: &DescList,
    ids: Indices<'_>,
    index: u64,
    hint: usize,
    position: usize,
) -> Result<Place, NixlError> {
    let side = ids.side;
    list.place(index, hint).ok_or_else(|| {
        let problem = if (index as i64) < 0 {
            format!("{side} index {} (position {position}) is negative; descriptor indices count from 0", index as i64)
        } else {
            format!(
                "{side} index {index} (position {position}) is past the {} descriptors of the {side} list",
                list.len()
            )
        };
        NixlError::InvalidParam(problem)
    })
}

/// Paired descriptors must be of one length.
fn check_lengths(local: u64, len: u64, remote: u64, remote_len: u64) -> Result<(), NixlError> {
    if len == remote_len {
        Ok(())
    } else {
        Err(NixlError::Mismatch(format!(
            "local descriptor {local} is {len} bytes and remote descriptor {remote} {remote_len}; paired descriptors must be of one length"
        )))
    }
}

/// Row `row` of `list` as a pool of blocks.
fn pool(list: &DescList, row: usize) -> Result<Pool, NixlError> {
    let row_of = &list.rows()[row];
    if row_of.count > u64::from(u32::MAX) {
        return Err(NixlError::InvalidParam(format!(
            "row {row} holds more blocks than 32-bit ids name"
        )));
    }
    let stride = if row_of.count == 1 {
        row_of.len
    } else {
        row_of.stride
    };
    Ok(Pool {
        base: row_of.addr,
        stride,
        blocks: row_of.count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(rows: &[[u64; 5]]) -> DescList {
        let raw: Vec<u8> = rows
            .iter()
            .flat_map(|row| row.iter().flat_map(|value| value.to_ne_bytes()))
            .collect();
        DescList::decode(&raw, 5).expect("valid")
    }

    const BLOCK: u64 = 4096;

    /// `values` as the bytes Python passes, kept alive for the test's `Indices`.
    fn ids(values: &[u64], side: &'static str) -> Indices<'static> {
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|value| value.to_ne_bytes())
            .collect();
        let bytes: &'static [u8] = bytes.leak();
        Indices::new(bytes, bytes.len(), side).expect("whole words")
    }

    #[test]
    fn vllm_ids_over_every_region_become_one_paged_copy() {
        // Two regions (layers) of 8 blocks each side; vLLM's ids are region * 8 + block.
        let local = list(&[
            [0x10_0000, BLOCK, 0, BLOCK, 8],
            [0x20_0000, BLOCK, 0, BLOCK, 8],
        ]);
        let remote = list(&[
            [0x90_0000, BLOCK, 0, BLOCK, 8],
            [0xa0_0000, BLOCK, 0, BLOCK, 8],
        ]);
        let blocks = [(3u64, 1u64), (4, 7)];
        let local_ids: Vec<u64> = (0..2)
            .flat_map(|r| blocks.map(|(l, _)| r * 8 + l))
            .collect();
        let remote_ids: Vec<u64> = (0..2)
            .flat_map(|r| blocks.map(|(_, p)| r * 8 + p))
            .collect();
        let (moves, bytes) = plan(
            &local,
            ids(&local_ids, "local"),
            &remote,
            ids(&remote_ids, "remote"),
        )
        .expect("planned");
        assert_eq!(bytes, 4 * BLOCK);
        let Moves::Paged(copies) = moves else {
            panic!("strided lists are planned as paged copies");
        };
        assert_eq!(copies.len(), 1);
        assert_eq!(&*copies[0].local_ids, &[3, 4]);
        assert_eq!(&*copies[0].remote_ids, &[1, 7]);
        assert_eq!(
            copies[0].pools,
            vec![(0x10_0000, 0x90_0000), (0x20_0000, 0xa0_0000)]
        );
    }

    #[test]
    fn slices_at_an_offset_keep_the_remote_stride() {
        // Heterogeneous TP: the remote rows read half a block at an offset.
        let local = list(&[[0x10_0000, BLOCK / 2, 0, BLOCK / 2, 8]]);
        let remote = list(&[[0x90_0000 + BLOCK / 2, BLOCK / 2, 0, BLOCK, 8]]);
        let (moves, _) =
            plan(&local, ids(&[2], "local"), &remote, ids(&[5], "remote")).expect("planned");
        let Moves::Paged(copies) = moves else {
            panic!("paged");
        };
        assert_eq!(copies[0].remote.block_stride, BLOCK);
        assert_eq!(copies[0].local.block_stride, BLOCK / 2);
        assert_eq!(copies[0].pools, vec![(0x10_0000, 0x90_0000 + BLOCK / 2)]);
    }

    #[test]
    fn bad_pairs_are_refused() {
        let local = list(&[[0x1000, 64, 0, 64, 4]]);
        let remote = list(&[[0x9000, 32, 0, 32, 4]]);
        let one = |value: u64, side| ids(&[value], side);
        let mismatch =
            plan(&local, one(0, "local"), &remote, one(0, "remote")).expect_err("lengths differ");
        assert!(matches!(mismatch, NixlError::Mismatch(_)), "{mismatch}");
        let same = list(&[[0x9000, 64, 0, 64, 4]]);
        assert!(matches!(
            plan(&local, one(4, "local"), &same, one(0, "remote")),
            Err(NixlError::InvalidParam(_))
        ));
        assert!(matches!(
            plan(&local, ids(&[0, 1], "local"), &same, one(0, "remote")),
            Err(NixlError::InvalidParam(_))
        ));
        assert!(matches!(
            plan(&local, ids(&[], "local"), &same, ids(&[], "remote")),
            Err(NixlError::InvalidParam(_))
        ));
        let flat_words: Vec<u8> = [0x9000u64, 64, 0, 0x9040, 64, 0]
            .iter()
            .flat_map(|value| value.to_ne_bytes())
            .collect();
        let flat = DescList::decode(&flat_words, 3).expect("valid");
        for remote in [&same, &flat] {
            let negative = ids(&[1, (-1i64) as u64], "local");
            let refused = plan(&local, negative, remote, ids(&[0, 1], "remote"))
                .map_err(|error| error.to_string());
            assert!(
                refused
                    .as_ref()
                    .is_err_and(|text| text.contains("local index -1 (position 1) is negative")),
                "{refused:?}"
            );
        }
        assert!(Indices::new(&[0; 9], 9, "local").is_err());
        assert!(Indices::new(&[0; 8], 16, "local").is_err());
        let two = [7i64, 9].map(i64::to_ne_bytes).concat();
        assert_eq!(Indices::new(&two, 8, "local").expect("valid").len(), 1);
    }

    /// Every pair a plan moves, as `(local address, remote address, length)`, sorted.
    fn moved(moves: Moves) -> Vec<Entry> {
        let mut out = match moves {
            Moves::Flat(entries) => entries,
            Moves::Paged(copies) => copies
                .iter()
                .flat_map(|copy| {
                    copy.pools.iter().flat_map(move |&(local, remote)| {
                        copy.local_ids
                            .iter()
                            .zip(copy.remote_ids.iter())
                            .map(move |(&l, &r)| {
                                (
                                    local + u64::from(l) * copy.local.block_stride,
                                    remote + u64::from(r) * copy.remote.block_stride,
                                    copy.len,
                                )
                            })
                    })
                })
                .collect(),
        };
        out.sort_unstable();
        out
    }

    #[test]
    fn paged_plans_move_exactly_the_pairs_named_whatever_their_order() {
        // Four rows of 8 blocks per side; requests that follow vLLM's order, that break it
        // half-way (a layer with one block changed, a row left early, a row revisited), and
        // random ones. The paged plan must move exactly the pairs a descriptor-by-descriptor
        // walk finds.
        let rows = |base: u64| -> Vec<[u64; 5]> {
            (0..4)
                .map(|r| [base + r * 0x10_0000, BLOCK, 0, BLOCK, 8])
                .collect()
        };
        let (local, remote) = (list(&rows(0x100_0000)), list(&rows(0x900_0000)));
        let vllm = |blocks: &[(u64, u64)]| -> (Vec<u64>, Vec<u64>) {
            (0..4)
                .flat_map(|r| blocks.iter().map(move |&(l, p)| (r * 8 + l, r * 8 + p)))
                .unzip()
        };
        let mut requests = vec![vllm(&[(1, 2), (3, 4), (5, 0)])];
        let (mut l, mut r) = vllm(&[(1, 2), (3, 4)]);
        l[5] = 8 + 7;
        requests.push((l, r.clone()));
        r.truncate(5);
        requests.push((vec![1, 3, 9, 11, 10], r));
        requests.push((vec![1, 2, 9, 10, 3, 4], vec![1, 2, 9, 10, 11, 12]));
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200 {
            let mut next = |bound: u64| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed % bound
            };
            let len = 1 + next(40) as usize;
            let (l, r): (Vec<u64>, Vec<u64>) = (0..len).map(|_| (next(32), next(32))).unzip();
            requests.push((l, r));
        }
        for (l, r) in requests {
            let expected: Vec<Entry> = {
                let mut pairs: Vec<Entry> = l
                    .iter()
                    .zip(&r)
                    .map(|(&li, &ri)| {
                        let place = |list: &DescList, id| list.place(id, 0).expect("in the list");
                        let (la, len) = local.descriptor(place(&local, li));
                        (la, remote.descriptor(place(&remote, ri)).0, len)
                    })
                    .collect();
                pairs.sort_unstable();
                pairs
            };
            let (moves, bytes) =
                plan(&local, ids(&l, "local"), &remote, ids(&r, "remote")).expect("planned");
            assert_eq!(bytes, BLOCK * l.len() as u64);
            assert_eq!(moved(moves), expected, "local {l:?} remote {r:?}");
        }
    }
}
