//! Entry lists of large batches, kept for the next batches of the engine.
//!
//! A request's flat entries take about a megabyte (40,960 entries of 32 bytes). Allocated
//! afresh for every batch and freed after it, such a list is mostly handed back to the
//! system by the allocator and faulted in again page by page: in measurements that tripled
//! the host cost of every entry. Kept here, a list keeps its pages.

use super::Entry;
use parking_lot::Mutex;

/// Lists kept at most: one per batch in flight at a time is the usual need.
const KEPT: usize = 4;

/// Lists with room for fewer entries than this are not kept: the allocator serves them well.
const SMALLEST_KEPT: usize = 1 << 10;

/// Lists with room for more entries than this (128 MiB) are not kept, so one outsized batch
/// does not hold its memory for the engine's lifetime.
const LARGEST_KEPT: usize = 1 << 22;

/// Entry lists kept for reuse.
#[derive(Default)]
pub(crate) struct Spares {
    lists: Mutex<Vec<Vec<Entry>>>,
}

impl Spares {
    /// An empty list, with the room of a kept one when there is one.
    pub(super) fn take(&self) -> Vec<Entry> {
        self.lists.lock().pop().unwrap_or_default()
    }

    /// Keeps `list`'s room for a later batch, when it is worth keeping and there is space.
    pub(super) fn give(&self, mut list: Vec<Entry>) {
        if !(SMALLEST_KEPT..=LARGEST_KEPT).contains(&list.capacity()) {
            return;
        }
        list.clear();
        let mut lists = self.lists.lock();
        if lists.len() < KEPT {
            lists.push(list);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Direction;

    fn entry() -> Entry {
        Entry {
            direction: Direction::Write,
            region: 0,
            offset: 0,
            remote_addr: 0,
            len: 1,
        }
    }

    #[test]
    fn large_lists_come_back_empty_with_their_room_and_small_ones_are_not_kept() {
        let spares = Spares::default();
        let mut list = spares.take();
        list.resize_with(5000, entry);
        let room = list.capacity();
        spares.give(list);
        let again = spares.take();
        assert!(again.is_empty());
        assert_eq!(again.capacity(), room);
        assert_eq!(spares.take().capacity(), 0, "only one was given");
        spares.give(vec![entry()]);
        assert_eq!(spares.take().capacity(), 0, "a small list is not kept");
        for _ in 0..KEPT + 2 {
            spares.give(Vec::with_capacity(SMALLEST_KEPT));
        }
        assert_eq!(spares.lists.lock().len(), KEPT);
    }
}
