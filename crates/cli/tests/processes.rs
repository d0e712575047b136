//! Faults with a peer in another process: a `ferry serve` killed mid-transfer, or replaced by a
//! new process at the same address. Every future resolves within a bounded time and the
//! survivors keep working.

mod common;

use common::{assert_bytes_eq, engine, pattern, ServeProcess};
use ferry::Error;
use std::time::{Duration, Instant};

#[tokio::test]
async fn a_peer_killed_mid_transfer_fails_the_transfer_quickly() {
    const BUFFER: usize = 256 << 20;
    let mut target = ServeProcess::start(BUFFER);
    let prefill = engine().await;
    let source = prefill.allocate(BUFFER as u64).unwrap();
    let peer = prefill.connect(&target.name).await.unwrap();
    // 16 passes over the target's buffer: 4 GiB, far more than loopback moves before the kill.
    let mut batch = prefill.batch(&peer);
    for _ in 0..16 {
        batch = batch.write(&source, 0, target.buffer_addr, target.buffer_len);
    }
    let transfer = batch.submit().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    target.child.kill().unwrap();
    let killed_at = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(15), transfer)
        .await
        .expect("the transfer must resolve, not hang");
    assert!(
        matches!(outcome, Err(Error::PeerGone { .. })),
        "{outcome:?}"
    );
    assert!(killed_at.elapsed() < Duration::from_secs(15));
    assert!(!peer.is_alive());

    // The survivor keeps working with other peers.
    let decode = engine().await;
    let pool = decode.allocate(4096).unwrap();
    source.write_at(0, &pattern(8, 4096)).unwrap();
    let other = prefill.connect(decode.name()).await.unwrap();
    prefill
        .batch(&other)
        .write(&source, 0, pool.addr(), 4096)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; 4096];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(8, 4096), "write after the peer died");
}

#[test]
fn a_peer_replaced_by_a_new_process_is_closed_and_reopened_afresh() {
    let first = ServeProcess::start(1 << 20);
    let prefill = ferry::builder()
        .liveness_interval(Duration::from_millis(100))
        .transfer_timeout(Duration::from_secs(10))
        .build_blocking()
        .unwrap();
    let source = prefill.allocate(1 << 20).unwrap();
    source.write_at(0, &pattern(31, 1 << 20)).unwrap();
    let old = prefill.connect_blocking(&first.name).unwrap();
    prefill
        .batch(&old)
        .write(&source, 0, first.buffer_addr, 4096)
        .submit_blocking()
        .unwrap();
    let name = first.name.clone();
    drop(first); // SIGKILL
                 // Within a few liveness rounds the engine notices the listener is gone.
    let deadline = Instant::now() + Duration::from_secs(5);
    while old.is_alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!old.is_alive(), "the dead peer's links are still open");
    // A new process under the same name is a new peer: opened afresh, with its own buffer.
    let second = start_on(&name);
    let fresh = prefill.connect_blocking(&name).unwrap();
    assert_eq!(fresh.buffers()[0].addr, second.buffer_addr);
    prefill
        .batch(&fresh)
        .write(&source, 0, second.buffer_addr, 1 << 20)
        .submit_blocking()
        .unwrap();
    let back = prefill.allocate(1 << 20).unwrap();
    prefill
        .batch(&fresh)
        .read(&back, 0, second.buffer_addr, 1 << 20)
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0u8; 1 << 20];
    back.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(31, 1 << 20), "bytes in the new process");
}

/// `ferry serve` listening on `address`, retrying while the old listener's port is released.
fn start_on(address: &str) -> ServeProcess {
    for _ in 0..50 {
        if std::net::TcpListener::bind(address).is_ok() {
            return ServeProcess::start_with(1 << 20, &["--listen", address], &[]);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{address} did not become free within 5 s");
}
