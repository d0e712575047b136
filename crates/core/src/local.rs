//! The engines alive in this process, by instance id, with their registrations.
//!
//! A peer in this very process needs no mapping: its addresses are valid here as they are.
//! But a descriptor's ids are the peer's own words, and any peer can copy another engine's
//! process id: so the shortcut is taken only for an engine this process really runs, and
//! only for ranges that engine really registered.

use crate::identity::InstanceId;
use crate::memory::RegionTable;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};

type Engines = Mutex<HashMap<InstanceId, Weak<RegionTable>>>;

fn engines() -> parking_lot::MutexGuard<'static, HashMap<InstanceId, Weak<RegionTable>>> {
    static ENGINES: OnceLock<Engines> = OnceLock::new();
    ENGINES.get_or_init(Engines::default).lock()
}

/// Lists the engine `instance` with its region table until [`forget`] (or the table is gone).
pub(crate) fn remember(instance: InstanceId, table: &Arc<RegionTable>) {
    let mut engines = engines();
    engines.retain(|_, table| table.strong_count() > 0);
    engines.insert(instance, Arc::downgrade(table));
}

/// Takes the engine `instance` off the list.
pub(crate) fn forget(instance: InstanceId) {
    engines().remove(&instance);
}

/// Whether `instance` is an engine alive in this process.
pub fn is_local_engine(instance: InstanceId) -> bool {
    engines()
        .get(&instance)
        .is_some_and(|table| table.strong_count() > 0)
}

/// Whether the engine `instance` of this process has all of `addr..addr+len` registered, so
/// this process may copy to and from it directly.
pub fn local_engine_registered(instance: InstanceId, addr: u64, len: u64) -> bool {
    let table = engines().get(&instance).and_then(Weak::upgrade);
    table.is_some_and(|table| table.acquire(addr, len).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_engines_of_this_process_and_their_registrations_are_local() {
        let engine = crate::EngineBuilder::new(crate::TcpOnly)
            .build_blocking()
            .unwrap();
        let region = engine.allocate(4096).unwrap();
        let instance = engine.descriptor().instance;
        assert!(is_local_engine(instance));
        assert!(local_engine_registered(instance, region.addr(), 4096));
        assert!(!local_engine_registered(instance, region.addr(), 4097));
        assert!(!local_engine_registered(instance, region.addr() - 1, 1));
        // Another engine's id, copied by a peer: not ours.
        let stranger = InstanceId::random().unwrap();
        assert!(!is_local_engine(stranger));
        assert!(!local_engine_registered(stranger, region.addr(), 1));
        drop(region);
        drop(engine);
        assert!(!is_local_engine(instance));
    }
}
