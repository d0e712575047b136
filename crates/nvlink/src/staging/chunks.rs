//! How a staged transfer's ranges are packed into the staging buffer's slots: a pure function,
//! tested without a GPU.

/// One range of a staged transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Its first byte in this process's memory.
    pub(crate) local: u64,
    /// The address the owner registered the buffer holding its owner's range at.
    pub(crate) buffer: u64,
    /// Its first byte in the owner's memory.
    pub(crate) remote: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// The pieces one slot of staging carries at once, each with its offset in the staging buffer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Chunk {
    pub(crate) pieces: Vec<(Piece, u64)>,
}

/// Where in a slot a piece starts: copies of 16-byte aligned blocks stay aligned, and the
/// kernels' plain (not shifted) build copies them.
const ALIGN: u64 = 256;

/// How a staging buffer of `staging_len` bytes (at least [`ALIGN`]; sessions hold 2 MiB or
/// more) is cut when `slots` slots are asked for:
/// `(slot_len, slots)`, at least one slot and no more than leave each slot [`ALIGN`] bytes,
/// each slot a multiple of [`ALIGN`] bytes, all of them inside the buffer.
pub(crate) fn slots_of(staging_len: u64, slots: u64) -> (u64, u64) {
    let slots = slots.clamp(1, (staging_len / ALIGN).max(1));
    (staging_len / slots / ALIGN * ALIGN, slots)
}

