//! Helpers shared by the integration tests.
#![allow(dead_code)]

use ferry::{Engine, Peer, Region};
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// An engine on loopback with a short timeout, so a failure cannot stall the suite.
pub(crate) async fn engine() -> Engine {
    ferry::builder()
        .transfer_timeout(Duration::from_secs(10))
        .build()
        .await
        .expect("engine starts on loopback")
}

/// A decode engine with a pool region and a prefill engine with a source region, connected.
// Fields are declared in reverse order of creation so they drop like the locals they replace.
pub(crate) struct Pair {
    /// The pool's address as the prefill side sees it: `peer.buffers()[0].addr`.
    pub(crate) remote: u64,
    /// The prefill engine's connection to the decode engine.
    pub(crate) peer: Peer,
    /// The region on the prefill engine that is the local side of transfers.
    pub(crate) source: Region,
    /// The engine that connects and submits.
    pub(crate) prefill: Engine,
    /// The decode engine's only registered region.
    pub(crate) pool: Region,
    /// The engine that listens and receives.
    pub(crate) decode: Engine,
}

impl Pair {
    /// Builds both engines, allocates `pool_len` on decode and `source_len` on prefill, connects.
    pub(crate) async fn new(pool_len: usize, source_len: usize) -> Pair {
        let decode = engine().await;
        let pool = decode
            .allocate(pool_len as u64)
            .expect("decode allocates its pool");
        let prefill = engine().await;
        let source = prefill
            .allocate(source_len as u64)
            .expect("prefill allocates its source");
        let peer = prefill
            .connect(decode.name())
            .await
            .expect("prefill connects to decode");
        let remote = peer.buffers()[0].addr;
        Pair {
            remote,
            peer,
            source,
            prefill,
            pool,
            decode,
        }
    }
}

/// Deterministic bytes that differ for every seed and position.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut bytes);
    bytes
}

/// Fails naming the first differing byte.
pub(crate) fn assert_bytes_eq(found: &[u8], expected: &[u8], what: &str) {
    assert_eq!(found.len(), expected.len(), "{what}: lengths differ");
    if let Some(index) = found.iter().zip(expected).position(|(a, b)| a != b) {
        panic!(
            "{what}: first bad byte at {index}: found {:#04x}, expected {:#04x}",
            found[index], expected[index]
        );
    }
}

/// Puts `bytes` at the start of `source`, writes them to the start of `pool` through `peer`
/// and asserts that they landed there.
pub(crate) async fn write_and_verify(
    prefill: &Engine,
    peer: &Peer,
    source: &Region,
    pool: &Region,
    bytes: &[u8],
    what: &str,
) {
    source.write_at(0, bytes).unwrap();
    prefill
        .batch(peer)
        .write(source, 0, pool.addr(), bytes.len() as u64)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; bytes.len()];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, bytes, what);
}

/// Log lines of this test binary, captured so tests can check what was logged.
pub(crate) fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&logs);
        tracing_subscriber::fmt()
            .with_writer(move || LogWriter(Arc::clone(&sink)))
            .with_ansi(false)
            .init();
        logs
    })
    .clone()
}

/// Appends what the log writes to the shared buffer.
struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
