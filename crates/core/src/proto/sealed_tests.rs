//! A sealed session ([`ServerSession::seal`]) driven from memory: tagged frames are served as
//! before, and a frame altered anywhere closes the session, with nothing landed when the
//! change is in a write's destination.

use super::test_memory::{test_config, Harness, TestMemory};
use super::Closed;
use crate::auth::FrameKeys;
use crate::error::ProtocolViolation;
use crate::wire::seal::{self, Sealer, TAG_LEN};
use crate::wire::{self, Header, Hello, Kind, WriteManyEntry, HEADER_LEN, WRITE_MANY_ENTRY_LEN};

const BASE: u64 = TestMemory::BASE;

/// The session's keys; the caller's sending key is the session's receiving one.
fn keys() -> FrameKeys {
    FrameKeys {
        send: [1; 32],
        receive: [2; 32],
    }
}

/// Frame `kind` with `body`, tagged as a caller sends it: after the address or table of a
/// write, and at the end.
fn sealed(sealer: &mut Sealer, kind: Kind, id: u64, body: &[u8]) -> Vec<u8> {
    let header = Header::for_body(kind, id, body).encode();
    let prefix = match kind {
        Kind::Write => 8,
        Kind::WriteMany => {
            let count = u32::from_le_bytes(body[..4].try_into().expect("a count"));
            4 + count as usize * WRITE_MANY_ENTRY_LEN
        }
        _ => body.len(),
    };
    sealer.begin(&header);
    sealer.update(&body[..prefix]);
    let mut bytes = header.to_vec();
    bytes.extend_from_slice(&body[..prefix]);
    if seal::tags_prefix(kind) {
        bytes.extend_from_slice(&sealer.prefix_tag());
    }
    sealer.update(&body[prefix..]);
    bytes.extend_from_slice(&body[prefix..]);
    bytes.extend_from_slice(&sealer.finish());
    bytes
}

/// A hello, a write of `data` at `BASE + 64` (id 7) and a write-many of it at `BASE + 200_000`
/// (id 8).
fn requests(data: &[u8]) -> Vec<u8> {
    let mut sealer = Sealer::new(keys().receive);
    let hello = wire::encode_hello(&Hello {
        name: "peer".into(),
    });
    let mut bytes = sealed(&mut sealer, Kind::Hello, 0, &hello);
    let mut write = (BASE + 64).to_le_bytes().to_vec();
    write.extend_from_slice(data);
    bytes.extend(sealed(&mut sealer, Kind::Write, 7, &write));
    let mut many = wire::encode_write_many_table(&[WriteManyEntry {
        addr: BASE + 200_000,
        len: data.len() as u32,
    }]);
    many.extend_from_slice(data);
    bytes.extend(sealed(&mut sealer, Kind::WriteMany, 8, &many));
    bytes
}

fn session(bytes: &[u8], chunk: usize) -> Harness {
    let mut harness = Harness::new(1 << 20, test_config());
    harness.seal(keys());
    harness.feed(bytes, chunk);
    harness
}

fn tampered(harness: &Harness) -> &'static str {
    match harness.closed() {
        Some(Closed::Protocol(ProtocolViolation::Tampered { kind })) => kind,
        other => panic!("expected the session closed for a bad tag, got {other:?}"),
    }
}

/// The session's answers, each checked against its tag: `(kind, id, body)`.
fn opened_answers(harness: &Harness) -> Vec<(Kind, u64, Vec<u8>)> {
    harness
        .answers()
        .into_iter()
        .map(|(header, body)| (header.kind, header.id, body))
        .collect()
}

#[test]
fn tagged_frames_land_and_are_answered_with_tagged_acks() {
    // 100,000 bytes go straight into their destination; one byte at a time through the buffer.
    let data: Vec<u8> = (0..100_000u32).map(|index| (index * 7) as u8).collect();
    for chunk in [usize::MAX, 1] {
        let harness = session(&requests(&data), chunk);
        assert_eq!(harness.closed(), None);
        assert!(harness.memory.read(BASE + 64, data.len()) == data);
        assert!(harness.memory.read(BASE + 200_000, data.len()) == data);
        let acks: Vec<(u64, Vec<u8>)> = opened_answers(&harness)
            .into_iter()
            .map(|(kind, id, body)| {
                assert_eq!(kind, Kind::Ack);
                (id, body)
            })
            .collect();
        assert_eq!(acks.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [7, 8]);
        assert!(acks
            .iter()
            .all(|(_, body)| wire::decode_ack(body) == Ok(Ok(()))));
    }
}

