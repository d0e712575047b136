//! The engine's background upkeep: republishing its descriptor and dropping peers that are gone.

use super::EngineInner;
use crate::error::Error;
use crate::peer::Peer;
use std::sync::Arc;
use std::time::Duration;

/// Keeps the metadata store in step with the region table, until the engine is gone.
pub(super) async fn republish_on_change(engine: std::sync::Weak<EngineInner>) {
    loop {
        let Some(table) = engine.upgrade().map(|engine| Arc::clone(&engine.table)) else {
            return;
        };
        table.changed().await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        if let Err(error) = engine.publish().await {
            tracing::warn!(%error, "republishing the descriptor failed; peers may see stale buffers");
        }
    }
}

/// Looks the open peers up again every `interval` and closes those that are gone or were
/// replaced by another engine (a new instance id), until the engine is gone.
pub(super) async fn watch_peers(engine: std::sync::Weak<EngineInner>, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        let open: Vec<(String, Peer)> = engine
            .peers
            .lock()
            .iter()
            .map(|(name, peer)| (name.clone(), peer.clone()))
            .collect();
        for (name, peer) in open {
            let why = match engine.metadata.fetch(&name).await {
                Ok(descriptor) => {
                    let known = peer.view();
                    if descriptor.instance == known.descriptor.instance {
                        // Only a new generation has buffers the transports have not read.
                        if descriptor.generation != known.descriptor.generation {
                            engine.import(&descriptor).await;
                            peer.update(descriptor);
                        }
                        continue;
                    }
                    format!(
                        "it is now another engine ({}, process {} on {})",
                        descriptor.instance, descriptor.pid, descriptor.host.hostname
                    )
                }
                Err(error @ (Error::NotPublished { .. } | Error::Unreachable { .. })) => {
                    error.to_string()
                }
                // The store itself is in trouble: the peer may be fine, keep it.
                Err(error) => {
                    tracing::debug!(peer = %name, %error, "could not look a peer up; keeping it");
                    continue;
                }
            };
            tracing::info!(peer = %name, reason = %why, "peer gone; closing its links and mappings");
            peer.close();
            let mut peers = engine.peers.lock();
            if peers.get(&name).is_some_and(|current| current.same(&peer)) {
                peers.remove(&name);
            }
        }
    }
}
