//! The `mnnvl` transport: GPU memory of any node of a multi-node NVLink domain (GB200/GB300
//! NVL racks), shared by FABRIC handles through the descriptor and copied by the initiator's
//! GPU over the NVLink fabric. It uses the nvlink transport's link; only who it reaches, and
//! how the memory is imported, differ.
//!
//! It needs an IMEX channel, which nodes without one refuse at `cuMemCreate` even when the
//! device attribute says FABRIC handles are supported; the run-time probe
//! ([`crate::probe_fabric`]) decides, and its reason is what `reach` reports.

use crate::export::{export_fabric, GpuExport};
use crate::fabric_probe::{probe_fabric, FabricSupport};
use crate::link::NvlinkLink;
use crate::transport::NvlinkConfig;
use ferry_core::cuda::Driver;
use ferry_core::{
    BufferDescriptor, Endpoint, Exported, Link, Location, Reach, RegionInfo, Result,
    SegmentDescriptor, Transport,
};
use std::sync::Arc;

/// The transport's name, as shown to users.
pub const MNNVL: &str = "mnnvl";

/// GPU to GPU across the nodes of an NVLink domain, through FABRIC handles.
#[derive(Debug)]
pub struct MnnvlTransport {
    config: NvlinkConfig,
    /// Why the transport cannot be used on this node, when it cannot.
    unavailable: Option<String>,
    /// The probe's answer per local GPU ordinal.
    permitted: Vec<bool>,
}

impl MnnvlTransport {
    /// The transport for this process's GPUs, each probed for FABRIC allocations once.
    pub fn new(config: NvlinkConfig) -> MnnvlTransport {
        let driver = Driver::get();
        let gpus = match driver.devices() {
            Ok(gpus) if driver.is_ready() => gpus,
            Ok(_) => return MnnvlTransport::unavailable(config, driver.status().to_string()),
            Err(error) => {
                return MnnvlTransport::unavailable(config, format!("listing GPUs failed: {error}"))
            }
        };
        let mut refusal = None;
        let permitted = gpus
            .iter()
            .map(|gpu| match probe_fabric(gpu.ordinal) {
                FabricSupport::Permitted => true,
                FabricSupport::Refused(error) => {
                    refusal.get_or_insert(format!(
                        "GPU {} refuses FABRIC allocations: {error}",
                        gpu.ordinal
                    ));
                    false
                }
            })
            .collect::<Vec<_>>();
        let unavailable = (!permitted.contains(&true))
            .then(|| refusal.unwrap_or_else(|| "this process sees no GPU".into()));
        MnnvlTransport {
            config,
            unavailable,
            permitted,
        }
    }

    fn unavailable(config: NvlinkConfig, reason: String) -> MnnvlTransport {
        MnnvlTransport {
            config,
            unavailable: Some(reason),
            permitted: Vec::new(),
        }
    }
}

