//! The staged-copy requests on a staging session, as bytes: sans-IO, so the decoder the owner
//! runs on a peer's words is tested and fuzzed without sockets or GPUs.
//!
//! A request is a header of [`HEADER_BYTES`] (the [`StageOp`] as one byte, then the entry
//! count as 4 bytes little-endian) followed by that many entries of [`ENTRY_BYTES`]: the
//! owner's registered buffer, the first byte of the owner's range, its offset in the staging
//! buffer and its length, each 8 bytes little-endian. The answer is one byte, [`DONE`], or
//! [`FAILED`] followed by the reason's length (4 bytes little-endian) and the reason as UTF-8;
//! after a failure the owner closes the session.

/// Bytes of a request's header.
pub(crate) const HEADER_BYTES: usize = 5;

/// Bytes of one entry.
pub(crate) const ENTRY_BYTES: usize = 32;

/// Most entries one request may carry (32 MiB of entries): KV blocks are kilobytes, so a slot
/// of their copies holds far fewer, and the initiator cuts a chunk of smaller ones at this
/// many ([`crate::staging::plan_chunks`]).
pub(crate) const MAX_ENTRIES: u32 = 1 << 20;

/// The answer to a request the owner carried out.
pub(crate) const DONE: u8 = 0;

/// The answer to a request the owner refused or could not carry out; its reason follows.
pub(crate) const FAILED: u8 = 1;

/// Longest reason an owner sends, and the initiator reads.
pub(crate) const MAX_REASON_BYTES: u32 = 64 << 10;

/// What the owner does with a request's entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StageOp {
    /// Copies its ranges into the staging buffer (the initiator reads them from there next).
    Gather,
    /// Copies the staging buffer into its ranges (the initiator wrote them there).
    Scatter,
}

impl StageOp {
    /// The operation's byte on the wire.
    fn code(self) -> u8 {
        match self {
            StageOp::Gather => 0,
            StageOp::Scatter => 1,
        }
    }
}

/// One range of the owner's memory and where it lies in the staging buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StageEntry {
    /// The address the owner registered the buffer holding the range at, as its descriptor
    /// names it.
    pub(crate) buffer: u64,
    /// The range's first byte in the owner's address space.
    pub(crate) addr: u64,
    /// The range's offset in the staging buffer.
    pub(crate) staging: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// A request's header, read before its entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// What the owner is asked to do.
    pub(crate) op: StageOp,
    /// Entries that follow.
    pub(crate) count: u32,
}

impl Header {
    /// Bytes of the entries that follow.
    pub(crate) fn entry_bytes(self) -> usize {
        self.count as usize * ENTRY_BYTES
    }
}

/// What is wrong with a request, as the owner tells the initiator before closing the session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum StageViolation {
    /// The first byte names no operation.
    #[error("staged-copy operation {0} is neither 0 (gather) nor 1 (scatter); are both engines the same ferry version?")]
    UnknownOp(u8),
    /// No entries, or more than [`MAX_ENTRIES`].
    #[error("a staged-copy request carries {0} entries; it must carry 1 to {MAX_ENTRIES}")]
    Count(u32),
    /// An entry's bytes do not fit the staging buffer, or its length is 0.
    #[error("entry {index} ({len} bytes at staging offset {staging}) does not fit the staging buffer of {staging_len} bytes")]
    OutsideStaging {
        /// The entry's place in the request.
        index: usize,
        /// Its offset in the staging buffer.
        staging: u64,
        /// Its length.
        len: u64,
        /// The staging buffer's bytes.
        staging_len: u64,
    },
    /// The entries' bytes are not as many as the header says.
    #[error("a staged-copy request's entries take {got} bytes, not {expected}")]
    Truncated {
        /// Bytes of entries received.
        got: usize,
        /// Bytes the header's count asks for.
        expected: usize,
    },
    /// The entries up to `index` copy more bytes than the staging buffer holds.
    #[error("entries 0..={index} copy more bytes than the staging buffer's {staging_len}; send at most one staging buffer's worth per request")]
    TooManyBytes {
        /// The entry that went over.
        index: usize,
        /// The staging buffer's bytes.
        staging_len: u64,
    },
}

