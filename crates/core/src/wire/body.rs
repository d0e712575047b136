use super::reader::Reader;
use crate::error::{ProtocolViolation, Refusal};
use serde::{Deserialize, Serialize};

/// Bytes per entry in a write-many table: `addr: u64` + `len: u32`.
pub const WRITE_MANY_ENTRY_LEN: usize = 12;

/// Longest engine name a hello may carry, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// Longest hello body: a name of [`MAX_NAME_BYTES`] behind its two-byte length prefix. The
/// header check refuses a longer hello before any of it is read.
pub const MAX_HELLO_BODY: u32 = MAX_NAME_BYTES as u32 + 2;

/// The first frame on a connection: who is calling.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The caller's engine name; empty for a caller without an engine (a metadata lookup).
    pub name: String,
}

/// Encodes a hello body.
pub fn encode_hello(hello: &Hello) -> Vec<u8> {
    // postcard into a Vec cannot fail for a struct of one string.
    postcard::to_allocvec(hello).unwrap_or_default()
}

/// Decodes a hello body, refusing trailing bytes, names over [`MAX_NAME_BYTES`] and any
/// encoding other than the one [`encode_hello`] makes.
pub fn decode_hello(body: &[u8]) -> Result<Hello, ProtocolViolation> {
    if body.len() > MAX_HELLO_BODY as usize {
        return Err(ProtocolViolation::Oversized {
            kind: "hello",
            len: body.len() as u64,
            limit: u64::from(MAX_HELLO_BODY),
        });
    }
    let (hello, rest) = postcard::take_from_bytes::<Hello>(body)
        .map_err(|_| ProtocolViolation::Malformed("hello is not a postcard Hello"))?;
    Reader::new(rest).finish()?;
    if hello.name.len() > MAX_NAME_BYTES {
        return Err(ProtocolViolation::Oversized {
            kind: "hello name",
            len: hello.name.len() as u64,
            limit: MAX_NAME_BYTES as u64,
        });
    }
    if encode_hello(&hello) != body {
        return Err(ProtocolViolation::Malformed(
            "hello name length is not in its shortest form",
        ));
    }
    Ok(hello)
}

/// First byte of an ack that carries a typed refusal; it never starts UTF-8 text, so a
/// reason in words (what older peers send for every refusal) stays readable.
const TYPED_ACK: u8 = 0xff;

/// Code after [`TYPED_ACK`] for [`Refusal::NotRegistered`], followed by `addr: u64` and
/// `len: u64`.
const NOT_REGISTERED: u8 = 1;

/// Encodes an ack: empty for success, else the refusal. A range outside the registrations is
/// sent typed (its batch entry is the sender's to find, so it is not sent); any other reason
/// is sent as its text.
pub fn encode_ack(result: Result<(), &Refusal>) -> Vec<u8> {
    match result {
        Ok(()) => Vec::new(),
        Err(Refusal::NotRegistered { addr, len, .. }) => {
            let mut out = Vec::with_capacity(18);
            out.extend_from_slice(&[TYPED_ACK, NOT_REGISTERED]);
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out
        }
        Err(Refusal::Other(reason)) if reason.is_empty() => b"refused without a reason".to_vec(),
        Err(Refusal::Other(reason)) => reason.as_bytes().to_vec(),
    }
}

/// Decodes an ack into success or the peer's refusal.
pub fn decode_ack(body: &[u8]) -> Result<Result<(), Refusal>, ProtocolViolation> {
    match body.first() {
        None => Ok(Ok(())),
        Some(&TYPED_ACK) => {
            let mut reader = Reader::new(&body[1..]);
            let code = reader.take(1, "ack refusal code")?[0];
            if code != NOT_REGISTERED {
                return Err(ProtocolViolation::Malformed("unknown ack refusal code"));
            }
            let addr = reader.u64("refused address")?;
            let len = reader.u64("refused length")?;
            reader.finish()?;
            Ok(Err(Refusal::NotRegistered {
                entry: None,
                addr,
                len,
            }))
        }
        Some(_) => std::str::from_utf8(body)
            .map(|reason| Err(Refusal::Other(reason.to_owned())))
            .map_err(|_| ProtocolViolation::Malformed("ack reason is not UTF-8")),
    }
}

/// Encodes a read request for `len` bytes at `addr`.
pub fn encode_read_request(addr: u64, len: u32) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[..8].copy_from_slice(&addr.to_le_bytes());
    out[8..].copy_from_slice(&len.to_le_bytes());
    out
}

/// Decodes a read request into `(addr, len)`.
pub fn decode_read_request(body: &[u8]) -> Result<(u64, u32), ProtocolViolation> {
    let mut reader = Reader::new(body);
    let addr = reader.u64("read address")?;
    let len = reader.u32("read length")?;
    reader.finish()?;
    if len == 0 {
        return Err(ProtocolViolation::Malformed("zero-length read"));
    }
    Ok((addr, len))
}

/// One entry of a write-many frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteManyEntry {
    /// Destination address in the receiver's memory.
    pub addr: u64,
    /// Bytes for this entry.
    pub len: u32,
}

/// Encodes the table that opens a write-many body.
pub fn encode_write_many_table(entries: &[WriteManyEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + entries.len() * WRITE_MANY_ENTRY_LEN);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for entry in entries {
        out.extend_from_slice(&entry.addr.to_le_bytes());
        out.extend_from_slice(&entry.len.to_le_bytes());
    }
    out
}

