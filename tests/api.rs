//! The public handles can move between threads and tasks, as an embedding server needs.

use ferry::{Batch, Completion, Engine, Error, Notifications, Peer, Region, Transfer};

fn send_and_sync<T: Send + Sync>() {}
fn send<T: Send>() {}

#[test]
fn handles_are_send_and_sync() {
    send_and_sync::<Engine>();
    send_and_sync::<Peer>();
    send_and_sync::<Region>();
    send_and_sync::<Transfer>();
    send_and_sync::<Completion>();
    send_and_sync::<Error>();
    send_and_sync::<Notifications>();
    send::<Batch>();
}

#[test]
fn errors_tell_the_caller_what_to_do() {
    let engine = Engine::builder().build_blocking().unwrap();
    let error = engine.connect_blocking("127.0.0.1:1").unwrap_err();
    assert!(
        error
            .to_string()
            .contains("check that its engine is running"),
        "{error}"
    );
    let error = Engine::builder()
        .listen("0.0.0.0:0")
        .build_blocking()
        .unwrap_err();
    assert!(error.to_string().contains("advertise"), "{error}");
}

#[test]
fn a_peer_finds_a_buffer_by_the_name_its_owner_gave_it() {
    let decode = Engine::builder().build_blocking().unwrap();
    let scratch = decode.allocate(4096).unwrap();
    let pool = decode.allocate(64 << 10).unwrap();
    pool.set_name("kv-pool").unwrap();
    assert_eq!(pool.name().as_deref(), Some("kv-pool"));
    let error = scratch.set_name("kv-pool").unwrap_err();
    assert!(
        matches!(&error, Error::ApiMisuse(text) if text.contains("already named")),
        "{error}"
    );
    assert!(matches!(scratch.set_name(""), Err(Error::ApiMisuse(_))));

    let prefill = Engine::builder().build_blocking().unwrap();
    let source = prefill.allocate(4096).unwrap();
    source.write_at(0, &[9u8; 4096]).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    let remote = peer.buffer("kv-pool").expect("the named pool");
    assert_eq!((remote.addr, remote.len), (pool.addr(), pool.len()));
    assert!(peer.buffer("no-such-pool").is_none());
    prefill
        .batch(&peer)
        .write(&source, 0, remote.addr + 4096, 4096)
        .submit_blocking()
        .unwrap();
    let mut landed = [0u8; 4096];
    pool.read_at(4096, &mut landed).unwrap();
    assert_eq!(landed, [9u8; 4096]);
}
