//! The caller's session driven from memory: against a listener's session as a pair, and
//! against hostile answers written by hand.

use super::test_memory::{test_config, TestMemory};
use super::test_pair::{Client, Outcome, Pair};
use super::Closed;
use crate::error::{ProtocolViolation, Refusal};
use crate::wire::seal::TAG_LEN;
use crate::wire::{self, Header, Kind, HEADER_LEN};
use std::time::Duration;

const BASE: u64 = TestMemory::BASE;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|index| (index as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn frame(kind: Kind, id: u64, body: &[u8]) -> Vec<u8> {
    let mut bytes = Header::for_body(kind, id, body).encode().to_vec();
    bytes.extend_from_slice(body);
    bytes
}

fn ack(id: u64) -> Vec<u8> {
    frame(Kind::Ack, id, &wire::encode_ack(Ok(())))
}

fn client() -> Client {
    let config = test_config();
    Client::new(1 << 20, config.limits, config.io_timeout)
}

fn violation(client: &Client) -> ProtocolViolation {
    match client.session.closed() {
        Some(Closed::Protocol(violation)) => violation.clone(),
        other => panic!("expected a protocol violation, got {other:?}"),
    }
}

/// A pair that writes `data` at the listener's `BASE + 64` (id 1) and reads it back into the
/// client's `BASE + 8` (id 2), sealed or not.
fn write_then_read(data: &[u8], sealed: bool) -> Pair {
    let mut pair = Pair::new(1 << 20, test_config());
    if sealed {
        pair.seal();
    }
    pair.client.hello("caller");
    pair.client.write(BASE + 64, data);
    pair.client
        .read(BASE + 64, BASE + 8, u32::try_from(data.len()).unwrap());
    pair
}

#[test]
fn a_write_is_acknowledged_and_read_data_lands_intact() {
    for sealed in [false, true] {
        for chunk in [usize::MAX, 1000, 1] {
            let data = pattern(7, 70_000);
            let mut pair = write_then_read(&data, sealed);
            pair.drive(chunk);
            assert_eq!(
                pair.client.outcomes,
                vec![(1, Outcome::Done), (2, Outcome::Done)]
            );
            assert_eq!(pair.server.memory.read(BASE + 64, data.len()), data);
            assert_eq!(pair.client.memory.read(BASE + 8, data.len()), data);
            assert_eq!(pair.client.waiting(), 0);
            assert_eq!(pair.client.session.closed(), None);
            assert_eq!(
                pair.client.session.poll_timeout(),
                None,
                "idle between answers"
            );
        }
    }
}

#[test]
fn block_sized_read_data_is_read_straight_into_its_destination() {
    let mut client = client();
    let id = client.expect_read(BASE, 100_000);
    client.receive(
        &Header::new(Kind::ReadData, id, 100_000).encode(),
        usize::MAX,
    );
    let mut target = client.session.read_target().expect("the session reads");
    assert_eq!(
        target.remaining(),
        100_000,
        "the whole destination, not the 16 KiB input buffer"
    );
    let data = pattern(1, 100_000);
    target.fill(&data);
    client.session.handle_read(client.now, data.len());
    client.answer_events();
    assert_eq!(client.outcomes, vec![(id, Outcome::Done)]);
    assert_eq!(client.memory.read(BASE, data.len()), data);
}

#[test]
fn refused_requests_report_the_listeners_reason() {
    let mut pair = Pair::new(1 << 20, test_config());
    pair.client.hello("caller");
    let write = pair.client.write(BASE + (1 << 20) - 2, b"four");
    let read = pair.client.read(BASE - 1, BASE, 2);
    let fine = pair.client.notify(b"hi");
    pair.drive(usize::MAX);
    assert_eq!(
        pair.client.outcomes,
        vec![
            (
                write,
                Outcome::Refused(Refusal::NotRegistered {
                    entry: None,
                    addr: BASE + (1 << 20) - 2,
                    len: 4,
                })
            ),
            (
                read,
                Outcome::Refused(Refusal::NotRegistered {
                    entry: None,
                    addr: BASE - 1,
                    len: 2,
                })
            ),
            (fine, Outcome::Done),
        ]
    );
    assert_eq!(pair.client.memory.read(BASE, 2), vec![0, 0]);
}

#[test]
fn a_tampered_answer_fails_its_request_and_closes_the_session() {
    let data = pattern(3, 5000);
    // Byte offsets into the answers: the flags of the ack's header (ignored when decoded, but
    // tagged), then the read data.
    let ack_flags = 6;
    let read_data = HEADER_LEN + TAG_LEN + HEADER_LEN + 100;
    for (at, kind) in [(ack_flags, "ack"), (read_data, "read-data")] {
        let mut pair = write_then_read(&data, true);
        pair.drive_altered(usize::MAX, |answers| answers[at] ^= 1);
        let tampered = ProtocolViolation::Tampered { kind };
        assert_eq!(
            pair.client.outcomes.last(),
            Some(&(
                if kind == "ack" { 1 } else { 2 },
                Outcome::Tampered(tampered.clone())
            ))
        );
        assert_eq!(
            pair.client.session.closed(),
            Some(&Closed::Protocol(tampered))
        );
    }
    // A tag cut off or replaced is as bad as altered bytes.
    let mut pair = write_then_read(&data, true);
    pair.drive_altered(usize::MAX, |answers| {
        let last = answers.len() - 1;
        answers[last] ^= 0x80;
    });
    assert_eq!(pair.client.outcomes[0], (1, Outcome::Done));
    assert_eq!(
        pair.client.outcomes[1],
        (
            2,
            Outcome::Tampered(ProtocolViolation::Tampered { kind: "read-data" })
        )
    );
}

#[test]
fn unsealed_answers_to_a_sealed_session_are_refused() {
    let mut client = client();
    client.seal(super::test_pair::client_keys());
    let id = client.expect_ack();
    client.receive(&ack(id), usize::MAX);
    client.receive(&[0u8; TAG_LEN], usize::MAX);
    assert_eq!(
        client.outcomes,
        vec![(
            id,
            Outcome::Tampered(ProtocolViolation::Tampered { kind: "ack" })
        )]
    );
}

#[test]
fn an_answer_to_no_outstanding_request_closes_the_session() {
    let mut client = client();
    let first = client.expect_ack();
    let second = client.expect_ack();
    let mut bytes = ack(first);
    bytes.extend(ack(99));
    bytes.extend(ack(second));
    client.receive(&bytes, usize::MAX);
    assert_eq!(client.outcomes, vec![(first, Outcome::Done)]);
    assert_eq!(violation(&client), ProtocolViolation::UnknownRequest(99));
    assert_eq!(
        client.waiting(),
        1,
        "the second request waits, to be failed"
    );
    // An id answered once is no longer outstanding.
    let mut client = self::client();
    let id = client.expect_ack();
    let mut bytes = ack(id);
    bytes.extend(ack(id));
    client.receive(&bytes, 1);
    assert_eq!(violation(&client), ProtocolViolation::UnknownRequest(id));
}

#[test]
fn answers_of_the_wrong_kind_close_the_session() {
    let mut client = client();
    let write = client.expect_ack();
    client.receive(&frame(Kind::ReadData, write, b"data"), usize::MAX);
    assert_eq!(
        violation(&client),
        ProtocolViolation::Unexpected {
            kind: "read-data",
            context: "in answer to a write",
        }
    );
    assert_eq!(client.waiting(), 0, "the request was taken, and dropped");
    for (kind, name) in [
        (Kind::Hello, "hello"),
        (Kind::Write, "write"),
        (Kind::DescriptorResponse, "descriptor-response"),
    ] {
        let mut client = self::client();
        let id = client.expect_ack();
        client.receive(&frame(kind, id, &[0u8; 12]), usize::MAX);
        assert_eq!(
            violation(&client),
            ProtocolViolation::Unexpected {
                kind: name,
                context: "from a listener",
            }
        );
    }
}

#[test]
fn read_data_of_the_wrong_length_lands_nothing() {
    for len in [99, 101, 0] {
        let mut client = client();
        let id = client.expect_read(BASE, 100);
        client.receive(&frame(Kind::ReadData, id, &vec![7u8; len]), usize::MAX);
        assert_eq!(
            violation(&client),
            ProtocolViolation::Malformed("read data of the wrong length")
        );
        assert!(client.outcomes.is_empty());
        assert_eq!(client.memory.read(BASE, 100), vec![0u8; 100]);
    }
}

#[test]
fn oversized_announcements_are_refused_at_the_header() {
    let limits = test_config().limits;
    let mut client = client();
    let id = client.expect_ack();
    client.receive(&Header::new(Kind::Ack, id, u32::MAX).encode(), usize::MAX);
    assert_eq!(
        violation(&client),
        ProtocolViolation::Oversized {
            kind: "ack",
            len: u64::from(u32::MAX),
            limit: u64::from(limits.max_control),
        }
    );
    assert!(client.peak_held < 64 << 10, "nothing allocated for it");
    let mut client = self::client();
    let id = client.expect_read(BASE, 100);
    let len = limits.max_data + 1;
    client.receive(&Header::new(Kind::ReadData, id, len).encode(), usize::MAX);
    assert_eq!(
        violation(&client),
        ProtocolViolation::Oversized {
            kind: "read-data",
            len: u64::from(len),
            limit: u64::from(limits.max_data),
        }
    );
}

#[test]
fn garbage_and_malformed_acks_close_the_session() {
    let mut client = client();
    client.expect_ack();
    client.receive(b"HTTP/1.1 400 Bad Request\r\n\r\n", usize::MAX);
    assert_eq!(
        violation(&client),
        ProtocolViolation::BadMagic { found: *b"HTTP" }
    );
    let mut client = self::client();
    let id = client.expect_ack();
    client.receive(&frame(Kind::Ack, id, &[0xff, 0xfe]), usize::MAX);
    assert_eq!(
        violation(&client),
        wire::decode_ack(&[0xff, 0xfe]).expect_err("an ack reason that is not text")
    );
}

#[test]
fn a_stream_that_ends_mid_answer_is_not_a_clean_end() {
    let mut client = client();
    let id = client.expect_ack();
    client.receive(&ack(id), usize::MAX);
    client.end();
    assert_eq!(client.session.closed(), Some(&Closed::Finished));
    for cut in [1, HEADER_LEN - 1, HEADER_LEN, HEADER_LEN + 1] {
        let mut client = self::client();
        let id = client.expect_read(BASE, 100);
        let answer = frame(Kind::ReadData, id, &[5u8; 100]);
        client.receive(&answer[..cut], usize::MAX);
        client.end();
        assert_eq!(
            client.session.closed(),
            Some(&Closed::EndedMidFrame),
            "{cut}"
        );
        assert!(client.outcomes.is_empty());
    }
}

#[test]
fn an_answer_stalled_after_its_header_times_out_but_an_idle_connection_does_not() {
    let io = test_config().io_timeout;
    let mut client = client();
    let id = client.expect_read(BASE, 100);
    client.wait(io * 10);
    assert_eq!(client.session.closed(), None, "no deadline between answers");
    let answer = frame(Kind::ReadData, id, &[5u8; 100]);
    client.receive(&answer[..HEADER_LEN + 10], usize::MAX);
    client.wait(io - Duration::from_millis(1));
    assert_eq!(client.session.closed(), None);
    client.wait(Duration::from_millis(1));
    assert_eq!(client.session.closed(), Some(&Closed::AnswerStalled(io)));
    assert!(
        client.session.read_target().is_none(),
        "a closed session reads no more"
    );
}

#[test]
fn a_sealed_answers_tag_gets_its_own_deadline() {
    let io = test_config().io_timeout;
    let mut client = client();
    client.seal(super::test_pair::client_keys());
    let id = client.expect_read(BASE, 10);
    client.receive(&Header::new(Kind::ReadData, id, 10).encode(), usize::MAX);
    client.wait(io - Duration::from_millis(2));
    client.receive(&[1u8; 10], usize::MAX);
    client.wait(io - Duration::from_millis(1));
    assert_eq!(
        client.session.closed(),
        None,
        "the tag's wait starts at the data's end"
    );
    client.wait(Duration::from_millis(1));
    assert_eq!(client.session.closed(), Some(&Closed::AnswerStalled(io)));
}

#[test]
fn the_client_fuzz_seeds_are_a_listeners_answers() {
    let data = crate::corpus::fuzz_corpus(env!("CARGO_MANIFEST_DIR"), "core").join("client");
    for (name, seed) in client_seeds() {
        let path = data.join(name);
        if std::env::var_os("FERRY_WRITE_FUZZ_SEEDS").is_some() {
            std::fs::create_dir_all(&data).unwrap();
            std::fs::write(&path, &seed).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_else(|error| {
            panic!(
                "{}: {error} (FERRY_WRITE_FUZZ_SEEDS=1 writes it)",
                path.display()
            )
        });
        assert_eq!(committed, seed, "{name} is not what the listener answers");
    }
    let whole = client_seeds().remove(0).1;
    assert_eq!(
        crate::fuzzing::client(&whole),
        format!("Some(Finished) {:?}", every_request_done())
    );
}

fn every_request_done() -> Vec<(u64, Outcome)> {
    let refused = Refusal::NotRegistered {
        entry: None,
        addr: BASE + (64 << 10),
        len: 10,
    };
    vec![
        (1, Outcome::Done),
        (2, Outcome::Done),
        (3, Outcome::Done),
        (4, Outcome::Done),
        (5, Outcome::Refused(refused)),
        (6, Outcome::Done),
    ]
}

/// The client target's seeds: a listener's answers to its requests, whole and cut off,
/// unsealed and sealed, each after the byte that picks the target's mode.
fn client_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut seeds = Vec::new();
    for sealed in [false, true] {
        let mut pair = Pair::new(64 << 10, crate::fuzzing::client_config());
        if sealed {
            pair.seal();
        }
        crate::fuzzing::client_requests(&mut pair.client);
        pair.drive(usize::MAX);
        assert_eq!(pair.client.outcomes, every_request_done());
        let answers = pair.answers();
        let mode = u8::from(sealed);
        let whole = [&[mode][..], answers].concat();
        // Cut in the middle of the 17,000-byte read's data, and left to time out.
        let cut = [&[mode | 2][..], &answers[..answers.len() / 2]].concat();
        match sealed {
            false => seeds.extend([("answers", whole), ("answers-stalled", cut)]),
            true => seeds.extend([("sealed-answers", whole), ("sealed-answers-stalled", cut)]),
        }
    }
    seeds
}
