//! The fuzz targets' narrow way in: compiled only for `cargo fuzz` (`--cfg fuzzing`) and for
//! this crate's own tests, which replay the committed corpus and every crash file through the
//! same two functions.

use crate::error::ProtocolViolation;
use crate::proto::test_memory::{test_config, Harness};
use crate::wire::{self, Header, Limits, Reader, HEADER_LEN};

/// Decodes `data` as one whole frame, encodes what was decoded again and panics if the two
/// disagree; returns why the frame was refused, if it was.
pub fn frame(data: &[u8]) -> Result<(), ProtocolViolation> {
    let limits = Limits::default();
    let mut reader = Reader::new(data);
    let mut raw = [0u8; HEADER_LEN];
    raw.copy_from_slice(reader.take(HEADER_LEN, "header")?);
    let header = Header::decode(&raw, &limits)?;
    let encoded = header.encode();
    // Flags and the reserved bytes are ignored on decode and written as zeros.
    assert_eq!(encoded[..6], raw[..6], "magic, version and kind");
    assert_eq!(encoded[8..20], raw[8..20], "id and length");
    assert_eq!(Header::decode(&encoded, &limits), Ok(header));
    let body = reader.take(header.len as usize, "frame body")?;
    reader.finish()?;
    match header.kind {
        wire::Kind::Hello => {
            let hello = wire::decode_hello(body)?;
            assert_eq!(wire::encode_hello(&hello), body, "hello");
        }
        wire::Kind::ReadRequest => {
            let (addr, len) = wire::decode_read_request(body)?;
            assert_eq!(wire::encode_read_request(addr, len), body, "read request");
        }
        wire::Kind::Ack => {
            let outcome = wire::decode_ack(body)?;
            let again = wire::encode_ack(outcome.as_ref().map(|_| ()));
            assert_eq!(again, body, "ack");
        }
        wire::Kind::WriteMany => {
            let mut count = [0u8; 4];
            count.copy_from_slice(Reader::new(body).take(4, "write-many count")?);
            let table_len = wire::decode_write_many_count(count, header.len, limits.max_entries)?;
            let table = &body[4..4 + table_len];
            let data_len = (body.len() - 4 - table_len) as u64;
            let entries = wire::decode_write_many_table(table, data_len)?;
            assert_eq!(
                wire::encode_write_many_table(&entries),
                body[..4 + table_len],
                "write-many table"
            );
        }
        wire::Kind::Write => {
            Reader::new(body).take(8, "write address")?;
        }
        wire::Kind::DescriptorRequest
        | wire::Kind::DescriptorResponse
        | wire::Kind::ReadData
        | wire::Kind::Notify => {}
    }
    Ok(())
}

/// Most bytes a session may hold for one connection, counted before its answers are
/// written: its input buffer, the largest part it collects (a 64 KiB control body) and at
/// most one frame's worth of answers (`max_data`, 64 KiB here) plus the answer that crossed it.
const SESSION_BOUND: usize = 256 << 10;

/// Read sizes the stream is cut into, in turn, so frames are split at many places.
const CHUNKS: [usize; 6] = [1, 23, 24, 7, 4096, 16 << 10];

/// Feeds `data` as one connection's bytes into a fresh listener session over 64 KiB of
/// memory at a fixed address, answering its events as the TCP driver does; panics if the
/// session holds more than its bound or writes a malformed answer. Returns how it ended.
pub fn session(data: &[u8]) -> String {
    let mut config = test_config();
    config.limits.max_data = 64 << 10;
    let mut harness = Harness::new(64 << 10, config);
    let mut taken = 0;
    for chunk in CHUNKS.iter().cycle() {
        if taken == data.len() {
            break;
        }
        let end = data.len().min(taken + chunk);
        let fed = harness.feed(&data[taken..end], usize::MAX);
        assert!(
            harness.peak_held <= SESSION_BOUND,
            "the session held {} bytes before writing its answers",
            harness.peak_held
        );
        if fed < end - taken {
            break;
        }
        taken = end;
    }
    harness.end();
    harness.answers();
    format!("{:?}", harness.closed())
}

#[cfg(test)]
mod tests {
    //! Replays the committed fuzz corpus and crash files through the fuzz targets' functions.

    use std::path::{Path, PathBuf};

    fn data() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz")
    }

    /// The files of `dir` other than `.expected` ones, sorted.
    fn inputs(dir: &Path) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_none_or(|ext| ext != "expected"))
            .collect();
        files.sort();
        files
    }

    fn replay(target: &str, run: impl Fn(&[u8]) -> String) {
        let corpus = inputs(&data().join(target));
        assert!(!corpus.is_empty(), "the {target} corpus is empty");
        for file in &corpus {
            run(&std::fs::read(file).unwrap());
        }
        for file in inputs(&data().join(format!("{target}-crashes"))) {
            let expected_file = file.with_extension("expected");
            let expected = std::fs::read_to_string(&expected_file)
                .unwrap_or_else(|error| panic!("{}: {error}", expected_file.display()));
            let outcome = run(&std::fs::read(&file).unwrap());
            assert_eq!(outcome, expected.trim_end(), "{}", file.display());
        }
    }

    #[test]
    fn the_frame_corpus_and_crashes_replay_without_panics() {
        replay("frame", |bytes| format!("{:?}", super::frame(bytes)));
    }

    #[test]
    fn the_session_corpus_and_crashes_replay_without_panics() {
        replay("session", super::session);
    }
}
