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

/// Decodes the descriptor indices of an index array (native-endian `i64`s) into `out`, which
/// the caller keeps from one request to the next: a fresh allocation of a request's indices
/// costs more in page faults than the planning.
pub(crate) fn indices_into(bytes: &[u8], side: &str, out: &mut Vec<u64>) -> Result<(), NixlError> {
    if bytes.len() % 8 != 0 {
        return Err(NixlError::InvalidParam(format!(
            "the {side} indices are {} bytes, not whole 64-bit integers",
            bytes.len()
        )));
    }
    out.clear();
    // A plain pass and a separate sign check let the compiler vectorize both.
    out.extend(bytes.chunks_exact(8).map(|word| {
        let mut value = [0u8; 8];
        value.copy_from_slice(word);
        i64::from_ne_bytes(value) as u64
    }));
    if out
        .iter()
        .fold(false, |negative, &value| negative | ((value as i64) < 0))
    {
        let position = out
            .iter()
            .position(|&value| (value as i64) < 0)
            .unwrap_or_default();
        return Err(NixlError::InvalidParam(format!(
            "{side} index {position} is negative; descriptor indices count from 0"
        )));
    }
    Ok(())
}

/// Plans descriptors `local_ids[i]` of `local` with `remote_ids[i]` of `remote`.
pub(crate) fn plan(
    local: &DescList,
    local_ids: &[u64],
    remote: &DescList,
    remote_ids: &[u64],
) -> Result<(Moves, u64), NixlError> {
    if local_ids.len() != remote_ids.len() {
        return Err(NixlError::InvalidParam(format!(
            "{} local indices against {} remote ones; pass one remote descriptor per local one",
            local_ids.len(),
            remote_ids.len()
        )));
    }
    if local_ids.is_empty() {
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
    for (position, (&li, &ri)) in local_ids.iter().zip(remote_ids).enumerate() {
        let lp = find(local, li, local_hint, "local", position)?;
        let rp = find(remote, ri, remote_hint, "remote", position)?;
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
/// the copy of its pool pair at once.
fn plan_paged(
    local: &DescList,
    local_ids: &[u64],
    remote: &DescList,
    remote_ids: &[u64],
) -> Result<(Vec<PagedCopy>, u64), NixlError> {
    let mut grouper = Grouper::default();
    let mut bytes = 0u64;
    let (mut local_hint, mut remote_hint) = (0, 0);
    let mut last: Option<Run> = None;
    let mut start = 0;
    while start < local_ids.len() {
        let lp = find(local, local_ids[start], local_hint, "local", start)?;
        let rp = find(remote, remote_ids[start], remote_hint, "remote", start)?;
        (local_hint, remote_hint) = (lp.row, rp.row);
        let (local_row, remote_row) = (&local.rows()[lp.row], &remote.rows()[rp.row]);
        check_lengths(
            local_ids[start],
            local_row.len,
            remote_ids[start],
            remote_row.len,
        )?;
        let run = Run {
            start,
            end: start + 1,
            local_first: local_ids[start] - lp.k,
            remote_first: remote_ids[start] - rp.k,
            local_row: lp.row,
            remote_row: rp.row,
        };
        let end = run_end(
            start,
            (local_ids, run.local_first, local_row.count),
            (remote_ids, run.remote_first, remote_row.count),
        );
        let run = Run { end, ..run };
        let (local_pool, remote_pool) = (pool(local, lp.row)?, pool(remote, rp.row)?);
        match last {
            Some(previous) if run.twin_of(&previous, local, local_ids, remote, remote_ids) => {
                grouper.add_twin(local_pool, remote_pool);
            }
            _ => {
                // Ids inside a row of at most u32::MAX descriptors fit 32 bits (see `pool`).
                grouper.add(
                    local_pool,
                    local_ids[start..end]
                        .iter()
                        .map(|&id| (id - run.local_first) as u32),
                    remote_pool,
                    remote_ids[start..end]
                        .iter()
                        .map(|&id| (id - run.remote_first) as u32),
                    local_row.len,
                );
            }
        }
        bytes += local_row.len * (end - start) as u64;
        last = Some(run);
        start = end;
    }
    Ok((grouper.copies(), bytes))
}

/// Where the run of pairs from `start` ends: the first pair whose local or remote id leaves its
/// side's row (`(ids, the row's first id, the row's count)`), or the end.
fn run_end(start: usize, local: (&[u64], u64, u64), remote: (&[u64], u64, u64)) -> usize {
    const CHUNK: usize = 64;
    let inside = |index: usize| {
        local.0[index].wrapping_sub(local.1) < local.2
            && remote.0[index].wrapping_sub(remote.1) < remote.2
    };
    let len = local.0.len();
    let mut end = start + 1;
    // Whole chunks first, each checked with a fold the compiler vectorizes; the chunk that
    // leaves the rows is then walked pair by pair.
    while end + CHUNK <= len {
        let leaves = (end..end + CHUNK).fold(false, |out, index| out | !inside(index));
        if leaves {
            break;
        }
        end += CHUNK;
    }
    while end < len && inside(end) {
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
    /// Whether this run moves the same blocks as `previous` (the run just before it) between
    /// other rows of the same shape: the next layer of a request, as vLLM lists them.
    fn twin_of(
        &self,
        previous: &Run,
        local: &DescList,
        local_ids: &[u64],
        remote: &DescList,
        remote_ids: &[u64],
    ) -> bool {
        let same_row_shape = |list: &DescList, a: usize, b: usize| {
            let (a, b) = (&list.rows()[a], &list.rows()[b]);
            a.len == b.len && a.stride == b.stride && a.count == b.count
        };
        // A fold over every pair rather than a search that stops at the first difference: the
        // compiler turns it into vector instructions, and twins, the usual case, are read whole.
        let same_ids = |ids: &[u64], first: u64, previous_first: u64| {
            ids[self.start..self.end]
                .iter()
                .zip(&ids[previous.start..previous.end])
                .fold(0, |differ, (&id, &before)| {
                    differ | (id.wrapping_sub(first) ^ before.wrapping_sub(previous_first))
                })
                == 0
        };
        self.end - self.start == previous.end - previous.start
            && (self.local_row, self.remote_row) != (previous.local_row, previous.remote_row)
            && same_row_shape(local, self.local_row, previous.local_row)
            && same_row_shape(remote, self.remote_row, previous.remote_row)
            && same_ids(local_ids, self.local_first, previous.local_first)
            && same_ids(remote_ids, self.remote_first, previous.remote_first)
    }
}

/// Where descriptor `index` of `list` is, or an error naming it.
fn find(
    list: &DescList,
    index: u64,
    hint: usize,
    side: &str,
    position: usize,
) -> Result<Place, NixlError> {
    list.place(index, hint).ok_or_else(|| {
        NixlError::InvalidParam(format!(
            "{side} index {index} (position {position}) is past the {} descriptors of the {side} list",
            list.len()
        ))
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
        let (moves, bytes) = plan(&local, &local_ids, &remote, &remote_ids).expect("planned");
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
        let (moves, _) = plan(&local, &[2], &remote, &[5]).expect("planned");
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
        let mismatch = plan(&local, &[0], &remote, &[0]).expect_err("lengths differ");
        assert!(matches!(mismatch, NixlError::Mismatch(_)), "{mismatch}");
        let same = list(&[[0x9000, 64, 0, 64, 4]]);
        assert!(matches!(
            plan(&local, &[4], &same, &[0]),
            Err(NixlError::InvalidParam(_))
        ));
        assert!(matches!(
            plan(&local, &[0, 1], &same, &[0]),
            Err(NixlError::InvalidParam(_))
        ));
        assert!(matches!(
            plan(&local, &[], &same, &[]),
            Err(NixlError::InvalidParam(_))
        ));
        let mut out = vec![3];
        let negative = [7i64, -1].map(i64::to_ne_bytes).concat();
        let refused = indices_into(&negative, "local", &mut out).map_err(|error| error.to_string());
        assert!(
            refused
                .as_ref()
                .is_err_and(|text| text.contains("local index 1 is negative")),
            "{refused:?}"
        );
        assert!(indices_into(&[0; 9], "local", &mut out).is_err());
        indices_into(&7i64.to_ne_bytes(), "local", &mut out).expect("valid");
        assert_eq!(out, vec![7]);
    }
}
