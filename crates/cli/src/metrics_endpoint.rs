//! `ferry serve --metrics-addr`: the engine's metrics as Prometheus text over HTTP.

use ferry::telemetry;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use std::net::{SocketAddr, ToSocketAddrs};

/// Bucket bounds of the transfer latency histogram, in seconds: 50 µs to 30 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Installs a Prometheus exporter as the process's metrics recorder, serving `/metrics` on
/// `address` (`HOST:PORT`), and returns the address it listens on.
///
/// # Errors
/// When `address` does not resolve, names port 0 (Prometheus needs a known port to scrape),
/// cannot be bound, or a recorder is already installed.
pub(crate) fn install(address: &str) -> Result<SocketAddr, Box<dyn std::error::Error>> {
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
    PrometheusBuilder::new()
        .with_http_listener(resolved)
        .set_buckets_for_metric(
            Matcher::Full(telemetry::TRANSFER_SECONDS.into()),
            LATENCY_BUCKETS,
        )?
        .install()
        .map_err(|error| format!("serving metrics on {resolved}: {error}"))?;
    telemetry::describe();
    Ok(resolved)
}
