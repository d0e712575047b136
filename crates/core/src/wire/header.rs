use crate::error::ProtocolViolation;
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"FRRY";
/// The protocol version this build speaks.
pub const VERSION: u8 = 1;
/// Length of the fixed header.
pub const HEADER_LEN: usize = 24;

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct RawHeader {
    magic: [u8; 4],
    version: u8,
    kind: u8,
    flags: [u8; 2],
    id: U64,
    len: U32,
    reserved: [u8; 4],
}

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// First frame of every connection: who is calling (postcard [`super::Hello`]).
    Hello = 1,
    /// Asks for the engine's descriptor (empty body).
    DescriptorRequest = 2,
    /// The descriptor as JSON.
    DescriptorResponse = 3,
    /// `addr: u64` then the bytes to write there.
    Write = 4,
    /// `count: u32`, `count` x (`addr: u64`, `len: u32`), then all their bytes in order.
    WriteMany = 5,
    /// `addr: u64`, `len: u32`: asks for those bytes.
    ReadRequest = 6,
    /// The bytes of the read request with the same id.
    ReadData = 7,
    /// Completes the request with the same id; empty for success, else the reason as UTF-8.
    Ack = 8,
    /// A notification's payload, delivered to the engine's notification stream.
    Notify = 9,
}

impl Kind {
    fn from_u8(value: u8) -> Option<Kind> {
        Some(match value {
            1 => Kind::Hello,
            2 => Kind::DescriptorRequest,
            3 => Kind::DescriptorResponse,
            4 => Kind::Write,
            5 => Kind::WriteMany,
            6 => Kind::ReadRequest,
            7 => Kind::ReadData,
            8 => Kind::Ack,
            9 => Kind::Notify,
            _ => return None,
        })
    }

    /// The kind's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Hello => "hello",
            Kind::DescriptorRequest => "descriptor-request",
            Kind::DescriptorResponse => "descriptor-response",
            Kind::Write => "write",
            Kind::WriteMany => "write-many",
            Kind::ReadRequest => "read-request",
            Kind::ReadData => "read-data",
            Kind::Ack => "ack",
            Kind::Notify => "notify",
        }
    }
}

/// Size limits a receiver enforces on frame bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most data bytes one write or read frame may carry.
    pub max_data: u32,
    /// Most entries one write-many frame may carry.
    pub max_entries: u32,
    /// Most bytes of an ack, read request or notification (a hello has its own, fixed limit:
    /// [`super::MAX_HELLO_BODY`]).
    pub max_control: u32,
    /// Most bytes of a descriptor.
    pub max_descriptor: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_data: 16 << 20,
            max_entries: 4096,
            max_control: 64 << 10,
            max_descriptor: 16 << 20,
        }
    }
}

impl Limits {
    /// The largest body a frame of `kind` may announce.
    pub fn body_limit(&self, kind: Kind) -> u64 {
        let entries_table = 4 + u64::from(self.max_entries) * super::WRITE_MANY_ENTRY_LEN as u64;
        match kind {
            Kind::Write => 8 + u64::from(self.max_data),
            Kind::WriteMany => entries_table + u64::from(self.max_data),
            Kind::ReadData => u64::from(self.max_data),
            Kind::DescriptorResponse => u64::from(self.max_descriptor),
            Kind::Hello => u64::from(super::MAX_HELLO_BODY),
            Kind::DescriptorRequest | Kind::ReadRequest | Kind::Ack | Kind::Notify => {
                u64::from(self.max_control)
            }
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame carries.
    pub kind: Kind,
    /// Request id, echoed by the response.
    pub id: u64,
    /// Body length in bytes.
    pub len: u32,
}

impl Header {
    /// A header announcing a frame of `kind` with request `id` and a body of `len` bytes.
    ///
    /// Every frame this crate sends gets its header here (or from the helpers below), so the
    /// fields are filled in one way only.
    pub fn new(kind: Kind, id: u64, len: u32) -> Header {
        Header { kind, id, len }
    }

    /// A header announcing `body` whole as the body of a frame of `kind` with request `id`.
    ///
    /// A body over `u32::MAX` bytes, which no frame may carry, is announced as `u32::MAX`, so
    /// the receiver refuses it at the header instead of misreading a shortened length.
    pub fn for_body(kind: Kind, id: u64, body: &[u8]) -> Header {
        Header::new(kind, id, u32::try_from(body.len()).unwrap_or(u32::MAX))
    }

    /// The header of the hello frame carrying `body`, a connection's first frame (id 0).
    pub fn hello(body: &[u8]) -> Header {
        Header::for_body(Kind::Hello, 0, body)
    }

    /// The header of a descriptor request, which has no body.
    pub fn descriptor_request(id: u64) -> Header {
        Header::new(Kind::DescriptorRequest, id, 0)
    }

    /// The header's 24 bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let raw = RawHeader {
            magic: MAGIC,
            version: VERSION,
            kind: self.kind as u8,
            flags: [0; 2],
            id: U64::new(self.id),
            len: U32::new(self.len),
            reserved: [0; 4],
        };
        let mut out = [0u8; HEADER_LEN];
        out.copy_from_slice(raw.as_bytes());
        out
    }

