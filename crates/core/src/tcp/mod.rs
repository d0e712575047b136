//! The TCP transport: works between any two hosts, and carries every engine's control traffic
//! (descriptor requests, notifications).
//!
//! Each peer gets a few connections. A write is sent as frames: entries larger than
//! [`TcpConfig::slice_bytes`] are cut into slices, entries smaller than
//! [`TcpConfig::pack_below`] are packed together into one write-many frame, and frames are dealt
//! round-robin over the connections. The receiver checks every range against its registrations
//! before a byte lands and acks each frame once its bytes are in memory.

mod admission;
mod driver;
mod frame_io;
mod handshake;
mod link;
mod server;
mod tracker;

pub(crate) use admission::AdmissionLimits;
pub(crate) use link::TcpLink;
pub(crate) use server::{serve, ServerContext};

use crate::auth::Secret;
use crate::descriptor::{BufferDescriptor, Endpoint, SegmentDescriptor};
use crate::error::{Error, Result};
use crate::memory::RegionInfo;
use crate::transport::{Link, Reach, Transport};
use crate::wire::seal::{Opener, Sealer};
use crate::wire::{self, Header, Hello, Kind, Limits};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The transport's name, as shown to users and used in descriptors.
pub const TCP: &str = "tcp";

/// How the TCP transport spreads work over connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpConfig {
    /// Connections opened to each peer.
    pub connections: usize,
    /// Entries longer than this are cut into slices of this size, spread over connections.
    pub slice_bytes: u32,
    /// Entries shorter than this are packed together into one frame.
    pub pack_below: u32,
    /// Packing stops once a frame holds this many bytes.
    pub pack_bytes: u32,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections: 4,
            slice_bytes: 4 << 20,
            pack_below: 256 << 10,
            pack_bytes: 1 << 20,
        }
    }
}

/// Which authenticated TCP connections tag their frames ([`crate::wire::seal`]): the
/// connecting side chooses, and the handshake binds its choice. Connections between engines
/// without a secret are never tagged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FrameTags {
    /// Connections to any address but a loopback one (the default): loopback traffic never
    /// leaves the kernel, where whoever could alter it can read both engines' memory anyway.
    #[default]
    BetweenHosts,
    /// Every connection, loopback included: where a loopback address leads elsewhere without
    /// protection of its own (a plain TCP forwarder), or to measure what tags cost.
    Always,
    /// None: for networks no one else can reach, where the CPU tags take (BLAKE3 at about
    /// 5 GB/s a core, on both sides) matters more.
    Never,
}

impl FrameTags {
    /// Whether a connection to `peer` tags its frames.
    pub(crate) fn apply_to(self, peer: std::io::Result<std::net::SocketAddr>) -> bool {
        match self {
            FrameTags::Always => true,
            FrameTags::Never => false,
            // An address that cannot be read is not known to be loopback.
            FrameTags::BetweenHosts => {
                !peer.is_ok_and(|peer| peer.ip().to_canonical().is_loopback())
            }
        }
    }
}

/// The TCP transport as the engine's router sees it.
pub(crate) struct TcpTransport {
    pub(crate) address: String,
    pub(crate) local_name: String,
    pub(crate) config: TcpConfig,
    pub(crate) limits: Limits,
    pub(crate) io_timeout: Duration,
    /// Proven to every listener before anything else is sent, when set.
    pub(crate) secret: Option<Secret>,
    /// Which authenticated connections tag their frames.
    pub(crate) frame_tags: FrameTags,
}

#[async_trait::async_trait]
impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        TCP
    }

    fn endpoint(&self) -> Option<Endpoint> {
        Some(Endpoint {
            transport: TCP.into(),
            address: self.address.clone(),
        })
    }

    fn reach(
        &self,
        _local: &RegionInfo,
        peer: &SegmentDescriptor,
        _remote: &BufferDescriptor,
    ) -> Reach {
        // Any memory: GPU memory on either side is staged through pinned host buffers.
        if peer.endpoint(TCP).is_none() {
            return Reach::No {
                reason: "the peer publishes no tcp endpoint".into(),
            };
        }
        Reach::Yes { cost: 100 }
    }

    async fn open(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Link>> {
        let address = peer.endpoint(TCP).ok_or_else(|| Error::Unreachable {
            peer: peer.name.clone(),
            reason: "its descriptor lists no tcp endpoint".into(),
        })?;
        let link: Arc<dyn Link> = TcpLink::connect(address, &peer.name, self).await?;
        Ok(link)
    }
}

