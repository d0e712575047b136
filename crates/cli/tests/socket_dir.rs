//! `--socket-dir`: `ferry serve` also serves its fd socket as a file in the directory, with the
//! permissions its secret calls for, removes the file as it exits, and refuses to start with
//! a directory it cannot use.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::{Duration, Instant};

/// The socket files in `dir`.
fn sockets(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            std::fs::metadata(path).is_ok_and(|metadata| metadata.file_type().is_socket())
        })
        .collect()
}

/// A secret of random-looking bytes (a typed one draws a warning).
const SECRET: &str = "q3J9xk2Vb7LmZt0sW8cYfPn4HdRa6EuG";

#[test]
fn serve_binds_its_socket_file_in_the_directory_and_removes_it_as_it_exits() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let mut serve = std::process::Command::new(common::ferry_bin())
        .args(["serve", "--bytes", "4096", "--notifications", "1"])
        .arg("--socket-dir")
        .arg(dir.path())
        .arg("--secret-file")
        .arg(&secret)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(serve.stdout.take().unwrap()).lines();
    let segment = lines.next().unwrap().unwrap();
    let name = segment.strip_prefix("segment: ").unwrap().to_owned();
    let found = sockets(dir.path());
    assert_eq!(found.len(), 1, "{found:?}");
    let file = found[0].file_name().unwrap().to_str().unwrap().to_owned();
    assert!(
        file.starts_with("ferry-") && file.ends_with(".sock") && file.len() == 43,
        "{file}"
    );
    let mode = std::fs::metadata(&found[0]).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o666, "with a secret every user may connect");
    // Its descriptor publishes the file as the nvlink endpoint.
    let engine = ferry::builder()
        .secret(SECRET.as_bytes().to_vec())
        .build_blocking()
        .unwrap();
    let peer = engine.connect_blocking(&name).unwrap();
    assert_eq!(
        peer.descriptor().endpoint("nvlink"),
        Some(found[0].to_str().unwrap())
    );
    // Its one notification ends it, and the file goes with its engine.
    engine.notify_blocking(&peer, b"done".to_vec()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "ferry serve did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(lines);
    assert!(status.success(), "{status}");
    assert_eq!(sockets(dir.path()), Vec::<std::path::PathBuf>::new());
}

#[test]
fn serve_refuses_a_socket_directory_it_cannot_use_and_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("not-mounted");
    let output = std::process::Command::new(common::ferry_bin())
        .args(["serve", "--bytes", "4096", "--socket-dir"])
        .arg(&missing)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(output.stdout.is_empty(), "it printed a segment");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("socket directory") && stderr.contains("hostPath"),
        "{stderr}"
    );
}
