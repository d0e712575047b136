//! The GEMM on a real GPU: every element of C against a CPU reference, and a measured rate.
//! Needs a GPU; fails without one.

use super::{Gemm, GEMM_TILE};
use ferry_core::cuda::Context;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// Element `(row, col)` of A * B, summed in fp32 as exactly as the GPU must (every partial
/// sum is a small integer).
fn reference(n: usize, row: usize, col: usize) -> f32 {
    (0..n)
        .map(|k| Gemm::a_value(row, k) * Gemm::b_value(k, col))
        .sum()
}

#[test]
fn a_gemm_of_256_matches_the_cpu_reference_in_every_element() {
    let n = 2 * GEMM_TILE;
    let gemm = Gemm::new(Context::get(0).expect("GPU 0"), n).expect("a GEMM on GPU 0");
    gemm.multiply().expect("one multiplication");
    let c = gemm.result().expect("C read back");
    assert_eq!(c.len(), n * n);
    for (index, &got) in c.iter().enumerate() {
        let (row, col) = (index / n, index % n);
        let want = reference(n, row, col);
        assert_eq!(got, want, "first bad element: C[{row}][{col}]");
    }
}

#[test]
fn the_rate_over_a_window_is_positive_and_stops_when_told() {
    let gemm = Gemm::new(Context::get(0).expect("GPU 0"), 4096).expect("a GEMM on GPU 0");
    let alone = gemm
        .rate_for(Duration::from_millis(200))
        .expect("a timed window");
    assert!(alone.multiplications > 0, "{alone:?}");
    assert!(
        alone.per_second() > 0.0 && alone.tflops() > 0.0,
        "{alone:?}"
    );
    let stop = AtomicBool::new(false);
    let (opened, open) = mpsc::channel();
    let rate = std::thread::scope(|scope| {
        let running = scope.spawn(|| gemm.rate_until(&stop, move || opened.send(()).unwrap_or(())));
        open.recv_timeout(Duration::from_secs(10))
            .expect("the window opened");
        std::thread::sleep(Duration::from_millis(100));
        stop.store(true, Ordering::Release);
        running.join().expect("the GEMM thread")
    })
    .expect("a window until stopped");
    assert!(rate.per_second() > 0.0, "{rate:?}");
    println!(
        "n = 4096: {:.1} TFLOP/s over 200 ms, {:.1} TFLOP/s until stopped",
        alone.tflops(),
        rate.tflops()
    );
}
