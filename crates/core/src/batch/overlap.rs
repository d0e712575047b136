//! The check that no read of a batch lands on bytes another of its entries uses: two reads
//! into one byte, or a read into a byte a write sends, would race.
//!
//! Entries of servers lie on a grid (whole blocks of a pool), so the usual answer comes from
//! one bitmap per region over the grid of its entries, in time linear in the entries; batches
//! whose grid would need too large a bitmap, and batches where the bitmaps found an overlap
//! (to name the entry the same way every time), are sorted by offset instead.

use super::plan::Gcd;
use super::Entry;
use crate::transport::Direction;

/// Grid cells a region's bitmaps may hold per entry of the region, beyond [`SPARE_CELLS`]:
/// past that the entries are too sparse on their grid for bitmaps to beat sorting.
const CELLS_PER_ENTRY: u64 = 64;

/// Grid cells every region's bitmaps may hold whatever its entries.
const SPARE_CELLS: u64 = 1 << 16;

/// The index of an entry whose local range overlaps another's where at least one of the two
/// reads into it, if any. Writes may share source bytes freely.
pub(super) fn read_overlap(entries: &[Entry]) -> Option<usize> {
    if entries
        .iter()
        .all(|entry| entry.direction == Direction::Write)
    {
        return None;
    }
    match grid_overlap(entries) {
        Some(false) => None,
        _ => sorted_overlap(entries),
    }
}

/// One region's entries on their grid.
#[derive(Default, Clone)]
struct Grid {
    /// The greatest common divisor of every offset and length: a cell of the grid.
    cell: Gcd,
    /// The end of the furthest entry.
    end: u64,
    entries: u64,
    /// Cells some read lands in, and cells some write sends from.
    read: Vec<u64>,
    written: Vec<u64>,
}

/// Whether a read overlaps another entry, from bitmaps over each region's grid; `None` when a
/// region's bitmaps would be too large for its entries.
fn grid_overlap(entries: &[Entry]) -> Option<bool> {
    let mut grids: Vec<Grid> = Vec::new();
    for entry in entries {
        let region = entry.region as usize;
        if region >= grids.len() {
            grids.resize(region + 1, Grid::default());
        }
        let grid = &mut grids[region];
        grid.cell.fold(entry.offset);
        grid.cell.fold(entry.len);
        grid.end = grid.end.max(entry.offset.checked_add(entry.len)?);
        grid.entries += 1;
    }
    for grid in &mut grids {
        if grid.entries == 0 {
            continue;
        }
        let cells = grid.end.div_ceil(grid.cell.value());
        if cells > CELLS_PER_ENTRY.saturating_mul(grid.entries) + SPARE_CELLS {
            return None;
        }
        let words = usize::try_from(cells.div_ceil(64)).ok()?;
        grid.read = vec![0; words];
        grid.written = vec![0; words];
    }
    for entry in entries {
        let grid = &mut grids[entry.region as usize];
        let first = grid.cell.quotient(entry.offset);
        let end = first + grid.cell.quotient(entry.len);
        let clash = match entry.direction {
            Direction::Read => {
                any_set(&grid.read, first, end) || any_set(&grid.written, first, end)
            }
            Direction::Write => any_set(&grid.read, first, end),
        };
        if clash {
            return Some(true);
        }
        let bits = match entry.direction {
            Direction::Read => &mut grid.read,
            Direction::Write => &mut grid.written,
        };
        set(bits, first, end);
    }
    Some(false)
}

/// The mask of bits `from..to` of one word (`to <= 64`).
fn mask(from: u64, to: u64) -> u64 {
    let high = if to == 64 { u64::MAX } else { (1 << to) - 1 };
    high & !((1u64 << from) - 1)
}

/// Calls `each(word, mask)` for the words and bits of cells `first..end`.
fn words(first: u64, end: u64, mut each: impl FnMut(usize, u64) -> bool) -> bool {
    let mut cell = first;
    while cell < end {
        let word = cell / 64;
        let to = (end - word * 64).min(64);
        if each(word as usize, mask(cell % 64, to)) {
            return true;
        }
        cell = (word + 1) * 64;
    }
    false
}

/// Whether any of cells `first..end` is set.
fn any_set(bits: &[u64], first: u64, end: u64) -> bool {
    words(first, end, |word, mask| bits[word] & mask != 0)
}

/// Sets cells `first..end`.
fn set(bits: &mut [u64], first: u64, end: u64) {
    words(first, end, |word, mask| {
        bits[word] |= mask;
        false
    });
}

/// The index of an entry whose local range overlaps another's where at least one of the two
/// reads into it, if any. Writes may share source bytes freely.
fn sorted_overlap(entries: &[Entry]) -> Option<usize> {
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by_key(|&index| (entries[index].region, entries[index].offset));
    // The entry reaching furthest so far in the current region: any entry starting before its
    // end overlaps it, and an earlier read overlapping a later entry is always found here.
    let mut furthest: Option<(u32, u64, bool)> = None;
    for index in order {
        let entry = &entries[index];
        let read = entry.direction == Direction::Read;
        let end = entry.offset + entry.len;
        match furthest {
            Some((region, reach, reach_read)) if region == entry.region && entry.offset < reach => {
                if read || reach_read {
                    return Some(index);
                }
                if end > reach {
                    furthest = Some((region, end, read));
                }
            }
            _ => furthest = Some((entry.region, end, read)),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(direction: Direction, region: u32, offset: u64, len: u64) -> Entry {
        Entry {
            direction,
            region,
            offset,
            remote_addr: 0,
            len,
        }
    }

    #[test]
    fn masks_cover_their_bits() {
        assert_eq!(mask(0, 64), u64::MAX);
        assert_eq!(mask(3, 5), 0b11000);
        assert_eq!(mask(63, 64), 1 << 63);
        let mut bits = vec![0u64; 3];
        set(&mut bits, 60, 130);
        assert_eq!(bits, [mask(60, 64), u64::MAX, mask(0, 2)]);
        assert!(any_set(&bits, 129, 140));
        assert!(!any_set(&bits, 130, 192));
        assert!(!any_set(&bits, 0, 60));
    }

    #[test]
    fn the_grid_and_the_sort_agree_on_random_batches() {
        // A fixed xorshift sequence: the same batches on every run.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut below = |bound: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % bound
        };
        for round in 0..2000 {
            let count = 1 + below(23);
            let unit = [16, 64, 100][round % 3];
            let entries: Vec<Entry> = (0..count)
                .map(|_| {
                    let direction = match below(2) {
                        0 => Direction::Read,
                        _ => Direction::Write,
                    };
                    let region = below(3) as u32;
                    let offset = below(64) * unit;
                    entry(direction, region, offset, (1 + below(3)) * unit)
                })
                .collect();
            let grid = grid_overlap(&entries).expect("small grids");
            assert_eq!(
                grid,
                sorted_overlap(&entries).is_some(),
                "round {round}: {:?}",
                entries
                    .iter()
                    .map(|e| (e.direction, e.region, e.offset, e.len))
                    .collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn a_sparse_grid_is_left_to_the_sort() {
        let entries = [
            entry(Direction::Read, 0, 0, 64),
            entry(Direction::Read, 0, 1 << 40, 64),
        ];
        assert_eq!(grid_overlap(&entries), None);
        assert_eq!(read_overlap(&entries), None);
    }
}
