//! `ferry serve --metrics-addr`: the engine's metrics as Prometheus text over HTTP.
//!
//! The endpoint is small on purpose and bounded everywhere a scraper could hold it: loopback
//! only unless the operator says otherwise, a few scrapes at once (more are closed as they
//! arrive), a deadline for the whole exchange, a cap on the request's size, one request per
//! connection, and warnings at most once every few seconds however many scrapers misbehave.

use ferry::telemetry::{self, Throttle};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bucket bounds of the transfer latency histogram, in seconds: 50 µs to 30 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Scrapes served at once; a connection over it is closed as it arrives.
const MAX_SCRAPES: usize = 8;

/// The whole exchange (request in, answer out) must fit in this.
const SCRAPE_DEADLINE: Duration = Duration::from_secs(5);

/// The longest request head read; a longer one gets 431.
const MAX_REQUEST_BYTES: usize = 8 << 10;

/// How often the recorder's histograms are folded, so they stay bounded between scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Warnings about refused or failed scrapes: at most one per this interval, with a count.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What a request asks for, as far as this endpoint cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// `GET /metrics`.
    Metrics,
    /// Another path.
    NotFound,
    /// Another method.
    WrongMethod,
    /// Not an HTTP request line.
    Malformed,
}

/// Reads the request line of `head` (the bytes before the blank line).
fn asked(head: &[u8]) -> Asked {
    let line = head.split(|&byte| byte == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Ok(line) = std::str::from_utf8(line) else {
        return Asked::Malformed;
    };
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Asked::Malformed;
    };
    if !version.starts_with("HTTP/1.") {
        return Asked::Malformed;
    }
    let path = target.split('?').next().unwrap_or(target);
    match (method, path) {
        ("GET", "/metrics") => Asked::Metrics,
        ("GET", _) => Asked::NotFound,
        _ => Asked::WrongMethod,
    }
}

/// The response for `status` with `body`; the connection closes after it.
fn response(status: &str, content_type: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Logs why a scrape was refused or failed, at most once per [`WARN_EVERY`].
fn warn_failed(throttle: &Throttle, reason: &str) {
    if let Some(count) = throttle.due() {
        tracing::warn!(
            reason,
            count,
            "metrics endpoint: scrapes refused or failed since the last warning (the latest reason shown)"
        );
    }
}

/// Reads a request head from `stream` within `deadline`; `None` when the peer is too slow,
/// sends too much, or goes away.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> Option<Result<Vec<u8>, ()>> {
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        let read = stream.read(&mut chunk).ok()?;
        if read == 0 {
            return None;
        }
        head.extend_from_slice(&chunk[..read]);
        if let Some(end) = head.windows(4).position(|window| window == b"\r\n\r\n") {
            head.truncate(end);
            return Some(Ok(head));
        }
        if head.len() > MAX_REQUEST_BYTES {
            return Some(Err(()));
        }
    }
}

/// Serves one scrape; `false` when the exchange failed.
fn serve_one(mut stream: TcpStream, handle: &PrometheusHandle) -> bool {
    let deadline = Instant::now() + SCRAPE_DEADLINE;
    let answer = match read_head(&mut stream, deadline) {
        None => return false,
        Some(Err(())) => response(
            "431 Request Header Fields Too Large",
            "text/plain",
            "request too large\n",
        ),
        Some(Ok(head)) => match asked(&head) {
            Asked::Metrics => response("200 OK", "text/plain; version=0.0.4", &handle.render()),
            Asked::NotFound => response("404 Not Found", "text/plain", "try /metrics\n"),
            Asked::WrongMethod => response("405 Method Not Allowed", "text/plain", "GET only\n"),
            Asked::Malformed => response("400 Bad Request", "text/plain", "bad request\n"),
        },
    };
    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
        return false;
    };
    stream
        .set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .is_ok()
        && stream.write_all(&answer).is_ok()
}

