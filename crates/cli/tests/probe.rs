//! `ferry probe` against a running `ferry serve`.

mod common;

use common::{ferry_bin, ServeProcess};

#[test]
fn probe_says_which_path_each_buffer_of_a_peer_gets_and_why() {
    let serve = ServeProcess::start(4096);
    let output = std::process::Command::new(ferry_bin())
        .args(["probe", "--peer", &serve.name])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    let peer_line = text
        .lines()
        .find(|line| line.starts_with(&format!("peer {}:", serve.name)))
        .unwrap_or_else(|| panic!("no peer line in:\n{text}"));
    assert!(
        peer_line.contains("another process on this host"),
        "{peer_line}"
    );
    let buffer_line = text
        .lines()
        .find(|line| line.contains(&format!("buffer {:#x}", serve.buffer_addr)))
        .unwrap_or_else(|| panic!("no line for the peer's buffer in:\n{text}"));
    // Host memory on both sides: TCP carries it, and nvlink says why it does not.
    assert!(buffer_line.contains("): tcp ["), "{buffer_line}");
    assert!(buffer_line.contains("nvlink: "), "{buffer_line}");
}
