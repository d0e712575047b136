//! What a registered region publishes for RDMA peers: the key each of the owner's NICs
//! registered it with. Peers address its bytes by the owner's virtual addresses (ferry
//! registers GPU memory with the address as its iova), so the export needs no base.

use super::refusal::Refusal;
use ferry_core::Export;
use serde::{Deserialize, Serialize};

/// The transport name in descriptors and endpoints.
pub const RDMA: &str = "rdma";

/// The export format this build writes and reads.
pub(crate) const EXPORT_VERSION: u32 = 1;

/// A NIC name longer than this is not one a kernel gives.
const MAX_NIC_NAME: usize = 64;
/// More NICs than this on one host is not a real machine.
const MAX_NICS: usize = 64;

/// One NIC's registration of a region: peers use `rkey` through a queue pair ending at `nic`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NicKey {
    /// The owner's device name, such as `mlx5_0`.
    pub(crate) nic: String,
    /// The remote key the NIC gave the region.
    pub(crate) rkey: u32,
}

/// A region's RDMA export: its keys, best NIC first (the one nearest its memory).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RdmaExport {
    pub(crate) keys: Vec<NicKey>,
}

impl RdmaExport {
    /// The export as core carries it.
    pub(crate) fn to_export(&self) -> Export {
        Export {
            transport: RDMA.to_owned(),
            version: EXPORT_VERSION,
            // Serializing a struct of strings and integers cannot fail.
            data: serde_json::to_string(self).unwrap_or_default(),
        }
    }

    /// Reads a peer's export, checking everything a peer controls.
    ///
    /// # Errors
    /// A reason naming what is wrong, for the log line and for `reach`'s answer.
    pub(crate) fn from_export(export: &Export) -> Result<RdmaExport, Refusal> {
        if export.version != EXPORT_VERSION {
            return Err(Refusal::ExportVersion {
                version: export.version,
            });
        }
        let parsed: RdmaExport =
            serde_json::from_str(&export.data).map_err(|error| Refusal::ExportInvalid {
                reason: error.to_string(),
            })?;
        if parsed.keys.is_empty() || parsed.keys.len() > MAX_NICS {
            return Err(Refusal::ExportNics {
                count: parsed.keys.len(),
                most: MAX_NICS,
            });
        }
        for key in &parsed.keys {
            if key.nic.is_empty() || key.nic.len() > MAX_NIC_NAME {
                return Err(Refusal::NicName {
                    len: key.nic.len(),
                    most: MAX_NIC_NAME,
                });
            }
        }
        Ok(parsed)
    }

    /// The key for the peer's NIC `nic`, if the region is registered there.
    pub(crate) fn rkey(&self, nic: &str) -> Option<u32> {
        self.keys
            .iter()
            .find(|key| key.nic == nic)
            .map(|key| key.rkey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(keys: Vec<NicKey>) -> RdmaExport {
        RdmaExport { keys }
    }

    #[test]
    fn an_export_reads_back_as_written() {
        let written = export(vec![
            NicKey {
                nic: "mlx5_0".into(),
                rkey: 0x1234,
            },
            NicKey {
                nic: "mlx5_1".into(),
                rkey: 0x5678,
            },
        ]);
        let read = RdmaExport::from_export(&written.to_export()).expect("valid export");
        assert_eq!(read, written);
        assert_eq!(read.rkey("mlx5_1"), Some(0x5678));
        assert_eq!(read.rkey("mlx5_2"), None);
    }

    #[test]
    fn another_version_junk_and_absurd_lists_are_refused_with_the_reason() {
        let mut other = export(vec![NicKey {
            nic: "mlx5_0".into(),
            rkey: 1,
        }])
        .to_export();
        other.version = 2;
        let reason = RdmaExport::from_export(&other)
            .expect_err("version 2")
            .to_string();
        assert!(reason.contains("version 2"), "{reason}");

        let junk = Export {
            transport: RDMA.into(),
            version: EXPORT_VERSION,
            data: "{".into(),
        };
        assert!(RdmaExport::from_export(&junk)
            .expect_err("junk")
            .to_string()
            .contains("not valid"));

        let none = export(Vec::new()).to_export();
        assert!(RdmaExport::from_export(&none)
            .expect_err("no NIC")
            .to_string()
            .contains("0 NICs"));

        let long = export(vec![NicKey {
            nic: "x".repeat(65),
            rkey: 1,
        }])
        .to_export();
        assert!(RdmaExport::from_export(&long)
            .expect_err("long")
            .to_string()
            .contains("65 bytes"));
    }
}
