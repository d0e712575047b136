//! The etcd and redis metadata stores against real servers: `.ci/run` starts them and passes
//! their URLs in `FERRY_TEST_ETCD` (`etcd://127.0.0.1:PORT/PREFIX`) and `FERRY_TEST_REDIS`
//! (`redis://127.0.0.1:PORT/0`). Built with `--features etcd,redis`; a feature without its
//! URL fails the tests instead of skipping them.
#![cfg(any(feature = "etcd", feature = "redis"))]

mod common;

use common::{assert_bytes_eq, pattern, ServeProcess};
use ferry::{Engine, Error};
use std::time::{Duration, Instant};

/// The URL of every store this build has, from the environment.
fn stores() -> Vec<String> {
    let mut urls = Vec::new();
    let mut need = |feature: &str, variable: &str| {
        match std::env::var(variable) {
        Ok(url) if !url.is_empty() => urls.push(url),
        _ => panic!(
            "built with feature `{feature}` but {variable} is not set: start a server and set it (see .ci/run)"
        ),
    }
    };
    if cfg!(feature = "etcd") {
        need("etcd", "FERRY_TEST_ETCD");
    }
    if cfg!(feature = "redis") {
        need("redis", "FERRY_TEST_REDIS");
    }
    urls
}

/// `url` with a short time to live.
fn with_ttl(url: &str, seconds: u64) -> String {
    format!("{url}?ttl={seconds}")
}

/// A runtime of the test's own for calling a store directly (stores do network I/O on tokio).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn engine_on(url: &str) -> Engine {
    ferry::builder()
        .metadata(ferry::metadata::from_url(url).expect("store URL"))
        .liveness_interval(Duration::from_millis(100))
        .transfer_timeout(Duration::from_secs(10))
        .build_blocking()
        .unwrap_or_else(|error| panic!("engine on {url}: {error}"))
}

/// Writes 1 MiB of `pattern(seed)` from `prefill` into `peer`'s first buffer, which is `pool`
/// of the other engine, and checks it landed.
fn write_and_check(
    prefill: &Engine,
    peer: &ferry::Peer,
    pool: &ferry::Region,
    seed: u64,
    what: &str,
) {
    let source = prefill.allocate(1 << 20).unwrap();
    source.write_at(0, &pattern(seed, 1 << 20)).unwrap();
    prefill
        .batch(peer)
        .write(&source, 0, peer.buffers()[0].addr, 1 << 20)
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0u8; 1 << 20];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(seed, 1 << 20), what);
}

/// `decode` opened from `prefill` once its descriptor in the store lists the buffer at `addr`:
/// an engine republishes after a registration in the background, so a peer that connects
/// right after it may still read the descriptor from before. Fails after 5 s.
fn connect_seeing(prefill: &Engine, decode: &Engine, addr: u64, url: &str) -> ferry::Peer {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let peer = prefill
            .connect_blocking(decode.name())
            .unwrap_or_else(|error| panic!("{url}: connect: {error}"));
        if peer.buffers().iter().any(|buffer| buffer.addr == addr) {
            return peer;
        }
        assert!(
            Instant::now() < deadline,
            "{url}: the buffer at {addr:#x} was not published within 5 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn engines_find_each_other_through_the_store_and_move_bytes() {
    for url in stores() {
        let decode = engine_on(&url);
        let pool = decode.allocate(1 << 20).unwrap();
        let prefill = engine_on(&url);
        let peer = connect_seeing(&prefill, &decode, pool.addr(), &url);
        write_and_check(
            &prefill,
            &peer,
            &pool,
            51,
            &format!("bytes found through {url}"),
        );
        // A registration made after connecting is published and found.
        let later = decode.allocate(4096).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !peer
            .buffers()
            .iter()
            .any(|buffer| buffer.addr == later.addr())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(50));
            let _ = prefill.connect_blocking(decode.name());
        }
        assert!(
            peer.buffers()
                .iter()
                .any(|buffer| buffer.addr == later.addr()),
            "{url}: the new buffer was not republished"
        );
    }
}

