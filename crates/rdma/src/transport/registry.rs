//! The local regions registered with the transport's NICs: their keys by region, and the
//! guard that deregisters them when the engine drops the region.

use super::dmabuf::NoDmaBuf;
use crate::error::VerbsError;
use crate::memory::MrKeys;
use crate::verbs::Verbs;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Why a region could not be registered with one of its NICs; the region is then not
/// reachable over RDMA, and `reach` says so.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegistrationFailure {
    /// Registering host memory (or memory of unknown placement) failed.
    #[error("{nic}: {source}")]
    Verbs {
        /// The NIC.
        nic: String,
        /// What verbs said.
        #[source]
        source: VerbsError,
    },
    /// GPU memory: the NIC took neither its dma-buf nor its pointer.
    #[error("{nic}: registering the dma-buf failed ({dmabuf}), and so did registering the pointer ({pointer}), which needs nvidia-peermem")]
    DmaBufAndPointer {
        /// The NIC.
        nic: String,
        /// Why the dma-buf registration failed.
        dmabuf: VerbsError,
        /// Why the pointer registration failed.
        #[source]
        pointer: VerbsError,
    },
    /// GPU memory without a dma-buf, whose pointer the NIC did not take either.
    #[error("{nic}: the GPU memory has no dma-buf ({export}), and registering the pointer failed ({pointer}): load nvidia-peermem or use a GPU and driver with dma-buf support")]
    NoDmaBuf {
        /// The NIC.
        nic: String,
        /// Why there is no dma-buf (shared by every NIC of the region).
        export: Arc<NoDmaBuf>,
        /// Why the pointer registration failed.
        #[source]
        pointer: VerbsError,
    },
}

/// Why a local region has no lkeys.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NotRegistered {
    /// Registering it failed.
    #[error("the local region is not registered with RDMA: {0}")]
    Refused(Arc<RegistrationFailure>),
    /// The transport never saw it registered (or it was dropped since).
    #[error("the local region is not registered with RDMA")]
    Unknown,
}

/// How a local region stands with the NICs.
#[derive(Debug)]
enum Standing {
    /// Registered: the lkey on each NIC, by the transport's NIC index (`None` where a NIC
    /// did not register it).
    Registered(Arc<[Option<u32>]>),
    /// Not registered, and why (reported by `reach`).
    Refused(Arc<RegistrationFailure>),
}

/// The standing of every registered region, by its first address.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    regions: Mutex<HashMap<u64, Standing>>,
}

impl Registry {
    /// The lkeys of the region at `addr` by NIC index, or why it cannot be used.
    pub(crate) fn lkeys(&self, addr: u64) -> Result<Arc<[Option<u32>]>, NotRegistered> {
        match self.regions.lock().get(&addr) {
            Some(Standing::Registered(lkeys)) => Ok(Arc::clone(lkeys)),
            Some(Standing::Refused(reason)) => Err(NotRegistered::Refused(Arc::clone(reason))),
            None => Err(NotRegistered::Unknown),
        }
    }

    /// Records that the region at `addr` could not be registered, and why.
    pub(crate) fn refuse(&self, addr: u64, reason: RegistrationFailure) {
        self.regions
            .lock()
            .insert(addr, Standing::Refused(Arc::new(reason)));
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

#[cfg(test)]
mod tests {
    use super::{NoDmaBuf, NotRegistered, RegistrationFailure, Registry};
    use crate::error::VerbsError;
    use std::sync::Arc;

    fn refused() -> VerbsError {
        VerbsError::BadAddress {
            addr: 0x1000,
            len: 64,
        }
    }

    #[test]
    fn a_refused_region_keeps_why_and_what_to_do() {
        let registry = Registry::default();
        assert!(matches!(
            registry.lkeys(0x1000),
            Err(NotRegistered::Unknown)
        ));
        assert_eq!(
            registry.lkeys(0x1000).map(|_| ()).unwrap_err().to_string(),
            "the local region is not registered with RDMA"
        );
        let export = Arc::new(NoDmaBuf::Io {
            what: "exporting".to_owned(),
            source: std::io::Error::other("no dma-buf here"),
        });
        registry.refuse(
            0x1000,
            RegistrationFailure::NoDmaBuf {
                nic: "mlx5_0".to_owned(),
                export,
                pointer: refused(),
            },
        );
        let why = registry.lkeys(0x1000).map(|_| ()).unwrap_err().to_string();
        assert_eq!(
            why,
            format!(
                "the local region is not registered with RDMA: mlx5_0: the GPU memory has no \
                 dma-buf (exporting failed: no dma-buf here), and registering the pointer failed \
                 ({}): load nvidia-peermem or use a GPU and driver with dma-buf support",
                refused()
            )
        );
        let both = RegistrationFailure::DmaBufAndPointer {
            nic: "mlx5_1".to_owned(),
            dmabuf: VerbsError::Failed {
                call: "ibv_reg_dmabuf_mr",
                message: "EINVAL".to_owned(),
            },
            pointer: refused(),
        };
        assert!(
            both.to_string().starts_with(
                "mlx5_1: registering the dma-buf failed (ibv_reg_dmabuf_mr failed: EINVAL; "
            ),
            "{both}"
        );
        assert!(
            both.to_string().ends_with("), which needs nvidia-peermem"),
            "{both}"
        );
    }
}
