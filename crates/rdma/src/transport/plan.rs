//! Turns a transfer's validated ranges into work requests: long entries sliced, short
//! entries that continue each other on the peer's side packed into one request's
//! scatter-gather list. Pure, so it is tested on its own.

use ferry_core::Direction;

/// One validated range of a transfer, with the index of its (local region, peer buffer)
/// pair, which decides the keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) direction: Direction,
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
    pub(crate) keys: usize,
}

/// One work request to post: local ranges gathered (WRITE) or scattered (READ) against one
/// contiguous peer range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkItem {
    pub(crate) direction: Direction,
    /// Local ranges in order: (address, bytes).
    pub(crate) sges: Vec<(u64, u32)>,
    pub(crate) remote: u64,
    pub(crate) len: u64,
    pub(crate) keys: usize,
}

impl WorkItem {
    fn start(piece: &Piece, len: u64) -> WorkItem {
        WorkItem {
            direction: piece.direction,
            sges: vec![(piece.local, len as u32)],
            remote: piece.remote,
            len,
            keys: piece.keys,
        }
    }

    /// Adds `len` bytes of `piece` when they continue this request on the peer's side and
    /// fit; false when they must start a new request.
    fn extend(&mut self, piece: &Piece, len: u64, slice: u64, max_sge: usize) -> bool {
        if piece.direction != self.direction
            || piece.keys != self.keys
            || self.remote + self.len != piece.remote
            || self.len + len > slice
        {
            return false;
        }
        let count = self.sges.len();
        match self.sges.last_mut() {
            Some((addr, bytes)) if *addr + u64::from(*bytes) == piece.local => {
                *bytes += len as u32;
            }
            _ if count < max_sge => self.sges.push((piece.local, len as u32)),
            _ => return false,
        }
        self.len += len;
        true
    }
}

/// The work requests that move `pieces`: none longer than `slice` bytes (at most 1 GiB, so a
/// length fits a verbs SG entry), none with more than `max_sge` local ranges.
pub(crate) fn plan(pieces: &[Piece], slice: u64, max_sge: usize) -> Vec<WorkItem> {
    let mut items: Vec<WorkItem> = Vec::new();
    for piece in pieces {
        let mut offset = 0;
        while offset < piece.len {
            let len = (piece.len - offset).min(slice);
            let part = Piece {
                local: piece.local + offset,
                remote: piece.remote + offset,
                len,
                ..*piece
            };
            let packed = items
                .last_mut()
                .is_some_and(|item| item.extend(&part, len, slice, max_sge));
            if !packed {
                items.push(WorkItem::start(&part, len));
            }
            offset += len;
        }
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(local: u64, remote: u64, len: u64) -> Piece {
        Piece {
            direction: Direction::Write,
            local,
            remote,
            len,
            keys: 0,
        }
    }

    fn bytes(items: &[WorkItem]) -> u64 {
        items.iter().map(|item| item.len).sum()
    }

    #[test]
    fn a_long_entry_is_sliced_into_requests_of_the_slice_size() {
        let items = plan(&[write(0x1000, 0x9000, 10 * 1024 + 5)], 4096, 16);
        assert_eq!(items.len(), 3);
        assert_eq!(items[0].sges, vec![(0x1000, 4096)]);
        assert_eq!(items[1].remote, 0x9000 + 4096);
        assert_eq!(items[2].len, 2048 + 5);
        assert_eq!(bytes(&items), 10 * 1024 + 5);
    }

    #[test]
    fn short_entries_contiguous_at_the_peer_share_one_request_as_a_gather_list() {
        // Paged blocks scattered locally, landing back to back at the peer.
        let pieces = [
            write(0x10_000, 0x90_000, 512),
            write(0x30_000, 0x90_200, 512),
            write(0x20_000, 0x90_400, 512),
        ];
        let items = plan(&pieces, 1 << 20, 16);
        assert_eq!(items.len(), 1);
        assert_eq!(
            items[0].sges,
            vec![(0x10_000, 512), (0x30_000, 512), (0x20_000, 512)]
        );
        assert_eq!((items[0].remote, items[0].len), (0x90_000, 1536));
    }

    #[test]
    fn ranges_contiguous_on_both_sides_merge_into_one_sg_entry() {
        let items = plan(
            &[write(0x1000, 0x9000, 100), write(0x1064, 0x9064, 100)],
            4096,
            1,
        );
        assert_eq!(
            items,
            vec![WorkItem {
                sges: vec![(0x1000, 200)],
                ..WorkItem::start(&write(0x1000, 0x9000, 200), 200)
            }]
        );
    }

    #[test]
    fn packing_stops_at_the_sge_limit_the_slice_a_gap_another_key_or_direction() {
        let gathered: Vec<Piece> = (0..5)
            .map(|i| write(0x10_000 * (i + 1), 0x1000 + 64 * i, 64))
            .collect();
        let items = plan(&gathered, 1 << 20, 2);
        assert_eq!(
            items.iter().map(|item| item.sges.len()).collect::<Vec<_>>(),
            vec![2, 2, 1]
        );

        let sliced = plan(
            &[write(0x10_000, 0, 3000), write(0x30_000, 3000, 3000)],
            4096,
            16,
        );
        assert_eq!(sliced.len(), 2);
        assert_eq!(bytes(&sliced), 6000);

        let gap = plan(
            &[write(0x10_000, 0, 64), write(0x30_000, 128, 64)],
            4096,
            16,
        );
        assert_eq!(gap.len(), 2);

        let mut other_keys = write(0x30_000, 64, 64);
        other_keys.keys = 1;
        assert_eq!(
            plan(&[write(0x10_000, 0, 64), other_keys], 4096, 16).len(),
            2
        );

        let mut read = write(0x30_000, 64, 64);
        read.direction = Direction::Read;
        assert_eq!(plan(&[write(0x10_000, 0, 64), read], 4096, 16).len(), 2);
    }
}
