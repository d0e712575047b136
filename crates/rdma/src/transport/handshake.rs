//! The messages of the connection side channel, and their framing: a 4-byte big-endian
//! length, then JSON. The client offers one QP endpoint per queue pair it wants (its NIC, the
//! peer NIC it should end at); the server answers with its own endpoint for each, or refuses.

use super::refusal::Refusal;
use crate::device::{Gid, Mtu};
use crate::qp::{Psn, QpEndpoint};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The side channel's protocol version.
pub(crate) const HANDSHAKE_VERSION: u32 = 1;
/// No message of this protocol is this long; a longer length is a broken or hostile peer.
const MAX_MESSAGE: u32 = 1 << 20;
/// More queue pairs than this for one connection is a broken or hostile peer.
pub(crate) const MAX_QPS: usize = 1024;

/// One side of a queue pair as the wire carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireEndpoint {
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    /// The port's active MTU, in bytes.
    pub(crate) mtu: u32,
    /// RDMA READs this side's queue pair answers at once: the peer's initiator depth may
    /// not exceed it.
    pub(crate) rd_atomic: u8,
}

/// A peer's side of a queue pair, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteQp {
    pub(crate) endpoint: QpEndpoint,
    pub(crate) mtu: Mtu,
    pub(crate) rd_atomic: u8,
}

impl WireEndpoint {
    pub(crate) fn new(endpoint: &QpEndpoint, mtu: Mtu, rd_atomic: u8) -> Self {
        WireEndpoint {
            qpn: endpoint.qpn,
            psn: endpoint.psn.value(),
            lid: endpoint.lid,
            gid: endpoint.gid.0,
            mtu: mtu.bytes(),
            rd_atomic,
        }
    }

    /// The endpoint, checked.
    ///
    /// # Errors
    /// What is wrong, when the peer sent a PSN wider than 24 bits, an MTU verbs lacks or no
    /// READ depth.
    pub(crate) fn read(&self) -> Result<RemoteQp, Refusal> {
        if self.rd_atomic == 0 {
            return Err(Refusal::NoReads);
        }
        let psn = Psn::new(self.psn)?;
        let mtu = match self.mtu {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            mtu => return Err(Refusal::Mtu { mtu }),
        };
        Ok(RemoteQp {
            endpoint: QpEndpoint {
                qpn: self.qpn,
                psn,
                lid: self.lid,
                gid: Gid(self.gid),
            },
            mtu,
            rd_atomic: self.rd_atomic,
        })
    }
}

/// One queue pair the client wants.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct QpOffer {
    /// The server's NIC the queue pair should end at.
    pub(crate) server_nic: String,
    /// The client's side of it.
    pub(crate) client: WireEndpoint,
}

/// What the client sends after authenticating.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ConnectRequest {
    pub(crate) version: u32,
    /// The client engine's instance id, for the server's log.
    pub(crate) client: String,
    pub(crate) offers: Vec<QpOffer>,
}

impl ConnectRequest {
    /// The client's endpoints, checked: the version, the number of queue pairs, each
    /// endpoint's PSN and MTU.
    ///
    /// # Errors
    /// What is wrong, to send back as the refusal.
    pub(crate) fn check(&self) -> Result<Vec<RemoteQp>, Refusal> {
        if self.version != HANDSHAKE_VERSION {
            return Err(Refusal::HandshakeVersion {
                version: self.version,
            });
        }
        if self.offers.is_empty() || self.offers.len() > MAX_QPS {
            return Err(Refusal::QueuePairs {
                count: self.offers.len(),
            });
        }
        self.offers
            .iter()
            .map(|offer| offer.client.read())
            .collect()
    }
}

/// The server's answer: its side of each offered queue pair, in order, or why not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ConnectResponse {
    Accepted(Vec<WireEndpoint>),
    Refused(String),
}

