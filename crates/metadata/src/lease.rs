//! What the etcd and redis stores share: descriptors that expire unless their engine keeps
//! renewing them, one owner per name, and the background renewal.

use async_trait::async_trait;
use ferry_core::{Error, MetadataStore, Result, SegmentDescriptor};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// The store-specific half: atomic claim, read and release of one name.
#[async_trait]
pub(crate) trait Backend: Send + Sync + 'static {
    /// Writes `value` under `name`, expiring after the store's time to live, unless another
    /// owner holds the name: then nothing is written and the holder is returned.
    async fn claim(
        &self,
        name: &str,
        owner: &str,
        value: &[u8],
    ) -> std::result::Result<Option<String>, crate::Error>;

    /// The value under `name`, if any.
    async fn read(&self, name: &str) -> std::result::Result<Option<Vec<u8>>, crate::Error>;

    /// Deletes `name` if `owner` holds it.
    async fn release(&self, name: &str, owner: &str) -> std::result::Result<(), crate::Error>;

    /// Renews whatever expiry the store keeps apart from the values (an etcd lease); stores
    /// whose values expire on their own, refreshed by claiming them again, keep the default.
    async fn renew(&self) -> std::result::Result<(), crate::Error> {
        Ok(())
    }

    /// Where the key of `name` lives, for error messages.
    fn key(&self, name: &str) -> String;
}

/// The keys of `name`'s descriptor and of its owner under `prefix`.
pub(crate) fn keys(prefix: &str, name: &str) -> (String, String) {
    (
        format!("{prefix}/segments/{name}"),
        format!("{prefix}/owners/{name}"),
    )
}

/// What a store published, by name: the owner and the value, renewed until unpublished.
type Published = Mutex<HashMap<String, (String, Vec<u8>)>>;

/// A [`MetadataStore`] over a [`Backend`]: descriptors live for `ttl` unless renewed, which
/// a background task does every third of it while this store has names published.
pub(crate) struct LeasedStore<B: Backend> {
    backend: Arc<B>,
    url: String,
    ttl: Duration,
    published: Arc<Published>,
    renewing: Mutex<Option<tokio::task::AbortHandle>>,
}

/// Who holds a name: the publishing engine's instance id, which alone decides ownership
/// (PIDs repeat across containers), followed by its process and host for people.
fn owner_of(descriptor: &SegmentDescriptor) -> String {
    format!(
        "engine {} (process {} on host {}, boot {})",
        descriptor.instance, descriptor.pid, descriptor.host.hostname, descriptor.host.boot_id
    )
}

impl<B: Backend> LeasedStore<B> {
    pub(crate) fn new(backend: B, url: String, ttl: Duration) -> Self {
        LeasedStore {
            backend: Arc::new(backend),
            url,
            ttl,
            published: Arc::default(),
            renewing: Mutex::new(None),
        }
    }

    /// The engine's error for `name` when the store failed with `error`.
    fn failed(&self, name: &str, error: crate::Error) -> Error {
        Error::Metadata {
            name: name.to_owned(),
            reason: format!("{}: {error}", self.url),
        }
    }

    /// Starts the renewal task once, on the runtime the first publish runs on.
    fn keep_renewing(&self) {
        let mut renewing = self.renewing.lock();
        if renewing.is_some() {
            return;
        }
        let task = tokio::spawn(renew(
            Arc::downgrade(&self.backend),
            Arc::downgrade(&self.published),
            self.ttl,
            self.url.clone(),
        ));
        *renewing = Some(task.abort_handle());
    }
}

impl<B: Backend> Drop for LeasedStore<B> {
    fn drop(&mut self) {
        if let Some(task) = self.renewing.lock().take() {
            task.abort();
        }
    }
}

/// Renews every published name every third of the time to live; backs off while the store is
/// down and claims the names again once it is back (the entries may have expired meanwhile).
async fn renew<B: Backend>(
    backend: Weak<B>,
    published: Weak<Published>,
    ttl: Duration,
    url: String,
) {
    let period = (ttl / 3).max(Duration::from_millis(100));
    let mut wait = period;
    loop {
        tokio::time::sleep(wait).await;
        let (Some(backend), Some(published)) = (backend.upgrade(), published.upgrade()) else {
            return;
        };
        let names: Vec<(String, (String, Vec<u8>))> = published
            .lock()
            .iter()
            .map(|(name, entry)| (name.clone(), entry.clone()))
            .collect();
        let mut healthy = backend
            .renew()
            .await
            .map_err(|error| {
                tracing::warn!(%url, %error, "renewing the metadata lease failed; retrying");
            })
            .is_ok();
        for (name, (owner, value)) in names {
            match backend.claim(&name, &owner, &value).await {
                Ok(None) => {}
                Ok(Some(holder)) => {
                    tracing::error!(%url, %name, %holder, "another engine took this segment name while the store lost ours; peers now find that engine");
                    published.lock().remove(&name);
                }
                Err(error) => {
                    tracing::warn!(%url, %name, %error, "refreshing a published descriptor failed; retrying");
                    healthy = false;
                }
            }
        }
        wait = match healthy {
            true => period,
            false => (wait * 2).min(ttl.max(period)),
        };
    }
}

