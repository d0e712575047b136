//! Faults: peers that die, garbage on the control port, engines dropped mid-transfer. Every
//! future resolves within a bounded time and the survivors keep working.

mod common;

use common::{assert_bytes_eq, captured_logs, engine, pattern, Pair};
use ferry::transport::{Endpoint, Link, Reach, Transport};
use ferry::{BufferDescriptor, Error, Refusal, RegionInfo, SegmentDescriptor};
use ferry_core::wire::{Header, Kind};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sends `bytes` and reports whether the listener then closed the connection.
fn closed_after(address: &str, bytes: &[u8]) -> bool {
    let mut stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = stream.write_all(bytes);
    let mut buffer = [0u8; 64];
    match stream.read(&mut buffer) {
        Ok(0) => true,
        Err(error) => error.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

#[tokio::test]
async fn garbage_and_oversized_frames_close_only_their_connection() {
    let logs = captured_logs();
    let decode = engine().await;
    let pool = decode.allocate(1 << 20).unwrap();
    let address = decode.name().to_owned();

    let http = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    let oversized = Header::new(Kind::Notify, 1, u32::MAX).encode().to_vec();
    let write_before_hello = Header::new(Kind::Write, 1, 16).encode().to_vec();
    let mut bad_hello = Header::new(Kind::Hello, 0, 3).encode().to_vec();
    bad_hello.extend_from_slice(&[0xff, 0xff, 0xff]);
    for (what, bytes) in [
        ("http", http),
        ("oversized", oversized),
        ("write before hello", write_before_hello),
        ("bad hello", bad_hello),
    ] {
        let address = address.clone();
        let closed = tokio::task::spawn_blocking(move || closed_after(&address, &bytes))
            .await
            .unwrap();
        assert!(closed, "{what}: the listener must close the connection");
    }

    // The engine still serves a well-behaved peer.
    let prefill = engine().await;
    let source = prefill.allocate(1 << 20).unwrap();
    source.write_at(0, &pattern(5, 1 << 20)).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    prefill
        .batch(&peer)
        .write(&source, 0, pool.addr(), 1 << 20)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; 1 << 20];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(5, 1 << 20), "write after the garbage");

    let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(text.contains("closing a connection"), "logs: {text}");
    assert!(
        text.contains("it sent \"GET \" where ferry's magic \"FRRY\" belongs"),
        "logs: {text}"
    );
    assert!(
        text.contains("exceeds the 65536-byte limit"),
        "logs: {text}"
    );
    assert!(text.contains("before hello"), "logs: {text}");
}

#[tokio::test]
async fn dropping_the_sending_engine_resolves_its_transfers() {
    let pair = Pair::new(64 << 20, 64 << 20).await;
    let mut transfers = Vec::new();
    for _ in 0..8 {
        transfers.push(
            pair.prefill
                .batch(&pair.peer)
                .write(&pair.source, 0, pair.pool.addr(), 64 << 20)
                .submit()
                .unwrap(),
        );
    }
    drop(pair.prefill);
    for transfer in transfers {
        let outcome = tokio::time::timeout(Duration::from_secs(10), transfer)
            .await
            .expect("a transfer of a dropped engine must resolve");
        if let Err(error) = outcome {
            assert!(matches!(error, Error::Shutdown { .. }), "{error}");
        }
    }
    // The source region outlived its engine; dropping it now must not hang either.
    drop(pair.source);
}

#[tokio::test]
async fn dropping_the_receiving_engine_fails_transfers_to_it() {
    let pair = Pair::new(128 << 20, 128 << 20).await;
    let mut batch = pair.prefill.batch(&pair.peer);
    for _ in 0..16 {
        batch = batch.write(&pair.source, 0, pair.remote, 128 << 20);
    }
    let transfer = batch.submit().unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(pair.decode);
    let outcome = tokio::time::timeout(Duration::from_secs(15), transfer)
        .await
        .expect("the transfer must resolve, not hang");
    assert!(
        outcome.is_err(),
        "2 GiB cannot all land after the receiver was dropped"
    );
    drop(pair.pool);
}

