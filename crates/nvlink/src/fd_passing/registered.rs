//! What the fd socket hands out or confirms, by the address of the buffer it belongs to.
//!
//! Each entry is held by the registration that made it. An address can be registered twice
//! for a moment (a registration that fails after its transports exported, a re-registration
//! whose old guard drops late): the newest entry answers, and a guard takes out only its own,
//! so neither takes a live buffer's entry with it.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Entries by buffer address, newest last.
pub(crate) struct ByAddress<T> {
    next: AtomicU64,
    entries: Mutex<HashMap<u64, Vec<(u64, T)>>>,
}

impl<T> Default for ByAddress<T> {
    fn default() -> Self {
        ByAddress {
            next: AtomicU64::new(0),
            entries: Mutex::default(),
        }
    }
}

impl<T: Send + 'static> ByAddress<T> {
    /// Adds `value` for the buffer at `addr` until the returned guard drops.
    pub(crate) fn insert(self: &Arc<Self>, addr: u64, value: T) -> Held<T> {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        self.entries
            .lock()
            .entry(addr)
            .or_default()
            .push((token, value));
        Held {
            map: Arc::downgrade(self),
            addr,
            token,
        }
    }

    /// `read` of the newest entry at `addr`, if there is one.
    pub(crate) fn with<R>(&self, addr: u64, read: impl FnOnce(Option<&T>) -> R) -> R {
        let entries = self.entries.lock();
        read(
            entries
                .get(&addr)
                .and_then(|held| held.last())
                .map(|(_, value)| value),
        )
    }
}

/// Keeps one entry of a [`ByAddress`]; dropped when its buffer is deregistered.
pub(crate) struct Held<T> {
    map: Weak<ByAddress<T>>,
    addr: u64,
    token: u64,
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        let Some(map) = self.map.upgrade() else {
            return;
        };
        let mut entries = map.entries.lock();
        if let Some(held) = entries.get_mut(&self.addr) {
            held.retain(|(token, _)| *token != self.token);
            if held.is_empty() {
                entries.remove(&self.addr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_entry_at_an_address_answers_and_each_guard_takes_only_its_own() {
        let map = Arc::new(ByAddress::<u32>::default());
        let live = map.insert(0x1000, 1);
        // A failed second registration of the same buffer comes and goes.
        drop(map.insert(0x1000, 2));
        assert_eq!(map.with(0x1000, |entry| entry.copied()), Some(1));
        // A re-registration whose old guard drops after it.
        let fresh = map.insert(0x1000, 3);
        drop(live);
        assert_eq!(map.with(0x1000, |entry| entry.copied()), Some(3));
        drop(fresh);
        assert_eq!(map.with(0x1000, |entry| entry.copied()), None);
    }
}
