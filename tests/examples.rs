//! The `prefill` and `decode` examples as processes, against a stranger without the secret
//! they do not use here: junk notifications do not stop the decode side, and a forged verdict
//! does not pass for the decode side's answer.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// An example binary: in `FERRY_EXAMPLES` when set (the GPU runner points it at the folder it
/// copied them to), else where cargo built it beside this test
/// (`target/<profile>/examples/NAME`).
fn example(name: &str) -> Command {
    let folder = match std::env::var_os("FERRY_EXAMPLES") {
        Some(folder) => std::path::PathBuf::from(folder),
        None => std::env::current_exe()
            .expect("the test's own path")
            .parent()
            .and_then(|deps| deps.parent())
            .expect("target/<profile>/deps")
            .join("examples"),
    };
    Command::new(folder.join(name))
}

/// Starts `command` with stdout piped and returns it with its `segment: NAME` line's name.
fn started(mut command: Command) -> (Child, String, impl Iterator<Item = String>) {
    let mut child = command
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the example starts (cargo test builds examples)");
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let first = lines.next().expect("a first line").expect("utf-8");
    let name = first
        .strip_prefix("segment: ")
        .unwrap_or_else(|| panic!("not a segment line: {first}"))
        .to_owned();
    (child, name, lines.map_while(Result::ok))
}

const SHAPE: [&str; 8] = [
    "--layers",
    "2",
    "--pool-blocks",
    "64",
    "--request-blocks",
    "16",
    "--block-bytes",
    "4096",
];

#[test]
fn junk_notifications_and_forged_verdicts_do_not_derail_prefill_and_decode() {
    let mut decode = example("decode");
    decode.args(SHAPE).args(["--requests", "2"]);
    let (decode, decode_name, decode_lines) = started(decode);

    // A stranger reaches the decode port first: junk, an announcement of blocks outside the
    // pool, and text meant to pass for a line of the decode's output.
    let stranger = ferry::builder()
        .transfer_timeout(Duration::from_secs(10))
        .build_blocking()
        .unwrap();
    let at_decode = stranger.connect_blocking(&decode_name).unwrap();
    for junk in [
        &b"junk"[..],
        b"kv request=0 token=00 blocks=999999",
        b"kv request=1 blocks=1,2",
        b"\nverified: true",
    ] {
        stranger.notify_blocking(&at_decode, junk.to_vec()).unwrap();
    }

    let mut prefill = example("prefill");
    prefill
        .args(SHAPE)
        .args(["--requests", "2", "--peer", &decode_name]);
    let (prefill, prefill_name, prefill_lines) = started(prefill);
    // The stranger tells the prefill side that the decode side found request 0 bad (and
    // request 1 good); no real answer can come before the decode side learns whom to answer.
    let at_prefill = stranger.connect_blocking(&prefill_name).unwrap();
    for forged in [
        &b"kv verified request=0 token=0000000000000000 bad"[..],
        b"kv verified request=0 bad",
        b"kv verified request=1 token=0000000000000000 ok",
    ] {
        stranger
            .notify_blocking(&at_prefill, forged.to_vec())
            .unwrap();
    }

    // Then the decode side is told whom to answer: only that engine, never a claimed sender.
    let mut decode = decode;
    {
        use std::io::Write;
        let mut input = decode.stdin.take().expect("piped");
        writeln!(input, "reply-to {prefill_name}").unwrap();
    }
    let prefill_lines: Vec<String> = prefill_lines.collect();
    assert_eq!(
        prefill_lines
            .iter()
            .filter(|line| line.starts_with("request "))
            .count(),
        2,
        "{prefill_lines:?}"
    );
    let prefill = prefill.wait_with_output().unwrap();
    let prefill_log = String::from_utf8_lossy(&prefill.stderr);
    assert!(prefill.status.success(), "prefill failed: {prefill_log}");
    let decode_lines: Vec<String> = decode_lines.collect();
    let decode = decode.wait_with_output().unwrap();
    let decode_log = String::from_utf8_lossy(&decode.stderr);
    assert!(decode.status.success(), "decode failed: {decode_log}");
    assert_eq!(
        decode_lines.last().map(String::as_str),
        Some("verified: true"),
        "{decode_lines:?}"
    );
    assert_eq!(
        decode_lines
            .iter()
            .filter(|line| line.starts_with("verified"))
            .count(),
        1,
        "{decode_lines:?}"
    );
    assert_eq!(
        decode_log
            .matches("ignoring a notification that is not a request")
            .count(),
        4,
        "{decode_log}"
    );
    assert!(
        prefill_log.contains("ignoring a notification that is not the awaited answer"),
        "{prefill_log}"
    );
}
