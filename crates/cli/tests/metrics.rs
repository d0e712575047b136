//! `ferry serve --metrics-addr`: Prometheus text at `/metrics` counts what peers moved.

mod common;

use common::{ferry_bin, ServeProcess};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

/// A loopback port that was free a moment ago (the exporter needs a fixed port).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("bound address").port()
}

/// The body of `GET /metrics` from `address`, retried while the listener is not answering.
fn scrape(address: &str) -> String {
    let mut last_error = String::new();
    for _ in 0..50 {
        match get_metrics(address) {
            Ok(body) => return body,
            Err(error) => last_error = error.to_string(),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("GET http://{address}/metrics never answered: {last_error}");
}

fn get_metrics(address: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    match response.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_owned()),
        _ => Err(std::io::Error::other(format!("not a 200: {response:?}"))),
    }
}

/// The value of the sample of `metric` whose labels contain `label`, if any.
fn sample(body: &str, metric: &str, label: &str) -> Option<f64> {
    body.lines()
        .filter(|line| line.starts_with(&format!("{metric}{{")) && line.contains(label))
        .find_map(|line| line.rsplit(' ').next()?.parse().ok())
}

/// An engine of this process writes 8 KiB into `serve`'s buffer.
fn write_8_kib_to(serve: &ServeProcess) {
    let prefill = ferry::builder().build_blocking().unwrap();
    let source = prefill.allocate(8192).unwrap();
    let peer = prefill.connect_blocking(&serve.name).unwrap();
    prefill
        .batch(&peer)
        .write(&source, 0, serve.buffer_addr, 8192)
        .submit_blocking()
        .unwrap();
}

#[test]
fn serve_reports_the_bytes_a_peer_wrote_at_its_metrics_address() {
    let address = format!("127.0.0.1:{}", free_port());
    let serve = ServeProcess::start_with(1 << 20, &["--metrics-addr", &address], &[]);
    assert_eq!(
        serve.metrics.as_deref(),
        Some(format!("http://{address}/metrics").as_str())
    );

    write_8_kib_to(&serve);

    let body = scrape(&address);
    let written = sample(&body, "ferry_served_bytes_total", r#"direction="write""#);
    assert!(
        written.is_some_and(|bytes| bytes >= 8192.0),
        "no write bytes counted in:\n{body}"
    );
    assert!(
        body.contains(r#"transport="tcp""#),
        "no tcp label in:\n{body}"
    );
    assert!(
        body.contains("# HELP ferry_served_bytes_total"),
        "no description in:\n{body}"
    );
}

#[test]
fn serve_refuses_a_metrics_address_without_a_fixed_port() {
    let output = Command::new(ferry_bin())
        .args(["serve", "--bytes", "4096", "--metrics-addr", "127.0.0.1:0"])
        .output()
        .expect("ferry serve runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("give a fixed port"), "{stderr}");
    assert!(
        output.stdout.is_empty(),
        "nothing is served, so no segment line"
    );
}

#[test]
fn serve_refuses_a_public_metrics_address_unless_told_and_then_serves_it() {
    let port = free_port();
    let public = format!("0.0.0.0:{port}");
    let output = Command::new(ferry_bin())
        .args(["serve", "--bytes", "4096", "--metrics-addr", &public])
        .output()
        .expect("ferry serve runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--metrics-public"), "{stderr}");
    let serve =
        ServeProcess::start_with(4096, &["--metrics-addr", &public, "--metrics-public"], &[]);
    assert!(serve.metrics.is_some());
    // A 200 (the engine has counted nothing yet, so the body may be empty).
    scrape(&format!("127.0.0.1:{port}"));
}

#[test]
fn a_flood_of_idle_scrapers_is_bounded_and_the_engine_and_a_late_scrape_go_on() {
    const FLOOD: usize = 200;
    let address = format!("127.0.0.1:{}", free_port());
    let serve = ServeProcess::start_with(1 << 20, &["--metrics-addr", &address], &[]);
    scrape(&address);
    let mut idle: Vec<TcpStream> = (0..FLOOD)
        .map(|_| TcpStream::connect(&address).expect("the listener accepts"))
        .collect();
    // All but the few the endpoint serves at once are closed as they arrive.
    let open = |streams: &mut [TcpStream], wait: Duration| {
        let mut open = 0;
        for stream in streams {
            stream.set_read_timeout(Some(wait)).unwrap();
            let mut byte = [0u8; 1];
            if let Err(error) = stream.read(&mut byte) {
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) {
                    open += 1;
                }
            }
        }
        open
    };
    let held = open(&mut idle, Duration::from_millis(20));
    assert!(held <= 8, "{held} idle scrapers are held");

    // The engine serves its peers meanwhile.
    write_8_kib_to(&serve);

    // The scrape deadline closes the held ones, and a real scrape gets its answer.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(open(&mut idle, Duration::from_millis(20)), 0);
    let body = scrape(&address);
    assert!(
        sample(&body, "ferry_served_bytes_total", r#"direction="write""#).is_some(),
        "{body}"
    );
}
