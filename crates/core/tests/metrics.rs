//! The metrics a transfer records, seen through a recorder installed for the whole process:
//! engine work runs on the engines' runtime threads, which a thread-local recorder misses.
//! This file is a test binary of its own, so no other test shares its recorder.

use ferry_core::telemetry::{
    NOTIFICATIONS_RECEIVED, NOTIFICATIONS_SENT, SERVED_BYTES, TRANSFERS, TRANSFER_BYTES,
    TRANSFER_FAILURES, TRANSFER_SECONDS,
};
use ferry_core::{Engine, Error, RangeError};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::OnceLock;

/// What the metrics added up to so far: counters summed, histogram samples kept. A snapshot
/// of the debugging recorder drains it, and the tests of this file run at once, so each
/// snapshot is folded in here.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Counter(u64),
    Histogram(Vec<f64>),
}

/// The process's recorder, installed by the first test that asks, and what it saw.
fn recorder() -> &'static (Snapshotter, Mutex<HashMap<CompositeKey, Seen>>) {
    static RECORDER: OnceLock<(Snapshotter, Mutex<HashMap<CompositeKey, Seen>>)> = OnceLock::new();
    RECORDER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("no other recorder in this test binary");
        (snapshotter, Mutex::new(HashMap::new()))
    })
}

/// The metric `name` of `kind` whose labels include every pair of `labels`.
fn value(kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> Option<Seen> {
    let (snapshotter, seen) = recorder();
    let mut seen = seen.lock();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        match (seen.entry(key).or_insert(Seen::Counter(0)), value) {
            (Seen::Counter(total), DebugValue::Counter(more)) => *total += more,
            (slot, DebugValue::Histogram(samples)) => {
                let samples = samples.into_iter().map(|sample| sample.0);
                match slot {
                    Seen::Histogram(kept) => kept.extend(samples),
                    Seen::Counter(_) => *slot = Seen::Histogram(samples.collect()),
                }
            }
            (_, other) => panic!("ferry records no gauges, found {other:?}"),
        }
    }
    seen.iter()
        .find(|(key, _)| {
            key.kind() == kind
                && key.key().name() == name
                && labels.iter().all(|(label, wanted)| {
                    key.key()
                        .labels()
                        .any(|found| found.key() == *label && found.value() == *wanted)
                })
        })
        .map(|(_, value)| value.clone())
}

fn counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    match value(MetricKind::Counter, name, labels) {
        Some(Seen::Counter(count)) => count,
        other => panic!("{name} {labels:?}: no counter, found {other:?}"),
    }
}

#[test]
fn a_tcp_transfer_counts_its_bytes_and_its_notification_by_transport_and_peer() {
    recorder();
    let decode = Engine::builder().build_blocking().unwrap();
    let kv = decode.allocate(1 << 20).unwrap();
    let mut inbox = decode.notifications().unwrap();
    let prefill = Engine::builder().build_blocking().unwrap();
    let source = prefill.allocate(1 << 20).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();

    for _ in 0..2 {
        prefill
            .batch(&peer)
            .write(&source, 0, kv.addr(), 3000)
            .notify(b"req-1".to_vec())
            .submit_blocking()
            .unwrap();
        inbox.recv_blocking().unwrap().expect("engine alive");
    }

    let labels = [("transport", "tcp"), ("peer", decode.name())];
    assert_eq!(counter(TRANSFER_BYTES, &labels), 6000);
    assert_eq!(counter(TRANSFERS, &labels), 2);
    match value(
        MetricKind::Histogram,
        TRANSFER_SECONDS,
        &[("transport", "tcp")],
    ) {
        Some(Seen::Histogram(seconds)) => {
            assert!(
                seconds.len() >= 2 && seconds.iter().all(|&second| second > 0.0),
                "{seconds:?}"
            )
        }
        other => panic!("no latency histogram: {other:?}"),
    }
    // The decode side saw the bytes arrive through its listener, and both notifications.
    assert!(
        counter(
            SERVED_BYTES,
            &[("transport", "tcp"), ("direction", "write")]
        ) >= 6000,
        "the listener counts the bytes written into it"
    );
    assert!(counter(NOTIFICATIONS_SENT, &[]) >= 2);
    assert!(counter(NOTIFICATIONS_RECEIVED, &[]) >= 2);
}

#[test]
fn a_failed_transfer_counts_its_error_kind_for_its_peer() {
    recorder();
    let decode = Engine::builder().build_blocking().unwrap();
    let kv = decode.allocate(4096).unwrap();
    let prefill = Engine::builder().build_blocking().unwrap();
    let source = prefill.allocate(8192).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();

    // Past the end of the peer's only buffer: refused before any byte moves.
    let failed = prefill
        .batch(&peer)
        .write(&source, 0, kv.addr(), 8192)
        .submit_blocking();
    assert!(
        matches!(failed, Err(Error::Range(RangeError::NotRegistered { .. }))),
        "{failed:?}"
    );

    let labels = [("kind", "range"), ("peer", decode.name())];
    assert_eq!(counter(TRANSFER_FAILURES, &labels), 1);
    assert_eq!(
        value(MetricKind::Counter, TRANSFERS, &[("peer", decode.name())]),
        None,
        "a failed transfer is not counted as completed"
    );
}
