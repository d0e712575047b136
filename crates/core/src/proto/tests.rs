//! The listener's session driven from memory: bytes in, answers and landed bytes out, time
//! passed in by hand.

use super::input::Input;
use super::server::MAX_COPIED_ANSWERS;
use super::test_memory::{test_config, Harness, TestMemory};
use super::Closed;
use crate::error::{ProtocolViolation, Refusal};
use crate::wire::{self, Header, Hello, Kind, WriteManyEntry, MAX_HELLO_BODY};
use std::time::Duration;

const BASE: u64 = TestMemory::BASE;

fn frame(kind: Kind, id: u64, body: &[u8]) -> Vec<u8> {
    let mut bytes = Header::for_body(kind, id, body).encode().to_vec();
    bytes.extend_from_slice(body);
    bytes
}

fn hello(name: &str) -> Vec<u8> {
    frame(
        Kind::Hello,
        0,
        &wire::encode_hello(&Hello { name: name.into() }),
    )
}

fn write(id: u64, addr: u64, data: &[u8]) -> Vec<u8> {
    let mut body = addr.to_le_bytes().to_vec();
    body.extend_from_slice(data);
    frame(Kind::Write, id, &body)
}

fn write_many(id: u64, entries: &[(u64, &[u8])]) -> Vec<u8> {
    let table: Vec<WriteManyEntry> = entries
        .iter()
        .map(|(addr, data)| WriteManyEntry {
            addr: *addr,
            len: data.len() as u32,
        })
        .collect();
    let mut body = wire::encode_write_many_table(&table);
    for (_, data) in entries {
        body.extend_from_slice(data);
    }
    frame(Kind::WriteMany, id, &body)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Feeds `bytes` whole and one byte at a time; both must end the same way.
fn both_ways(bytes: &[u8], check: impl Fn(&Harness)) {
    for chunk in [usize::MAX, 1] {
        let mut harness = Harness::new(1 << 20, test_config());
        harness.feed(bytes, chunk);
        check(&harness);
    }
}

fn acks(harness: &Harness) -> Vec<(u64, Result<(), Refusal>)> {
    harness
        .answers()
        .into_iter()
        .map(|(header, body)| {
            assert_eq!(header.kind, Kind::Ack);
            (header.id, wire::decode_ack(&body).unwrap())
        })
        .collect()
}

fn violation(harness: &Harness) -> ProtocolViolation {
    match harness.closed() {
        Some(Closed::Protocol(violation)) => violation.clone(),
        other => panic!("expected a protocol violation, got {other:?}"),
    }
}

#[test]
fn a_hello_then_a_write_lands_its_bytes_and_is_acknowledged() {
    let data = pattern(3, 100_000);
    let mut bytes = hello("10.0.0.1:17000");
    bytes.extend(write(7, BASE + 64, &data));
    both_ways(&bytes, |harness| {
        assert_eq!(harness.session.peer(), Some("10.0.0.1:17000"));
        assert_eq!(acks(harness), vec![(7, Ok(()))]);
        assert_eq!(harness.memory.read(BASE + 64, data.len()), data);
        assert_eq!(harness.closed(), None);
    });
}

#[test]
fn a_write_many_lands_every_entry_in_order() {
    let (first, second) = (pattern(1, 10), pattern(2, 40_000));
    let mut bytes = hello("peer");
    bytes.extend(write_many(3, &[(BASE + 100_000, &first), (BASE, &second)]));
    bytes.extend(write(4, BASE + 200_000, &first));
    both_ways(&bytes, |harness| {
        assert_eq!(acks(harness), vec![(3, Ok(())), (4, Ok(()))]);
        assert_eq!(harness.memory.read(BASE + 100_000, 10), first);
        assert_eq!(harness.memory.read(BASE, 40_000), second);
        assert_eq!(harness.memory.read(BASE + 200_000, 10), first);
    });
}

#[test]
fn a_write_outside_the_memory_is_refused_whole_and_the_next_frame_still_lands() {
    let data = pattern(5, 300);
    let mut bytes = hello("peer");
    // The second entry runs one byte past the end: nothing of the frame may land.
    bytes.extend(write_many(
        1,
        &[(BASE, &data), (BASE + (1 << 20) - 299, &data)],
    ));
    bytes.extend(write(2, BASE + 1000, &data));
    both_ways(&bytes, |harness| {
        let acks = acks(harness);
        assert_eq!(acks.len(), 2);
        assert_eq!(
            acks[0],
            (
                1,
                Err(Refusal::NotRegistered {
                    entry: None,
                    addr: BASE + (1 << 20) - 299,
                    len: 300,
                })
            )
        );
        assert_eq!(acks[1], (2, Ok(())));
        assert_eq!(harness.memory.read(BASE, 300), vec![0u8; 300]);
        assert_eq!(harness.memory.read(BASE + 1000, 300), data);
    });
}

#[test]
fn a_read_is_answered_with_the_bytes_and_a_descriptor_request_with_the_descriptor() {
    let data = pattern(9, 5000);
    let mut bytes = hello("peer");
    bytes.extend(write(1, BASE + 8, &data));
    bytes.extend(frame(
        Kind::ReadRequest,
        2,
        &wire::encode_read_request(BASE + 8, 5000),
    ));
    bytes.extend(frame(Kind::DescriptorRequest, 3, &[]));
    bytes.extend(frame(
        Kind::ReadRequest,
        4,
        &wire::encode_read_request(BASE - 1, 2),
    ));
    both_ways(&bytes, |harness| {
        let answers = harness.answers();
        assert_eq!(answers.len(), 4);
        assert_eq!((answers[1].0.kind, answers[1].0.id), (Kind::ReadData, 2));
        assert_eq!(answers[1].1, data);
        assert_eq!(
            (answers[2].0.kind, answers[2].1.as_slice()),
            (Kind::DescriptorResponse, TestMemory::DESCRIPTOR)
        );
        assert_eq!((answers[3].0.kind, answers[3].0.id), (Kind::Ack, 4));
        assert_eq!(
            wire::decode_ack(&answers[3].1),
            Ok(Err(Refusal::NotRegistered {
                entry: None,
                addr: BASE - 1,
                len: 2,
            }))
        );
    });
}

#[test]
fn notifications_are_delivered_until_the_inbox_refuses() {
    let mut bytes = hello("peer");
    for id in 1..=5 {
        bytes.extend(frame(Kind::Notify, id, format!("note {id}").as_bytes()));
    }
    both_ways(&bytes, |harness| {
        assert_eq!(harness.delivered.len(), 4);
        assert_eq!(harness.delivered[3], b"note 4");
        let acks = acks(harness);
        assert_eq!(acks[3], (4, Ok(())));
        assert_eq!(
            acks[4],
            (5, Err(Refusal::Other("the test inbox is full".into())))
        );
    });
}

#[test]
fn garbage_is_refused_at_the_magic() {
    both_ways(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", |harness| {
        assert_eq!(
            violation(harness),
            ProtocolViolation::BadMagic { found: *b"GET " }
        );
        assert!(harness.sent.is_empty());
    });
}

