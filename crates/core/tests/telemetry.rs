//! The metrics and the span a transfer records, seen through a metrics recorder and a tracing
//! subscriber installed for the whole process: engine work runs on the engines' runtime
//! threads, which thread-local ones miss. This file is a test binary of its own, so no other
//! test shares them.

use ferry_core::telemetry::{
    NOTIFICATIONS_RECEIVED, NOTIFICATIONS_SENT, NOTIFY_FIELD_CHARS, SERVED_BYTES, TRANSFERS,
    TRANSFER_BYTES, TRANSFER_FAILURES, TRANSFER_SECONDS,
};
use ferry_core::{EngineBuilder, Error, RangeError, TcpOnly};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::OnceLock;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use tracing_core::span::Current;

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
    let decode = EngineBuilder::new(TcpOnly).build_blocking().unwrap();
    let kv = decode.allocate(1 << 20).unwrap();
    let mut inbox = decode.notifications().unwrap();
    let prefill = EngineBuilder::new(TcpOnly).build_blocking().unwrap();
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
    let decode = EngineBuilder::new(TcpOnly).build_blocking().unwrap();
    let kv = decode.allocate(4096).unwrap();
    let prefill = EngineBuilder::new(TcpOnly).build_blocking().unwrap();
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

/// A span as the test subscriber keeps it: its metadata and the fields recorded so far.
type Kept = (&'static Metadata<'static>, Vec<(&'static str, String)>);

/// The fields of every span, its id being its position + 1, and the spans each thread is in:
/// a subscriber that keeps nothing else.
#[derive(Default)]
struct Spans {
    spans: Mutex<Vec<Kept>>,
}

thread_local! {
    /// The spans this thread entered and has not left, innermost last.
    static ENTERED: std::cell::RefCell<Vec<Id>> = const { std::cell::RefCell::new(Vec::new()) };
}

struct Fields<'a>(&'a mut Vec<(&'static str, String)>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name(), value.to_owned()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name(), format!("{value:?}")));
    }
}

impl Subscriber for Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, attributes: &Attributes<'_>) -> Id {
        let mut spans = self.spans.lock();
        let mut fields = Vec::new();
        attributes.record(&mut Fields(&mut fields));
        spans.push((attributes.metadata(), fields));
        Id::from_u64(spans.len() as u64)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut spans = self.spans.lock();
        if let Some((_, fields)) = spans.get_mut(span.into_u64() as usize - 1) {
            values.record(&mut Fields(fields));
        }
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, _: &Event<'_>) {}

    fn enter(&self, span: &Id) {
        ENTERED.with(|entered| entered.borrow_mut().push(span.clone()));
    }

    fn exit(&self, _: &Id) {
        ENTERED.with(|entered| entered.borrow_mut().pop());
    }

    fn current_span(&self) -> Current {
        let Some(id) = ENTERED.with(|entered| entered.borrow().last().cloned()) else {
            return Current::none();
        };
        let metadata = self.spans.lock()[id.into_u64() as usize - 1].0;
        Current::new(id, metadata)
    }
}

/// The process's subscriber, installed by the first test that asks.
fn spans() -> &'static Spans {
    static SPANS: OnceLock<&'static Spans> = OnceLock::new();
    SPANS.get_or_init(|| {
        let spans: &'static Spans = Box::leak(Box::default());
        tracing::subscriber::set_global_default(Forward(spans))
            .expect("no other subscriber in this test binary");
        spans
    })
}

/// Hands a `'static` subscriber to `set_global_default`, which takes one by value.
struct Forward(&'static Spans);

impl Subscriber for Forward {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.0.enabled(metadata)
    }

    fn new_span(&self, attributes: &Attributes<'_>) -> Id {
        self.0.new_span(attributes)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        self.0.record(span, values)
    }

    fn record_follows_from(&self, span: &Id, follows: &Id) {
        self.0.record_follows_from(span, follows)
    }

    fn event(&self, event: &Event<'_>) {
        self.0.event(event)
    }

    fn enter(&self, span: &Id) {
        self.0.enter(span)
    }

    fn exit(&self, span: &Id) {
        self.0.exit(span)
    }

    fn current_span(&self) -> Current {
        self.0.current_span()
    }
}

#[test]
fn a_transfer_runs_in_a_span_naming_its_peer_bytes_and_cut_notification() {
    let spans = spans();
    let decode = EngineBuilder::new(TcpOnly).build_blocking().unwrap();
    let kv = decode.allocate(4096).unwrap();
    let prefill = EngineBuilder::new(TcpOnly).build_blocking().unwrap();
    let source = prefill.allocate(4096).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    let mut payload = vec![0xff];
    payload.extend_from_slice("é".repeat(100).as_bytes());
    prefill
        .batch(&peer)
        .write(&source, 0, kv.addr(), 1234)
        .notify(payload)
        .submit_blocking()
        .unwrap();

    let spans = spans.spans.lock();
    let fields = spans
        .iter()
        .filter(|(metadata, _)| metadata.name() == "transfer")
        .map(|(_, fields)| fields)
        .find(|fields| fields.contains(&("peer", decode.name().to_owned())))
        .expect("a transfer span names the peer");
    let field = |wanted: &str| {
        fields
            .iter()
            .find(|(name, _)| *name == wanted)
            .map(|(_, value)| value.clone())
    };
    assert_eq!(field("bytes").as_deref(), Some("1234"), "{fields:?}");
    let expected: String = std::iter::once('\u{fffd}')
        .chain(std::iter::repeat_n('é', NOTIFY_FIELD_CHARS - 1))
        .collect();
    assert_eq!(field("notify"), Some(expected), "{fields:?}");
}