#[async_trait::async_trait]
impl Transport for MnnvlTransport {
    fn name(&self) -> &'static str {
        MNNVL
    }

    fn endpoint(&self) -> Option<Endpoint> {
        None
    }

    fn prefers_blocks(&self) -> bool {
        true
    }

    fn export(&self, region: &RegionInfo) -> Result<Option<Exported>> {
        if self.unavailable.is_some() || !matches!(region.location, Location::Device { .. }) {
            return Ok(None);
        }
        Ok(
            export_fabric(region.addr, region.len)?.map(|export| Exported {
                export: export.to_export(MNNVL),
                guard: None,
            }),
        )
    }

    fn reach(
        &self,
        local: &RegionInfo,
        _peer: &SegmentDescriptor,
        remote: &BufferDescriptor,
    ) -> Reach {
        let no = |reason: String| Reach::No { reason };
        if let Some(reason) = &self.unavailable {
            return no(reason.clone());
        }
        let Location::Device { ordinal, .. } = local.location else {
            return no("the local memory is not on a GPU".into());
        };
        if !self
            .permitted
            .get(ordinal as usize)
            .copied()
            .unwrap_or(false)
        {
            return no(format!("GPU {ordinal} refuses FABRIC allocations"));
        }
        match GpuExport::of(remote, MNNVL) {
            Ok(Some(GpuExport::Fabric { .. })) | Err(_) => {}
            Ok(_) => return no("the peer's buffer carries no FABRIC handles".into()),
        }
        Reach::Yes { cost: 20 }
    }

    async fn open(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Link>> {
        Ok(Arc::new(NvlinkLink::new(
            MNNVL,
            peer.name.clone(),
            peer.instance,
            None,
            self.config,
            // Remote GPUs of other nodes are never visible here, so every copy takes the copy
            // engines until the kernel path is checked on a multi-node NVLink domain.
            Arc::new(Vec::new()),
            None,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::cuda::GpuId;
    use ferry_core::HostIdentity;

    fn transport(permitted: Vec<bool>, unavailable: Option<&str>) -> MnnvlTransport {
        MnnvlTransport {
            config: NvlinkConfig::default(),
            unavailable: unavailable.map(str::to_owned),
            permitted,
        }
    }

    fn peer() -> SegmentDescriptor {
        SegmentDescriptor {
            version: ferry_core::DESCRIPTOR_VERSION,
            name: "node-b:7000".into(),
            host: HostIdentity {
                hostname: "node-b".into(),
                boot_id: "other".into(),
            },
            generation: 1,
            instance: ferry_core::InstanceId::from_u128(1),
            process: ferry_core::InstanceId::from_u128(1),
            pid: 1,
            endpoints: Vec::new(),
            gpus: Vec::new(),
            buffers: Vec::new(),
            signature: None,
        }
    }

    fn on_gpu(ordinal: u32) -> RegionInfo {
        RegionInfo {
            addr: 0x1000,
            len: 4096,
            location: Location::Device {
                gpu: GpuId([1; 16]),
                ordinal,
            },
        }
    }

    fn remote(export: Option<GpuExport>) -> BufferDescriptor {
        BufferDescriptor {
            addr: 0x9000,
            len: 4096,
            location: Location::Device {
                gpu: GpuId([2; 16]),
                ordinal: 0,
            },
            name: None,
            exports: export
                .map(|export| export.to_export(MNNVL))
                .into_iter()
                .collect(),
        }
    }

    fn fabric() -> Option<GpuExport> {
        Some(GpuExport::Fabric {
            handles: vec!["00".repeat(64)],
            offset: 0,
            pieces: vec![2 << 20],
        })
    }

    #[test]
    fn fabric_memory_on_another_node_is_reached_when_the_probe_permits() {
        let reach = transport(vec![true], None).reach(&on_gpu(0), &peer(), &remote(fabric()));
        assert_eq!(reach, Reach::Yes { cost: 20 });
    }

    #[test]
    fn refusals_name_their_reason() {
        let cases = [
            (
                transport(
                    vec![true],
                    Some("GPU 0 refuses FABRIC allocations: CUDA_ERROR_NOT_PERMITTED"),
                ),
                on_gpu(0),
                fabric(),
                "NOT_PERMITTED",
            ),
            (
                transport(vec![true, false], None),
                on_gpu(1),
                fabric(),
                "GPU 1 refuses",
            ),
            (
                transport(vec![true], None),
                on_gpu(0),
                None,
                "no FABRIC handles",
            ),
            (
                transport(vec![true], None),
                RegionInfo {
                    addr: 0x1000,
                    len: 4096,
                    location: Location::Host { pinned: true },
                },
                fabric(),
                "not on a GPU",
            ),
        ];
        for (transport, local, export, expected) in cases {
            match transport.reach(&local, &peer(), &remote(export)) {
                Reach::No { reason } => assert!(reason.contains(expected), "{reason}"),
                other => panic!("expected a refusal naming {expected:?}, got {other:?}"),
            }
        }
    }
}
