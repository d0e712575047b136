//! The checks `Batch::submit` makes on its entries before anything moves, on entries built in
//! memory.

use super::{check_ranges, read_overlap, Entry};
use crate::error::RangeError;
use crate::memory::{Location, RegionEntry, RegionInfo};
use crate::transport::Direction;
use std::sync::Arc;

/// The same remote address for every entry: the checks look at local ranges only.
const REMOTE: u64 = 0x2000_0000;

fn entry(direction: Direction, region: u32, offset: u64, len: u64) -> Entry {
    Entry {
        direction,
        region,
        offset,
        remote_addr: REMOTE,
        len,
    }
}

fn write(offset: u64, len: u64) -> Entry {
    entry(Direction::Write, 0, offset, len)
}

fn read(offset: u64, len: u64) -> Entry {
    entry(Direction::Read, 0, offset, len)
}

/// Registrations of the given lengths, back to back, as a batch's regions 0, 1, ...
fn regions(lens: &[u64]) -> Vec<Arc<RegionEntry>> {
    let mut addr = 0x1000_0000;
    lens.iter()
        .enumerate()
        .map(|(sequence, &len)| {
            let info = RegionInfo {
                addr,
                len,
                location: Location::Host { pinned: false },
            };
            addr += len;
            Arc::new(RegionEntry::new(
                info,
                sequence as u64,
                1,
                Vec::new(),
                Vec::new(),
                None,
            ))
        })
        .collect()
}

#[test]
fn a_read_into_bytes_another_entry_uses_is_named_by_the_later_start() {
    assert_eq!(read_overlap(&[write(0, 0x100), read(0x80, 0x100)]), Some(1));
    // Sorted by offset, the write starts inside the read, so the write is named.
    assert_eq!(read_overlap(&[write(0x80, 0x100), read(0, 0x100)]), Some(0));
    assert_eq!(read_overlap(&[read(0, 0x100), read(0, 0x100)]), Some(1));
}

#[test]
fn writes_may_share_source_bytes() {
    let entries = [write(0, 0x100), write(0x80, 0x100), write(0, 0x100)];
    assert_eq!(read_overlap(&entries), None);
}

#[test]
fn ranges_that_only_touch_do_not_overlap() {
    assert_eq!(read_overlap(&[read(0x100, 0x100), read(0, 0x100)]), None);
    assert_eq!(read_overlap(&[write(0, 0x100), read(0x100, 0x100)]), None);
}

#[test]
fn the_same_offsets_in_two_regions_do_not_overlap() {
    let entries = [
        entry(Direction::Read, 0, 0, 0x100),
        entry(Direction::Read, 1, 0, 0x100),
    ];
    assert_eq!(read_overlap(&entries), None);
}

#[test]
fn an_overlap_with_a_long_earlier_entry_is_found_past_short_ones_between() {
    // The short write ends long before the read starts; the long one reaches past it.
    let entries = [write(0, 0x1000), write(0x10, 0x10), read(0x800, 0x100)];
    assert_eq!(read_overlap(&entries), Some(2));
    let entries = [read(0, 0x1000), write(0x10, 0x10), write(0x800, 0x100)];
    assert_eq!(read_overlap(&entries), Some(1));
}

#[test]
fn reads_of_the_same_remote_bytes_into_separate_places_do_not_overlap() {
    // Every entry reads from REMOTE: only the local ranges race.
    assert_eq!(read_overlap(&[read(0, 0x100), read(0x100, 0x100)]), None);
}

#[test]
fn a_zero_length_entry_is_refused_by_its_index() {
    let entries = [write(0, 0x10), read(0x100, 0)];
    assert_eq!(
        check_ranges(&entries, &regions(&[0x1000])),
        Err(RangeError::ZeroLength { index: 1 })
    );
}

#[test]
fn a_range_up_to_its_regions_end_passes_and_one_byte_more_is_refused() {
    let regions = regions(&[0x1000, 0x100]);
    assert_eq!(check_ranges(&[write(0xf00, 0x100)], &regions), Ok(()));
    assert_eq!(
        check_ranges(&[write(0, 0x10), write(0xf00, 0x101)], &regions),
        Err(RangeError::PastRegionEnd {
            index: 1,
            offset: 0xf00,
            len: 0x101,
            region_len: 0x1000,
        })
    );
    // Checked against the entry's own region, the shorter second one.
    assert_eq!(
        check_ranges(&[entry(Direction::Read, 1, 0x80, 0x100)], &regions),
        Err(RangeError::PastRegionEnd {
            index: 0,
            offset: 0x80,
            len: 0x100,
            region_len: 0x100,
        })
    );
}

#[test]
fn an_offset_whose_end_wraps_is_past_the_end_not_a_panic() {
    assert_eq!(
        check_ranges(&[write(u64::MAX, 2)], &regions(&[0x1000])),
        Err(RangeError::PastRegionEnd {
            index: 0,
            offset: u64::MAX,
            len: 2,
            region_len: 0x1000,
        })
    );
}
