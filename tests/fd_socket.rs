//! The fd socket's listener in a socket directory: what it logs about the connections it
//! serves. Another engine starting in the directory connects to each old socket file and closes
//! at once to see whether its engine is alive; that must not read as a failed request.

mod common;

use common::captured_logs;
use ferry::{Links, NvlinkConfig};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

const FAILED: &str = "fd-passing requests failed or were refused";

fn logged(text: &str) -> bool {
    let logs = captured_logs();
    let logs = logs.lock().unwrap();
    String::from_utf8_lossy(&logs).contains(text)
}

#[test]
fn a_connection_that_closes_before_asking_is_not_warned_about_and_one_cut_short_is() {
    let logs = captured_logs();
    let dir = tempfile::tempdir().unwrap();
    let engine = Links::default()
        .nvlink(NvlinkConfig::default().socket_dir(dir.path()))
        .builder()
        .build_blocking()
        .unwrap();
    let socket = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|entry| entry.path())
        .find(|path| {
            path.extension()
                .is_some_and(|extension| extension == "sock")
        })
        .expect("the engine's socket file");

    // Connected and closed at once, as the liveness check does.
    drop(UnixStream::connect(&socket).unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !logged(FAILED),
        "{}",
        String::from_utf8_lossy(&logs.lock().unwrap())
    );

    // A request cut short after its first byte is a failure, and is logged.
    let mut cut = UnixStream::connect(&socket).unwrap();
    cut.write_all(&[0]).unwrap();
    drop(cut);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !logged(FAILED) {
        assert!(Instant::now() < deadline, "the cut request was not logged");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(engine);
}
