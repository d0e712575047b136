//! The RDMA transport: ferry's [`Transport`] over any [`Verbs`] implementation (rdma-core
//! through sideway in an engine, the in-memory model in tests).
//!
//! - **Memory**: every registered region is registered with each NIC (host memory with
//!   `ibv_reg_mr`; GPU memory through a dma-buf, or the pointer itself where
//!   nvidia-peermem is loaded); the rkeys go in the region's export, the registrations end
//!   with the region.
//! - **Connections**: a side channel (TCP, authenticated with the engine's secret like every
//!   other channel) where the initiator offers one RC queue pair per lane and the peer answers
//!   with its own; both then move their queue pairs INIT -> RTR -> RTS. A peer's queue pairs
//!   live as long as its side-channel connection.
//! - **Data**: one-sided WRITE and READ, sliced, packed and striped ([`link`]).

mod completion;
mod config;
mod connect_failure;
mod dmabuf;
mod export;
mod handshake;
mod link;
mod nic;
mod peers;
mod plan;
mod queue;
mod refusal;
mod registry;
mod server;

pub use config::RdmaConfig;
pub use dmabuf::{CudaGpus, DmaBufRange, DmaBufSource, NoDmaBuf};
pub use export::RDMA;
pub use nic::NoUsableNic;

use self::connect_failure::ConnectFailure;
use self::export::{NicKey, RdmaExport};
use self::handshake::{ConnectRequest, ConnectResponse, QpOffer, HANDSHAKE_VERSION};
use self::link::{KeySource, Lane, RdmaLink, Shared};
use self::nic::Nic;
use self::peers::PeerTable;
use self::queue::QueuePair;
use self::registry::{Registration, RegistrationFailure, Registry};
use self::server::{Service, ANONYMOUS, AUTHENTICATES};
use crate::memory::AccessFlags;
use crate::topology::Topology;
use crate::verbs::Verbs;
use ferry_core::{
    BufferDescriptor, Endpoint, EngineContext, Error, Exported, Link, Location, Reach, RegionInfo,
    Result, SegmentDescriptor, Transport,
};
use std::sync::{Arc, OnceLock};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Every decoder of peer input, for the fuzz target ([`crate::fuzzing`]): the count of those
/// that accepted `data`; panics where a decoded value does not encode back to itself.
#[cfg(any(fuzzing, test))]
pub(crate) fn fuzz_peer_input(data: &[u8]) -> usize {
    let mut accepted = 0;
    if let Ok(request) = handshake::decode::<ConnectRequest>(data) {
        accepted += 1;
        let _ = request.check();
        let again: ConnectRequest =
            handshake::decode(&serde_json::to_vec(&request).unwrap_or_default())
                .expect("re-encoded request");
        assert_eq!(again, request, "request round trip");
    }
    if let Ok(response) = handshake::decode::<ConnectResponse>(data) {
        accepted += 1;
        if let ConnectResponse::Accepted(endpoints) = &response {
            for endpoint in endpoints {
                if let Ok(remote) = endpoint.read() {
                    assert_eq!(
                        handshake::WireEndpoint::new(
                            &remote.endpoint,
                            remote.mtu,
                            remote.rd_atomic
                        ),
                        *endpoint,
                        "endpoint round trip"
                    );
                }
            }
        }
    }
    let export = ferry_core::Export {
        transport: RDMA.to_owned(),
        version: export::EXPORT_VERSION,
        data: String::from_utf8_lossy(data).into_owned(),
    };
    if let Ok(read) = RdmaExport::from_export(&export) {
        accepted += 1;
        assert_eq!(
            RdmaExport::from_export(&read.to_export()),
            Ok(read),
            "export round trip"
        );
    }
    accepted
}

/// What RDMA costs against the other transports (TCP is 100, NVLink 5-10).
const COST: u32 = 40;

/// The names of `nics`, in order.
fn names<V: Verbs>(nics: &[Arc<Nic<V>>]) -> Vec<String> {
    nics.iter().map(|nic| nic.name.clone()).collect()
}

/// ferry's RDMA transport.
pub struct RdmaTransport<V: Verbs> {
    verbs: Arc<V>,
    config: RdmaConfig,
    nics: std::result::Result<Vec<Arc<Nic<V>>>, NoUsableNic>,
    registry: Arc<Registry>,
    /// What each peer's descriptor says, read once per generation.
    peers: Arc<PeerTable>,
    dmabuf: Arc<dyn DmaBufSource>,
    /// Where the NICs sit on the PCI tree, to register GPU memory with the nearest.
    topology: parking_lot::Mutex<Topology>,
    /// What the engine told the transport, and the side channel's port, once attached.
    attached: OnceLock<Attached>,
}

