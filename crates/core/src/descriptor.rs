//! An engine's descriptor: what a peer needs to know to reach the engine's memory.

use crate::error::{Error, Result};
use crate::identity::InstanceId;
use serde::{Deserialize, Serialize};

/// Where a registered region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Location {
    /// Host memory; `pinned` when CUDA has page-locked it.
    Host {
        /// Whether the pages are pinned through CUDA.
        pinned: bool,
    },
    /// Memory on a GPU.
    Device {
        /// The GPU, by UUID (the same in every process).
        gpu: crate::cuda::GpuId,
        /// The GPU's ordinal in the owning process.
        ordinal: u32,
    },
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Host { pinned: true } => f.write_str("pinned host memory"),
            Location::Host { pinned: false } => f.write_str("pageable host memory"),
            Location::Device { gpu, ordinal } => write!(f, "memory of GPU {ordinal} ({gpu})"),
        }
    }
}

/// The descriptor format this build writes and reads.
pub const DESCRIPTOR_VERSION: u32 = 3;

/// An engine's descriptor: everything a peer needs to reach the engine, fetched by the
/// engine's name: its name, host, endpoints and buffers.
///
/// Serialized as JSON; `version` lets a reader refuse a format it does not know.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// Format version, [`DESCRIPTOR_VERSION`] for this build.
    pub version: u32,
    /// The engine's name; by default `host:port` of its control listener.
    pub name: String,
    /// Which machine (and which boot of it) the engine runs on.
    pub host: HostIdentity,
    /// Bumped whenever the engine's registrations change.
    pub generation: u64,
    /// The engine's random identity: a descriptor with another instance id comes from another
    /// engine (a restart, or an impostor), whatever its name, host and PID.
    pub instance: InstanceId,
    /// Shared by the engines of one process: only peers with this process's id use remote
    /// addresses directly, without mapping them.
    pub process: InstanceId,
    /// The engine's operating-system process id, for people reading logs; never used to decide
    /// anything (in containers every service may be PID 1).
    #[serde(default)]
    pub pid: u32,
    /// Where each transport can reach the engine.
    pub endpoints: Vec<Endpoint>,
    /// The GPUs the engine's process sees.
    #[serde(default)]
    pub gpus: Vec<crate::cuda::DeviceInfo>,
    /// Registered buffers, in registration order.
    pub buffers: Vec<BufferDescriptor>,
    /// HMAC-SHA256 under the shared secret over the rest of the descriptor, hex, when its
    /// engine has a secret: engines with the same secret refuse a descriptor whose signature
    /// does not match, whichever store or peer it came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

/// Identifies one boot of one machine, so peers can tell "same host" reliably: the boot id
/// decides ([`HostIdentity::same_boot`]); the host name is for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIdentity {
    /// The kernel's host name.
    pub hostname: String,
    /// The kernel's boot id (changes on every boot).
    pub boot_id: String,
}

impl HostIdentity {
    /// Whether both name the same running kernel: by boot id alone, since containers on one
    /// host each have their own host name (UTS namespace) but share the kernel's boot id.
    /// False when either boot id is unknown.
    pub fn same_boot(&self, other: &HostIdentity) -> bool {
        !self.boot_id.is_empty() && self.boot_id == other.boot_id
    }

    /// Reads this machine's identity from the kernel; fields it cannot read are left empty.
    pub fn current() -> Self {
        let read = |path: &str| {
            std::fs::read_to_string(path)
                .map(|text| text.trim().to_owned())
                .unwrap_or_default()
        };
        HostIdentity {
            hostname: read("/proc/sys/kernel/hostname"),
            boot_id: read("/proc/sys/kernel/random/boot_id"),
        }
    }
}

/// An address at which one transport reaches the engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The transport's name, such as `tcp`.
    pub transport: String,
    /// The address in that transport's format (`host:port` for TCP).
    pub address: String,
}

/// One registered buffer as peers see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDescriptor {
    /// First byte, in the owning process's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where the memory lives.
    pub location: Location,
    /// The name its owner gave it ([`crate::Region::set_name`]), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// How each transport that can reach it from another process does so, one entry per
    /// transport; only the transport named in an entry reads it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exports: Vec<Export>,
}

impl BufferDescriptor {
    /// The export `transport` published for this buffer, if it published one.
    pub fn export(&self, transport: &str) -> Option<&Export> {
        self.exports
            .iter()
            .find(|export| export.transport == transport)
    }
}

/// One transport's description of how a process elsewhere reaches a registered buffer (a
/// handle to map, a key to use). Core carries it in the descriptor without reading it: the
/// transport named by `transport` writes `data` when the buffer is registered and reads it
/// when a peer's buffer is routed, refusing versions it does not know.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Export {
    /// The transport that wrote it, such as `nvlink`.
    pub transport: String,
    /// The format of `data`, as the transport numbers its formats.
    pub version: u32,
    /// The transport's own encoding of what peers need.
    pub data: String,
}

impl SegmentDescriptor {
    /// The descriptor as JSON bytes.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing plain structs of strings and integers into a Vec cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses JSON bytes, refusing other format versions.
    ///
    /// # Errors
    /// [`Error::Metadata`] when the bytes are not a descriptor or have another version.
    pub fn from_json(name: &str, bytes: &[u8]) -> Result<Self> {
        let descriptor: SegmentDescriptor =
            serde_json::from_slice(bytes).map_err(|error| Error::Metadata {
                name: name.to_owned(),
                reason: format!("not a ferry engine's descriptor ({error}); check that the name points at a ferry engine"),
            })?;
        if descriptor.version != DESCRIPTOR_VERSION {
            return Err(Error::Metadata {
                name: name.to_owned(),
                reason: format!(
                    "descriptor version {} is not {DESCRIPTOR_VERSION}; run the same ferry version on both sides",
                    descriptor.version
                ),
            });
        }
        Ok(descriptor)
    }

    /// The endpoint of `transport`, if the engine offers one.
    pub fn endpoint(&self, transport: &str) -> Option<&str> {
        self.endpoints
            .iter()
            .find(|endpoint| endpoint.transport == transport)
            .map(|endpoint| endpoint.address.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "127.0.0.1:7000".into(),
            host: HostIdentity::current(),
            generation: 3,
            instance: InstanceId::from_u128(11),
            process: InstanceId::from_u128(12),
            pid: 7,
            gpus: Vec::new(),
            endpoints: vec![Endpoint {
                transport: "tcp".into(),
                address: "127.0.0.1:7000".into(),
            }],
            buffers: vec![BufferDescriptor {
                addr: 0x1000,
                len: 0x1000,
                location: Location::Host { pinned: false },
                name: Some("kv".into()),
                exports: Vec::new(),
            }],
            signature: None,
        }
    }

    #[test]
    fn json_round_trip_keeps_every_field() {
        let descriptor = sample();
        let parsed = SegmentDescriptor::from_json("x", &descriptor.to_json()).unwrap();
        assert_eq!(parsed, descriptor);
    }

    #[test]
    fn other_version_is_refused_with_its_number() {
        let mut descriptor = sample();
        descriptor.version = 99;
        let error = SegmentDescriptor::from_json("x", &descriptor.to_json()).unwrap_err();
        assert!(error.to_string().contains("version 99"), "{error}");
    }
}
