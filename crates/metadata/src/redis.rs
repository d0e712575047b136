//! The redis store (feature `redis`): `redis://host:port/db[?ttl=SECONDS]`. Each descriptor
//! lives under `ferry/segments/NAME` and its owner under `ferry/owners/NAME`, both expiring
//! after the time to live unless the engine refreshes them.

use crate::lease::{Backend, LeasedStore};
use crate::{bad_url, Error};
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::time::Duration;
use tokio::sync::OnceCell;

const PREFIX: &str = "ferry";

/// Writes the value and owner with the expiry, unless someone else owns the name; returns
/// the holder then, else an empty string.
const CLAIM: &str = r#"
local owner = redis.call('GET', KEYS[2])
if owner and owner ~= ARGV[1] then return owner end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
return ''
"#;

/// Deletes both keys if the caller owns the name.
const RELEASE: &str = r#"
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
end
return 1
"#;

pub(crate) struct Redis {
    client: redis::Client,
    connection: OnceCell<ConnectionManager>,
    ttl: Duration,
    claim: redis::Script,
    release: redis::Script,
}

impl Redis {
    async fn connection(&self) -> Result<ConnectionManager, Error> {
        let connection = self
            .connection
            .get_or_try_init(|| async {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(2)))
                    .set_response_timeout(Some(Duration::from_secs(2)))
                    .set_number_of_retries(2);
                self.client.get_connection_manager_with_config(config).await
            })
            .await
            .map_err(|error| Error::Unreachable {
                store: "redis",
                reason: error.to_string(),
            })?;
        Ok(connection.clone())
    }

    fn keys(name: &str) -> (String, String) {
        crate::lease::keys(PREFIX, name)
    }
}

#[async_trait]
impl Backend for Redis {
    async fn claim(&self, name: &str, owner: &str, value: &[u8]) -> Result<Option<String>, Error> {
        let mut connection = self.connection().await?;
        let (value_key, owner_key) = Redis::keys(name);
        let holder: String = self
            .claim
            .key(value_key)
            .key(owner_key)
            .arg(owner)
            .arg(value)
            .arg(self.ttl.as_millis() as u64)
            .invoke_async(&mut connection)
            .await
            .map_err(failed("claiming a name"))?;
        Ok((!holder.is_empty()).then_some(holder))
    }

    async fn read(&self, name: &str) -> Result<Option<Vec<u8>>, Error> {
        let mut connection = self.connection().await?;
        redis::cmd("GET")
            .arg(Redis::keys(name).0)
            .query_async(&mut connection)
            .await
            .map_err(failed("reading a descriptor"))
    }

    async fn release(&self, name: &str, owner: &str) -> Result<(), Error> {
        let mut connection = self.connection().await?;
        let (value_key, owner_key) = Redis::keys(name);
        let _: i64 = self
            .release
            .key(value_key)
            .key(owner_key)
            .arg(owner)
            .invoke_async(&mut connection)
            .await
            .map_err(failed("releasing a name"))?;
        Ok(())
    }

    fn key(&self, name: &str) -> String {
        Redis::keys(name).0
    }
}

/// [`Error::Request`] for `action`, from the client's error.
fn failed(action: &'static str) -> impl Fn(redis::RedisError) -> Error {
    move |error| Error::Request {
        store: "redis",
        action,
        reason: error.to_string(),
    }
}

/// The store for `url` (`redis://host:port/db`, optionally `?ttl=SECONDS`); connects on first
/// use, so an unreachable server shows up as the engine's first publish failing.
///
/// # Errors
/// [`Error::BadUrl`] for a malformed URL.
pub(crate) fn store(url: &str) -> Result<LeasedStore<Redis>, Error> {
    let (address, ttl) = crate::lease::split_ttl(url)?;
    let client = redis::Client::open(address).map_err(|error| bad_url(url, error.to_string()))?;
    Ok(LeasedStore::new(
        Redis {
            client,
            connection: OnceCell::new(),
            ttl,
            claim: redis::Script::new(CLAIM),
            release: redis::Script::new(RELEASE),
        },
        url.to_owned(),
        ttl,
    ))
}