#[test]
fn a_long_write_is_tagged_across_the_reads_it_lands_in() {
    // 2.5 MiB, landed straight in its destination 64 KiB or one byte at a time and hashed as
    // it lands; one altered byte in its middle still fails the tag.
    let data: Vec<u8> = (0..(5u32 << 19)).map(|index| (index % 253) as u8).collect();
    let mut sealer = Sealer::new(keys().receive);
    let hello = wire::encode_hello(&Hello {
        name: "peer".into(),
    });
    let mut bytes = sealed(&mut sealer, Kind::Hello, 0, &hello);
    let mut write = BASE.to_le_bytes().to_vec();
    write.extend_from_slice(&data);
    bytes.extend(sealed(&mut sealer, Kind::Write, 1, &write));
    let mut config = test_config();
    config.limits.max_data = 4 << 20;
    for (chunk, altered) in [(64 << 10, false), (1, false), (64 << 10, true)] {
        let mut harness = Harness::new(4 << 20, config);
        harness.seal(keys());
        let mut stream = bytes.clone();
        if altered {
            let at = stream.len() - TAG_LEN - data.len() + (3 << 19);
            stream[at] ^= 0x10;
        }
        harness.feed(&stream, chunk);
        if altered {
            assert_eq!(tampered(&harness), "write");
        } else {
            assert_eq!(harness.closed(), None);
            assert!(harness.memory.read(BASE, data.len()) == data);
            assert_eq!(opened_answers(&harness).len(), 1);
        }
    }
}

#[test]
fn an_altered_destination_closes_the_session_before_a_byte_lands() {
    let data = vec![0xabu8; 40_000];
    let mut bytes = requests(&data);
    let hello = wire::encode_hello(&Hello {
        name: "peer".into(),
    });
    // The write's address: the first byte after the hello and the write's header.
    bytes[HEADER_LEN + hello.len() + TAG_LEN + HEADER_LEN] ^= 0x40;
    for chunk in [usize::MAX, 1] {
        let harness = session(&bytes, chunk);
        assert_eq!(tampered(&harness), "write");
        assert!(harness
            .memory
            .read(BASE, 1 << 19)
            .iter()
            .all(|&byte| byte == 0));
        assert!(
            opened_answers(&harness).is_empty(),
            "nothing is acknowledged"
        );
    }
}

#[test]
fn altered_data_is_refused_with_its_reason_and_closes_the_session() {
    let data = vec![0xabu8; 40_000];
    let mut bytes = requests(&data);
    let last = bytes.len() - TAG_LEN - 1;
    // The write-many's last data byte.
    bytes[last] ^= 0x01;
    for chunk in [usize::MAX, 1] {
        let harness = session(&bytes, chunk);
        assert_eq!(tampered(&harness), "write-many");
        let answers = opened_answers(&harness);
        assert_eq!(
            answers.len(),
            2,
            "the write's ack, then the write-many's refusal"
        );
        let refusal = wire::decode_ack(&answers[1].2).expect("an ack");
        assert!(
            refusal
                .as_ref()
                .is_err_and(|reason| reason.to_string().contains("integrity tag")),
            "{refusal:?}"
        );
    }
}

#[test]
fn an_untagged_or_replayed_frame_closes_the_session() {
    let hello = wire::encode_hello(&Hello {
        name: "peer".into(),
    });
    let untagged = {
        let mut bytes = Header::for_body(Kind::Hello, 0, &hello).encode().to_vec();
        bytes.extend_from_slice(&hello);
        bytes.extend_from_slice(&[0; TAG_LEN]);
        bytes
    };
    assert_eq!(tampered(&session(&untagged, usize::MAX)), "hello");
    let mut sealer = Sealer::new(keys().receive);
    let once = sealed(&mut sealer, Kind::Hello, 0, &hello);
    let request = sealed(&mut sealer, Kind::DescriptorRequest, 1, &[]);
    let mut replayed = once.clone();
    replayed.extend_from_slice(&request);
    replayed.extend_from_slice(&request);
    let harness = session(&replayed, usize::MAX);
    assert_eq!(tampered(&harness), "descriptor-request");
    let answers = opened_answers(&harness);
    assert_eq!(
        answers.len(),
        1,
        "the first request is answered, the replay is not"
    );
    assert_eq!(answers[0].0, Kind::DescriptorResponse);
}

#[test]
fn the_sealed_session_fuzz_seed_is_served_whole() {
    // The seed: hello, write, descriptor request, read request and notification, tagged with
    // the target's caller key. Served to its clean end, it keeps the fuzzer's start valid.
    let seed = include_bytes!("../../tests/data/fuzz/sealed_session/requests");
    assert_eq!(crate::fuzzing::sealed_session(seed), "Some(Finished)");
    let mut altered = seed.to_vec();
    altered[100] ^= 1;
    assert!(crate::fuzzing::sealed_session(&altered).contains("Tampered"));
}
