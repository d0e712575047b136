//! Where engines' descriptors live, behind one small trait.
//!
//! The default, [`PeerToPeer`], needs no service: an engine's name is `host:port` of its
//! engine's control listener, and fetching asks that listener. Stores such as etcd or redis
//! (crate `ferry-metadata`) implement the same trait.

use crate::auth::Secret;
use crate::descriptor::SegmentDescriptor;
use crate::error::Result;
use std::sync::Arc;
use std::time::Duration;

/// A place where engines publish their descriptors and find each other's.
#[async_trait::async_trait]
pub trait MetadataStore: Send + Sync + 'static {
    /// Makes `descriptor` findable under its name, replacing an older one from this engine.
    ///
    /// # Errors
    /// When the store cannot be written.
    ///
    /// # Cancel safety
    /// Implementations must leave the store consistent when the future is dropped at any
    /// await: the descriptor is then either published or not, never half written. The engine
    /// runs its own publishes on tasks it does not drop, except when it shuts down.
    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()>;

    /// Fetches the current descriptor of the engine named `name`.
    ///
    /// # Errors
    /// [`crate::Error::NotPublished`] when no live engine holds the name (with the
    /// peer-to-peer default: [`crate::Error::Unreachable`], nothing answers there);
    /// [`crate::Error::Metadata`] when the store itself fails or holds a bad value.
    ///
    /// # Cancel safety
    /// Implementations must change nothing in the store, so dropping the future at any await
    /// only abandons the lookup.
    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor>;

    /// Removes the descriptor of `name`, if present.
    ///
    /// # Errors
    /// When the store cannot be written.
    ///
    /// # Cancel safety
    /// Implementations must leave the store consistent when the future is dropped at any
    /// await: the descriptor is then either removed or still findable (for a store whose
    /// entries expire, until they do).
    async fn unpublish(&self, name: &str) -> Result<()>;

    /// This store with its lookups authenticated by `secret`, for stores that fetch
    /// descriptors from the engines themselves (peer-to-peer); an engine with a secret swaps
    /// its store for this. `None`, the default, for stores that never talk to engines.
    fn with_secret(&self, secret: &Secret) -> Option<Arc<dyn MetadataStore>> {
        let _ = secret;
        None
    }
}

/// The service-free default: each engine serves its own descriptor on its control listener.
///
/// An engine with a shared secret authenticates each lookup with it (see
/// [`MetadataStore::with_secret`]), so a listener that requires the secret answers it.
#[derive(Debug, Clone)]
pub struct PeerToPeer {
    timeout: Duration,
    secret: Option<Secret>,
}

impl PeerToPeer {
    /// A lookup that gives up on a silent peer after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        PeerToPeer {
            timeout,
            secret: None,
        }
    }
}

impl Default for PeerToPeer {
    fn default() -> Self {
        PeerToPeer::new(Duration::from_secs(5))
    }
}

#[async_trait::async_trait]
impl MetadataStore for PeerToPeer {
    /// Does nothing: the engine's listener answers for its descriptor.
    ///
    /// # Cancel safety
    /// Nothing to cancel; it is ready on its first poll.
    async fn publish(&self, _descriptor: &SegmentDescriptor) -> Result<()> {
        Ok(())
    }

    /// Asks the listener at `name` (`host:port`) for its descriptor, giving up after the
    /// store's timeout.
    ///
    /// # Cancel safety
    /// Dropping the future closes the lookup's connection; neither engine keeps any state
    /// from it.
    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        crate::tcp::fetch_descriptor(name, self.timeout, self.secret.as_ref()).await
    }

    /// Does nothing: an engine stops answering for its descriptor when it is dropped.
    ///
    /// # Cancel safety
    /// Nothing to cancel; it is ready on its first poll.
    async fn unpublish(&self, _name: &str) -> Result<()> {
        Ok(())
    }

    fn with_secret(&self, secret: &Secret) -> Option<Arc<dyn MetadataStore>> {
        Some(Arc::new(PeerToPeer {
            timeout: self.timeout,
            secret: Some(secret.clone()),
        }))
    }
}

/// Any store, with the descriptors it holds signed with the shared secret: publishing signs,
/// fetching refuses a descriptor whose signature does not match ([`crate::auth`]'s
/// `signature`), naming the key. An engine with a secret wraps its store in this.
pub(crate) struct Signed {
    inner: Arc<dyn MetadataStore>,
    secret: Secret,
}

impl Signed {
    /// `inner`, signed and checked with `secret`.
    pub(crate) fn new(inner: Arc<dyn MetadataStore>, secret: Secret) -> Signed {
        Signed { inner, secret }
    }
}

#[async_trait::async_trait]
impl MetadataStore for Signed {
    /// Publishes `descriptor` signed.
    ///
    /// # Cancel safety
    /// As the inner store's.
    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        let signed = crate::auth::sign_descriptor(descriptor, &self.secret);
        self.inner.publish(&signed).await
    }

    /// The inner store's descriptor of `name`, refused unless signed with the secret.
    ///
    /// # Cancel safety
    /// As the inner store's.
    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        let descriptor = self.inner.fetch(name).await?;
        crate::auth::signature::check(&descriptor, &self.secret).map_err(|why| {
            crate::Error::Metadata {
                name: name.to_owned(),
                reason: format!(
                    "the descriptor stored under {name:?} {why}; it is not used. Check who can write the store, and that every engine has the same secret"
                ),
            }
        })?;
        Ok(descriptor)
    }

    /// # Cancel safety
    /// As the inner store's.
    async fn unpublish(&self, name: &str) -> Result<()> {
        self.inner.unpublish(name).await
    }
}