/// Packs `pieces`, in order, into chunks of at most `slot_len` bytes and `max_pieces` pieces
/// each (a piece longer than what is left of a slot continues in the next chunk); chunk `k`
/// lies in slot `k % slots` of a staging buffer cut into `slots` slots of `slot_len` bytes
/// ([`slots_of`]). Empty pieces are left out.
pub(crate) fn plan_chunks(
    pieces: impl IntoIterator<Item = Piece>,
    slot_len: u64,
    slots: u64,
    max_pieces: usize,
) -> Vec<Chunk> {
    let max_pieces = max_pieces.max(1);
    let slot_len = slot_len.max(ALIGN) / ALIGN * ALIGN;
    let slots = slots.max(1);
    let mut chunks: Vec<Chunk> = Vec::new();
    let mut current = Chunk::default();
    let mut fill = 0u64;
    let slot_start = |chunk: usize| (chunk as u64 % slots) * slot_len;
    for piece in pieces {
        let mut done = 0;
        while done < piece.len {
            fill = fill.div_ceil(ALIGN) * ALIGN;
            if fill >= slot_len || current.pieces.len() >= max_pieces {
                chunks.push(std::mem::take(&mut current));
                fill = 0;
            }
            let len = (piece.len - done).min(slot_len - fill);
            let part = Piece {
                local: piece.local + done,
                buffer: piece.buffer,
                remote: piece.remote + done,
                len,
            };
            current.pieces.push((part, slot_start(chunks.len()) + fill));
            fill += len;
            done += len;
        }
    }
    if !current.pieces.is_empty() {
        chunks.push(current);
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(at: u64, len: u64) -> Piece {
        Piece {
            local: 0x1000_0000 + at,
            buffer: 0x7000_0000,
            remote: 0x7000_0000 + at,
            len,
        }
    }

    /// Every byte of `pieces` lands once, in order, inside its chunk's slot.
    fn check(pieces: &[Piece], chunks: &[Chunk], slot_len: u64, slots: u64) {
        let mut expected = pieces.iter().filter(|piece| piece.len > 0);
        let mut current = expected.next().copied();
        for (index, chunk) in chunks.iter().enumerate() {
            let slot = (index as u64 % slots) * slot_len;
            let mut used: Vec<(u64, u64)> = Vec::new();
            for (part, staging) in &chunk.pieces {
                assert!(*staging >= slot && staging + part.len <= slot + slot_len);
                assert_eq!(staging % ALIGN, 0);
                assert!(used
                    .iter()
                    .all(|(at, len)| staging + part.len <= *at || at + len <= *staging));
                used.push((*staging, part.len));
                let whole = current.expect("more bytes than pieces");
                assert_eq!(
                    (part.local, part.remote, part.buffer),
                    (whole.local, whole.remote, whole.buffer)
                );
                assert!(part.len <= whole.len && part.len > 0);
                current = match part.len == whole.len {
                    true => expected.next().copied(),
                    false => Some(Piece {
                        local: whole.local + part.len,
                        remote: whole.remote + part.len,
                        len: whole.len - part.len,
                        ..whole
                    }),
                };
            }
        }
        assert_eq!(current, None, "bytes left unplaced");
    }

    #[test]
    fn blocks_fill_slots_in_turn_and_every_byte_lands_once() {
        let pieces: Vec<Piece> = (0..100).map(|block| piece(block * 32768, 32768)).collect();
        let chunks = plan_chunks(pieces.iter().copied(), 1 << 20, 4, usize::MAX);
        assert_eq!(chunks.len(), 4);
        assert_eq!(chunks[0].pieces.len(), 32);
        assert_eq!(chunks[1].pieces[0].1, 1 << 20);
        assert_eq!(chunks[3].pieces.len(), 4);
        check(&pieces, &chunks, 1 << 20, 4);
    }

    #[test]
    fn a_long_range_is_cut_across_chunks_and_slots_wrap() {
        let pieces = [
            piece(0, 10 << 20),
            piece(64 << 20, 100),
            piece(65 << 20, 0),
            piece(66 << 20, 3 << 20),
        ];
        let chunks = plan_chunks(pieces, 2 << 20, 3, usize::MAX);
        check(&pieces, &chunks, 2 << 20, 3);
        assert_eq!(chunks.len(), 7);
        // Chunk 3 wraps back to slot 0.
        assert_eq!(chunks[3].pieces[0].1, 0);
    }

    #[test]
    fn unaligned_lengths_leave_gaps_so_every_piece_starts_aligned() {
        let pieces: Vec<Piece> = (0..50).map(|n| piece(n * 1000, 1000)).collect();
        let chunks = plan_chunks(pieces.iter().copied(), 8192, 2, usize::MAX);
        check(&pieces, &chunks, 8192, 2);
        assert!(chunks.iter().all(|chunk| chunk.pieces.len() <= 8));
    }

    #[test]
    fn nothing_to_move_plans_no_chunk() {
        assert!(plan_chunks([piece(0, 0)], 1 << 20, 4, usize::MAX).is_empty());
        assert!(plan_chunks(std::iter::empty(), 1 << 20, 4, usize::MAX).is_empty());
    }

    #[test]
    fn a_chunk_holds_at_most_max_pieces_even_with_room_left() {
        let pieces: Vec<Piece> = (0..10).map(|n| piece(n * 4096, 16)).collect();
        let chunks = plan_chunks(pieces.iter().copied(), 1 << 20, 2, 4);
        check(&pieces, &chunks, 1 << 20, 2);
        let sizes: Vec<usize> = chunks.iter().map(|chunk| chunk.pieces.len()).collect();
        assert_eq!(sizes, [4, 4, 2]);
    }

    #[test]
    fn slots_stay_inside_the_buffer_and_aligned_however_many_are_asked() {
        assert_eq!(slots_of(256 << 20, 4), (64 << 20, 4));
        assert_eq!(slots_of(256 << 20, 0), (256 << 20, 1));
        // 3 slots of a 2 MiB buffer: aligned down, inside it.
        let (len, slots) = slots_of(2 << 20, 3);
        assert_eq!((len % ALIGN, slots), (0, 3));
        assert!(len * slots <= 2 << 20);
        // Far more slots than 256-byte pieces fit: one per 256 bytes.
        assert_eq!(slots_of(4096, 1000), (256, 16));
    }
}
