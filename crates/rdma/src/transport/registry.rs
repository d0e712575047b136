//! The local regions registered with the transport's NICs: their keys by region, and the
//! guard that deregisters them when the engine drops the region.

use crate::memory::MrKeys;
use crate::verbs::Verbs;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// How a local region stands with the NICs.
#[derive(Debug)]
enum Standing {
    /// Registered: the lkey on each NIC, by the transport's NIC index (`None` where a NIC
    /// did not register it).
    Registered(Arc<[Option<u32>]>),
    /// Not registered, and why (reported by `reach`).
    Refused(String),
}

/// The standing of every registered region, by its first address.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    regions: Mutex<HashMap<u64, Standing>>,
}

impl Registry {
    /// The lkeys of the region at `addr` by NIC index, or why it cannot be used.
    pub(crate) fn lkeys(&self, addr: u64) -> Result<Arc<[Option<u32>]>, String> {
        match self.regions.lock().get(&addr) {
            Some(Standing::Registered(lkeys)) => Ok(Arc::clone(lkeys)),
            Some(Standing::Refused(reason)) => Err(format!(
                "the local region is not registered with RDMA: {reason}"
            )),
            None => Err("the local region is not registered with RDMA".into()),
        }
    }

    pub(crate) fn refuse(&self, addr: u64, reason: String) {
        self.regions.lock().insert(addr, Standing::Refused(reason));
    }

    fn forget(&self, addr: u64) {
        self.regions.lock().remove(&addr);
    }
}

/// A region's memory registrations; dropping it deregisters them (peers' rkeys stop working)
/// and forgets the region.
pub(crate) struct Registration<V: Verbs> {
    verbs: Arc<V>,
    registry: Arc<Registry>,
    addr: u64,
    regions: Vec<V::MemoryRegion>,
}

impl<V: Verbs> Registration<V> {
    /// Records `regions`, one per NIC index in `nics`, as the registration of the region at
    /// `addr`; returns it with the keys in the order given.
    pub(crate) fn record(
        verbs: &Arc<V>,
        registry: &Arc<Registry>,
        addr: u64,
        nic_count: usize,
        registered: Vec<(usize, V::MemoryRegion)>,
    ) -> (Self, Vec<(usize, MrKeys)>) {
        let mut lkeys = vec![None; nic_count];
        let mut keys = Vec::with_capacity(registered.len());
        let mut regions = Vec::with_capacity(registered.len());
        for (nic, region) in registered {
            let key = verbs.mr_keys(&region);
            lkeys[nic] = Some(key.lkey);
            keys.push((nic, key));
            regions.push(region);
        }
        registry
            .regions
            .lock()
            .insert(addr, Standing::Registered(lkeys.into()));
        let registration = Registration {
            verbs: Arc::clone(verbs),
            registry: Arc::clone(registry),
            addr,
            regions,
        };
        (registration, keys)
    }
}

impl<V: Verbs> Drop for Registration<V> {
    fn drop(&mut self) {
        self.registry.forget(self.addr);
        for region in self.regions.drain(..) {
            if let Err(error) = self.verbs.dereg_mr(region) {
                tracing::warn!(%error, addr = self.addr, "deregistering a region from an RDMA NIC failed");
            }
        }
    }
}
