//! `Engine`: registers memory, opens peers, starts batches and hands out the notification
//! stream, as `ferry::Engine` does.

use super::batch::Batch;
use super::notifications::Notifications;
use super::peer::Peer;
use super::region::Region;
use super::{drop_outside_runtime, duration};
use crate::errors::{to_py, FerryError};
use parking_lot::RwLock;
use pyo3::prelude::*;
use std::sync::Arc;

/// A ferry engine. Closing it (or dropping the last reference) stops it: transfers in flight
/// fail, and peers can no longer reach its memory.
#[pyclass(module = "ferry_kv._ferry", frozen)]
pub(crate) struct Engine {
    engine: RwLock<Option<Arc<ferry::Engine>>>,
}

impl Engine {
    /// The running engine, or `FerryError` once it was closed.
    pub(crate) fn running(&self) -> PyResult<Arc<ferry::Engine>> {
        self.engine.read().clone().ok_or_else(|| {
            FerryError::new_err("the engine is closed; create a new Engine to transfer again")
        })
    }
}

#[pymethods]
impl Engine {
    /// Starts an engine listening on `listen`, reached by peers at `advertise` (the listen
    /// host when not given), publishing its descriptor where `metadata` says (`p2p`, `memory`,
    /// `etcd://…`, `redis://…`). Peers must prove they hold `secret` (`FERRY_SECRET` when
    /// `None`). A transfer fails after `transfer_timeout` seconds. `gpu_links=False` moves GPU
    /// memory over TCP only. `socket_dir` (`FERRY_SOCKET_DIR` when `None`) is a directory
    /// shared with engines of other network namespaces, such as another pod's: the engine
    /// also serves its fd socket there (see `ferry::NvlinkConfig::socket_dir`).
    #[new]
    #[pyo3(signature = (listen = "127.0.0.1:0", advertise = None, metadata = "p2p", secret = None, transfer_timeout = 30.0, gpu_links = true, socket_dir = None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one per setting.
    fn new(
        py: Python<'_>,
        listen: &str,
        advertise: Option<&str>,
        metadata: &str,
        secret: Option<&[u8]>,
        transfer_timeout: f64,
        gpu_links: bool,
        socket_dir: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let store = ferry::metadata::from_url(metadata)
            .map_err(|error| FerryError::new_err(format!("metadata `{metadata}`: {error}")))?;
        let mut links = ferry::Links::default().gpu_links(gpu_links);
        if let Some(dir) = socket_dir {
            links = links.nvlink(ferry::NvlinkConfig::default().socket_dir(dir));
        }
        let mut builder = links
            .builder()
            .listen(listen)
            .metadata(store)
            .transfer_timeout(duration(transfer_timeout, "transfer_timeout")?);
        if let Some(host) = advertise {
            builder = builder.advertise(host);
        }
        if let Some(secret) = secret {
            builder = builder.secret(secret);
        }
        let engine = py.detach(|| builder.build_blocking()).map_err(to_py)?;
        Ok(Engine {
            engine: RwLock::new(Some(Arc::new(engine))),
        })
    }

    /// The engine's name, `host:port`: what peers pass to `connect`.
    #[getter]
    fn name(&self) -> PyResult<String> {
        Ok(self.running()?.name().to_owned())
    }

    /// The port the engine listens on.
    #[getter]
    fn port(&self) -> PyResult<u16> {
        Ok(self.running()?.local_addr().port())
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.engine.read().is_none()
    }

    /// Registers `nbytes` at `addr` (host or GPU memory; the kind is detected) and keeps
    /// `owner` alive until the region is closed. The memory must stay valid that long.
    #[pyo3(signature = (addr, nbytes, owner = None))]
    fn register(
        &self,
        py: Python<'_>,
        addr: u64,
        nbytes: u64,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<Region> {
        let engine = self.running()?;
        let len = byte_count(nbytes)?;
        // SAFETY: the caller promises (and `ferry_kv.Engine.register` ensures, by passing the
        // object that owns the memory as `owner`, which the region keeps) that `addr..+nbytes`
        // stays valid until the region is deregistered, which `Region` does before releasing
        // `owner`. Peers writing it concurrently is the point of registering it.
        let region = py
            .detach(|| unsafe { engine.register(addr as *mut u8, len as u64) })
            .map_err(to_py)?;
        Ok(Region::new(region, owner))
    }

    /// A fresh, zeroed host buffer of `nbytes`, owned and registered by the engine.
    fn allocate(&self, py: Python<'_>, nbytes: u64) -> PyResult<Region> {
        let engine = self.running()?;
        let len = byte_count(nbytes)?;
        let region = py.detach(|| engine.allocate(len as u64)).map_err(to_py)?;
        Ok(Region::new(region, None))
    }

    /// Opens the peer named `name` (its `host:port` with `p2p` metadata), fetching its
    /// descriptor afresh; connect again to see memory it registered since.
    fn connect(&self, py: Python<'_>, name: &str) -> PyResult<Peer> {
        let engine = self.running()?;
        let peer = py.detach(|| engine.connect_blocking(name)).map_err(to_py)?;
        Ok(Peer::new(peer))
    }

    /// An empty batch of transfers with `peer`.
    fn batch(&self, peer: PyRef<'_, Peer>) -> PyResult<Batch> {
        let engine = self.running()?;
        Ok(Batch::new(engine.batch(peer.inner()), peer.inner().clone()))
    }

    /// Sends `payload` (at most 64 KiB) to `peer` on its own, returning once the peer took it.
    fn notify(&self, py: Python<'_>, peer: PyRef<'_, Peer>, payload: Vec<u8>) -> PyResult<()> {
        let engine = self.running()?;
        let peer = peer.inner().clone();
        py.detach(|| engine.notify_blocking(&peer, payload))
            .map_err(to_py)
    }

    /// The stream of notifications peers send to this engine; there is one per engine.
    fn notifications(&self) -> PyResult<Notifications> {
        let stream = self.running()?.notifications().map_err(to_py)?;
        Ok(Notifications::new(stream))
    }

    /// Stops the engine; transfers in flight fail. Closing twice does nothing.
    fn close(&self, py: Python<'_>) {
        let engine = self.engine.write().take();
        py.detach(|| drop(engine));
    }

    fn __repr__(&self) -> String {
        match self.running() {
            Ok(engine) => format!("Engine(name={:?})", engine.name()),
            Err(_) => "Engine(closed)".to_owned(),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(engine) = self.engine.get_mut().take() {
            drop_outside_runtime(engine);
        }
    }
}

/// `nbytes` as a length of this machine, or a `FerryError` saying it does not fit.
fn byte_count(nbytes: u64) -> PyResult<usize> {
    usize::try_from(nbytes).map_err(|_| {
        FerryError::new_err(format!(
            "{nbytes} bytes do not fit this machine's addresses"
        ))
    })
}
