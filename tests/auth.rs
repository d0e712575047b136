//! Engines with a shared secret authenticate every connection; a wrong or missing secret is
//! refused on both sides with a typed error, before anything about registered memory moves.

mod common;

use common::pattern;
use ferry::metadata::{MemoryStore, MetadataStore};
use ferry::{AuthFailure, Engine, Error};
use std::sync::Arc;
use std::time::Duration;

const SECRET_A: &[u8] = b"secret-a-0123456789abcdef";
const SECRET_B: &[u8] = b"secret-b-0123456789abcdef";

async fn engine(secret: Option<&[u8]>, store: Option<Arc<dyn MetadataStore>>) -> Engine {
    let mut builder = ferry::builder().transfer_timeout(Duration::from_secs(5));
    if let Some(secret) = secret {
        builder = builder.secret(secret);
    }
    if let Some(store) = store {
        builder = builder.metadata(store);
    }
    builder.build().await.expect("engine starts on loopback")
}

fn refusal(outcome: Result<impl std::fmt::Debug, Error>) -> AuthFailure {
    match outcome {
        Err(Error::Unauthenticated { reason, .. }) => reason,
        other => panic!("expected Error::Unauthenticated, got {other:?}"),
    }
}

#[tokio::test]
async fn same_secret_moves_bytes_and_notifications() {
    let decode = engine(Some(SECRET_A), None).await;
    let pool = decode.allocate(64 << 10).unwrap();
    let mut inbox = decode.notifications().unwrap();
    let prefill = engine(Some(SECRET_A), None).await;
    let source = prefill.allocate(64 << 10).unwrap();
    let data = pattern(7, 64 << 10);
    source.write_at(0, &data).unwrap();

    let peer = prefill.connect(decode.name()).await.unwrap();
    let remote = peer.buffers()[0].addr;
    prefill
        .batch(&peer)
        .write(&source, 0, remote, 64 << 10)
        .notify(b"req-1".to_vec())
        .submit()
        .unwrap()
        .await
        .unwrap();
    assert_eq!(inbox.recv().await.unwrap().payload, b"req-1");
    let mut landed = vec![0u8; 64 << 10];
    pool.read_at(0, &mut landed).unwrap();
    common::assert_bytes_eq(&landed, &data, "authenticated write");
}

#[tokio::test]
async fn a_wrong_secret_gets_no_descriptor() {
    let decode = engine(Some(SECRET_A), None).await;
    let _pool = decode.allocate(4096).unwrap();
    let prefill = engine(Some(SECRET_B), None).await;
    let error = prefill.connect(decode.name()).await;
    assert_eq!(refusal(error), AuthFailure::PeerProofMismatch);
}

#[tokio::test]
async fn a_wrong_secret_writes_nothing_even_with_the_descriptor_from_a_store() {
    // The descriptor comes from a shared store, so only the data connections authenticate.
    let store: Arc<dyn MetadataStore> = MemoryStore::new();
    let decode = engine(Some(SECRET_A), Some(Arc::clone(&store))).await;
    let pool = decode.allocate(4096).unwrap();
    let prefill = engine(Some(SECRET_B), Some(store)).await;
    // The descriptor is signed with the other secret, so it is refused before any connection.
    match prefill.connect(decode.name()).await {
        Err(Error::Metadata { reason, .. }) => {
            assert!(reason.contains("another secret"), "{reason}")
        }
        other => panic!("expected Error::Metadata, got {other:?}"),
    }
    let mut landed = vec![0xffu8; 4096];
    pool.read_at(0, &mut landed).unwrap();
    assert!(landed.iter().all(|&byte| byte == 0), "nothing may land");
}

#[tokio::test]
async fn a_secret_against_no_secret_is_refused_both_ways() {
    // This side has a secret, the listener none.
    let open = engine(None, None).await;
    let _pool = open.allocate(4096).unwrap();
    let guarded = engine(Some(SECRET_A), None).await;
    let error = guarded.connect(open.name()).await;
    assert_eq!(refusal(error), AuthFailure::PeerHasNoSecret);

    // The listener has a secret, this side none: its descriptor is not handed out.
    let pool = guarded.allocate(4096).unwrap();
    let error = open.connect(guarded.name()).await;
    let reason = refusal(error);
    assert_eq!(reason, AuthFailure::NoLocalSecret);
    assert!(reason.to_string().contains("FERRY_SECRET"), "{reason}");
    let mut landed = vec![0xffu8; 4096];
    pool.read_at(0, &mut landed).unwrap();
    assert!(landed.iter().all(|&byte| byte == 0), "nothing may land");
}

#[tokio::test]
async fn without_a_secret_a_write_to_a_guarded_engine_fails_and_lands_nothing() {
    // With the descriptor from a store, a client without a secret opens its connections
    // without a round trip; its first write then meets the listener's refusal.
    let store: Arc<dyn MetadataStore> = MemoryStore::new();
    let guarded = engine(Some(SECRET_A), Some(Arc::clone(&store))).await;
    let pool = guarded.allocate(4096).unwrap();
    guarded.publish().await.unwrap();
    let open = engine(None, Some(store)).await;
    let source = open.allocate(4096).unwrap();
    source.write_at(0, &[9u8; 4096]).unwrap();
    let peer = open.connect(guarded.name()).await.unwrap();
    let remote = peer.buffers()[0].addr;
    let outcome = open
        .batch(&peer)
        .write(&source, 0, remote, 4096)
        .submit()
        .unwrap()
        .await;
    assert_eq!(refusal(outcome), AuthFailure::NoLocalSecret);
    let mut landed = vec![0xffu8; 4096];
    pool.read_at(0, &mut landed).unwrap();
    assert!(landed.iter().all(|&byte| byte == 0), "nothing may land");
}