#[tokio::test]
async fn a_peer_that_never_acknowledges_times_out() {
    // A fake peer: answers the descriptor request, then swallows everything in silence.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let descriptor = SegmentDescriptor {
        version: ferry::transport::DESCRIPTOR_VERSION,
        name: address.clone(),
        host: ferry::transport::HostIdentity::current(),
        generation: 1,
        instance: ferry::transport::InstanceId::from_u128(1),
        process: ferry::transport::InstanceId::from_u128(1),
        pid: 0,
        gpus: Vec::new(),
        endpoints: vec![Endpoint {
            transport: "tcp".into(),
            address: address.clone(),
        }],
        buffers: vec![BufferDescriptor {
            addr: 0x10000,
            len: 1 << 20,
            location: ferry::Location::Host { pinned: false },
            name: None,
            exports: Vec::new(),
        }],
        signature: None,
    };
    std::thread::spawn(move || {
        for stream in listener.incoming().take(8) {
            let Ok(mut stream) = stream else { return };
            let json = descriptor.to_json();
            std::thread::spawn(move || {
                let mut buffer = vec![0u8; 1 << 16];
                let _ = stream.set_read_timeout(Some(Duration::from_secs(20)));
                let mut answered = false;
                while let Ok(read) = stream.read(&mut buffer) {
                    if read == 0 {
                        return;
                    }
                    // Answer descriptor requests only (kind byte after magic and version): the
                    // data connections' hello and write frames must go unanswered.
                    let asks_descriptor = buffer[..read]
                        .windows(6)
                        .any(|w| &w[..4] == b"FRRY" && w[5] == Kind::DescriptorRequest as u8);
                    if !answered && asks_descriptor {
                        answered = true;
                        let header = Header::for_body(Kind::DescriptorResponse, 1, &json);
                        let _ = stream.write_all(&header.encode());
                        let _ = stream.write_all(&json);
                    }
                }
            });
        }
    });
    let prefill = ferry::builder()
        .transfer_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let source = prefill.allocate(4096).unwrap();
    let peer = prefill.connect(&address).await.unwrap();
    let started = Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        prefill
            .batch(&peer)
            .write(&source, 0, 0x10000, 4096)
            .submit()
            .unwrap(),
    )
    .await
    .expect("the transfer must resolve, not hang");
    assert!(matches!(outcome, Err(Error::Timeout { .. })), "{outcome:?}");
    assert!(started.elapsed() >= Duration::from_millis(500));
    drop(source);
}

#[tokio::test]
async fn a_full_inbox_refuses_notifications_at_once_and_data_still_flows() {
    let decode = ferry::builder()
        .notification_capacity(2)
        .build()
        .await
        .unwrap();
    let pool = decode.allocate(1 << 20).unwrap();
    let prefill = engine().await;
    let source = prefill.allocate(1 << 20).unwrap();
    source.write_at(0, &pattern(12, 1 << 20)).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    prefill.notify(&peer, "one").await.unwrap();
    prefill.notify(&peer, "two").await.unwrap();
    let refused = prefill.notify(&peer, "three").await;
    match refused {
        Err(Error::Rejected {
            reason: Refusal::Other(reason),
            ..
        }) => {
            assert!(reason.contains("inbox is full"), "{reason}")
        }
        other => panic!("expected the full inbox to refuse, got {other:?}"),
    }
    // Every connection, including the one notifications use, still carries data.
    for _ in 0..8 {
        prefill
            .batch(&peer)
            .write(&source, 0, pool.addr(), 1 << 20)
            .submit()
            .unwrap()
            .await
            .unwrap();
    }
    let mut landed = vec![0u8; 1 << 20];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(
        &landed,
        &pattern(12, 1 << 20),
        "data after the inbox filled",
    );
}

