pub use crate::config::NvlinkConfig;
use crate::config::{CudaMallocStaging, CUDA_MALLOC_STAGING_ENV};
use crate::export::{export_local, GpuExport};
use crate::fd_passing::{
    configured_socket_dir, open_messages, FdServer, FdSocket, SocketDir, SOCKET_DIR_ENV,
};
use crate::link::{NoRing, NvlinkLink};
use crate::trial::{ExportKind, Mapped, Trials};
use ferry_core::auth::Secret;
use ferry_core::cuda::{DeviceInfo, Driver};
use ferry_core::{
    BufferDescriptor, Endpoint, EngineContext, Error, Exported, HostIdentity, InstanceId, Link,
    Location, Reach, RegionInfo, Result, SegmentDescriptor, Transport,
};
use std::sync::{Arc, OnceLock};

/// The transport's name, as shown to users.
pub const NVLINK: &str = "nvlink";

/// GPU to GPU between processes of one host, through CUDA IPC mappings.
#[derive(Debug)]
pub struct NvlinkTransport {
    host: HostIdentity,
    gpus: Arc<Vec<DeviceInfo>>,
    /// `(from, to)` ordinals of the GPU pairs with peer access, probed once.
    peer_pairs: Vec<(u32, u32)>,
    config: NvlinkConfig,
    unavailable: Option<String>,
    /// The id shared by this process's engines; `None` when none could be drawn, and then no
    /// peer is taken for this process.
    process: Option<InstanceId>,
    /// Whether mapping each peer's kinds of export worked, tried once per peer and kind; the
    /// links read it to tell which memory goes through staging.
    trials: Arc<Trials>,
    /// Whether an instance id names an engine alive in this process.
    is_local: fn(InstanceId) -> bool,
    /// What the engine this transport serves told it, once attached.
    attached: OnceLock<Attached>,
}

/// What nvlink keeps of the engine it serves.
#[derive(Debug)]
struct Attached {
    /// Proven to peers' fd sockets.
    secret: Option<Secret>,
    /// Hands out this engine's VMM memory and reads the message rings peers of this host
    /// hand it; `None` when it could not be bound.
    fds: Option<FdServer>,
    /// The engine's segment name, which its notifications carry.
    name: String,
}

impl NvlinkTransport {
    /// The transport for this process's GPUs. Without a usable CUDA driver it is still
    /// created, and declines every pair with the driver's status as the reason.
    pub fn new(config: NvlinkConfig) -> NvlinkTransport {
        let driver = Driver::get();
        let (gpus, unavailable) = match driver.devices() {
            Ok(gpus) if driver.is_ready() => (gpus, None),
            Ok(_) => (Vec::new(), Some(driver.status().to_string())),
            Err(error) => (Vec::new(), Some(format!("listing GPUs failed: {error}"))),
        };
        let mut peer_pairs = Vec::new();
        for from in &gpus {
            for to in &gpus {
                if from.ordinal != to.ordinal
                    && driver
                        .can_access_peer(from.ordinal, to.ordinal)
                        .unwrap_or(false)
                {
                    peer_pairs.push((from.ordinal, to.ordinal));
                }
            }
        }
        let staging = CudaMallocStaging::resolve(
            config.cuda_malloc_staging,
            std::env::var_os(CUDA_MALLOC_STAGING_ENV),
        );
        NvlinkTransport {
            host: HostIdentity::current(),
            gpus: Arc::new(gpus),
            peer_pairs,
            config,
            unavailable,
            process: InstanceId::of_this_process().ok(),
            trials: Arc::new(Trials::real(staging, config.staging_bytes)),
            is_local: ferry_core::is_local_engine,
            attached: OnceLock::new(),
        }
    }

    fn secret(&self) -> Option<&Secret> {
        self.attached
            .get()
            .and_then(|attached| attached.secret.as_ref())
    }

    fn same_host(&self, peer: &SegmentDescriptor) -> bool {
        self.host.same_boot(&peer.host)
    }

    /// Whether `peer` is an engine of this very process: by the random process id (two
    /// containers' PID 1 on one host are different processes), and, since a peer can copy
    /// that id, only if this process really runs an engine with the peer's instance id.
    fn same_process(&self, peer: &SegmentDescriptor) -> bool {
        self.process == Some(peer.process) && self.same_host(peer) && (self.is_local)(peer.instance)
    }
}

