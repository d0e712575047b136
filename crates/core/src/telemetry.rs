//! What ferry tells an operator: counters and a histogram through the [`metrics`] facade,
//! and a `tracing` span per transfer.
//!
//! # Metrics
//! Recorded through the `metrics` crate (0.24), so they go wherever the process's recorder
//! sends them: install any recorder (`metrics-exporter-prometheus`, for one) in the embedding
//! server and they appear; install none and every recording is a no-op. `ferry serve
//! --metrics-addr HOST:PORT` installs a Prometheus exporter. The names, each with its labels:
//!
//! | name | kind | labels | what |
//! | --- | --- | --- | --- |
//! | [`TRANSFER_BYTES`] | counter | `transport`, `peer` | bytes of completed transfers started here |
//! | [`TRANSFERS`] | counter | `transport`, `peer` | completed transfers started here |
//! | [`TRANSFER_FAILURES`] | counter | `kind`, `peer` | failed transfers started here |
//! | [`TRANSFER_SECONDS`] | histogram | `transport` | submit to completion of completed transfers |
//! | [`SERVED_BYTES`] | counter | `transport`, `direction` | bytes peers wrote here or read from here |
//! | [`NOTIFICATIONS_SENT`] | counter | | notifications a peer accepted from this engine |
//! | [`NOTIFICATIONS_RECEIVED`] | counter | | notifications handed to this engine's inbox |
//!
//! - `transport` is the transport's name (`tcp`, `nvlink`); a batch that several transports
//!   carried counts once, under their names joined with `+` (`nvlink+tcp`).
//! - `peer` is the peer's segment name as this engine opened it, so there are as many values
//!   as peers the process connects to. The passive side has no `peer` label: the names
//!   senders claim are unauthenticated and unbounded.
//! - `kind` is the [`Error`] variant in snake case: `timeout`, `peer_gone`, `rejected`,
//!   `protocol`, `range`, `unreachable`, `shutdown`, ...
//! - `direction` is `write` (a peer wrote into this engine's memory) or `read` (a peer read
//!   from it). Only TCP serves bytes here: NVLink copies are made by the initiator's GPU,
//!   which the target never sees.
//!
//! # Tracing
//! Each transfer runs inside a `transfer` span at DEBUG level with the fields `peer`, `bytes`
//! and, when the batch carries a notification, `notify`: its payload as lossy UTF-8, cut to
//! [`NOTIFY_FIELD_CHARS`] characters. The transports' work happens inside it.

use crate::error::Error;
use metrics::{counter, histogram};
use std::sync::Arc;

/// Counter of bytes moved by completed transfers this engine started; labels `transport`
/// and `peer`.
pub const TRANSFER_BYTES: &str = "ferry_transfer_bytes_total";
/// Counter of completed transfers this engine started; labels `transport` and `peer`.
pub const TRANSFERS: &str = "ferry_transfers_total";
/// Counter of failed transfers this engine started; labels `kind` (the [`Error`] variant in
/// snake case) and `peer`.
pub const TRANSFER_FAILURES: &str = "ferry_transfer_failures_total";
/// Histogram of the seconds from submitting a batch to its completion, for completed
/// transfers; label `transport`.
pub const TRANSFER_SECONDS: &str = "ferry_transfer_duration_seconds";
/// Counter of bytes peers wrote into (`direction="write"`) or read from (`direction="read"`)
/// this engine's memory; labels `transport` and `direction`.
pub const SERVED_BYTES: &str = "ferry_served_bytes_total";
/// Counter of notifications a peer accepted from this engine, alone or with a batch.
pub const NOTIFICATIONS_SENT: &str = "ferry_notifications_sent_total";
/// Counter of notifications handed to this engine's inbox.
pub const NOTIFICATIONS_RECEIVED: &str = "ferry_notifications_received_total";
/// Most characters of a notification payload a transfer span's `notify` field shows.
pub const NOTIFY_FIELD_CHARS: usize = 64;

/// Gives the installed recorder a description of every metric above (the `# HELP` line of a
/// Prometheus exporter). Optional: the metrics are recorded either way. Call it once, after
/// installing the recorder; with none installed it does nothing.
pub fn describe() {
    use metrics::{describe_counter, describe_histogram, Unit};
    describe_counter!(
        TRANSFER_BYTES,
        Unit::Bytes,
        "Bytes of completed transfers this engine started."
    );
    describe_counter!(TRANSFERS, "Completed transfers this engine started.");
    describe_counter!(
        TRANSFER_FAILURES,
        "Failed transfers this engine started, by error kind."
    );
    describe_histogram!(
        TRANSFER_SECONDS,
        Unit::Seconds,
        "Seconds from submitting a batch to its completion, for completed transfers."
    );
    describe_counter!(
        SERVED_BYTES,
        Unit::Bytes,
        "Bytes peers wrote into or read from this engine's memory."
    );
    describe_counter!(
        NOTIFICATIONS_SENT,
        "Notifications a peer accepted from this engine."
    );
    describe_counter!(
        NOTIFICATIONS_RECEIVED,
        "Notifications handed to this engine's inbox."
    );
}

/// The span a transfer to `peer` runs in; `bytes` is recorded once routed, see
/// [`transfer_routed`].
pub(crate) fn transfer_span(peer: &str, notification: Option<&[u8]>) -> tracing::Span {
    let span = tracing::debug_span!(
        "transfer",
        peer,
        bytes = tracing::field::Empty,
        notify = tracing::field::Empty
    );
    if let Some(payload) = notification.filter(|_| !span.is_disabled()) {
        let text: String = String::from_utf8_lossy(payload)
            .chars()
            .take(NOTIFY_FIELD_CHARS)
            .collect();
        span.record("notify", text.as_str());
    }
    span
}