#[test]
fn an_oversized_frame_is_refused_at_its_header() {
    let mut bytes = hello("peer");
    bytes.extend(Header::new(Kind::Notify, 1, 64 << 20).encode());
    both_ways(&bytes, |harness| {
        assert_eq!(
            violation(harness),
            ProtocolViolation::Oversized {
                kind: "notify",
                len: 64 << 20,
                limit: 64 << 10
            }
        );
    });
}

#[test]
fn an_over_long_hello_is_refused_before_its_body_is_read() {
    let long = hello(&"x".repeat(300));
    both_ways(&long[..wire::HEADER_LEN], |harness| {
        assert_eq!(
            violation(harness),
            ProtocolViolation::Oversized {
                kind: "hello",
                len: 302,
                limit: u64::from(MAX_HELLO_BODY)
            }
        );
    });
}

#[test]
fn a_write_many_whose_table_outruns_its_frame_is_refused() {
    let mut body = 3u32.to_le_bytes().to_vec();
    body.extend_from_slice(&[0u8; 20]);
    let mut bytes = hello("peer");
    bytes.extend(frame(Kind::WriteMany, 1, &body));
    both_ways(&bytes, |harness| {
        assert_eq!(
            violation(harness),
            ProtocolViolation::TooShort {
                what: "write-many table",
                needed: 16
            }
        );
    });
}