/// Accepts scrapes on `listener` for the life of the process.
fn serve(listener: TcpListener, handle: PrometheusHandle) {
    let active = Arc::new(AtomicUsize::new(0));
    let warnings = Arc::new(Throttle::new(WARN_EVERY));
    for stream in listener.incoming() {
        let Ok(stream) = stream else {
            warn_failed(&warnings, "accepting a connection failed");
            // Out of descriptors, say: give the process a moment instead of spinning.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_SCRAPES {
            active.fetch_sub(1, Ordering::AcqRel);
            warn_failed(
                &warnings,
                &format!("over {MAX_SCRAPES} scrapes at once; the newest is closed"),
            );
            continue;
        }
        let (running, failures, scraped) =
            (Arc::clone(&active), Arc::clone(&warnings), handle.clone());
        let spawned = std::thread::Builder::new()
            .name("ferry-metrics".into())
            .spawn(move || {
                if !serve_one(stream, &scraped) {
                    warn_failed(&failures, "a slow, oversized or broken request");
                }
                running.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::AcqRel);
            warn_failed(&warnings, "no thread to serve a scrape");
        }
    }
}

/// Installs a Prometheus recorder as the process's metrics recorder and serves `/metrics` on
/// `address` (`HOST:PORT`) from a thread of its own; returns the address it listens on.
/// A non-loopback address needs `public`: the metrics name peers and their traffic.
///
/// # Errors
/// When `address` does not resolve, names port 0 (Prometheus needs a known port to scrape),
/// is not a loopback address without `public`, cannot be bound, or a recorder is already
/// installed.
pub(crate) fn install(
    address: &str,
    public: bool,
) -> Result<SocketAddr, Box<dyn std::error::Error>> {
    let resolved = address
        .to_socket_addrs()
        .map_err(|error| format!("--metrics-addr {address}: {error}; give HOST:PORT"))?
        .next()
        .ok_or_else(|| format!("--metrics-addr {address} resolves to no address"))?;
    if resolved.port() == 0 {
        return Err(format!(
            "--metrics-addr {address}: give a fixed port; Prometheus must know where to scrape"
        )
        .into());
    }
    if !resolved.ip().is_loopback() && !public {
        return Err(format!(
            "--metrics-addr {address} is not a loopback address, and the endpoint has no authentication: anyone who reaches it sees the engine's peers and traffic; add --metrics-public to serve it there anyway (behind a firewall that admits only the scraper), or scrape through 127.0.0.1"
        )
        .into());
    }
    let listener = TcpListener::bind(resolved)
        .map_err(|error| format!("serving metrics on {resolved}: {error}"))?;
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(telemetry::TRANSFER_SECONDS.into()),
            LATENCY_BUCKETS,
        )?
        .install_recorder()
        .map_err(|error| format!("installing the metrics recorder: {error}"))?;
    telemetry::describe();
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("ferry-metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_EVERY);
            upkeep.run_upkeep();
        })?;
    std::thread::Builder::new()
        .name("ferry-metrics-accept".into())
        .spawn(move || serve(listener, handle))?;
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_metrics_is_served_and_anything_else_is_named() {
        assert_eq!(asked(b"GET /metrics HTTP/1.1\r\nHost: x"), Asked::Metrics);
        assert_eq!(asked(b"GET /metrics?name=x HTTP/1.0"), Asked::Metrics);
        assert_eq!(asked(b"GET / HTTP/1.1"), Asked::NotFound);
        assert_eq!(asked(b"POST /metrics HTTP/1.1"), Asked::WrongMethod);
        assert_eq!(asked(b"GET /metrics"), Asked::Malformed);
        assert_eq!(asked(b"GET /metrics SMTP/1.1"), Asked::Malformed);
        assert_eq!(asked(b"\xff\xfe"), Asked::Malformed);
        assert_eq!(asked(b""), Asked::Malformed);
        let answer = String::from_utf8(response("200 OK", "text/plain", "abc")).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.contains("Content-Length: 3\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\nabc"), "{answer}");
    }
}
