//! The binary's log lines: plain text, without colour codes, when stderr is not a terminal.

mod common;

use common::ferry_bin;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[test]
fn logs_written_to_a_pipe_carry_no_colour_codes() {
    let mut child = Command::new(ferry_bin())
        .args(["serve", "--bytes", "4096"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ferry serve starts");
    let stderr = child.stderr.take().expect("stderr is piped");
    let mut logged = String::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.expect("utf-8 log line");
        logged.push_str(&line);
        logged.push('\n');
        if line.contains("listening") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(logged.contains("INFO"), "no log line at info: {logged:?}");
    assert!(logged.contains("listening"), "{logged:?}");
    assert!(!logged.contains('\u{1b}'), "colour codes in {logged:?}");
}
