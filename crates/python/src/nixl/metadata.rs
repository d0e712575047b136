//! The agent metadata blob (`get_agent_metadata` / `add_remote_agent`): what a peer needs to
//! reach this agent. A marker line, then JSON: the agent's name, the ferry engine that serves
//! it (`host:port`), ferry's version, and the registered ranges. Blobs come from peers, so
//! decoding checks the marker, the size and every field, and never panics.

use super::errors::NixlError;
use serde::{Deserialize, Serialize};

/// Opens every blob: a blob without it is not ferry's (a real NIXL agent's, say).
const MARKER: &[u8] = b"ferry-nixl/1\n";

/// Largest blob accepted: a registration list of a few hundred thousand ranges.
const MAX_BLOB_BYTES: usize = 64 << 20;

/// Longest agent name accepted (NIXL names are UUIDs in vLLM).
const MAX_NAME_BYTES: usize = 1024;

/// One registered range: address, length, device id, memory type (`"DRAM"`, `"VRAM"`).
pub(crate) type Registration = (u64, u64, u64, String);

/// What the blob says of an agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AgentMetadata {
    /// The agent's name, as its owner gave it.
    pub(crate) name: String,
    /// The ferry engine serving the agent, `host:port`.
    pub(crate) engine: String,
    /// ferry's version on that side.
    pub(crate) version: String,
    /// The ranges the agent registered.
    pub(crate) registrations: Vec<Registration>,
}

impl AgentMetadata {
    /// The blob.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut blob = MARKER.to_vec();
        // Serializing plain strings and integers cannot fail.
        blob.extend(serde_json::to_vec(self).unwrap_or_default());
        blob
    }

    /// Reads a blob a peer sent.
    pub(crate) fn decode(blob: &[u8]) -> Result<AgentMetadata, NixlError> {
        let invalid = |what: String| Err(NixlError::InvalidParam(what));
        if blob.len() > MAX_BLOB_BYTES {
            return invalid(format!(
                "the agent metadata is {} bytes, more than the {MAX_BLOB_BYTES} accepted",
                blob.len()
            ));
        }
        let Some(json) = blob.strip_prefix(MARKER) else {
            return invalid(
                "the agent metadata is not from a ferry agent; both sides must use ferry's nixl (FERRY_NIXL=1) or both NIXL's own".into(),
            );
        };
        let metadata: AgentMetadata = match serde_json::from_slice(json) {
            Ok(metadata) => metadata,
            Err(error) => return invalid(format!("the agent metadata does not parse: {error}")),
        };
        if metadata.name.is_empty() || metadata.name.len() > MAX_NAME_BYTES {
            return invalid(format!(
                "the agent name in the metadata is {} bytes; names are 1 to {MAX_NAME_BYTES} bytes",
                metadata.name.len()
            ));
        }
        if metadata.engine.is_empty() {
            return invalid("the agent metadata names no engine to reach it at".into());
        }
        Ok(metadata)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_comes_back_as_sent_and_foreign_or_broken_ones_are_refused() {
        let metadata = AgentMetadata {
            name: "prefill-0".into(),
            engine: "10.0.0.1:4000".into(),
            version: "0.1.0".into(),
            registrations: vec![(0x1000, 4096, 0, "VRAM".into())],
        };
        let blob = metadata.encode();
        assert_eq!(AgentMetadata::decode(&blob).expect("valid"), metadata);
        for bad in [
            b"ucx-blob".to_vec(),
            b"ferry-nixl/1\n{".to_vec(),
            b"ferry-nixl/1\n{\"name\":\"\",\"engine\":\"a:1\",\"version\":\"\",\"registrations\":[]}"
                .to_vec(),
            blob[..blob.len() - 3].to_vec(),
        ] {
            let error = AgentMetadata::decode(&bad).expect_err("refused");
            assert!(error.to_string().starts_with("NIXL_ERR_INVALID_PARAM"), "{error}");
        }
    }
}