/// Asks the engine listening at `address` for its descriptor (the peer-to-peer lookup),
/// authenticating first with `secret` when set.
pub(crate) async fn fetch_descriptor(
    address: &str,
    timeout: Duration,
    secret: Option<&Secret>,
) -> Result<SegmentDescriptor> {
    let unreachable = |reason: String| Error::Unreachable {
        peer: address.to_owned(),
        reason,
    };
    let exchange = async {
        let mut stream = TcpStream::connect(address)
            .await
            .map_err(|error| unreachable(format!("connect failed: {error}")))?;
        // Descriptors are signed, so lookups keep the default whatever the engine chose.
        let tag_frames = FrameTags::BetweenHosts.apply_to(stream.peer_addr());
        let keys = handshake::client(&mut stream, secret, tag_frames, address, timeout).await?;
        let mut sealer = keys.as_ref().map(|keys| Sealer::new(keys.send));
        let mut opener = keys.map(|keys| Opener::new(keys.receive));
        let hello = wire::encode_hello(&Hello {
            name: String::new(),
        });
        let mut request = Vec::new();
        for (header, body) in [
            (Header::hello(&hello), &hello[..]),
            (Header::descriptor_request(1), &[][..]),
        ] {
            let encoded = header.encode();
            request.extend_from_slice(&encoded);
            request.extend_from_slice(body);
            if let Some(sealer) = &mut sealer {
                request.extend_from_slice(&sealer.seal(&encoded, body));
            }
        }
        stream.write_all(&request).await.map_err(|error| {
            unreachable(format!("sending the descriptor request failed: {error}"))
        })?;
        let limits = Limits::default();
        let header = frame_io::read_header(&mut stream, &limits)
            .await
            .map_err(|error| match handshake::refusal_seen_as_frame(&error) {
                Some(reason) => Error::Unauthenticated {
                    peer: address.to_owned(),
                    reason,
                },
                None => unreachable(format!("no descriptor came back: {error}")),
            })?
            .ok_or_else(|| unreachable("it closed the connection without answering".into()))?;
        let body = frame_io::read_body(&mut stream, header.len)
            .await
            .map_err(|error| unreachable(format!("reading the descriptor failed: {error}")))?;
        if let Some(opener) = &mut opener {
            let tag = frame_io::read_tag(&mut stream).await.map_err(|error| {
                unreachable(format!("reading the descriptor's tag failed: {error}"))
            })?;
            opener
                .open(&header.encode(), &body, header.kind, &tag)
                .map_err(|violation| Error::Protocol {
                    peer: address.to_owned(),
                    violation,
                })?;
        }
        match header.kind {
            Kind::DescriptorResponse => SegmentDescriptor::from_json(address, &body),
            _ => Err(unreachable(format!(
                "it answered with a {} frame instead of a descriptor; is it a ferry engine?",
                header.kind.name()
            ))),
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| unreachable(format!("no answer within {timeout:?}")))?
}

#[cfg(test)]
mod tests {
    use super::FrameTags;

    #[test]
    fn frames_are_tagged_between_hosts_by_default_and_as_asked_otherwise() {
        let at = |address: &str| Ok(address.parse().expect("an address"));
        for (address, between_hosts) in [
            ("127.0.0.1:1", false),
            ("127.9.9.9:1", false),
            ("[::1]:1", false),
            ("[::ffff:127.0.0.1]:1", false),
            ("10.0.0.7:1", true),
            ("[fd00::7]:1", true),
        ] {
            assert_eq!(
                FrameTags::default().apply_to(at(address)),
                between_hosts,
                "{address}"
            );
            assert!(FrameTags::Always.apply_to(at(address)));
            assert!(!FrameTags::Never.apply_to(at(address)));
        }
        let unknown = || Err(std::io::ErrorKind::NotConnected.into());
        assert!(FrameTags::BetweenHosts.apply_to(unknown()));
    }
}
