//! ferry-metadata: where ferry engines publish their segment descriptors and find each other's.
//!
//! Every store implements [`ferry_core::MetadataStore`]. Pick one by URL with [`from_url`]:
//!
//! | URL | store |
//! |---|---|
//! | `p2p` (default) | [`PeerToPeer`]: no service; a segment's name is its listener's `host:port` |
//! | `memory` | [`MemoryStore`]: one process-wide map, for tests and single-process setups |
//! | `etcd://host:port[,host:port]/prefix[?ttl=SECONDS]` | etcd (feature `etcd`): descriptors on a lease the engine keeps alive |
//! | `redis://host:port/db[?ttl=SECONDS]` | redis (feature `redis`): descriptors with a key expiry the engine refreshes |
//!
//! With etcd and redis, a descriptor disappears within the time to live (10 s by default)
//! after its engine dies, and a name is held by one live engine at a time: a second engine
//! publishing it gets an error naming the holder.
//!
//! ```
//! let store = ferry_metadata::from_url("p2p").unwrap();
//! # let _ = store;
//! ```
#![forbid(unsafe_code)]

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(any(feature = "etcd", feature = "redis"))]
mod lease;
mod memory;
#[cfg(feature = "redis")]
mod redis;

pub use ferry_core::{MetadataStore, PeerToPeer};
pub use memory::MemoryStore;

use std::sync::Arc;

/// Why a metadata URL was refused, or a metadata service failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL names a known store but is malformed.
    #[error("metadata URL {url:?} is malformed: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The URL names a store this build does not have.
    #[error("metadata URL {url:?} is not supported by this build: {reason}")]
    UnsupportedUrl {
        /// The URL as given.
        url: String,
        /// What is supported instead.
        reason: String,
    },
    /// The metadata service could not be connected to.
    #[error("cannot connect to the {store} server: {reason}; check that it is running and reachable at the URL's address")]
    Unreachable {
        /// Which service: `etcd` or `redis`.
        store: &'static str,
        /// What the client reported.
        reason: String,
    },
    /// The metadata service refused or failed a request.
    #[error("{store} {action} failed: {reason}; check that the server is running and healthy, then retry")]
    Request {
        /// Which service: `etcd` or `redis`.
        store: &'static str,
        /// What was asked, such as `claiming a name`.
        action: &'static str,
        /// What the client reported.
        reason: String,
    },
    /// The etcd lease holding this engine's names expired (the server was unreachable for
    /// longer than the time to live).
    #[error("the etcd lease of this engine's names expired; a new one is taken and the names are claimed again on the next renewal")]
    LeaseExpired,
}

impl From<Error> for ferry_core::Error {
    /// [`ferry_core::Error::Metadata`] naming the URL, so `?` turns a refused URL into the
    /// engine's error.
    fn from(error: Error) -> Self {
        let (name, reason) = match error {
            Error::BadUrl { url, reason } => (url, format!("the URL is malformed: {reason}")),
            Error::UnsupportedUrl { url, reason } => (
                url,
                format!("this build does not support the URL: {reason}"),
            ),
            Error::Unreachable { store, .. } | Error::Request { store, .. } => {
                (store.to_owned(), error.to_string())
            }
            Error::LeaseExpired => ("etcd".to_owned(), error.to_string()),
        };
        ferry_core::Error::Metadata { name, reason }
    }
}

/// The store a URL names (see the table above). Network stores connect on first use, so an
/// unreachable server shows up when the engine first publishes, with the URL in the error.
///
/// # Errors
/// [`Error::UnsupportedUrl`] for a store this build lacks, naming what is supported;
/// [`Error::BadUrl`] for a malformed etcd or redis URL.
pub fn from_url(url: &str) -> Result<Arc<dyn MetadataStore>, Error> {
    let url = url.trim();
    match url {
        "" | "p2p" => Ok(Arc::new(PeerToPeer::default())),
        "memory" => Ok(MemoryStore::global()),
        #[cfg(feature = "etcd")]
        url if url.starts_with("etcd://") => Ok(Arc::new(etcd::store(url)?)),
        #[cfg(feature = "redis")]
        url if url.starts_with("redis://") => Ok(Arc::new(redis::store(url)?)),
        other => Err(Error::UnsupportedUrl {
            url: other.to_owned(),
            reason: "use `p2p` (peers find each other by host:port), `memory` (one process), or etcd:// and redis:// in a build with the `etcd` and `redis` features".into(),
        }),
    }
}

/// [`Error::BadUrl`] for `url`, with what is wrong.
#[cfg(any(feature = "etcd", feature = "redis"))]
fn bad_url(url: &str, reason: impl Into<String>) -> Error {
    Error::BadUrl {
        url: url.to_owned(),
        reason: reason.into(),
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

    fn store_for_engine(url: &str) -> ferry_core::Result<Arc<dyn MetadataStore>> {
        Ok(from_url(url)?)
    }

    #[test]
    fn a_refused_url_becomes_the_engines_metadata_error_with_question_mark() {
        match store_for_engine("zookeeper://x") {
            Err(ferry_core::Error::Metadata { name, reason }) => {
                assert_eq!(name, "zookeeper://x");
                assert!(
                    reason.starts_with("this build does not support the URL: use `p2p`"),
                    "{reason}"
                );
            }
            Err(other) => panic!("expected a metadata error, got {other:?}"),
            Ok(_) => panic!("zookeeper:// must be refused"),
        }
        assert!(store_for_engine("memory").is_ok());
    }

    #[test]
    fn memory_url_is_one_shared_store() {
        let first = from_url("memory").unwrap();
        let second = from_url("memory").unwrap();
        assert!(Arc::ptr_eq(&first, &second));
    }
}