#[test]
fn frames_out_of_place_are_refused() {
    let cases = [
        (
            write(1, BASE, b"abc"),
            ProtocolViolation::Unexpected {
                kind: "write",
                context: "before hello",
            },
        ),
        (
            [hello("a"), hello("b")].concat(),
            ProtocolViolation::Unexpected {
                kind: "hello",
                context: "twice on one connection",
            },
        ),
        (
            [hello("a"), frame(Kind::Ack, 1, &[])].concat(),
            ProtocolViolation::Unexpected {
                kind: "ack",
                context: "at a listener",
            },
        ),
        (
            [hello("a"), frame(Kind::Write, 1, &[0; 8])].concat(),
            ProtocolViolation::Malformed("zero-length write"),
        ),
        (
            [hello("a"), frame(Kind::DescriptorRequest, 1, &[1])].concat(),
            ProtocolViolation::TrailingBytes(1),
        ),
    ];
    for (bytes, expected) in cases {
        both_ways(&bytes, |harness| assert_eq!(violation(harness), expected));
    }
}

#[test]
fn a_frame_cut_short_by_the_end_of_the_stream_is_named() {
    let mut bytes = hello("peer");
    let whole = write(1, BASE, &pattern(1, 1000));
    bytes.extend_from_slice(&whole[..500]);
    let mut harness = Harness::new(1 << 20, test_config());
    harness.feed(&bytes, usize::MAX);
    harness.end();
    assert_eq!(harness.closed(), Some(&Closed::EndedMidFrame));
    assert!(harness.sent.is_empty(), "a cut frame is never acknowledged");

    let mut clean = Harness::new(1 << 20, test_config());
    clean.feed(&hello("peer"), usize::MAX);
    clean.end();
    assert_eq!(clean.closed(), Some(&Closed::Finished));
}

#[test]
fn a_connection_without_a_hello_is_closed_after_the_io_timeout() {
    let mut harness = Harness::new(4096, test_config());
    harness.wait(Duration::from_secs(29));
    assert_eq!(harness.closed(), None);
    harness.wait(Duration::from_secs(1));
    assert_eq!(
        harness.closed(),
        Some(&Closed::NoHello(Duration::from_secs(30)))
    );
}

#[test]
fn an_idle_connection_is_closed_after_the_idle_timeout_but_a_busy_one_is_not() {
    let mut config = test_config();
    config.idle_timeout = Duration::from_secs(60);
    let mut harness = Harness::new(4096, config);
    harness.feed(&hello("peer"), usize::MAX);
    harness.wait(Duration::from_secs(59));
    harness.feed(&write(1, BASE, b"abc"), usize::MAX);
    // The frame reset the idle clock.
    harness.wait(Duration::from_secs(59));
    assert_eq!(harness.closed(), None);
    harness.wait(Duration::from_secs(1));
    assert_eq!(
        harness.closed(),
        Some(&Closed::Idle(Duration::from_secs(60)))
    );
}

#[test]
fn a_frame_that_stalls_part_way_is_closed_after_the_io_timeout() {
    let mut config = test_config();
    config.io_timeout = Duration::from_secs(5);
    let mut harness = Harness::new(1 << 20, config);
    let data = pattern(4, 50_000);
    let whole = write(1, BASE, &data);
    harness.feed(&hello("peer"), usize::MAX);
    harness.feed(&whole[..40_000], usize::MAX);
    harness.wait(Duration::from_secs(5));
    assert_eq!(
        harness.closed(),
        Some(&Closed::Stalled(Duration::from_secs(5)))
    );
    assert!(
        harness.sent.is_empty(),
        "a stalled frame is never acknowledged"
    );
}

#[test]
fn answers_the_peer_does_not_read_are_given_up_on() {
    let mut config = test_config();
    config.io_timeout = Duration::from_secs(5);
    let mut harness = Harness::new(4096, config);
    let mut bytes = hello("peer");
    bytes.extend(frame(Kind::DescriptorRequest, 1, &[]));
    // Fed by hand so that nothing is written.
    let mut target = harness.session.read_target().unwrap();
    assert_eq!(target.fill(&bytes), bytes.len());
    harness.session.handle_read(harness.now, bytes.len());
    assert!(harness.session.poll_transmit().is_some());
    harness.now += Duration::from_secs(5);
    harness.session.handle_timeout(harness.now);
    assert_eq!(
        harness.closed(),
        Some(&Closed::NotReading(Duration::from_secs(5)))
    );
    harness.now += Duration::from_secs(5);
    harness.session.handle_timeout(harness.now);
    assert!(harness.session.poll_transmit().is_none());
    assert_eq!(harness.session.poll_timeout(), None);
}