#[async_trait]
impl<B: Backend> MetadataStore for LeasedStore<B> {
    /// Claims the name for this engine with the descriptor as its value, then keeps renewing
    /// it in the background until it is unpublished or the store dropped.
    ///
    /// # Cancel safety
    /// Dropped before the claim answers, the descriptor may or may not have been written;
    /// dropped at any point, nothing renews it, so a written entry expires after the time to
    /// live (a later publish of the name by the same engine claims it again).
    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        let name = &descriptor.name;
        let owner = owner_of(descriptor);
        let value = descriptor.to_json();
        match self.backend.claim(name, &owner, &value).await {
            Ok(None) => {}
            Ok(Some(holder)) => {
                return Err(Error::Metadata {
                    name: name.clone(),
                    reason: format!(
                        "the name is held by {holder} in {}; give this engine another name, or if that engine is gone wait up to {:?} for its entry to expire",
                        self.url, self.ttl
                    ),
                })
            }
            Err(error) => return Err(self.failed(name, error)),
        }
        self.published.lock().insert(name.clone(), (owner, value));
        self.keep_renewing();
        Ok(())
    }

    /// Reads the descriptor under `name`.
    ///
    /// # Cancel safety
    /// A read only: dropping the future changes nothing in the store.
    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        let value = self
            .backend
            .read(name)
            .await
            .map_err(|error| self.failed(name, error))?;
        let Some(value) = value else {
            return Err(Error::NotPublished {
                name: name.to_owned(),
                reason: format!(
                    "nothing under key {} in {}: the engine is not running, its entry expired, or the name is wrong",
                    self.backend.key(name),
                    self.url
                ),
            });
        };
        SegmentDescriptor::from_json(name, &value).map_err(|error| Error::Metadata {
            name: name.to_owned(),
            reason: format!(
                "the value under key {} is not a ferry segment descriptor of this version ({error}); remove it or use another prefix",
                self.backend.key(name)
            ),
        })
    }

    /// Stops renewing `name` and deletes it if this engine still holds it.
    ///
    /// # Cancel safety
    /// Renewal stops on the first poll; dropped before the delete answers, the entry may
    /// stay until its time to live runs out.
    async fn unpublish(&self, name: &str) -> Result<()> {
        let entry = self.published.lock().remove(name);
        if let Some((owner, _)) = entry {
            self.backend
                .release(name, &owner)
                .await
                .map_err(|error| self.failed(name, error))?;
        }
        Ok(())
    }
}