/// Appends a request of `entries` to `out`.
pub(crate) fn encode_request(op: StageOp, entries: &[StageEntry], out: &mut Vec<u8>) {
    out.reserve(HEADER_BYTES + entries.len() * ENTRY_BYTES);
    out.push(op.code());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for entry in entries {
        for value in [entry.buffer, entry.addr, entry.staging, entry.len] {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
}

/// Reads a request's header.
///
/// # Errors
/// [`StageViolation::UnknownOp`] or [`StageViolation::Count`].
pub(crate) fn decode_header(bytes: [u8; HEADER_BYTES]) -> Result<Header, StageViolation> {
    let op = match bytes[0] {
        0 => StageOp::Gather,
        1 => StageOp::Scatter,
        other => return Err(StageViolation::UnknownOp(other)),
    };
    let count = u32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    if count == 0 || count > MAX_ENTRIES {
        return Err(StageViolation::Count(count));
    }
    Ok(Header { op, count })
}

/// Reads the entries of a request whose header said `header`, each checked to lie, non-empty,
/// inside a staging buffer of `staging_len` bytes. Whether the owner's ranges are its own is
/// for the owner to check against its registrations.
///
/// # Errors
/// [`StageViolation::Truncated`] or [`StageViolation::OutsideStaging`].
pub(crate) fn decode_entries(
    header: Header,
    bytes: &[u8],
    staging_len: u64,
) -> Result<Vec<StageEntry>, StageViolation> {
    if bytes.len() != header.entry_bytes() {
        return Err(StageViolation::Truncated {
            got: bytes.len(),
            expected: header.entry_bytes(),
        });
    }
    let word = |field: &[u8]| {
        let mut value = [0u8; 8];
        value.copy_from_slice(field);
        u64::from_le_bytes(value)
    };
    // Entries may overlap in the staging buffer; their sum bounds the owner's work to one
    // staging buffer's worth per request, whatever the count.
    let mut total = 0u64;
    bytes
        .chunks_exact(ENTRY_BYTES)
        .enumerate()
        .map(|(index, raw)| {
            let entry = StageEntry {
                buffer: word(&raw[0..8]),
                addr: word(&raw[8..16]),
                staging: word(&raw[16..24]),
                len: word(&raw[24..32]),
            };
            let fits = entry.len > 0
                && entry
                    .staging
                    .checked_add(entry.len)
                    .is_some_and(|end| end <= staging_len);
            if !fits {
                return Err(StageViolation::OutsideStaging {
                    index,
                    staging: entry.staging,
                    len: entry.len,
                    staging_len,
                });
            }
            total = total.saturating_add(entry.len);
            match total <= staging_len {
                true => Ok(entry),
                false => Err(StageViolation::TooManyBytes { index, staging_len }),
            }
        })
        .collect()
}

/// The answer for a failed request: [`FAILED`], the reason's length, the reason (cut to
/// [`MAX_REASON_BYTES`] at a character boundary).
pub(crate) fn encode_failure(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON_BYTES as usize);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut answer = Vec::with_capacity(5 + end);
    answer.push(FAILED);
    answer.extend_from_slice(&(end as u32).to_le_bytes());
    answer.extend_from_slice(&reason.as_bytes()[..end]);
    answer
}

/// Reads `data` as an initiator's request to an owner with 256 MiB of staging: the header,
/// then the entries; a request read whole must write back as the same bytes. Returns how many
/// entries were accepted; panics on a decoder that panics or disagrees.
#[cfg(any(fuzzing, test))]
pub(crate) fn fuzz_request(data: &[u8]) -> usize {
    let Some((head, rest)) = data.split_first_chunk::<HEADER_BYTES>() else {
        return 0;
    };
    let Ok(header) = decode_header(*head) else {
        return 0;
    };
    let Ok(entries) = decode_entries(header, rest, 256 << 20) else {
        return 0;
    };
    let mut again = Vec::new();
    encode_request(header.op, &entries, &mut again);
    assert_eq!(
        again, data,
        "a request read whole did not write back as itself"
    );
    entries.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(staging: u64, len: u64) -> StageEntry {
        StageEntry {
            buffer: 0x7f00_0000_0000,
            addr: 0x7f00_0000_1000u64.wrapping_add(staging),
            staging,
            len,
        }
    }

    fn decode(
        bytes: &[u8],
        staging_len: u64,
    ) -> Result<(StageOp, Vec<StageEntry>), StageViolation> {
        let mut head = [0u8; HEADER_BYTES];
        head.copy_from_slice(&bytes[..HEADER_BYTES]);
        let header = decode_header(head)?;
        decode_entries(header, &bytes[HEADER_BYTES..], staging_len)
            .map(|entries| (header.op, entries))
    }

    #[test]
    fn a_request_reads_back_as_it_was_written() {
        let entries = [entry(0, 4096), entry(4096, 32 << 10), entry(1 << 20, 1)];
        for op in [StageOp::Gather, StageOp::Scatter] {
            let mut bytes = Vec::new();
            encode_request(op, &entries, &mut bytes);
            assert_eq!(bytes.len(), HEADER_BYTES + 3 * ENTRY_BYTES);
            assert_eq!(decode(&bytes, 2 << 20), Ok((op, entries.to_vec())));
        }
    }

    #[test]
    fn entries_outside_the_staging_buffer_or_empty_are_refused_by_index() {
        let staging_len = 1 << 20;
        for (bad, index) in [
            (entry((1 << 20) - 10, 11), 1),
            (entry(0, 0), 1),
            (entry(u64::MAX - 4, 8), 1),
        ] {
            let mut bytes = Vec::new();
            encode_request(StageOp::Scatter, &[entry(0, 64), bad], &mut bytes);
            match decode(&bytes, staging_len) {
                Err(StageViolation::OutsideStaging { index: at, .. }) => assert_eq!(at, index),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn overlapping_entries_that_add_up_past_the_staging_buffer_are_refused() {
        let staging_len = 1 << 20;
        let mut bytes = Vec::new();
        let entries = [entry(0, 1 << 20), entry(0, 1 << 20)];
        encode_request(StageOp::Scatter, &entries, &mut bytes);
        assert_eq!(
            decode(&bytes, staging_len),
            Err(StageViolation::TooManyBytes {
                index: 1,
                staging_len
            })
        );
        bytes.clear();
        encode_request(StageOp::Scatter, &entries[..1], &mut bytes);
        assert!(decode(&bytes, staging_len).is_ok());
    }

    #[test]
    fn unknown_ops_counts_and_short_entries_are_refused() {
        let mut bytes = Vec::new();
        encode_request(StageOp::Gather, &[entry(0, 64)], &mut bytes);
        let mut unknown = bytes.clone();
        unknown[0] = 7;
        assert_eq!(decode(&unknown, 1 << 20), Err(StageViolation::UnknownOp(7)));
        let mut none = bytes.clone();
        none[1..5].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(decode(&none, 1 << 20), Err(StageViolation::Count(0)));
        let mut many = bytes.clone();
        many[1..5].copy_from_slice(&(MAX_ENTRIES + 1).to_le_bytes());
        assert_eq!(
            decode(&many, 1 << 20),
            Err(StageViolation::Count(MAX_ENTRIES + 1))
        );
        assert_eq!(
            decode(&bytes[..bytes.len() - 1], 1 << 20),
            Err(StageViolation::Truncated {
                got: ENTRY_BYTES - 1,
                expected: ENTRY_BYTES
            })
        );
    }

    #[test]
    fn a_failure_carries_its_reason_cut_at_a_character_boundary() {
        let answer = encode_failure("no buffer there");
        assert_eq!(answer[0], FAILED);
        assert_eq!(u32::from_le_bytes(answer[1..5].try_into().unwrap()), 15);
        assert_eq!(&answer[5..], b"no buffer there");
        let long = "\u{e9}".repeat(MAX_REASON_BYTES as usize);
        let answer = encode_failure(&long);
        let len = u32::from_le_bytes(answer[1..5].try_into().unwrap()) as usize;
        assert!(len <= MAX_REASON_BYTES as usize);
        assert!(std::str::from_utf8(&answer[5..]).is_ok());
        assert_eq!(answer.len(), 5 + len);
    }
}