#[test]
fn block_sized_data_is_read_straight_into_its_destination() {
    let mut harness = Harness::new(1 << 20, test_config());
    let data = pattern(6, 64 << 10);
    let whole = write(1, BASE, &data);
    harness.feed(&hello("peer"), usize::MAX);
    // Header and address first, exactly: the data must then be asked for in one piece.
    harness.feed(&whole[..wire::HEADER_LEN + 8], usize::MAX);
    let mut target = harness.session.read_target().unwrap();
    assert_eq!(target.remaining(), data.len(), "the whole span is offered");
    target.fill(&data);
    harness.session.handle_read(harness.now, data.len());
    harness.pump();
    assert_eq!(acks(&harness), vec![(1, Ok(()))]);
    assert_eq!(harness.memory.read(BASE, data.len()), data);
}

#[test]
fn limits_too_large_to_add_to_an_instant_never_pass() {
    let mut config = test_config();
    config.io_timeout = Duration::MAX;
    config.idle_timeout = Duration::MAX;
    let mut harness = Harness::new(4096, config);
    harness.feed(&hello("peer"), usize::MAX);
    assert_eq!(harness.session.poll_timeout(), None);
    harness.wait(Duration::from_secs(365 * 24 * 3600));
    assert_eq!(harness.closed(), None);
}

#[test]
fn a_peer_that_asks_faster_than_it_reads_is_answered_one_frame_at_a_time() {
    let mut config = test_config();
    config.limits.max_data = 4096;
    let mut harness = Harness::new(1 << 20, config);
    let mut bytes = hello("greedy");
    for id in 1..=8 {
        bytes.extend(frame(
            Kind::ReadRequest,
            id,
            &wire::encode_read_request(BASE + id * 4096, 4096),
        ));
    }
    // All eight requests arrive at once and the peer reads nothing back.
    let mut target = harness.session.read_target().unwrap();
    assert_eq!(target.fill(&bytes), bytes.len());
    harness.session.handle_read(harness.now, bytes.len());
    harness.answer_events();
    assert!(
        harness.session.held_bytes() <= (16 << 10) + 1024 + 2 * (4096 + wire::HEADER_LEN),
        "the session held {} bytes for a peer that reads nothing",
        harness.session.held_bytes()
    );
    assert!(
        !harness.session.has_event(),
        "no new frame is taken while answers back up"
    );
    // Once the peer reads, the rest is answered, in order.
    harness.pump();
    let answers = harness.answers();
    assert_eq!(answers.len(), 8);
    for (index, (header, body)) in answers.iter().enumerate() {
        assert_eq!((header.kind, header.id), (Kind::ReadData, index as u64 + 1));
        assert_eq!(body.len(), 4096);
    }
}

#[test]
fn a_peer_that_pipelines_descriptor_requests_and_reads_nothing_gets_a_bounded_backlog() {
    let mut harness = Harness::new(4096, test_config());
    let mut bytes = hello("peer");
    for id in 1..=20_000u64 {
        bytes.extend(frame(Kind::DescriptorRequest, id, &[]));
    }
    // Fed by hand, nothing written: the peer never reads.
    let mut taken = 0;
    while taken < bytes.len() {
        assert!(
            harness.session.poll_event().is_none(),
            "a descriptor request raises no event"
        );
        let Some(mut target) = harness.session.read_target() else {
            break;
        };
        let len = target.fill(&bytes[taken..]);
        taken += len;
        harness.session.handle_read(harness.now, len);
    }
    let answer = wire::HEADER_LEN + TestMemory::DESCRIPTOR.len();
    let held = harness.session.held_bytes();
    assert!(
        held <= Input::CAPACITY + 2 * MAX_COPIED_ANSWERS + answer,
        "the session holds {held} bytes"
    );
    assert!(taken < bytes.len(), "the session should stop reading");
    // Once the peer reads, the rest is answered, every request once.
    harness.feed(&bytes[taken..], usize::MAX);
    harness.pump();
    let answers = harness.answers();
    assert_eq!(answers.len(), 20_000);
    assert!(answers
        .iter()
        .all(|(header, _)| header.kind == Kind::DescriptorResponse));
}
