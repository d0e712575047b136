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
    run_session(data, None)
}

/// The keys of the sealed session target; its seeds are tagged with them.
pub const SEALED_SESSION_KEYS: ([u8; 32], [u8; 32]) = ([0x5e; 32], [0xa1; 32]);

/// [`session`] on a sealed connection ([`SEALED_SESSION_KEYS`]: the caller's sending key,
/// then the session's): also panics if an answer is not tagged right.
pub fn sealed_session(data: &[u8]) -> String {
    let (caller, session) = SEALED_SESSION_KEYS;
    run_session(
        data,
        Some(crate::auth::FrameKeys {
            send: session,
            receive: caller,
        }),
    )
}

fn run_session(data: &[u8], keys: Option<crate::auth::FrameKeys>) -> String {
    let mut config = test_config();
    config.limits.max_data = 64 << 10;
    let mut harness = Harness::new(64 << 10, config);
    if let Some(keys) = keys {
        harness.seal(keys);
    }
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

/// Most bytes a client session may hold: its input buffer and the largest part it collects
/// (a 64 KiB ack body and its tag, in a buffer grown by doubling).
const CLIENT_BOUND: usize = 256 << 10;

/// The limits of the client target's session, and of the listener that made its seeds.
pub(crate) fn client_config() -> crate::proto::SessionConfig {
    let mut config = test_config();
    config.limits.max_data = 64 << 10;
    config
}

/// The requests the client target waits on, in order (ids 1 to 6): two writes, three reads
/// (the last refused by the listener) and a notification, after a hello. Its seeds are a
/// listener's answers to them.
pub(crate) fn client_requests(client: &mut crate::proto::test_pair::Client) {
    use crate::proto::test_memory::TestMemory;
    let base = TestMemory::BASE;
    let data: Vec<u8> = (0..17_000u32).map(|index| (index % 251) as u8).collect();
    client.hello("fuzz");
    client.write(base, &data[..100]);
    client.write(base + 1000, &data);
    client.read(base, base, 100);
    client.read(base + 1000, base + 1000, 17_000);
    client.read(base + (64 << 10), base + 30_000, 10);
    client.notify(b"fuzz");
}

/// Feeds `data` as a listener's answers into a fresh client session waiting on
/// [`client_requests`]: the first byte picks a sealed session (bit 0) and whether the session
/// then waits out its timer (bit 1) instead of seeing the stream end; the rest is cut into
/// reads of changing sizes. Panics if the session holds more than its bound, answers a request
/// twice, loses more than the one whose answer it was reading, or has not ended once the
/// stream did. Returns how it ended and what became of each request.
pub fn client(data: &[u8]) -> String {
    use crate::proto::test_pair::{client_keys, Client};
    let Some((&choice, answers)) = data.split_first() else {
        return "empty".into();
    };
    let config = client_config();
    let mut client = Client::new(64 << 10, config.limits, config.io_timeout);
    if choice & 1 != 0 {
        client.seal(client_keys());
    }
    client_requests(&mut client);
    let sent = client.waiting();
    let mut taken = 0;
    for chunk in CHUNKS.iter().cycle() {
        if taken == answers.len() {
            break;
        }
        let end = answers.len().min(taken + chunk);
        let fed = client.receive(&answers[taken..end], usize::MAX);
        if fed < end - taken {
            break;
        }
        taken = end;
    }
    assert!(
        client.peak_held <= CLIENT_BOUND,
        "the client session held {} bytes",
        client.peak_held
    );
    if choice & 2 != 0 {
        client.wait(config.io_timeout);
    } else {
        client.end();
        assert!(
            client.session.closed().is_some(),
            "the stream ended and the session did not"
        );
    }
    let mut ids: Vec<u64> = client.outcomes.iter().map(|(id, _)| *id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        ids.len(),
        client.outcomes.len(),
        "a request was answered twice"
    );
    assert!(
        client.outcomes.len() + client.waiting() + 1 >= sent,
        "requests vanished: {} answered and {} waiting of {sent}",
        client.outcomes.len(),
        client.waiting()
    );
    format!("{:?} {:?}", client.session.closed(), client.outcomes)
}

/// The secret the handshake and descriptor targets hold; the fuzzer never sees it.
const FUZZ_SECRET: &[u8] = b"fuzzing-secret-that-inputs-never-hold";

/// Feeds `data` to one side of an authentication handshake as the other side's bytes: the
/// first byte picks the side (a client, a server with the secret, a server without one) and
/// whether the stream ends after the bytes; the rest is cut into reads of the sizes its own
/// bytes give. Panics if the machine takes more than it was given, wants more than a message,
/// or ends in success, which no input can reach without the secret. Returns how it ended.
pub fn handshake(data: &[u8]) -> String {
    use crate::auth::{Handshake, Secret, HELLO_LEN, NONCE_LEN};
    let Some((&choice, mut rest)) = data.split_first() else {
        return "empty".into();
    };
    let secret = Secret::new(FUZZ_SECRET.to_vec()).expect("the fuzz secret is long enough");
    let nonce = [0x5a; NONCE_LEN];
    let mut machine = match choice % 3 {
        0 => Handshake::client(secret, nonce, choice & 4 != 0),
        1 => Handshake::server(Some(secret), nonce),
        _ => Handshake::server(None, nonce),
    };
    while let Some((&size, tail)) = rest.split_first() {
        let _ = machine.poll_transmit();
        if machine.outcome().is_some() {
            break;
        }
        let piece = &tail[..usize::from(size).min(tail.len())];
        // No message of the handshake is longer than two hellos.
        let wanted = machine.wants();
        assert!(wanted <= 2 * HELLO_LEN, "the machine wants {wanted} bytes");
        let used = machine.handle_input(piece);
        assert!(used <= piece.len(), "took {used} of {} bytes", piece.len());
        rest = &tail[piece.len()..];
    }
    if choice & 0x80 != 0 {
        machine.handle_eof();
    }
    let _ = machine.poll_transmit();
    let outcome = machine.outcome();
    assert!(
        !matches!(outcome, Some(Ok(()))),
        "a handshake succeeded against bytes that hold no proof of the secret"
    );
    format!("{outcome:?}")
}

/// Parses `data` as a descriptor fetched from a store or a peer and checks its signature
/// against the target's secret, as an engine with that secret does: panics if a parsed
/// descriptor does not survive its own JSON unchanged, or if a signature checks out, which no
/// input can reach without the secret. Returns why it was refused.
pub fn descriptor(data: &[u8]) -> String {
    use crate::auth::Secret;
    use crate::descriptor::SegmentDescriptor;
    let parsed = match SegmentDescriptor::from_json("fuzz", data) {
        Ok(parsed) => parsed,
        Err(error) => return format!("not a descriptor: {error}"),
    };
    let again = SegmentDescriptor::from_json("fuzz", &parsed.to_json())
        .expect("a parsed descriptor parses again");
    assert_eq!(again, parsed, "the JSON round trip changed the descriptor");
    let secret = Secret::new(FUZZ_SECRET.to_vec()).expect("the fuzz secret is long enough");
    match crate::auth::signature::check(&parsed, &secret) {
        Ok(()) => panic!("a descriptor checked out without the secret"),
        Err(why) => why.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    //! Replays the committed fuzz corpus and crash files through the fuzz targets' functions.

    use std::path::{Path, PathBuf};

    fn data() -> PathBuf {
        crate::corpus::fuzz_corpus(env!("CARGO_MANIFEST_DIR"), "core")
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
        // A target that never crashed has no crash folder.
        let crashes = data().join(format!("{target}-crashes"));
        let crash_files = match crashes.exists() {
            true => inputs(&crashes),
            false => Vec::new(),
        };
        for file in crash_files {
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

    #[test]
    fn the_sealed_session_corpus_and_crashes_replay_without_panics() {
        replay("sealed_session", super::sealed_session);
    }

    #[test]
    fn the_client_corpus_and_crashes_replay_without_panics() {
        replay("client", super::client);
    }

    #[test]
    fn the_handshake_corpus_and_crashes_replay_without_panics() {
        replay("handshake", super::handshake);
    }

    #[test]
    fn the_descriptor_corpus_and_crashes_replay_without_panics() {
        replay("descriptor", super::descriptor);
    }

    #[test]
    fn a_descriptor_signed_with_the_targets_secret_is_the_one_input_that_checks_out() {
        // The target's assertion can fail: a descriptor really signed with its secret.
        let secret = crate::auth::Secret::new(super::FUZZ_SECRET.to_vec()).unwrap();
        let seed = std::fs::read(data().join("descriptor/signed-other-secret.json")).unwrap();
        let mut parsed = crate::descriptor::SegmentDescriptor::from_json("x", &seed).unwrap();
        parsed.signature = None;
        let signed = crate::auth::sign_descriptor(&parsed, &secret).to_json();
        let outcome = std::panic::catch_unwind(|| super::descriptor(&signed));
        assert!(
            outcome.is_err(),
            "the target must refuse to call a real signature forged"
        );
    }
}
