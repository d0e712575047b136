//! `ferry bench` refuses at once, naming what it needs and what it found, when the GPUs it was
//! asked for are not there: before it starts a child process or touches CUDA.

mod common;

use common::ferry_bin;
use std::time::{Duration, Instant};

/// GPU ordinal no machine has, so the test behaves the same with and without GPUs.
const ABSENT_GPU: &str = "4096";

#[test]
fn a_bench_on_gpus_this_machine_lacks_fails_at_once_saying_it_needs_them() {
    let started = Instant::now();
    let output = std::process::Command::new(ferry_bin())
        .args(["bench", "--decode-gpu", ABSENT_GPU, "--iterations", "1"])
        .env("RUST_LOG", "info")
        .output()
        .expect("ferry bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("error: ferry bench needs CUDA GPUs (GPU0, GPU4096) but found "),
        "{stderr}"
    );
    assert!(stderr.contains("`ferry bench --host`"), "{stderr}");
    assert!(!stderr.contains("serve process"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// `ferry bench --host` of 256 blocks of 4 KiB, two rounds a row, with `extra` arguments:
/// its stdout, once it succeeded.
fn host_bench(extra: &[&std::ffi::OsStr]) -> String {
    let output = std::process::Command::new(ferry_bin())
        .args([
            "bench",
            "--host",
            "--block-bytes",
            "4096",
            "--blocks",
            "256",
            "--iterations",
            "2",
        ])
        .args(extra)
        .output()
        .expect("ferry bench runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{stdout}\n{stderr}");
    stdout.into_owned()
}

#[test]
fn a_bench_of_host_memory_needs_no_gpu_and_verifies_every_row() {
    let stdout = host_bench(&[]);
    assert!(
        stdout.contains("memcpy (host memory, 1 GiB, one process, same run)"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|line| line.starts_with("blocks-"))
        .collect();
    assert_eq!(rows.len(), 2, "a write and a read row: {stdout}");
    for row in rows {
        assert!(row.contains(" tcp "), "{row}");
        assert!(row.trim_end().ends_with("yes"), "{row}");
    }
}

#[test]
fn requests_that_carry_a_notification_are_timed_until_the_peer_took_it_and_verified() {
    let json = std::env::temp_dir().join(format!("ferry-bench-notify-{}.json", std::process::id()));
    let stdout = host_bench(&[
        "--notify-requests".as_ref(),
        "--json".as_ref(),
        json.as_os_str(),
    ]);
    assert!(
        stdout.contains("each request of the bandwidth rows carries a notification"),
        "{stdout}"
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON report")).expect("JSON");
    let _ = std::fs::remove_file(&json);
    assert_eq!(report["notify_requests"], true, "{report}");
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "a write and a read row: {report}");
    for row in rows {
        assert_eq!(row["verified"], true, "{row}");
        assert!(row["gbps"].as_f64().is_some_and(|gbps| gbps > 0.0), "{row}");
    }
}

#[test]
fn the_multi_pair_bench_checks_every_gpu_it_lists() {
    let output = std::process::Command::new(ferry_bin())
        .args(["bench", "--prefill-gpus", "0,0", "--decode-gpus"])
        .arg(format!("1,{ABSENT_GPU}"))
        .output()
        .expect("ferry bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("ferry bench needs CUDA GPUs (GPU0, GPU1, GPU4096) but found "),
        "{stderr}"
    );
}

/// What `ferry probe` says about RDMA with this binary: whether it was built with RDMA, and
/// why there is none here (`None` when it lists devices).
fn probed_rdma() -> (bool, Option<String>) {
    let output = std::process::Command::new(ferry_bin())
        .arg("probe")
        .env("RUST_LOG", "warn")
        .output()
        .expect("ferry probe runs");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    let Some(reason) = text.lines().find_map(|line| {
        line.strip_prefix("RDMA: unavailable: ")?
            .strip_suffix("; transfers between hosts use TCP")
    }) else {
        return (true, None);
    };
    let built = !reason.contains("rebuild with `--features rdma`");
    (built, Some(reason.to_owned()))
}

/// `ferry bench --rdma` refuses before it starts anything where it cannot run over RDMA: a
/// build without the `rdma` feature says how to get it, a host without RDMA gives the probe's
/// reason. Which of the two applies is read from `ferry probe` (`FERRY_BIN` may be another
/// build than these tests'), and where the probe lists devices the bench must get past the
/// RDMA check to the GPU check, so the test holds on every machine.
#[test]
fn a_bench_over_rdma_refuses_where_this_build_or_host_has_no_rdma() {
    let (built, unavailable) = probed_rdma();
    if std::env::var_os("FERRY_BIN").is_none() {
        assert_eq!(
            built,
            cfg!(feature = "rdma"),
            "ferry probe: {unavailable:?}"
        );
    }
    let started = Instant::now();
    let output = std::process::Command::new(ferry_bin())
        .args([
            "bench",
            "--rdma",
            "--decode-gpu",
            ABSENT_GPU,
            "--iterations",
            "1",
        ])
        .output()
        .expect("ferry bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    match (built, unavailable) {
        (false, _) => assert!(
            stderr.contains(
                "error: this ferry was built without RDMA: rebuild with `--features rdma`"
            ),
            "{stderr}"
        ),
        (true, Some(reason)) => {
            assert!(
                stderr
                    .contains("error: ferry bench --rdma needs RDMA, which is unavailable here: "),
                "{stderr}"
            );
            assert!(
                stderr.contains(&reason),
                "not the probe's reason {reason:?}: {stderr}"
            );
        }
        (true, None) => assert!(stderr.contains("ferry bench needs CUDA GPUs"), "{stderr}"),
    }
    assert!(!stderr.contains("serve process"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn rdma_and_tcp_are_one_transport_each_and_do_not_combine() {
    let output = std::process::Command::new(ferry_bin())
        .args(["bench", "--rdma", "--tcp"])
        .output()
        .expect("ferry bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}