/// Records the byte count of the transfer whose span is current.
pub(crate) fn transfer_routed(bytes: u64) {
    tracing::Span::current().record("bytes", bytes);
}

/// Counts a transfer to `peer` that moved `bytes` through `transports` in `elapsed`.
pub(crate) fn transfer_succeeded(
    peer: &Arc<str>,
    transports: &[&'static str],
    bytes: u64,
    elapsed: std::time::Duration,
) {
    let transport = transport_label(transports);
    let labels = [
        ("transport", transport.clone()),
        ("peer", Arc::clone(peer).into()),
    ];
    counter!(TRANSFER_BYTES, &labels).increment(bytes);
    counter!(TRANSFERS, &labels).increment(1);
    histogram!(TRANSFER_SECONDS, "transport" => transport).record(elapsed.as_secs_f64());
}

/// Counts a transfer to `peer` that failed with `error`.
pub(crate) fn transfer_failed(peer: &Arc<str>, error: &Error) {
    counter!(TRANSFER_FAILURES, "kind" => kind(error), "peer" => Arc::clone(peer)).increment(1);
}

/// Counts `bytes` a peer moved through this engine's listener of `transport` in `direction`
/// (`"write"` or `"read"`, as the peer sees it).
pub(crate) fn served(transport: &'static str, direction: &'static str, bytes: u64) {
    counter!(SERVED_BYTES, "transport" => transport, "direction" => direction).increment(bytes);
}

/// Counts a notification a peer accepted.
pub(crate) fn notification_sent() {
    counter!(NOTIFICATIONS_SENT).increment(1);
}

/// Counts a notification handed to the inbox.
pub(crate) fn notification_received() {
    counter!(NOTIFICATIONS_RECEIVED).increment(1);
}

/// The `transport` label of a batch carried by `transports`: the one name, or the names
/// joined with `+`.
fn transport_label(transports: &[&'static str]) -> metrics::SharedString {
    match transports {
        [one] => metrics::SharedString::const_str(one),
        many => {
            let mut names = many.to_vec();
            names.sort_unstable();
            names.join("+").into()
        }
    }
}

/// The `kind` label of `error`: its variant in snake case.
pub(crate) fn kind(error: &Error) -> &'static str {
    match error {
        Error::Protocol { .. } => "protocol",
        Error::Range(_) => "range",
        Error::Unsupported { .. } => "unsupported",
        Error::Unavailable { .. } => "unavailable",
        Error::Cuda(_) => "cuda",
        Error::Unreachable { .. } => "unreachable",
        Error::PeerGone { .. } => "peer_gone",
        Error::Timeout { .. } => "timeout",
        Error::Shutdown { .. } => "shutdown",
        Error::Rejected { .. } => "rejected",
        Error::NotPublished { .. } => "not_published",
        Error::Metadata { .. } => "metadata",
        Error::Io { .. } => "io",
        Error::Unauthenticated { .. } => "unauthenticated",
        Error::ApiMisuse(_) => "api_misuse",
        Error::OutOfMemory { .. } => "out_of_memory",
        Error::Registration { .. } => "registration",
        Error::Internal { .. } => "internal",
    }
}

/// Lets a warning through at most once per interval and counts the events it held back, so
/// a flood of bad connections or requests writes a few log lines, not gigabytes.
#[derive(Debug)]
pub struct Throttle {
    every: std::time::Duration,
    /// When the last line was let through, and the events since.
    state: parking_lot::Mutex<(Option<std::time::Instant>, u64)>,
}

impl Throttle {
    /// A throttle that lets one line through per `every`.
    pub fn new(every: std::time::Duration) -> Throttle {
        Throttle {
            every,
            state: parking_lot::Mutex::new((None, 0)),
        }
    }

    /// Counts one event; `Some(events since the last line, this one included)` when a line
    /// is due now, `None` while the interval has not passed.
    pub fn due(&self) -> Option<u64> {
        let mut state = self.state.lock();
        state.1 += 1;
        let now = std::time::Instant::now();
        if state
            .0
            .is_some_and(|last| now.duration_since(last) < self.every)
        {
            return None;
        }
        state.0 = Some(now);
        Some(std::mem::take(&mut state.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_lets_the_first_event_through_then_counts_until_the_interval_passes() {
        let throttle = Throttle::new(std::time::Duration::from_millis(50));
        assert_eq!(throttle.due(), Some(1));
        assert_eq!(throttle.due(), None);
        assert_eq!(throttle.due(), None);
        std::thread::sleep(std::time::Duration::from_millis(60));
        assert_eq!(throttle.due(), Some(3));
    }

    #[test]
    fn a_batch_of_several_transports_is_labelled_by_their_sorted_names() {
        assert_eq!(&*transport_label(&["tcp"]), "tcp");
        assert_eq!(&*transport_label(&["tcp", "nvlink"]), "nvlink+tcp");
    }

    #[test]
    fn failure_kinds_are_the_variant_names_in_snake_case() {
        let gone = Error::PeerGone {
            peer: "a".into(),
            reason: "b".into(),
        };
        assert_eq!(kind(&gone), "peer_gone");
        assert_eq!(kind(&Error::ApiMisuse("x".into())), "api_misuse");
    }
}