/// Splits `?ttl=SECONDS` off a URL: the rest and the time to live (10 s by default).
///
/// # Errors
/// [`crate::Error::BadUrl`] for any query other than a positive `ttl`.
pub(crate) fn split_ttl(url: &str) -> std::result::Result<(&str, Duration), crate::Error> {
    let Some((rest, query)) = url.split_once('?') else {
        return Ok((url, Duration::from_secs(10)));
    };
    let seconds = query
        .strip_prefix("ttl=")
        .and_then(|value| value.parse::<u64>().ok())
        .filter(|&seconds| seconds > 0)
        .ok_or_else(|| {
            crate::bad_url(
                url,
                format!(
                    "the only query the URL takes is ttl=SECONDS (a positive integer), not {query:?}"
                ),
            )
        })?;
    Ok((rest, Duration::from_secs(seconds)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{HostIdentity, InstanceId, DESCRIPTOR_VERSION};

    /// An in-memory backend: names with owner and value (tests corrupt a value in place).
    #[derive(Default)]
    struct Fake {
        entries: Mutex<HashMap<String, (String, Vec<u8>)>>,
    }

    #[async_trait]
    impl Backend for Fake {
        async fn claim(
            &self,
            name: &str,
            owner: &str,
            value: &[u8],
        ) -> std::result::Result<Option<String>, crate::Error> {
            let mut entries = self.entries.lock();
            match entries.get(name) {
                Some((holder, _)) if holder != owner => Ok(Some(holder.clone())),
                _ => {
                    entries.insert(name.to_owned(), (owner.to_owned(), value.to_vec()));
                    Ok(None)
                }
            }
        }

        async fn read(&self, name: &str) -> std::result::Result<Option<Vec<u8>>, crate::Error> {
            Ok(self
                .entries
                .lock()
                .get(name)
                .map(|(_, value)| value.clone()))
        }

        async fn release(&self, name: &str, owner: &str) -> std::result::Result<(), crate::Error> {
            let mut entries = self.entries.lock();
            if entries.get(name).is_some_and(|(holder, _)| holder == owner) {
                entries.remove(name);
            }
            Ok(())
        }

        fn key(&self, name: &str) -> String {
            format!("fake/{name}")
        }
    }

    /// A descriptor of engine `instance`; every one claims PID 1 on this host, as services in
    /// separate containers do.
    fn descriptor(name: &str, instance: u128) -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: name.into(),
            host: HostIdentity::current(),
            generation: 1,
            instance: InstanceId::from_u128(instance),
            process: InstanceId::from_u128(instance),
            pid: 1,
            endpoints: Vec::new(),
            gpus: Vec::new(),
            buffers: Vec::new(),
            signature: None,
        }
    }

    fn store() -> LeasedStore<Fake> {
        LeasedStore::new(Fake::default(), "fake://".into(), Duration::from_secs(5))
    }

    #[tokio::test]
    async fn a_name_is_found_while_published_and_gone_after() {
        let store = store();
        store.publish(&descriptor("a:1", 10)).await.unwrap();
        assert_eq!(
            store.fetch("a:1").await.unwrap().instance,
            InstanceId::from_u128(10)
        );
        store.unpublish("a:1").await.unwrap();
        assert!(matches!(
            store.fetch("a:1").await,
            Err(Error::NotPublished { .. })
        ));
    }

    #[tokio::test]
    async fn a_held_name_is_refused_to_another_engine_with_the_same_pid_naming_the_holder() {
        let store = store();
        store.publish(&descriptor("a:1", 10)).await.unwrap();
        match store.publish(&descriptor("a:1", 11)).await {
            Err(Error::Metadata { reason, .. }) => {
                let holder = InstanceId::from_u128(10).to_string();
                assert!(reason.contains(&holder), "{reason}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(
            store.fetch("a:1").await.unwrap().instance,
            InstanceId::from_u128(10)
        );
        // Only the holder can remove it.
        store.unpublish("a:1").await.unwrap();
        assert!(store.fetch("a:1").await.is_err());
    }

    #[tokio::test]
    async fn a_foreign_value_is_an_error_naming_its_key_and_others_still_resolve() {
        let store = store();
        store.publish(&descriptor("good:1", 10)).await.unwrap();
        store
            .backend
            .entries
            .lock()
            .insert("bad:1".into(), ("x".into(), b"{not json".to_vec()));
        match store.fetch("bad:1").await {
            Err(Error::Metadata { name, reason }) => {
                assert_eq!(name, "bad:1");
                assert!(reason.contains("fake/bad:1"), "{reason}");
            }
            other => panic!("expected the bad value to be refused, got {other:?}"),
        }
        assert_eq!(
            store.fetch("good:1").await.unwrap().instance,
            InstanceId::from_u128(10)
        );
    }

    #[test]
    fn the_time_to_live_comes_from_the_query() {
        assert_eq!(
            split_ttl("redis://h:1/0?ttl=3"),
            Ok(("redis://h:1/0", Duration::from_secs(3)))
        );
        assert_eq!(
            split_ttl("etcd://h:1/p"),
            Ok(("etcd://h:1/p", Duration::from_secs(10)))
        );
        for url in ["redis://h:1/0?ttl=0", "redis://h:1/0?lease=3"] {
            match split_ttl(url) {
                Err(crate::Error::BadUrl { url: named, reason }) => {
                    assert_eq!(named, url);
                    assert!(reason.contains("ttl=SECONDS"), "{reason}");
                }
                other => panic!("expected {url} to be refused as malformed, got {other:?}"),
            }
        }
    }

    /// A backend whose every request fails, as a store that is down does.
    struct Down;

    #[async_trait]
    impl Backend for Down {
        async fn claim(
            &self,
            _: &str,
            _: &str,
            _: &[u8],
        ) -> std::result::Result<Option<String>, crate::Error> {
            Err(down())
        }

        async fn read(&self, _: &str) -> std::result::Result<Option<Vec<u8>>, crate::Error> {
            Err(down())
        }

        async fn release(&self, _: &str, _: &str) -> std::result::Result<(), crate::Error> {
            Err(down())
        }

        fn key(&self, name: &str) -> String {
            format!("down/{name}")
        }
    }

    fn down() -> crate::Error {
        crate::Error::Unreachable {
            store: "etcd",
            reason: "connection refused".into(),
        }
    }

    #[tokio::test]
    async fn a_store_that_is_down_is_the_engines_metadata_error_naming_url_and_remedy() {
        let store = LeasedStore::new(Down, "etcd://h:1/p".into(), Duration::from_secs(5));
        for outcome in [
            store.publish(&descriptor("a:1", 10)).await.map(drop),
            store.fetch("a:1").await.map(drop),
        ] {
            match outcome {
                Err(Error::Metadata { name, reason }) => {
                    assert_eq!(name, "a:1");
                    assert!(
                        reason.starts_with("etcd://h:1/p: cannot connect to the etcd server: connection refused; check that it is running"),
                        "{reason}"
                    );
                }
                other => panic!("expected a metadata error, got {other:?}"),
            }
        }
    }
}