    /// Parses and checks a header: magic, version, kind and the body limit for that kind.
    pub fn decode(bytes: &[u8; HEADER_LEN], limits: &Limits) -> Result<Header, ProtocolViolation> {
        let raw = RawHeader::ref_from_bytes(bytes).map_err(|_| ProtocolViolation::TooShort {
            what: "header",
            needed: HEADER_LEN,
        })?;
        if raw.magic != MAGIC {
            return Err(ProtocolViolation::BadMagic { found: raw.magic });
        }
        if raw.version != VERSION {
            return Err(ProtocolViolation::Version {
                found: raw.version,
                expected: VERSION,
            });
        }
        let kind = Kind::from_u8(raw.kind).ok_or(ProtocolViolation::UnknownKind(raw.kind))?;
        let len = raw.len.get();
        let limit = limits.body_limit(kind);
        if u64::from(len) > limit {
            return Err(ProtocolViolation::Oversized {
                kind: kind.name(),
                len: u64::from(len),
                limit,
            });
        }
        Ok(Header::new(kind, raw.id.get(), len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips() {
        for value in 1..=9 {
            let kind = Kind::from_u8(value).unwrap();
            let header = Header::new(kind, 0xdead_beef_0102, 12);
            assert_eq!(
                Header::decode(&header.encode(), &Limits::default()),
                Ok(header)
            );
        }
    }

    #[test]
    fn garbage_is_refused_at_the_magic() {
        let bytes = *b"GET / HTTP/1.1\r\nHost: abc";
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&bytes[..HEADER_LEN]);
        assert_eq!(
            Header::decode(&header, &Limits::default()),
            Err(ProtocolViolation::BadMagic { found: *b"GET " })
        );
    }

    #[test]
    fn a_peer_that_is_not_ferry_is_described_by_what_it_sent() {
        let text = |found: &[u8; 4]| ProtocolViolation::BadMagic { found: *found }.to_string();
        assert_eq!(
            text(b"HTTP"),
            "it answered like an HTTP server (\"HTTP\"), not a ferry engine; check the port"
        );
        assert_eq!(
            text(b"GET "),
            "it sent \"GET \" where ferry's magic \"FRRY\" belongs: not a ferry engine; check the port"
        );
        assert_eq!(
            text(&[0x16, 0x03, 0x01, 0x00]),
            "it sent the bytes [16, 03, 01, 00] where ferry's magic \"FRRY\" belongs: not a ferry engine; check the port"
        );
    }

    #[test]
    fn oversized_body_is_refused_before_reading_it() {
        let header = Header::new(Kind::Notify, 1, u32::MAX);
        let error = Header::decode(&header.encode(), &Limits::default()).unwrap_err();
        assert!(
            matches!(error, ProtocolViolation::Oversized { kind: "notify", .. }),
            "{error}"
        );
    }

    #[test]
    fn unknown_kind_and_version_are_named() {
        let mut bytes = Header::new(Kind::Ack, 1, 0).encode();
        bytes[5] = 77;
        assert_eq!(
            Header::decode(&bytes, &Limits::default()),
            Err(ProtocolViolation::UnknownKind(77))
        );
        bytes[4] = 9;
        assert_eq!(
            Header::decode(&bytes, &Limits::default()),
            Err(ProtocolViolation::Version {
                found: 9,
                expected: VERSION
            })
        );
    }
}