#[async_trait::async_trait]
impl Transport for NvlinkTransport {
    fn name(&self) -> &'static str {
        NVLINK
    }

    /// The fd socket's file in the socket directory, when the engine binds one: the place
    /// peers of other network namespaces hand this engine message rings and confirm its IPC
    /// handles at (its VMM exports carry it too).
    fn endpoint(&self) -> Option<Endpoint> {
        let path = self.attached.get()?.fds.as_ref()?.socket_path()?;
        Some(Endpoint {
            transport: NVLINK.to_owned(),
            address: path.to_owned(),
        })
    }

    fn prefers_blocks(&self) -> bool {
        true
    }

    /// Removes the fd socket's file from the socket directory: the engine is stopping, and the
    /// server itself may be dropped after its process exited.
    fn stop(&self) {
        if let Some(server) = self
            .attached
            .get()
            .and_then(|attached| attached.fds.as_ref())
        {
            server.withdraw_file();
        }
    }

    /// Starts the engine's fd socket: the abstract one (a failure is logged, and VMM memory
    /// and notifications of this host's peers then take TCP), and with a socket directory
    /// ([`NvlinkConfig::socket_dir`], else `FERRY_SOCKET_DIR`) its file there too.
    ///
    /// # Errors
    /// [`Error::Io`] whose source is a [`crate::SocketDirError`] when the socket directory
    /// cannot be used: the operator asked for it, so the engine is not built without it.
    fn attach(&self, engine: &EngineContext) -> Result<()> {
        if self.attached.get().is_some() {
            return Err(Error::ApiMisuse(
                "this nvlink transport already serves an engine; create one per engine".into(),
            ));
        }
        let dir = configured_socket_dir(self.config.socket_dir, std::env::var_os(SOCKET_DIR_ENV))
            .map(|dir| SocketDir::check(&dir))
            .transpose()
            .map_err(socket_dir_error)?;
        let mut fds = FdServer::start(
            engine.instance,
            engine.secret.clone(),
            &engine.runtime,
            engine.inbox.clone(),
            self.config,
        )
        .inspect_err(|error| {
            tracing::warn!(%error, "opening the fd-passing socket failed; VMM GPU memory cannot be shared, and notifications from this host's peers come over TCP");
        })
        .ok();
        if let (Some(server), Some(dir)) = (fds.as_mut(), &dir) {
            server.serve_in(dir).map_err(socket_dir_error)?;
        }
        let attached = Attached {
            secret: engine.secret.clone(),
            fds,
            name: engine.name.clone(),
        };
        self.attached.set(attached).map_err(|_| {
            Error::ApiMisuse(
                "this nvlink transport already serves an engine; create one per engine".into(),
            )
        })
    }

    fn export(&self, region: &RegionInfo) -> Result<Option<Exported>> {
        if self.unavailable.is_some() || !matches!(region.location, Location::Device { .. }) {
            return Ok(None);
        }
        let fds = self
            .attached
            .get()
            .and_then(|attached| attached.fds.as_ref());
        Ok(
            export_local(region.addr, region.len, fds)?.map(|(export, guard)| Exported {
                export: export.to_export(NVLINK),
                guard,
            }),
        )
    }

    async fn import(&self, peer: &SegmentDescriptor) {
        if self.unavailable.is_some() || !self.same_host(peer) || self.same_process(peer) {
            return;
        }
        let exports = peer
            .buffers
            .iter()
            .filter(|buffer| matches!(buffer.location, Location::Device { .. }))
            .filter_map(|buffer| {
                let export = GpuExport::of(buffer, NVLINK).ok().flatten()?;
                Some((export, buffer.addr))
            });
        let ordinals: Vec<u32> = self.gpus.iter().map(|gpu| gpu.ordinal).collect();
        self.trials
            .try_peer(peer, exports, &ordinals, &peer_socket(peer), self.secret())
            .await;
    }

    fn reach(
        &self,
        local: &RegionInfo,
        peer: &SegmentDescriptor,
        remote: &BufferDescriptor,
    ) -> Reach {
        let no = |reason: String| Reach::No { reason };
        if let Some(reason) = &self.unavailable {
            return no(reason.clone());
        }
        let Location::Device {
            ordinal: local_gpu, ..
        } = local.location
        else {
            return no("the local memory is not on a GPU".into());
        };
        let Location::Device {
            gpu: remote_gpu, ..
        } = remote.location
        else {
            return no("the peer's memory is not on a GPU".into());
        };
        if !self.same_host(peer) {
            return no(format!(
                "the peer runs on host {:?} (boot {}), not on this one",
                peer.host.hostname, peer.host.boot_id
            ));
        }
        if self.same_process(peer) {
            return Reach::Yes { cost: 5 };
        }
        let export = match GpuExport::of(remote, NVLINK) {
            Ok(Some(export @ (GpuExport::CudaIpc { .. } | GpuExport::VmmFd { .. }))) => export,
            Ok(_) => return no("the peer's buffer carries no CUDA IPC handle or VMM export".into()),
            // The peer's fault: the transfer routed here fails with the violation and closes
            // the peer, instead of quietly taking TCP.
            Err(_) => return Reach::Yes { cost: 10 },
        };
        // A remote GPU this process cannot see (CUDA_VISIBLE_DEVICES) is still mapped through
        // IPC; whether the two GPUs can reach each other is then up to the driver.
        if let Some(visible) = self.gpus.iter().find(|gpu| gpu.uuid == remote_gpu) {
            let reachable = visible.ordinal == local_gpu
                || self.peer_pairs.contains(&(local_gpu, visible.ordinal));
            if !reachable {
                return no(format!(
                    "GPU {local_gpu} cannot access GPU {} ({remote_gpu}) as a peer",
                    visible.ordinal
                ));
            }
        }
        // Namespaces, cgroups and users decide whether the mapping works, and nothing short
        // of trying tells: `import` mapped this kind of export once and kept the answer.
        match self
            .trials
            .verdict(local_gpu, peer.instance, ExportKind::of(&export))
        {
            Some(Ok(Mapped::Directly)) => Reach::Yes { cost: 10 },
            // One more copy, on the peer's GPU: still far ahead of TCP's host staging.
            Some(Ok(Mapped::ThroughStaging { .. })) => Reach::Yes { cost: 20 },
            Some(Err(unmappable)) => no(unmappable.to_string()),
            // Left untried as the peer's lie: routed here, it fails with the violation.
            None if crate::bounds::export_owner(&export, peer.instance).is_err() => {
                Reach::Yes { cost: 10 }
            }
            None => no("nvlink has not tried this peer's kind of GPU memory here yet (the engine reads a peer's descriptor when it connects or refreshes it)".into()),
        }
    }

    fn carries_notifications(&self, peer: &SegmentDescriptor) -> bool {
        self.config.shared_memory_notifications
            && self.same_host(peer)
            && self.attached.get().is_some()
    }

    async fn open(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Link>> {
        let local_peer = self.same_process(peer).then_some(peer.instance);
        let socket = peer_socket(peer);
        let messages = match self.attached.get() {
            Some(attached) if self.carries_notifications(peer) => {
                open_messages(&socket, &peer.name, &attached.name, self.secret())
                    .await
                    .map_err(NoRing::from)
            }
            _ => Err(NoRing::NotCarried),
        };
        Ok(Arc::new(
            NvlinkLink::new(
                NVLINK,
                peer.name.clone(),
                peer.instance,
                local_peer,
                self.config,
                Arc::clone(&self.gpus),
                self.secret().cloned(),
            )
            .with_socket(socket)
            .with_messages(messages)
            .with_trials(Arc::clone(&self.trials)),
        ))
    }
}

