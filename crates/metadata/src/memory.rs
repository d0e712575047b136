use async_trait::async_trait;
use ferry_core::{Error, MetadataStore, Result, SegmentDescriptor};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Descriptors kept in this process's memory. Engines sharing one store find each other
/// without any network lookup; engines in other processes cannot see it.
#[derive(Debug, Default)]
pub struct MemoryStore {
    descriptors: Mutex<HashMap<String, SegmentDescriptor>>,
}

impl MemoryStore {
    /// An empty store of its own.
    pub fn new() -> Arc<Self> {
        Arc::new(MemoryStore::default())
    }

    /// The process-wide store that the `memory` URL names.
    pub fn global() -> Arc<dyn MetadataStore> {
        static GLOBAL: OnceLock<Arc<MemoryStore>> = OnceLock::new();
        GLOBAL.get_or_init(MemoryStore::new).clone()
    }
}

#[async_trait]
impl MetadataStore for MemoryStore {
    /// Keeps `descriptor` under its name, replacing any other.
    ///
    /// # Cancel safety
    /// Nothing to cancel; it is ready on its first poll.
    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        self.descriptors
            .lock()
            .insert(descriptor.name.clone(), descriptor.clone());
        Ok(())
    }

    /// The descriptor kept under `name`.
    ///
    /// # Cancel safety
    /// Nothing to cancel; it is ready on its first poll.
    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        self.descriptors.lock().get(name).cloned().ok_or_else(|| Error::NotPublished {
            name: name.to_owned(),
            reason: "no engine published this name in the in-memory store; check the name, and that both engines use the same store".into(),
        })
    }

    /// Forgets the descriptor under `name`.
    ///
    /// # Cancel safety
    /// Nothing to cancel; it is ready on its first poll.
    async fn unpublish(&self, name: &str) -> Result<()> {
        self.descriptors.lock().remove(name);
        Ok(())
    }
}