#[tokio::test]
async fn a_listener_that_never_answers_fails_the_handshake_within_the_io_timeout() {
    // A TCP listener that accepts and then says nothing, published in a store under a name.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = silent.local_addr().unwrap().to_string();
    let store: Arc<dyn MetadataStore> = MemoryStore::new();
    let mut descriptor = engine(None, None).await.descriptor();
    descriptor.name = "silent".into();
    descriptor.endpoints = vec![ferry::transport::Endpoint {
        transport: ferry::transport::TCP.into(),
        address,
    }];
    let secret = ferry::auth::Secret::new(SECRET_A.to_vec()).unwrap();
    store
        .publish(&ferry::auth::sign_descriptor(&descriptor, &secret))
        .await
        .unwrap();
    let limit = Duration::from_millis(300);
    let client = ferry::builder()
        .secret(SECRET_A)
        .metadata(store)
        .transfer_timeout(limit)
        .build()
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let error = client.connect("silent").await;
    assert_eq!(refusal(error), AuthFailure::TimedOut { after: limit });
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(silent);
}

#[tokio::test]
async fn a_short_secret_is_refused_at_build() {
    let error = ferry::builder().secret(b"short".to_vec()).build().await;
    assert!(
        matches!(&error, Err(Error::ApiMisuse(text)) if text.contains("too short")),
        "{error:?}"
    );
}

/// What a raw connection that sends `request` and then stops sending gets back, until the
/// listener closes it.
fn raw_answer(address: &str, request: &[u8]) -> Vec<u8> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap();
    answer
}

#[tokio::test]
async fn a_guarded_listener_sends_an_unauthenticated_caller_only_its_refusal() {
    let guarded = engine(Some(SECRET_A), None).await;
    let _pool = guarded.allocate(4096).unwrap();
    // A hello with an empty name and a descriptor request, as an old peer-to-peer lookup sends.
    let hello = ferry_core::wire::encode_hello(&ferry_core::wire::Hello {
        name: String::new(),
    });
    let mut request = ferry_core::wire::Header::hello(&hello).encode().to_vec();
    request.extend_from_slice(&hello);
    request.extend_from_slice(&ferry_core::wire::Header::descriptor_request(1).encode());
    let name = guarded.name().to_owned();
    let answer = tokio::task::spawn_blocking(move || raw_answer(&name, &request))
        .await
        .unwrap();
    assert_eq!(answer.len(), 70, "one refusal and nothing else: {answer:?}");
    assert_eq!(answer[..4], ferry_core::auth::MAGIC);
}

#[tokio::test]
async fn a_caller_that_says_nothing_is_closed_after_the_handshake_timeout() {
    let guarded = ferry::builder()
        .secret(SECRET_A)
        .handshake_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let name = guarded.name().to_owned();
    let started = std::time::Instant::now();
    let answer = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut stream = std::net::TcpStream::connect(&name).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        answer
    })
    .await
    .unwrap();
    assert!(answer.is_empty(), "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn a_descriptor_altered_or_unsigned_in_the_store_is_refused_naming_its_key() {
    let store: Arc<dyn MetadataStore> = MemoryStore::new();
    let decode = engine(Some(SECRET_A), Some(Arc::clone(&store))).await;
    let pool = decode.allocate(64 << 10).unwrap();
    // The engine republishes in the background after a registration: wait until the store
    // holds the buffer, so nothing overwrites what is written below.
    let mut published = store.fetch(decode.name()).await.unwrap();
    for _ in 0..200 {
        if published
            .buffers
            .iter()
            .any(|buffer| buffer.addr == pool.addr())
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        published = store.fetch(decode.name()).await.unwrap();
    }
    assert!(
        published.signature.is_some(),
        "an engine with a secret signs"
    );
    let honest = engine(Some(SECRET_A), Some(Arc::clone(&store))).await;
    honest.connect(decode.name()).await.unwrap();

    // Someone who can write the store rotates the buffer's address, keeping the signature.
    let mut rotated = published.clone();
    rotated.buffers[0].addr += 4096;
    store.publish(&rotated).await.unwrap();
    let fresh = engine(Some(SECRET_A), Some(Arc::clone(&store))).await;
    match fresh.connect(decode.name()).await {
        Err(Error::Metadata { name, reason }) => {
            assert_eq!(name, decode.name());
            assert!(reason.contains("does not match"), "{reason}");
        }
        other => panic!("expected Error::Metadata, got {other:?}"),
    }
    // Or writes it without a signature, as an engine without the secret would.
    let unsigned = ferry::SegmentDescriptor {
        signature: None,
        ..rotated
    };
    store.publish(&unsigned).await.unwrap();
    match fresh.connect(decode.name()).await {
        Err(Error::Metadata { reason, .. }) => {
            assert!(reason.contains("no signature"), "{reason}")
        }
        other => panic!("expected Error::Metadata, got {other:?}"),
    }
}