#[test]
fn a_second_engine_cannot_take_a_live_name() {
    for url in stores() {
        let holder = engine_on(&url);
        // Same PID, host and name, as a restarted container would have: only the instance id
        // differs, and it alone decides.
        let mut impostor = holder.descriptor();
        impostor.instance = ferry::transport::InstanceId::random().unwrap();
        let store = ferry::metadata::from_url(&url).unwrap();
        let runtime = runtime();
        let refused = runtime.block_on(store.publish(&impostor));
        match refused {
            Err(Error::Metadata { name, reason }) => {
                assert_eq!(name, holder.name());
                let holder_id = holder.descriptor().instance.to_string();
                assert!(
                    reason.contains(&holder_id),
                    "{url}: {reason} should name {holder_id}"
                );
            }
            other => panic!("{url}: expected the name to be refused, got {other:?}"),
        }
        // The holder is untouched.
        let found = runtime.block_on(store.fetch(holder.name())).unwrap();
        assert_eq!(found.instance, holder.descriptor().instance);
    }
}

#[test]
fn a_killed_engine_vanishes_within_the_ttl_and_its_peers_let_go() {
    for url in stores() {
        let url = with_ttl(&url, 2);
        let serve = ServeProcess::start_with(1 << 20, &["--metadata", &url], &[]);
        let prefill = engine_on(&url);
        let peer = prefill.connect_blocking(&serve.name).unwrap();
        assert!(peer.is_alive());
        let name = serve.name.clone();
        let killed = Instant::now();
        drop(serve); // SIGKILL: nothing is unpublished
        let store = ferry::metadata::from_url(&url).unwrap();
        let runtime = runtime();
        let gone = loop {
            match runtime.block_on(store.fetch(&name)) {
                Err(Error::NotPublished { .. }) => break killed.elapsed(),
                Ok(_) if killed.elapsed() < Duration::from_secs(8) => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                other => panic!("{url}: expected the entry to expire, got {other:?}"),
            }
        };
        assert!(
            gone <= Duration::from_secs(4),
            "{url}: the entry outlived its 2 s TTL by too much ({gone:?})"
        );
        let deadline = Instant::now() + Duration::from_secs(3);
        while peer.is_alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !peer.is_alive(),
            "{url}: the survivor still holds the dead peer open"
        );
        match prefill.connect_blocking(&name) {
            Err(Error::NotPublished { .. }) => {}
            other => panic!("{url}: connecting to the dead name should say so, got {other:?}"),
        }
    }
}

#[test]
fn an_unreachable_store_fails_the_engine_start_naming_the_url() {
    let mut urls = Vec::new();
    if cfg!(feature = "etcd") {
        urls.push("etcd://127.0.0.1:9/ferry-unreachable");
    }
    if cfg!(feature = "redis") {
        urls.push("redis://127.0.0.1:9/0");
    }
    for url in urls {
        let started = Instant::now();
        let outcome = ferry::builder()
            .metadata(ferry::metadata::from_url(url).unwrap())
            .build_blocking();
        match outcome {
            Err(error) => assert!(error.to_string().contains(url), "{error} should name {url}"),
            Ok(_) => panic!("{url}: an engine started without its store"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{url}: gave up too slowly"
        );
    }
}

/// A redis server of this test's own on `port`, killed on drop.
#[cfg(feature = "redis")]
struct OwnRedis(std::process::Child);

#[cfg(feature = "redis")]
impl OwnRedis {
    fn start(port: u16) -> OwnRedis {
        let child = std::process::Command::new("redis-server")
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--save",
                "",
            ])
            .args(["--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server on PATH (Debian: redis-server)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        OwnRedis(child)
    }
}

#[cfg(feature = "redis")]
impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(feature = "redis")]
#[test]
fn open_peers_outlive_a_store_restart_and_engines_publish_again() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .unwrap();
    let url = format!("redis://127.0.0.1:{port}/0?ttl=2");
    let server = OwnRedis::start(port);
    let decode = engine_on(&url);
    let pool = decode.allocate(1 << 20).unwrap();
    let prefill = engine_on(&url);
    let peer = connect_seeing(&prefill, &decode, pool.addr(), &url);
    drop(server);
    // The store is gone: open peers keep working and are not closed as if gone.
    std::thread::sleep(Duration::from_millis(500));
    assert!(peer.is_alive(), "a store outage closed a live peer");
    write_and_check(
        &prefill,
        &peer,
        &pool,
        52,
        "bytes moved while the store was down",
    );
    // The store comes back empty: the engines put their descriptors back in it.
    let _server = OwnRedis::start(port);
    let store = ferry::metadata::from_url(&url).unwrap();
    let runtime = runtime();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match runtime.block_on(store.fetch(decode.name())) {
            Ok(found) => {
                assert_eq!(found.instance, decode.descriptor().instance);
                break;
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(error) => panic!("the engine did not republish after the store came back: {error}"),
        }
    }
}