struct Attached {
    secret: Option<ferry_core::Secret>,
    instance: ferry_core::InstanceId,
    port: u16,
}

impl<V: Verbs + 'static> RdmaTransport<V> {
    /// A transport over `verbs` that opens the NICs `config` names now; GPU memory is
    /// exported through `dmabuf`. Without usable NICs it still builds: it then reaches
    /// nothing and says why ([`RdmaTransport::unavailable`]).
    pub fn new(verbs: V, config: RdmaConfig, dmabuf: Arc<dyn DmaBufSource>) -> Self {
        let config = config.sanitized();
        let nics: std::result::Result<Vec<Arc<Nic<V>>>, NoUsableNic> =
            nic::open(&verbs, &config).map(|nics| nics.into_iter().map(Arc::new).collect());
        if let Err(reason) = &nics {
            tracing::info!(%reason, "RDMA is unavailable; transfers between hosts use TCP");
        }
        let names = nics.as_deref().map(names).unwrap_or_default();
        let topology = Topology::read(&config.sysfs_root, &names);
        RdmaTransport {
            verbs: Arc::new(verbs),
            config,
            nics,
            registry: Arc::default(),
            peers: Arc::default(),
            dmabuf,
            topology: parking_lot::Mutex::new(topology),
            attached: OnceLock::new(),
        }
    }

    /// Why the transport reaches nothing, or `None` when it has NICs to use.
    pub fn unavailable(&self) -> Option<&NoUsableNic> {
        self.nics.as_ref().err()
    }

    /// The names of the NICs in use.
    pub fn nic_names(&self) -> Vec<String> {
        self.nics.as_deref().map(names).unwrap_or_default()
    }

    fn nics(&self) -> Result<&Vec<Arc<Nic<V>>>> {
        self.nics.as_ref().map_err(|reason| Error::Unavailable {
            local: "the RDMA transport".into(),
            peer: "any peer".into(),
            reason: reason.to_string(),
        })
    }

    /// The NICs (by index) to register `region` with: for GPU memory the nearest to the GPU
    /// on the PCI tree (all that tie), for host memory or an unknown placement every NIC.
    fn nics_for(&self, region: &RegionInfo, nics: &[Arc<Nic<V>>]) -> Vec<usize> {
        let every = (0..nics.len()).collect();
        let Location::Device { ordinal, .. } = region.location else {
            return every;
        };
        let Some(pci) = self.dmabuf.pci_bus_id(ordinal) else {
            return every;
        };
        let ranked = self.topology.lock().assign_gpu(&pci);
        let Some(best) = ranked.first().and_then(|choice| choice.distance) else {
            return every;
        };
        let nearest: Vec<usize> = ranked
            .iter()
            .filter(|choice| choice.distance == Some(best))
            .filter_map(|choice| nics.iter().position(|nic| nic.name == choice.name))
            .collect();
        if nearest.is_empty() {
            every
        } else {
            nearest
        }
    }

    /// Registers `region` with its NICs among `nics` ([`Self::nics_for`]): the regions
    /// registered, by NIC index.
    fn register(
        &self,
        region: &RegionInfo,
        nics: &[Arc<Nic<V>>],
    ) -> std::result::Result<Vec<(usize, V::MemoryRegion)>, RegistrationFailure> {
        let chosen = self.nics_for(region, nics);
        let access = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::RELAXED_ORDERING;
        let dmabuf = match region.location {
            // Shared: every NIC that takes no pointer names the same export failure.
            Location::Device { .. } => Some(
                self.dmabuf
                    .export(region.addr, region.len)
                    .map_err(Arc::new),
            ),
            _ => None,
        };
        let mut registered = Vec::with_capacity(chosen.len());
        for index in chosen {
            let nic = &nics[index];
            let region = match &dmabuf {
                None => self
                    .verbs
                    .reg_mr(&nic.pd, region.addr, region.len, access)
                    .map_err(|source| RegistrationFailure::Verbs {
                        nic: nic.name.clone(),
                        source,
                    })?,
                Some(Ok(buffer)) => {
                    use std::os::fd::AsFd;
                    self.verbs
                        .reg_dmabuf_mr(
                            &nic.pd,
                            buffer.fd.as_fd(),
                            buffer.offset,
                            region.len,
                            region.addr,
                            access,
                        )
                        .or_else(|dmabuf_error| {
                            self.verbs
                                .reg_mr(&nic.pd, region.addr, region.len, access)
                                .map_err(|pointer| RegistrationFailure::DmaBufAndPointer {
                                    nic: nic.name.clone(),
                                    dmabuf: dmabuf_error,
                                    pointer,
                                })
                        })?
                }
                Some(Err(export)) => self
                    .verbs
                    .reg_mr(&nic.pd, region.addr, region.len, access)
                    .map_err(|pointer| RegistrationFailure::NoDmaBuf {
                        nic: nic.name.clone(),
                        export: Arc::clone(export),
                        pointer,
                    })?,
            };
            registered.push((index, region));
        }
        Ok(registered)
    }

    async fn connect(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Link>> {
        let nics = self.nics()?;
        let name = peer.name.clone();
        let unreachable = |failure: ConnectFailure| failure.unreachable(&name);
        let exports = self.peers.of(peer);
        let address = exports
            .side_channel
            .clone()
            .map_err(|refusal| unreachable(refusal.into()))?;
        let remote_nics = exports.nics.clone();
        if remote_nics.is_empty() {
            return Err(unreachable(ConnectFailure::NoBuffers));
        }
        let mut stream = TcpStream::connect(&address).await.map_err(|source| {
            unreachable(ConnectFailure::Connect {
                address: address.clone(),
                source,
            })
        })?;
        let attached = self
            .attached
            .get()
            .ok_or_else(|| Error::ApiMisuse("the RDMA transport was not attached to an engine: add it with the engine builder's `transport`".into()))?;
        handshake::keep_alive(&stream);
        let secret = attached.secret.clone();
        let flag = if secret.is_some() {
            AUTHENTICATES
        } else {
            ANONYMOUS
        };
        stream
            .write_all(&[flag])
            .await
            .map_err(|error| unreachable(ConnectFailure::Write(error)))?;
        if let Some(secret) = &secret {
            ferry_core::auth::client(&mut stream, secret, self.config.connect_timeout)
                .await
                .map_err(|reason| Error::Unauthenticated {
                    peer: name.clone(),
                    reason,
                })?;
        }
        // Every local NIC with every peer NIC: GPU memory is registered only with the NICs
        // nearest its GPU, on both sides, so a transfer between two GPUs may need any pair.
        let pairs = (0..nics.len())
            .flat_map(|local| (0..remote_nics.len()).map(move |remote| (local, remote)));
        let count = nics.len() * remote_nics.len() * self.config.qps_per_nic_pair;
        if count > handshake::MAX_QPS {
            return Err(unreachable(ConnectFailure::TooManyQueuePairs {
                local: nics.len(),
                remote: remote_nics.len(),
                per_pair: self.config.qps_per_nic_pair,
                count,
            }));
        }
        let mut lanes = Vec::with_capacity(count);
        let mut offers = Vec::with_capacity(count);
        for (local_nic, remote_nic) in pairs {
            for _ in 0..self.config.qps_per_nic_pair {
                let queue = QueuePair::create(&self.verbs, &nics[local_nic], &self.config)
                    .map_err(|error| unreachable(error.into()))?;
                offers.push(QpOffer {
                    server_nic: remote_nics[remote_nic].clone(),
                    client: queue
                        .wire_endpoint()
                        .map_err(|error| unreachable(error.into()))?,
                });
                lanes.push(Lane {
                    queue,
                    local_nic,
                    remote_nic,
                });
            }
        }
        let request = ConnectRequest {
            version: HANDSHAKE_VERSION,
            client: format!("{:?}", attached.instance),
            offers,
        };
        handshake::send(&mut stream, &request)
            .await
            .map_err(|error| unreachable(ConnectFailure::Send(error)))?;
        // `open` bounds the whole connection by `connect_timeout`, this wait included.
        let response: ConnectResponse = handshake::receive(&mut stream)
            .await
            .map_err(|error| unreachable(ConnectFailure::Receive(error)))?;
        let endpoints = match response {
            ConnectResponse::Accepted(endpoints) => endpoints,
            ConnectResponse::Refused(reason) => {
                return Err(unreachable(ConnectFailure::PeerRefused { reason }))
            }
        };
        if endpoints.len() != lanes.len() {
            return Err(unreachable(ConnectFailure::Answered {
                answered: endpoints.len(),
                offered: lanes.len(),
            }));
        }
        for (lane, endpoint) in lanes.iter().zip(&endpoints) {
            let remote = endpoint
                .read()
                .map_err(|refusal| unreachable(refusal.into()))?;
            lane.queue
                .connect(&remote, &self.config)
                .map_err(|error| unreachable(error.into()))?;
        }
        let shared = Arc::new(Shared::new(
            name.clone(),
            Arc::clone(&self.verbs),
            KeySource {
                registry: Arc::clone(&self.registry),
                peers: Arc::clone(&self.peers),
                peer: peer.instance,
            },
            names(nics),
            remote_nics,
            lanes,
            self.config.clone(),
        ));
        let watched = Arc::downgrade(&shared);
        // The peer never writes after its answer: a read that ends means it hung up or died,
        // and its queue pairs are gone with it.
        let watcher = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut byte = [0u8; 1];
            while matches!(stream.read(&mut byte).await, Ok(1..)) {}
            if let Some(shared) = watched.upgrade() {
                tracing::info!(peer = %shared.peer, "the RDMA side channel closed; failing the link");
                shared.close();
            }
        });
        Ok(Arc::new(RdmaLink::new(shared, watcher.abort_handle())))
    }
}