#[tokio::test]
async fn notifying_a_dropped_peer_fails_instead_of_hanging() {
    let decode = engine().await;
    let prefill = engine().await;
    let peer = prefill.connect(decode.name()).await.unwrap();
    prefill.notify(&peer, "before").await.unwrap();
    drop(decode);
    tokio::time::sleep(Duration::from_millis(100)).await;
    for attempt in 0..3 {
        let outcome = tokio::time::timeout(Duration::from_secs(15), prefill.notify(&peer, "after"))
            .await
            .expect("notify must resolve, not hang");
        assert!(outcome.is_err(), "attempt {attempt}: {outcome:?}");
    }
}

#[tokio::test]
async fn a_connection_that_never_says_hello_is_closed() {
    let decode = ferry::builder()
        .transfer_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let address = decode.name().to_owned();
    let closed = tokio::task::spawn_blocking(move || closed_after(&address, b""))
        .await
        .unwrap();
    assert!(
        closed,
        "a silent connection must be closed after the hello timeout"
    );
}

#[tokio::test]
async fn a_peer_restarted_at_the_same_address_is_reached_again() {
    let first = engine().await;
    let address = first.name().to_owned();
    let prefill = engine().await;
    let peer = prefill.connect(&address).await.unwrap();
    prefill.notify(&peer, "to the first").await.unwrap();
    drop(first);
    // A dropped engine's listener closes in the background; a restarted server retries.
    let deadline = Instant::now() + Duration::from_secs(5);
    let restarted = loop {
        match ferry::builder().listen(address.clone()).build().await {
            Ok(engine) => break engine,
            Err(error) if Instant::now() < deadline => {
                assert!(error.to_string().contains("binding"), "{error}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => panic!("the address never came free: {error}"),
        }
    };
    let pool = restarted.allocate(4096).unwrap();
    let mut inbox = restarted.notifications().unwrap();
    // The old connection's end is noticed, then the next notification reconnects.
    let deadline = Instant::now() + Duration::from_secs(10);
    while peer.is_alive() {
        assert!(
            Instant::now() < deadline,
            "the closed connection was never noticed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    prefill.notify(&peer, "to the second").await.unwrap();
    assert_eq!(inbox.recv().await.unwrap().payload, b"to the second");
    assert!(peer.is_alive());
    // The descriptor was fetched afresh: the new engine's buffer is known and reachable.
    let source = prefill.allocate(4096).unwrap();
    source.write_at(0, &pattern(31, 4096)).unwrap();
    prefill
        .batch(&peer)
        .write(&source, 0, pool.addr(), 4096)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; 4096];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(31, 4096), "write to the restarted engine");
}

/// A transport that records being stopped, and reaches nothing.
struct Stoppable {
    stopped: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl Transport for Stoppable {
    fn name(&self) -> &'static str {
        "stoppable"
    }

    fn endpoint(&self) -> Option<Endpoint> {
        None
    }

    fn reach(&self, _: &RegionInfo, _: &SegmentDescriptor, _: &BufferDescriptor) -> Reach {
        Reach::No {
            reason: "reaches nothing".into(),
        }
    }

    async fn open(&self, peer: &SegmentDescriptor) -> ferry::Result<Arc<dyn Link>> {
        Err(Error::Unavailable {
            local: "a test transport".into(),
            peer: peer.name.clone(),
            reason: "it opens no links".into(),
        })
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }
}

#[test]
fn dropping_an_engine_stops_its_transports_before_the_drop_returns() {
    // What a transport withdraws in `stop` (a socket file) must be gone when the engine's drop
    // returns: the transport itself may live on in a task the process does not wait for (here,
    // in this test's own reference).
    let stopped = Arc::new(AtomicBool::new(false));
    let transport = Arc::new(Stoppable {
        stopped: Arc::clone(&stopped),
    });
    let engine = ferry::builder()
        .transport(transport.clone())
        .build_blocking()
        .unwrap();
    assert!(!stopped.load(Ordering::SeqCst));
    drop(engine);
    assert!(stopped.load(Ordering::SeqCst));
    drop(transport);
}
