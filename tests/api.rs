//! The public handles can move between threads and tasks, as an embedding server needs.

use ferry::transport::{MNNVL, NVLINK, RDMA, TCP};
use ferry::{
    Batch, Completion, Engine, EngineBuilder, Error, Links, Notifications, Peer, Region, Transfer,
};

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
    send_and_sync::<EngineBuilder>();
    send_and_sync::<Links>();
}

/// The transports an engine built with `links` asks about a route, in its order; RDMA, which
/// only some hosts have, left out.
fn transports_of(links: Links) -> Vec<&'static str> {
    let decode = ferry::builder().build_blocking().unwrap();
    let _pool = decode.allocate(4096).unwrap();
    let prefill = links.builder().build_blocking().unwrap();
    let local = prefill.allocate(4096).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    let routes = prefill.routes(&local, &peer);
    routes[0]
        .answers
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| *name != RDMA)
        .collect()
}

#[test]
fn the_default_links_are_every_transport_of_the_build() {
    assert_eq!(transports_of(Links::default()), [NVLINK, MNNVL, TCP]);
}

#[test]
fn without_gpu_links_an_engine_has_tcp_alone() {
    assert_eq!(transports_of(Links::default().gpu_links(false)), [TCP]);
}

#[test]
fn errors_tell_the_caller_what_to_do() {
    let engine = ferry::builder().build_blocking().unwrap();
    let error = engine.connect_blocking("127.0.0.1:1").unwrap_err();
    assert!(
        error
            .to_string()
            .contains("check that its engine is running"),
        "{error}"
    );
    let error = ferry::builder()
        .listen("0.0.0.0:0")
        .build_blocking()
        .unwrap_err();
    assert!(error.to_string().contains("advertise"), "{error}");
}

#[test]
fn a_peer_finds_a_buffer_by_the_name_its_owner_gave_it() {
    let decode = ferry::builder().build_blocking().unwrap();
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

    let prefill = ferry::builder().build_blocking().unwrap();
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