#[async_trait::async_trait]
impl<V: Verbs + 'static> Transport for RdmaTransport<V> {
    fn name(&self) -> &'static str {
        RDMA
    }

    fn attach(&self, engine: &EngineContext) -> Result<()> {
        let Ok(nics) = &self.nics else { return Ok(()) };
        let listener =
            std::net::TcpListener::bind(&self.config.listen).map_err(|source| Error::Io {
                what: format!("binding the RDMA side channel to {}", self.config.listen),
                source,
            })?;
        let port = listener
            .local_addr()
            .map(|address| address.port())
            .map_err(|source| Error::Io {
                what: "reading the RDMA side channel's port".into(),
                source,
            })?;
        listener.set_nonblocking(true).map_err(|source| Error::Io {
            what: "setting up the RDMA side channel".into(),
            source,
        })?;
        let listener = {
            let _entered = engine.runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(|source| Error::Io {
                what: "setting up the RDMA side channel".into(),
                source,
            })?
        };
        let service = Arc::new(Service {
            verbs: Arc::clone(&self.verbs),
            nics: nics.clone(),
            config: self.config.clone(),
            secret: engine.secret.clone(),
        });
        self.attached
            .set(Attached {
                secret: engine.secret.clone(),
                instance: engine.instance,
                port,
            })
            .map_err(|_| {
                Error::ApiMisuse(
                    "this RDMA transport serves an engine already: give each engine its own".into(),
                )
            })?;
        engine.runtime.spawn(server::accept_loop(listener, service));
        Ok(())
    }

    fn export(&self, region: &RegionInfo) -> Result<Option<Exported>> {
        let Ok(nics) = &self.nics else {
            return Ok(None);
        };
        let registered = match self.register(region, nics) {
            Ok(registered) => registered,
            Err(reason) => {
                tracing::warn!(addr = region.addr, len = region.len, %reason, "the region is not reachable over RDMA");
                self.registry.refuse(region.addr, reason);
                return Ok(None);
            }
        };
        let (registration, keys) = Registration::record(
            &self.verbs,
            &self.registry,
            region.addr,
            nics.len(),
            registered,
        );
        let export = RdmaExport {
            keys: keys
                .into_iter()
                .map(|(nic, key)| NicKey {
                    nic: nics[nic].name.clone(),
                    rkey: key.rkey,
                })
                .collect(),
        };
        Ok(Some(Exported {
            export: export.to_export(),
            guard: Some(Box::new(registration)),
        }))
    }

    /// Reads the peer's exports when the engine learns its descriptor, so that routing and
    /// transfers only look them up.
    async fn import(&self, peer: &SegmentDescriptor) {
        self.peers.of(peer);
    }

    fn endpoint(&self) -> Option<Endpoint> {
        let port = self.attached.get()?.port;
        let address = match &self.config.advertise {
            Some(host) => format!("{host}:{port}"),
            None => format!(":{port}"),
        };
        Some(Endpoint {
            transport: RDMA.to_owned(),
            address,
        })
    }

    fn reach(
        &self,
        local: &RegionInfo,
        peer: &SegmentDescriptor,
        remote: &BufferDescriptor,
    ) -> Reach {
        let no = |reason: String| Reach::No { reason };
        if let Err(reason) = &self.nics {
            return no(format!("RDMA is unavailable here: {reason}"));
        }
        if let Err(reason) = self.registry.lkeys(local.addr) {
            return no(reason.to_string());
        }
        let exports = self.peers.of(peer);
        if let Err(refusal) = &exports.side_channel {
            return no(refusal.to_string());
        }
        match exports.buffer(remote.addr) {
            Ok(_) => Reach::Yes { cost: COST },
            Err(refusal) => no(refusal.to_string()),
        }
    }

    async fn open(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Link>> {
        tokio::time::timeout(self.config.connect_timeout, self.connect(peer))
            .await
            .map_err(|_| {
                ConnectFailure::Timeout(self.config.connect_timeout).unreachable(&peer.name)
            })?
    }
}
