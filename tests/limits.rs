//! Bounded resources per peer, over real sockets on 127.0.0.1: a cap on connections, an idle
//! timeout after hello, a bounded hello name and a notification inbox bounded in bytes. Under
//! a flood of idle connections and a chatty peer, a real transfer still completes.

mod common;

use common::{assert_bytes_eq, captured_logs, pattern, write_and_verify};
use ferry::Refusal;
use ferry::{Engine, Error, ProtocolViolation};
use ferry_core::wire::{self, Header, Hello, Kind};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

fn logged(logs: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&logs.lock().unwrap()).into_owned()
}

fn hello_frame(name: &str) -> Vec<u8> {
    let body = wire::encode_hello(&Hello { name: name.into() });
    let mut bytes = Header::hello(&body).encode().to_vec();
    bytes.extend_from_slice(&body);
    bytes
}

/// Whether the listener closes `stream` within `limit` (end of stream or reset).
fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut buffer = [0u8; 64];
    match stream.read(&mut buffer) {
        Ok(0) => true,
        Ok(_) => false,
        Err(error) => error.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_and_a_chatty_peer_do_not_stop_a_real_transfer() {
    const CAP: usize = 12;
    const FLOOD: usize = 40;
    const INBOX: usize = 256 << 10;
    let decode = ferry::builder()
        .max_connections(CAP)
        .notification_bytes(INBOX as u64)
        .idle_timeout(Duration::from_secs(3))
        .transfer_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let pool = decode.allocate(1 << 20).unwrap();
    let mut inbox = decode.notifications().unwrap();

    // A well-behaved prefill and a chatty peer connect first: 4 connections each.
    let prefill = common::engine().await;
    let source = prefill.allocate(1 << 20).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let chatty = common::engine().await;
    let chatty_peer = chatty.connect(decode.name()).await.unwrap();

    // The chatty peer fills the inbox's bytes long before its 4096 slots.
    let note = vec![7u8; 64 << 10];
    let mut accepted = 0;
    let refusal = loop {
        match chatty.notify(&chatty_peer, note.clone()).await {
            Ok(()) => accepted += 1,
            Err(error) => break error,
        }
        assert!(
            accepted < 8,
            "the inbox took {accepted} notifications of 64 KiB"
        );
    };
    let held = accepted * (note.len() + chatty.name().len());
    assert_eq!(accepted, INBOX / (note.len() + chatty.name().len()));
    match &refusal {
        Error::Rejected {
            reason: Refusal::Other(reason),
            ..
        } => assert!(
            reason.contains(&format!("({held} of its {INBOX} bytes unread")),
            "{reason}"
        ),
        other => panic!("expected the inbox to refuse, got {other:?}"),
    }

    // A flood of idle connections that introduce themselves: those over the cap are closed at
    // once, the rest are held until the idle timeout.
    let address = decode.name().to_owned();
    let (mut held_open, closed_at_once) = tokio::task::spawn_blocking(move || {
        let mut streams = Vec::new();
        for index in 0..FLOOD {
            let mut stream = TcpStream::connect(&address).unwrap();
            let _ = stream.write_all(&hello_frame(&format!("flood-{index}")));
            streams.push(stream);
        }
        let mut held_open = Vec::new();
        let mut closed = 0;
        for mut stream in streams {
            if closed_within(&mut stream, Duration::from_millis(200)) {
                closed += 1;
            } else {
                held_open.push(stream);
            }
        }
        (held_open, closed)
    })
    .await
    .unwrap();
    assert!(
        closed_at_once >= FLOOD - (CAP - 8),
        "only {closed_at_once} of {FLOOD} connections over the cap were closed"
    );
    assert!(!held_open.is_empty(), "the cap leaves room for some");

    // The well-behaved peer's transfer completes under the flood and the full inbox.
    let started = Instant::now();
    let data = pattern(21, 1 << 20);
    write_and_verify(
        &prefill,
        &peer,
        &source,
        &pool,
        &data,
        "write under the flood",
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(10));

    // Once the reader drains the inbox, notifications are taken again.
    for _ in 0..accepted {
        assert_eq!(inbox.recv().await.unwrap().payload, note);
    }
    prefill.notify(&peer, "kv ready").await.unwrap();
    assert_eq!(inbox.recv().await.unwrap().payload, b"kv ready");

    // The idle flood is closed after the idle timeout, freeing the cap for a new peer.
    let still_open = tokio::task::spawn_blocking(move || {
        let mut open = 0;
        for stream in &mut held_open {
            if !closed_within(stream, Duration::from_secs(5)) {
                open += 1;
            }
        }
        open
    })
    .await
    .unwrap();
    assert_eq!(still_open, 0, "idle connections outlived the idle timeout");
    let late = common::engine().await;
    let late_source = late.allocate(4096).unwrap();
    let late_peer = late.connect(decode.name()).await.unwrap();
    let data = pattern(22, 4096);
    write_and_verify(
        &late,
        &late_peer,
        &late_source,
        &pool,
        &data,
        "write of a late peer",
    )
    .await;
}

#[tokio::test]
async fn an_over_long_hello_is_refused_with_the_exact_error() {
    let logs = captured_logs();
    let decode = common::engine().await;
    let address = decode.name().to_owned();
    let name = "n".repeat(300);
    let closed = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(&address).unwrap();
        let _ = stream.write_all(&hello_frame(&name));
        closed_within(&mut stream, Duration::from_secs(5))
    })
    .await
    .unwrap();
    assert!(closed, "the listener must close the connection");
    let expected = ProtocolViolation::Oversized {
        kind: "hello",
        len: 302,
        limit: u64::from(wire::MAX_HELLO_BODY),
    }
    .to_string();
    assert_eq!(
        expected,
        "hello frame of 302 bytes exceeds the 258-byte limit"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !logged(&logs).contains(&expected) {
        assert!(Instant::now() < deadline, "logs: {}", logged(&logs));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn an_idle_connection_is_closed_after_the_idle_timeout_and_its_peer_reconnects() {
    let logs = captured_logs();
    const IDLE: Duration = Duration::from_millis(400);
    let decode = ferry::builder()
        .idle_timeout(IDLE)
        .transfer_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let pool = decode.allocate(4096).unwrap();
    let address = decode.name().to_owned();
    let (idle_for, busy_open) = tokio::task::spawn_blocking(move || {
        let mut idle = TcpStream::connect(&address).unwrap();
        idle.write_all(&hello_frame("idle")).unwrap();
        let started = Instant::now();
        // A connection that asks for the descriptor every 100 ms is never idle that long.
        let mut busy = TcpStream::connect(&address).unwrap();
        busy.write_all(&hello_frame("busy")).unwrap();
        busy.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let request = Header::descriptor_request(1).encode();
        let mut busy_open = true;
        for _ in 0..8 {
            std::thread::sleep(Duration::from_millis(100));
            let mut answer = [0u8; wire::HEADER_LEN];
            busy_open &= busy.write_all(&request).is_ok() && busy.read_exact(&mut answer).is_ok();
            let mut body = vec![
                0u8;
                Header::decode(&answer, &Default::default())
                    .map_or(0, |h| h.len as usize)
            ];
            busy_open &= busy.read_exact(&mut body).is_ok();
        }
        assert!(closed_within(&mut idle, Duration::from_secs(5)));
        (started.elapsed(), busy_open)
    })
    .await
    .unwrap();
    assert!(idle_for >= IDLE, "closed after {idle_for:?}");
    assert!(
        busy_open,
        "a connection with frames every 100 ms was closed"
    );
    assert!(logged(&logs).contains("closing an idle connection"));

    // A peer whose connections idled out opens new ones on its next transfer.
    let prefill = common::engine().await;
    let source = prefill.allocate(4096).unwrap();
    source.write_at(0, &pattern(23, 4096)).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while peer.is_alive() {
        assert!(
            Instant::now() < deadline,
            "the idle links were never closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    prefill
        .batch(&peer)
        .write(&source, 0, pool.addr(), 4096)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; 4096];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(23, 4096), "write after the idle timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_that_arrive_in_one_read_are_each_delivered_once() {
    let decode = ferry::builder()
        .transfer_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let mut inbox = decode.notifications().unwrap();
    let mut bytes = hello_frame("burst");
    for (id, payload) in [(1u64, b"first".as_slice()), (2, b"second"), (3, b"third")] {
        bytes.extend_from_slice(&Header::for_body(Kind::Notify, id, payload).encode());
        bytes.extend_from_slice(payload);
    }
    let address = decode.local_addr();
    let acks = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(address).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        // One write: the three frames arrive together and are parsed from one read.
        stream.write_all(&bytes).unwrap();
        let mut acks = Vec::new();
        for _ in 0..3 {
            let mut header = [0u8; wire::HEADER_LEN];
            stream.read_exact(&mut header).unwrap();
            let header = Header::decode(&header, &wire::Limits::default()).unwrap();
            let mut body = vec![0u8; header.len as usize];
            stream.read_exact(&mut body).unwrap();
            acks.push((header.id, wire::decode_ack(&body).unwrap()));
        }
        acks
    })
    .await
    .unwrap();
    assert_eq!(acks, vec![(1, Ok(())), (2, Ok(())), (3, Ok(()))]);
    for expected in [b"first".as_slice(), b"second", b"third"] {
        let note = tokio::time::timeout(Duration::from_secs(5), inbox.recv())
            .await
            .expect("every acknowledged notification is delivered")
            .unwrap();
        assert_eq!(note.payload, expected);
    }
    assert!(
        inbox.try_recv().unwrap().is_none(),
        "nothing is delivered twice"
    );
}

/// Opens `count` connections to `address` that stay silent, or (`slow`) send the first byte
/// of an authentication hello and nothing more, as a slow-loris client does.
fn strangers(address: &str, count: usize, slow: bool) -> Vec<TcpStream> {
    (0..count)
        .filter_map(|_| {
            let mut stream = TcpStream::connect(address).ok()?;
            if slow {
                let _ = stream.write_all(&ferry_core::auth::MAGIC[..1]);
            }
            Some(stream)
        })
        .collect()
}

/// How many of `streams` the listener has not closed.
fn still_open(streams: &mut [TcpStream]) -> usize {
    let mut open = 0;
    for stream in streams {
        stream.set_nonblocking(true).unwrap();
        let mut buffer = [0u8; 64];
        match stream.read(&mut buffer) {
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => open += 1,
            _ => {}
        }
    }
    open
}

/// The decode side of the flood tests: a cap of 12 peers, 16 strangers (8 a source).
async fn flooded_decode(secret: Option<&[u8]>) -> Engine {
    let mut builder = ferry::builder()
        .max_connections(12)
        .max_unauthenticated(16, 8)
        .handshake_timeout(Duration::from_secs(2))
        .transfer_timeout(Duration::from_secs(10));
    if let Some(secret) = secret {
        builder = builder.secret(secret);
    }
    builder.build().await.unwrap()
}

/// 300 silent connections and 50 slow-loris ones, then a real peer's transfer while more
/// strangers keep arriving: the strangers hold at most their budget, evict each other, and the
/// real transfer completes with its bytes.
async fn strangers_never_lock_out_a_real_peer(secret: Option<&'static [u8]>) {
    let decode = flooded_decode(secret).await;
    let pool = decode.allocate(1 << 20).unwrap();
    let address = decode.name().to_owned();
    let flood_address = address.clone();
    let mut flood = tokio::task::spawn_blocking(move || {
        let mut flood = strangers(&flood_address, 300, false);
        flood.extend(strangers(&flood_address, 50, true));
        flood
    })
    .await
    .unwrap();
    assert_eq!(flood.len(), 350, "the listener accepts every connection");

    // More strangers keep arriving, a few a millisecond apart, while the real peer works.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopping = std::sync::Arc::clone(&stop);
    let trickle_address = address.clone();
    let trickle = std::thread::spawn(move || {
        let mut held = Vec::new();
        for round in 0..400 {
            if stopping.load(std::sync::atomic::Ordering::Relaxed) {
                break;
            }
            held.extend(strangers(&trickle_address, 1, round % 2 == 0));
            std::thread::sleep(Duration::from_millis(5));
        }
        held
    });

    let mut builder = ferry::builder().transfer_timeout(Duration::from_secs(10));
    if let Some(secret) = secret {
        builder = builder.secret(secret);
    }
    let prefill = builder.build().await.unwrap();
    let source = prefill.allocate(1 << 20).unwrap();
    let started = Instant::now();
    let peer = prefill.connect(&address).await.unwrap();
    for round in 0..5u8 {
        let data = pattern(40 + u64::from(round), 1 << 20);
        write_and_verify(
            &prefill,
            &peer,
            &source,
            &pool,
            &data,
            "write under the flood",
        )
        .await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the real peer took {:?}",
        started.elapsed()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut trickled = trickle.join().unwrap();

    // The strangers hold no more than their budget, and the handshake timeout closes the rest.
    let open = still_open(&mut flood) + still_open(&mut trickled);
    assert!(
        open <= 16,
        "{open} unauthenticated connections are still open"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let open = still_open(&mut flood) + still_open(&mut trickled);
    assert_eq!(open, 0, "strangers outlived the handshake timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_slow_strangers_never_lock_out_an_authenticated_peer() {
    strangers_never_lock_out_a_real_peer(Some(b"flood-test-secret-0123456789")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_slow_strangers_never_lock_out_a_peer_without_a_secret() {
    strangers_never_lock_out_a_real_peer(None).await;
}
