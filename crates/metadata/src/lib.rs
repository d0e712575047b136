//! ferry-metadata: where ferry engines publish their segment descriptors and find each other's.
//!
//! Every store implements [`ferry_core::MetadataStore`]. Pick one by URL with [`from_url`]:
//!
//! | URL | store |
//! |---|---|
//! | `p2p` (default) | [`PeerToPeer`]: no service; a segment's name is its listener's `host:port` |
//! | `memory` | [`MemoryStore`]: one process-wide map, for tests and single-process setups |
//!
//! ```
//! let store = ferry_metadata::from_url("p2p").unwrap();
//! # let _ = store;
//! ```
#![forbid(unsafe_code)]

mod memory;

pub use ferry_core::{MetadataStore, PeerToPeer};
pub use memory::MemoryStore;

use std::sync::Arc;

/// Why a metadata URL was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL names a store this build does not have.
    #[error("metadata URL {url:?} is not supported by this build: {reason}")]
    UnsupportedUrl {
        /// The URL as given.
        url: String,
        /// What is supported instead.
        reason: String,
    },
}

/// The store a URL names: `p2p` (the default) or `memory`.
///
/// # Errors
/// [`Error::UnsupportedUrl`] for any other URL, naming what is supported.
pub fn from_url(url: &str) -> Result<Arc<dyn MetadataStore>, Error> {
    match url.trim() {
        "" | "p2p" => Ok(Arc::new(PeerToPeer::default())),
        "memory" => Ok(MemoryStore::global()),
        other => Err(Error::UnsupportedUrl {
            url: other.to_owned(),
            reason: "use `p2p` (peers find each other by host:port) or `memory` (one process)"
                .into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_url_names_the_supported_ones() {
        let error = from_url("zookeeper://x").err().unwrap();
        let text = error.to_string();
        assert!(
            text.contains("zookeeper://x") && text.contains("p2p"),
            "{text}"
        );
    }

    #[test]
    fn memory_url_is_one_shared_store() {
        let first = from_url("memory").unwrap();
        let second = from_url("memory").unwrap();
        assert!(Arc::ptr_eq(&first, &second));
    }
}
