//! The etcd store (feature `etcd`): `etcd://host:port[,host:port]/prefix[?ttl=SECONDS]`.
//! Each descriptor lives under `PREFIX/segments/NAME` and its owner under
//! `PREFIX/owners/NAME`, both attached to a lease the engine keeps alive, so a process that
//! dies disappears within the time to live.

use crate::lease::{Backend, LeasedStore};
use crate::{bad_url, Error};
use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn,
    TxnOp, TxnOpResponse,
};
use std::time::Duration;
use tokio::sync::{Mutex, OnceCell};

pub(crate) struct Etcd {
    endpoints: Vec<String>,
    prefix: String,
    ttl: Duration,
    client: OnceCell<Client>,
    /// The lease every key of this store is attached to, with its keep-alive stream.
    lease: Mutex<Option<(i64, LeaseKeeper, LeaseKeepAliveStream)>>,
}

impl Etcd {
    async fn client(&self) -> Result<Client, Error> {
        let client = self
            .client
            .get_or_try_init(|| async {
                let options = ConnectOptions::new()
                    .with_connect_timeout(Duration::from_secs(2))
                    .with_timeout(Duration::from_secs(2));
                Client::connect(&self.endpoints, Some(options)).await
            })
            .await
            .map_err(|error| Error::Unreachable {
                store: "etcd",
                reason: error.to_string(),
            })?;
        Ok(client.clone())
    }

    /// The live lease, granted afresh when there is none or the server let it expire.
    async fn lease(&self) -> Result<i64, Error> {
        let mut lease = self.lease.lock().await;
        if let Some((id, _, _)) = lease.as_ref() {
            return Ok(*id);
        }
        let mut client = self.client().await?;
        let granted = client
            .lease_grant(self.ttl.as_secs().max(1) as i64, None)
            .await
            .map_err(failed("granting a lease"))?;
        let (keeper, stream) = client
            .lease_keep_alive(granted.id())
            .await
            .map_err(failed("starting the lease's keep-alive"))?;
        *lease = Some((granted.id(), keeper, stream));
        Ok(granted.id())
    }

    fn keys(&self, name: &str) -> (String, String) {
        crate::lease::keys(&self.prefix, name)
    }
}

#[async_trait]
impl Backend for Etcd {
    async fn claim(&self, name: &str, owner: &str, value: &[u8]) -> Result<Option<String>, Error> {
        let lease = self.lease().await?;
        let mut client = self.client().await?;
        let (value_key, owner_key) = self.keys(name);
        let put = |key: &str, bytes: &[u8]| {
            TxnOp::put(key, bytes, Some(PutOptions::new().with_lease(lease)))
        };
        // Free, or already ours: write both under the lease; otherwise read the holder.
        let free = Txn::new()
            .when([Compare::version(owner_key.as_str(), CompareOp::Equal, 0)])
            .and_then([put(&owner_key, owner.as_bytes()), put(&value_key, value)]);
        if client
            .txn(free)
            .await
            .map_err(failed("claiming a name"))?
            .succeeded()
        {
            return Ok(None);
        }
        let ours = Txn::new()
            .when([Compare::value(owner_key.as_str(), CompareOp::Equal, owner)])
            .and_then([put(&owner_key, owner.as_bytes()), put(&value_key, value)])
            .or_else([TxnOp::get(owner_key.as_str(), None)]);
        let response = client.txn(ours).await.map_err(failed("claiming a name"))?;
        if response.succeeded() {
            return Ok(None);
        }
        let holder = response
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                TxnOpResponse::Get(get) => get
                    .kvs()
                    .first()
                    .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
                _ => None,
            })
            .unwrap_or_else(|| "another engine".into());
        Ok(Some(holder))
    }

    async fn read(&self, name: &str) -> Result<Option<Vec<u8>>, Error> {
        let mut client = self.client().await?;
        let response = client
            .get(self.keys(name).0, None)
            .await
            .map_err(failed("reading a descriptor"))?;
        Ok(response.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn release(&self, name: &str, owner: &str) -> Result<(), Error> {
        let mut client = self.client().await?;
        let (value_key, owner_key) = self.keys(name);
        let release = Txn::new()
            .when([Compare::value(owner_key.as_str(), CompareOp::Equal, owner)])
            .and_then([
                TxnOp::delete(value_key.as_str(), None),
                TxnOp::delete(owner_key.as_str(), None),
            ]);
        client
            .txn(release)
            .await
            .map_err(failed("releasing a name"))?;
        Ok(())
    }

    async fn renew(&self) -> Result<(), Error> {
        self.lease().await?;
        let mut lease = self.lease.lock().await;
        let Some((_, keeper, stream)) = lease.as_mut() else {
            return Ok(());
        };
        let answer = async {
            keeper.keep_alive().await?;
            stream.message().await
        };
        match answer.await {
            Ok(Some(response)) if response.ttl() > 0 => Ok(()),
            Ok(_) => {
                // The server let the lease expire (it was down longer than the time to
                // live): the next claim takes a new lease and writes the keys again.
                *lease = None;
                Err(Error::LeaseExpired)
            }
            Err(error) => {
                *lease = None;
                Err(failed("renewing the lease")(error))
            }
        }
    }

    fn key(&self, name: &str) -> String {
        self.keys(name).0
    }
}

/// [`Error::Request`] for `action`, from the client's error.
fn failed(action: &'static str) -> impl Fn(etcd_client::Error) -> Error {
    move |error| Error::Request {
        store: "etcd",
        action,
        reason: error.to_string(),
    }
}

/// The store for `url`; connects on first use, so an unreachable server shows up as the
/// engine's first publish failing.
///
/// # Errors
/// [`Error::BadUrl`] for a malformed URL.
pub(crate) fn store(url: &str) -> Result<LeasedStore<Etcd>, Error> {
    let (address, ttl) = crate::lease::split_ttl(url)?;
    let rest = address
        .strip_prefix("etcd://")
        .ok_or_else(|| bad_url(url, "an etcd URL starts with etcd://"))?;
    let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, "ferry"));
    let endpoints: Vec<String> = hosts
        .split(',')
        .filter(|host| !host.is_empty())
        .map(|host| format!("http://{host}"))
        .collect();
    if endpoints.is_empty() {
        return Err(bad_url(
            url,
            "name at least one host:port, as etcd://host:port[,host:port]/prefix",
        ));
    }
    let prefix = format!("/{}", prefix.trim_matches('/'));
    Ok(LeasedStore::new(
        Etcd {
            endpoints,
            prefix,
            ttl,
            client: OnceCell::new(),
            lease: Mutex::new(None),
        },
        url.to_owned(),
        ttl,
    ))
}