/// `peer`'s fd socket: its abstract name, and the file its descriptor's `nvlink` endpoint
/// names when that is the peer engine's own ([`crate::bounds::socket_path`]). An endpoint
/// naming anything else is not used (and logged): the peer is then reached by name only.
fn peer_socket(peer: &SegmentDescriptor) -> FdSocket {
    let path = peer.endpoint(NVLINK).and_then(|path| {
        crate::bounds::socket_path(path, peer.instance, "endpoints")
            .inspect_err(|violation| {
                tracing::warn!(peer = %peer.name, %violation, "the peer's nvlink endpoint is not its own fd socket; it is reached by its abstract socket only");
            })
            .ok()
            .map(|()| path.to_owned())
    });
    FdSocket::new(crate::fd_socket_name(peer.instance), path)
}

/// The error that stops an engine whose socket directory cannot be used: [`Error::Io`] with
/// the [`crate::SocketDirError`] as its source, which says what to do.
fn socket_dir_error(error: crate::SocketDirError) -> Error {
    Error::Io {
        what: "starting nvlink's fd socket in the socket directory".into(),
        source: std::io::Error::other(error),
    }
}

#[cfg(test)]
mod socket_dir_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::cuda::GpuId;

    const LOCAL_GPU: GpuId = GpuId([1; 16]);
    const REMOTE_GPU: GpuId = GpuId([2; 16]);

    fn transport() -> NvlinkTransport {
        NvlinkTransport {
            host: HostIdentity {
                hostname: "node-a".into(),
                boot_id: "boot-1".into(),
            },
            gpus: Arc::new(vec![DeviceInfo {
                ordinal: 0,
                uuid: LOCAL_GPU,
                pci_bus_id: "0000:06:00.0".into(),
                name: "test GPU".into(),
            }]),
            peer_pairs: Vec::new(),
            config: NvlinkConfig::default(),
            unavailable: None,
            process: Some(THIS_PROCESS),
            trials: Arc::new(Trials::new(maps_unless_vmm())),
            is_local: |instance| instance == THIS_PROCESS,
            attached: OnceLock::new(),
        }
    }

    /// `transport.reach` after the engine had the transport import a descriptor listing
    /// `remote`, as the engine does when it connects.
    fn reach(
        transport: &NvlinkTransport,
        local: &RegionInfo,
        peer: &SegmentDescriptor,
        remote: &BufferDescriptor,
    ) -> Reach {
        let mut peer = peer.clone();
        peer.buffers = vec![remote.clone()];
        futures::executor::block_on(transport.import(&peer));
        transport.reach(local, &peer, remote)
    }

    const THIS_PROCESS: InstanceId = InstanceId::from_u128(0x70);
    const OTHER_PROCESS: InstanceId = InstanceId::from_u128(0x71);

    /// IPC handles map; fd sockets are out of reach, as across network namespaces.
    fn maps_unless_vmm() -> crate::trial::Mapper {
        Arc::new(|_, export, _, _, _| {
            Box::pin(async move {
                match export {
                    GpuExport::VmmFd { .. } => Err(crate::trial::Failed::lasting(
                        "connecting to the peer's fd socket: Connection refused",
                    )),
                    _ => Ok(Mapped::Directly),
                }
            })
        })
    }

    /// A peer on host `hostname`; `node-b` is another machine (another boot id), any other
    /// name is this machine's kernel seen from a container with its own host name.
    fn peer(hostname: &str, process: InstanceId) -> SegmentDescriptor {
        SegmentDescriptor {
            version: ferry_core::DESCRIPTOR_VERSION,
            name: "decode".into(),
            host: HostIdentity {
                hostname: hostname.into(),
                boot_id: match hostname {
                    "node-b" => "boot-2".into(),
                    _ => "boot-1".into(),
                },
            },
            generation: 1,
            instance: process,
            process,
            // Both sides are PID 1 in their containers; the PID must not matter.
            pid: std::process::id(),
            endpoints: Vec::new(),
            gpus: Vec::new(),
            buffers: Vec::new(),
            signature: None,
        }
    }

    fn local(location: Location) -> RegionInfo {
        RegionInfo {
            addr: 0x1000,
            len: 4096,
            location,
        }
    }

    fn remote(export: Option<GpuExport>) -> BufferDescriptor {
        BufferDescriptor {
            addr: 0x9000,
            len: 4096,
            location: Location::Device {
                gpu: REMOTE_GPU,
                ordinal: 0,
            },
            name: None,
            exports: export
                .map(|export| export.to_export(NVLINK))
                .into_iter()
                .collect(),
        }
    }

    fn ipc() -> Option<GpuExport> {
        Some(GpuExport::CudaIpc {
            handle: "00".repeat(64),
            offset: 0,
        })
    }

    const ON_GPU: Location = Location::Device {
        gpu: LOCAL_GPU,
        ordinal: 0,
    };

    #[test]
    fn a_gpu_buffer_of_another_process_on_this_host_is_reached() {
        let reach = reach(
            &transport(),
            &local(ON_GPU),
            &peer("node-a", OTHER_PROCESS),
            &remote(ipc()),
        );
        assert_eq!(reach, Reach::Yes { cost: 10 });
    }

    #[test]
    fn the_same_process_is_reached_without_ipc() {
        let reach = reach(
            &transport(),
            &local(ON_GPU),
            &peer("node-a", THIS_PROCESS),
            &remote(None),
        );
        assert_eq!(reach, Reach::Yes { cost: 5 });
    }

    #[test]
    fn a_peer_with_this_pid_in_another_process_is_mapped_not_taken_for_this_process() {
        // The peer's PID equals this process's (both PID 1 in containers); only its process
        // id tells them apart, so its buffer goes through IPC.
        let other = peer("node-a", OTHER_PROCESS);
        assert_eq!(other.pid, std::process::id());
        assert_eq!(
            reach(&transport(), &local(ON_GPU), &other, &remote(ipc())),
            Reach::Yes { cost: 10 }
        );
        assert!(matches!(
            reach(&transport(), &local(ON_GPU), &other, &remote(None)),
            Reach::No { .. }
        ));
    }

    #[test]
    fn a_peer_that_copies_this_process_id_is_not_taken_for_this_process() {
        // The descriptor claims this process, but no engine here has its instance id: its
        // addresses are not used as they are, and without an export it is not reached.
        let mut impostor = peer("node-a", THIS_PROCESS);
        impostor.instance = OTHER_PROCESS;
        assert!(!transport().same_process(&impostor));
        assert!(matches!(
            reach(&transport(), &local(ON_GPU), &impostor, &remote(None)),
            Reach::No { .. }
        ));
        assert_eq!(
            reach(&transport(), &local(ON_GPU), &impostor, &remote(ipc())),
            Reach::Yes { cost: 10 }
        );
    }

    #[test]
    fn an_export_that_does_not_map_here_is_declined_with_the_cause() {
        let vmm = Some(GpuExport::VmmFd {
            socket: crate::fd_socket_name(OTHER_PROCESS),
            socket_path: None,
            region: 0x9000,
            offset: 0,
            pieces: vec![4096],
        });
        match reach(
            &transport(),
            &local(ON_GPU),
            &peer("node-a", OTHER_PROCESS),
            &remote(vmm),
        ) {
            Reach::No { reason } => {
                assert!(reason.contains("Connection refused"), "{reason}");
                assert!(reason.contains("TCP staging"), "{reason}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_container_with_its_own_host_name_on_this_machine_is_on_this_host() {
        // Pods have their own UTS namespace: another host name, the same kernel boot.
        let pod = peer("decode-pod-7f9c", OTHER_PROCESS);
        assert_eq!(
            reach(&transport(), &local(ON_GPU), &pod, &remote(ipc())),
            Reach::Yes { cost: 10 }
        );
    }

    #[test]
    fn other_hosts_host_memory_and_missing_handles_are_declined_with_the_reason() {
        let reasons = [
            reach(
                &transport(),
                &local(ON_GPU),
                &peer("node-b", OTHER_PROCESS),
                &remote(ipc()),
            ),
            reach(
                &transport(),
                &local(Location::Host { pinned: true }),
                &peer("node-a", OTHER_PROCESS),
                &remote(ipc()),
            ),
            reach(
                &transport(),
                &local(ON_GPU),
                &peer("node-a", OTHER_PROCESS),
                &remote(None),
            ),
        ];
        let expected = [
            "node-b",
            "local memory is not on a GPU",
            "no CUDA IPC handle",
        ];
        for (reach, expected) in reasons.iter().zip(expected) {
            match reach {
                Reach::No { reason } => assert!(reason.contains(expected), "{reason}"),
                other => panic!("expected a refusal naming {expected:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn without_a_driver_every_pair_is_declined_with_its_status() {
        let mut transport = transport();
        transport.unavailable = Some("no CUDA driver library (libcuda) found".into());
        let reach = transport.reach(
            &local(ON_GPU),
            &peer("node-a", OTHER_PROCESS),
            &remote(ipc()),
        );
        assert_eq!(
            reach,
            Reach::No {
                reason: "no CUDA driver library (libcuda) found".into()
            }
        );
    }
}