/// Makes the kernel probe an idle side channel, so a peer whose host died (no FIN, no RST)
/// ends the connection in about 25 s, and with it the queue pairs it held.
pub(crate) fn keep_alive(stream: &tokio::net::TcpStream) {
    use rustix::net::sockopt;
    let set = sockopt::set_socket_keepalive(stream, true)
        .and_then(|()| sockopt::set_tcp_keepidle(stream, std::time::Duration::from_secs(10)))
        .and_then(|()| sockopt::set_tcp_keepintvl(stream, std::time::Duration::from_secs(5)))
        .and_then(|()| sockopt::set_tcp_keepcnt(stream, 3));
    if let Err(error) = set {
        tracing::debug!(%error, "TCP keepalive on the RDMA side channel is off");
    }
}

/// Writes one message.
///
/// # Errors
/// The stream's error.
pub(crate) async fn send<S: AsyncWrite + Unpin, M: Serialize>(
    stream: &mut S,
    message: &M,
) -> std::io::Result<()> {
    let body = serde_json::to_vec(message).map_err(std::io::Error::other)?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|len| *len <= MAX_MESSAGE)
        .ok_or_else(|| std::io::Error::other("handshake message too long"))?;
    stream.write_all(&len.to_be_bytes()).await?;
    stream.write_all(&body).await?;
    stream.flush().await
}

/// Decodes one message's body.
///
/// # Errors
/// `InvalidData` naming what is wrong with it.
pub(crate) fn decode<M: for<'de> Deserialize<'de>>(body: &[u8]) -> std::io::Result<M> {
    serde_json::from_slice(body).map_err(|error| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a handshake message that is not valid: {error}"),
        )
    })
}

/// Reads one message.
///
/// # Errors
/// The stream's error, or `InvalidData` naming what is wrong with the message.
pub(crate) async fn receive<S: AsyncRead + Unpin, M: for<'de> Deserialize<'de>>(
    stream: &mut S,
) -> std::io::Result<M> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a handshake message of {len} bytes, more than the {MAX_MESSAGE} allowed"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body).await?;
    decode(&body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_crosses_a_stream_intact() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let request = ConnectRequest {
            version: HANDSHAKE_VERSION,
            client: "abc".into(),
            offers: vec![QpOffer {
                server_nic: "mlx5_1".into(),
                client: WireEndpoint {
                    qpn: 7,
                    psn: 9,
                    lid: 3,
                    gid: [1; 16],
                    mtu: 4096,
                    rd_atomic: 16,
                },
            }],
        };
        send(&mut a, &request).await.expect("send");
        let read: ConnectRequest = receive(&mut b).await.expect("receive");
        assert_eq!(read, request);
    }

    #[tokio::test]
    async fn an_oversized_length_or_junk_is_invalid_data() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        a.write_all(&(MAX_MESSAGE + 1).to_be_bytes())
            .await
            .expect("write");
        let error = receive::<_, ConnectResponse>(&mut b)
            .await
            .expect_err("oversized");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
        assert!(error.to_string().contains("bytes"), "{error}");

        a.write_all(&3u32.to_be_bytes()).await.expect("write");
        a.write_all(b"{{{").await.expect("write");
        let error = receive::<_, ConnectResponse>(&mut b)
            .await
            .expect_err("junk");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn endpoints_with_a_wide_psn_an_unknown_mtu_or_no_read_depth_are_refused() {
        let good = WireEndpoint {
            qpn: 1,
            psn: 5,
            lid: 0,
            gid: [0; 16],
            mtu: 1024,
            rd_atomic: 4,
        };
        let read = good.read().expect("valid");
        assert_eq!((read.mtu, read.rd_atomic), (Mtu::Mtu1024, 4));
        let wide = WireEndpoint {
            psn: 1 << 24,
            ..good
        };
        assert!(wide.read().is_err());
        let odd = WireEndpoint { mtu: 9000, ..good };
        assert!(odd.read().expect_err("9000").to_string().contains("9000"));
        let no_reads = WireEndpoint {
            rd_atomic: 0,
            ..good
        };
        assert!(no_reads
            .read()
            .expect_err("depth 0")
            .to_string()
            .contains("READ depth 0"));
    }
}
