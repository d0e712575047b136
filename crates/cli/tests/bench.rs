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
    assert!(!stderr.contains("serve process"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30));
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