/// Reads the entry count from the first four body bytes and returns the table's byte length,
/// checked against `max_entries` and the body length before the table is read.
pub fn decode_write_many_count(
    count: [u8; 4],
    body_len: u32,
    max_entries: u32,
) -> Result<usize, ProtocolViolation> {
    let count = u32::from_le_bytes(count);
    if count == 0 {
        return Err(ProtocolViolation::Malformed("write-many with no entries"));
    }
    if count > max_entries {
        return Err(ProtocolViolation::Oversized {
            kind: "write-many table",
            len: u64::from(count),
            limit: u64::from(max_entries),
        });
    }
    let table_len = count as usize * WRITE_MANY_ENTRY_LEN;
    if 4 + table_len > body_len as usize {
        return Err(ProtocolViolation::TooShort {
            what: "write-many table",
            needed: 4 + table_len - body_len as usize,
        });
    }
    Ok(table_len)
}

/// Decodes a write-many table and checks that its lengths add up to `data_len`.
pub fn decode_write_many_table(
    table: &[u8],
    data_len: u64,
) -> Result<Vec<WriteManyEntry>, ProtocolViolation> {
    let mut reader = Reader::new(table);
    let mut entries = Vec::with_capacity(table.len() / WRITE_MANY_ENTRY_LEN);
    let mut total = 0u64;
    for _ in 0..table.len() / WRITE_MANY_ENTRY_LEN {
        let addr = reader.u64("entry address")?;
        let len = reader.u32("entry length")?;
        if len == 0 {
            return Err(ProtocolViolation::Malformed("zero-length write-many entry"));
        }
        total += u64::from(len);
        entries.push(WriteManyEntry { addr, len });
    }
    reader.finish()?;
    if total != data_len {
        return Err(ProtocolViolation::Malformed(
            "write-many entry lengths do not add up to the frame's data",
        ));
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_many_table_round_trips() {
        let entries = vec![
            WriteManyEntry {
                addr: 0x1000,
                len: 10,
            },
            WriteManyEntry {
                addr: 0x9000,
                len: 32768,
            },
        ];
        let encoded = encode_write_many_table(&entries);
        let count: [u8; 4] = encoded[..4].try_into().unwrap();
        let table_len = decode_write_many_count(count, encoded.len() as u32 + 32778, 4096).unwrap();
        assert_eq!(table_len, encoded.len() - 4);
        assert_eq!(
            decode_write_many_table(&encoded[4..], 32778).unwrap(),
            entries
        );
    }

    #[test]
    fn write_many_lengths_must_match_the_data() {
        let encoded = encode_write_many_table(&[WriteManyEntry { addr: 1, len: 10 }]);
        assert_eq!(
            decode_write_many_table(&encoded[4..], 11),
            Err(ProtocolViolation::Malformed(
                "write-many entry lengths do not add up to the frame's data"
            ))
        );
    }

    #[test]
    fn write_many_count_is_bounded_before_the_table_is_read() {
        assert!(matches!(
            decode_write_many_count(u32::MAX.to_le_bytes(), 100, 4096),
            Err(ProtocolViolation::Oversized { .. })
        ));
        assert!(matches!(
            decode_write_many_count(100u32.to_le_bytes(), 100, 4096),
            Err(ProtocolViolation::TooShort { .. })
        ));
    }

    #[test]
    fn hello_and_ack_round_trip_and_reject_junk() {
        let hello = Hello {
            name: "10.0.0.1:17000".into(),
        };
        assert_eq!(decode_hello(&encode_hello(&hello)), Ok(hello));
        let mut junk = encode_hello(&Hello { name: "a".into() });
        junk.push(0);
        assert_eq!(
            decode_hello(&junk),
            Err(ProtocolViolation::TrailingBytes(1))
        );
        assert_eq!(decode_ack(&encode_ack(Ok(()))), Ok(Ok(())));
        let other = Refusal::Other("no".into());
        assert_eq!(decode_ack(&encode_ack(Err(&other))), Ok(Err(other)));
        let range = Refusal::NotRegistered {
            entry: None,
            addr: 0x1000,
            len: 64,
        };
        assert_eq!(decode_ack(&encode_ack(Err(&range))), Ok(Err(range)));
        assert_eq!(
            decode_ack(&[0xff, 0xfe]),
            Err(ProtocolViolation::Malformed("unknown ack refusal code"))
        );
        let mut long = encode_ack(Err(&Refusal::NotRegistered {
            entry: None,
            addr: 1,
            len: 1,
        }));
        long.push(0);
        assert_eq!(decode_ack(&long), Err(ProtocolViolation::TrailingBytes(1)));
        assert_eq!(
            decode_ack(&[0xc3]),
            Err(ProtocolViolation::Malformed("ack reason is not UTF-8"))
        );
    }

    #[test]
    fn read_request_round_trips_and_refuses_zero_length() {
        assert_eq!(
            decode_read_request(&encode_read_request(42, 7)),
            Ok((42, 7))
        );
        assert!(decode_read_request(&encode_read_request(42, 0)).is_err());
        assert!(decode_read_request(&[0; 11]).is_err());
    }
}
