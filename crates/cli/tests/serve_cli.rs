//! `ferry serve` as a peer: it answers the engine its operator named, never the sender a
//! notification claims to be from, and `--secret-file` guards it.

mod common;

use common::ServeProcess;
use ferry::{AuthFailure, Error};
use ferry_core::wire::{self, Header, Hello, Kind};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Sends a notification to `address` over a raw connection whose hello claims `claimed_name`,
/// and returns the ack's outcome.
fn notify_claiming(
    address: &str,
    claimed_name: &str,
    payload: &[u8],
) -> Result<(), ferry_core::Refusal> {
    let mut stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let hello = wire::encode_hello(&Hello {
        name: claimed_name.to_owned(),
    });
    let mut bytes = Header::hello(&hello).encode().to_vec();
    bytes.extend_from_slice(&hello);
    bytes.extend_from_slice(&Header::for_body(Kind::Notify, 1, payload).encode());
    bytes.extend_from_slice(payload);
    stream.write_all(&bytes).unwrap();
    let mut header = [0u8; wire::HEADER_LEN];
    stream.read_exact(&mut header).unwrap();
    let header = Header::decode(&header, &wire::Limits::default()).unwrap();
    assert_eq!(header.kind, Kind::Ack);
    let mut body = vec![0u8; header.len as usize];
    stream.read_exact(&mut body).unwrap();
    wire::decode_ack(&body).unwrap()
}

#[test]
fn echo_answers_the_configured_engine_and_never_the_claimed_sender() {
    // The engine the operator named, and a third listener a hostile sender names instead.
    let named = ferry::builder().build_blocking().unwrap();
    let mut inbox = named.notifications().unwrap();
    let third = TcpListener::bind("127.0.0.1:0").unwrap();
    third.set_nonblocking(true).unwrap();
    let third_name = third.local_addr().unwrap().to_string();

    let serve = ServeProcess::start_with(4096, &["--echo", "--reply-to", named.name()], &[]);
    notify_claiming(&serve.name, &third_name, b"ping 1").unwrap();

    let answer = inbox
        .recv_timeout_blocking(Duration::from_secs(10))
        .unwrap()
        .expect("the named engine is alive");
    assert!(answer.payload.starts_with(b"held "), "{:?}", answer.payload);
    let deadline = Instant::now() + Duration::from_millis(300);
    while Instant::now() < deadline {
        match third.accept() {
            Ok((_, from)) => panic!("serve connected to the claimed sender (from {from})"),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(error) => panic!("accept failed: {error}"),
        }
    }
}

#[test]
fn secret_file_guards_serve() {
    let path = std::env::temp_dir().join(format!("ferry-serve-secret-{}", std::process::id()));
    std::fs::write(&path, b"serve-secret-0123456789abcdef\n").unwrap();
    let serve = ServeProcess::start_with(4096, &["--secret-file", path.to_str().unwrap()], &[]);
    std::fs::remove_file(&path).unwrap();

    // The file's final newline is not part of the secret.
    let same = ferry::builder()
        .secret(b"serve-secret-0123456789abcdef".to_vec())
        .build_blocking()
        .unwrap();
    let peer = same.connect_blocking(&serve.name).unwrap();
    assert_eq!(peer.buffers()[0].addr, serve.buffer_addr);

    let without = ferry::builder().build_blocking().unwrap();
    match without.connect_blocking(&serve.name) {
        Err(Error::Unauthenticated { reason, .. }) => {
            assert_eq!(reason, AuthFailure::NoLocalSecret)
        }
        outcome => panic!("expected Error::Unauthenticated, got {outcome:?}"),
    }
}

#[test]
fn echo_answers_the_engine_its_parent_names_on_stdin() {
    use std::io::BufRead;
    let named = ferry::builder().build_blocking().unwrap();
    let mut inbox = named.notifications().unwrap();
    let mut child = std::process::Command::new(common::ferry_bin())
        .args(["serve", "--bytes", "4096", "--echo"])
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let segment = lines.next().unwrap().unwrap();
    let serve_name = segment.strip_prefix("segment: ").unwrap().to_owned();
    lines.next().unwrap().unwrap();
    writeln!(input, "reply-to {}", named.name()).unwrap();
    input.flush().unwrap();
    assert_eq!(
        lines.next().unwrap().unwrap(),
        format!("reply-to: {}", named.name())
    );

    notify_claiming(&serve_name, "127.0.0.1:1", b"ping 1").unwrap();
    let answer = inbox
        .recv_timeout_blocking(Duration::from_secs(10))
        .unwrap()
        .expect("the named engine is alive");
    assert!(answer.payload.starts_with(b"held "), "{:?}", answer.payload);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_peer_cannot_print_lines_of_its_own_or_escape_codes_through_serve() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(common::ferry_bin())
        .args(["serve", "--bytes", "4096", "--notifications", "1"])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let segment = lines.next().unwrap().unwrap();
    let serve_name = segment.strip_prefix("segment: ").unwrap().to_owned();
    lines.next().unwrap().unwrap();
    notify_claiming(
        &serve_name,
        "x\nbuffer: 0x1 1",
        b"ok\nsegment: 10.0.0.9:1\x1b[2J",
    )
    .unwrap();
    let printed: Vec<String> = lines.map_while(Result::ok).collect();
    assert_eq!(
        printed,
        [
            r#"notification from "x\nbuffer: 0x1 1" (as it claims): "ok\nsegment: 10.0.0.9:1\u{1b}[2J""#
        ]
    );
    let _ = child.wait();
}

/// `ferry serve --secret-file` with `secret`, until its first line: what it logged meanwhile.
fn serve_logs_with_secret(secret: &[u8], tag: &str) -> String {
    use std::io::BufRead;
    let path = std::env::temp_dir().join(format!("ferry-secret-{tag}-{}", std::process::id()));
    std::fs::write(&path, secret).unwrap();
    let mut child = std::process::Command::new(common::ferry_bin())
        .args(["serve", "--bytes", "4096", "--secret-file"])
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("segment: "));
    let _ = child.kill();
    let output = child.wait_with_output().unwrap();
    std::fs::remove_file(&path).unwrap();
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn ferry_secret_prints_32_random_bytes_and_only_a_typed_secret_draws_a_warning() {
    use base64::Engine as _;
    let generate = || {
        let output = std::process::Command::new(common::ferry_bin())
            .arg("secret")
            .output()
            .unwrap();
        assert!(output.status.success());
        String::from_utf8(output.stdout).unwrap()
    };
    let (first, second) = (generate(), generate());
    assert_ne!(first, second, "two secrets should differ");
    let line = first.strip_suffix('\n').expect("one line");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(line)
        .unwrap();
    assert_eq!(bytes.len(), 32);

    let warning = "looks like text";
    let generated = serve_logs_with_secret(first.as_bytes(), "generated");
    assert!(!generated.contains(warning), "{generated}");
    let typed = serve_logs_with_secret(b"correct-horse-battery-staple\n", "typed");
    assert!(typed.contains(warning), "{typed}");
}
