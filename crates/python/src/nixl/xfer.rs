//! A prepared transfer (`make_prepped_xfer`): descriptor pairs from two prepared lists,
//! planned once into ferry's moves, and posted as often as the caller likes.
//!
//! Lists given in NIXL's strided form are pools of blocks: each pair of descriptors becomes a
//! block id of its row on each side, and rows that move the same ids share one paged copy, so
//! vLLM's ids (`region * blocks + block`, the same blocks in every region) become one copy
//! over every layer. Other lists become flat entries, which the session's planner still turns
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

/// The descriptor indices of an index array: native-endian `i64`s.
pub(crate) fn indices(bytes: &[u8], side: &str) -> Result<Vec<u64>, NixlError> {
    if bytes.len() % 8 != 0 {
        return Err(NixlError::InvalidParam(format!(
            "the {side} indices are {} bytes, not whole 64-bit integers",
            bytes.len()
        )));
    }
    bytes
        .chunks_exact(8)
        .enumerate()
        .map(|(position, word)| {
            let mut value = [0u8; 8];
            value.copy_from_slice(word);
            u64::try_from(i64::from_ne_bytes(value)).map_err(|_| {
                NixlError::InvalidParam(format!(
                    "{side} index {position} is negative; descriptor indices count from 0"
                ))
            })
        })
        .collect()
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
    let paged = local.strided && remote.strided;
    let mut grouper = Grouper::default();
    let mut flat = Vec::new();
    let mut bytes = 0u64;
    let (mut local_hint, mut remote_hint) = (0, 0);
    for (position, (&li, &ri)) in local_ids.iter().zip(remote_ids).enumerate() {
        let out_of_range = |side: &str, index: u64, list: &DescList| {
            NixlError::InvalidParam(format!(
                "{side} index {index} (position {position}) is past the {} descriptors of the {side} list",
                list.len()
            ))
        };
        let lp = local
            .place(li, local_hint)
            .ok_or_else(|| out_of_range("local", li, local))?;
        let rp = remote
            .place(ri, remote_hint)
            .ok_or_else(|| out_of_range("remote", ri, remote))?;
        (local_hint, remote_hint) = (lp.row, rp.row);
        let (local_addr, len) = local.descriptor(lp);
        let (remote_addr, remote_len) = remote.descriptor(rp);
        if len != remote_len {
            return Err(NixlError::Mismatch(format!(
                "local descriptor {li} is {len} bytes and remote descriptor {ri} {remote_len}; paired descriptors must be of one length"
            )));
        }
        bytes += len;
        if paged {
            let (local_pool, local_id) = pool(local, lp)?;
            let (remote_pool, remote_id) = pool(remote, rp)?;
            grouper.add(local_pool, local_id, remote_pool, remote_id, len);
        } else {
            flat.push((local_addr, remote_addr, len));
        }
    }
    let moves = if paged {
        Moves::Paged(grouper.copies())
    } else {
        Moves::Flat(flat)
    };
    Ok((moves, bytes))
}

/// Descriptor `place`'s row as a pool, and its block id there.
fn pool(list: &DescList, place: Place) -> Result<(Pool, u32), NixlError> {
    let row = &list.rows()[place.row];
    let id = u32::try_from(place.k).map_err(|_| {
        NixlError::InvalidParam(format!(
            "row {} holds more blocks than 32-bit ids name",
            place.row
        ))
    })?;
    let stride = if row.count == 1 { row.len } else { row.stride };
    Ok((
        Pool {
            base: row.addr,
            stride,
            blocks: row.count,
        },
        id,
    ))
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
        assert!(indices(&(-1i64).to_ne_bytes(), "local").is_err());
        assert_eq!(
            indices(&7i64.to_ne_bytes(), "local").expect("valid"),
            vec![7]
        );
    }
}
