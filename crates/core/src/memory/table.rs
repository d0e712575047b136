use super::region::ExportGuard;
use super::region::{OwnedMemory, Region, RegionEntry, RegionInfo, RegionUse};
use crate::descriptor::{BufferDescriptor, Export};
use crate::error::RangeError;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The regions one engine has registered, keyed by start address.
pub(crate) struct RegionTable {
    id: u64,
    regions: Mutex<BTreeMap<u64, Arc<RegionEntry>>>,
    next_sequence: AtomicU64,
    /// Bumped on every change, so peers can tell a stale descriptor.
    generation: AtomicU64,
    /// Wakes the engine's publisher after a change.
    changed: tokio::sync::Notify,
}

impl RegionTable {
    pub(crate) fn new() -> Arc<Self> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Arc::new(RegionTable {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            regions: Mutex::new(BTreeMap::new()),
            next_sequence: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            changed: tokio::sync::Notify::new(),
        })
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Resolves after the next registration change (at once if one happened unobserved).
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Adds a region unless it overlaps one already registered.
    pub(crate) fn insert(
        self: &Arc<Self>,
        info: RegionInfo,
        exports: Vec<Export>,
        guards: Vec<ExportGuard>,
        owned: Option<OwnedMemory>,
    ) -> Result<Region, RangeError> {
        let mut regions = self.regions.lock();
        let end = info.addr + info.len;
        let before = regions.range(..end).next_back();
        if let Some((_, existing)) = before {
            if existing.info.addr + existing.info.len > info.addr {
                return Err(RangeError::Overlap {
                    addr: info.addr,
                    len: info.len,
                    existing_addr: existing.info.addr,
                    existing_len: existing.info.len,
                });
            }
        }
        let sequence = self.next_sequence.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(RegionEntry::new(
            info, sequence, self.id, exports, guards, owned,
        ));
        regions.insert(info.addr, Arc::clone(&entry));
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_one();
        Ok(Region {
            entry,
            table: Arc::clone(self),
        })
    }

    pub(crate) fn remove(&self, entry: &Arc<RegionEntry>) {
        let mut regions = self.regions.lock();
        if regions
            .get(&entry.info.addr)
            .is_some_and(|found| Arc::ptr_eq(found, entry))
        {
            regions.remove(&entry.info.addr);
            self.generation.fetch_add(1, Ordering::SeqCst);
            self.changed.notify_one();
        }
    }

    /// Finds the region holding all of `addr..addr+len` and marks it in use.
    pub(crate) fn acquire(&self, addr: u64, len: u64) -> Option<RegionUse> {
        let regions = self.regions.lock();
        let (_, entry) = regions.range(..=addr).next_back()?;
        if !entry.contains(addr, len) {
            return None;
        }
        entry.acquire()
    }

    /// Gives `entry` the name peers find it by, unless another region has it.
    pub(crate) fn rename(&self, entry: &RegionEntry, name: String) -> Result<(), crate::Error> {
        if name.is_empty() || name.len() > 256 {
            return Err(crate::Error::ApiMisuse(format!(
                "a region name must be 1 to 256 bytes, not {}; choose a short name such as \"kv-pool\"",
                name.len()
            )));
        }
        let regions = self.regions.lock();
        let taken = regions.values().any(|other| {
            !std::ptr::eq(Arc::as_ptr(other), entry) && other.name().as_deref() == Some(&name)
        });
        if taken {
            return Err(crate::Error::ApiMisuse(format!(
                "another region of this engine is already named {name:?}; give each region its own name"
            )));
        }
        *entry.name.lock() = Some(name);
        drop(regions);
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_one();
        Ok(())
    }

    /// Every live registration as peers see it, in registration order.
    pub(crate) fn snapshot(&self) -> Vec<BufferDescriptor> {
        let regions = self.regions.lock();
        let mut entries: Vec<&Arc<RegionEntry>> = regions.values().collect();
        entries.sort_by_key(|entry| entry.sequence);
        entries
            .iter()
            .map(|entry| BufferDescriptor {
                addr: entry.info.addr,
                len: entry.info.len,
                location: entry.info.location,
                name: entry.name(),
                exports: entry.exports.clone(),
            })
            .collect()
    }
}
