//! The check `ferry bench` makes before it starts anything: every GPU it was asked for is one
//! this process sees, so a machine without them gets one clear message instead of a CUDA
//! error from a child process.

use ferry::cuda::Driver;

/// `ferry bench` was asked for GPUs this process does not see.
#[derive(Debug, thiserror::Error)]
#[error(
    "ferry bench needs CUDA GPUs ({wanted}) but found {found} ({status}); run it on a machine \
     with NVIDIA GPUs and their driver, or pick GPUs this process sees with \
     --prefill-gpu/--decode-gpu (--prefill-gpus/--decode-gpus) and CUDA_VISIBLE_DEVICES; \
     `ferry bench --host` measures host memory over TCP with no GPU"
)]
pub(crate) struct MissingGpus {
    /// The ordinals asked for, as `GPU0, GPU1`.
    wanted: String,
    /// What this process sees, as `no GPUs` or `1 GPU (GPU0)`.
    found: String,
    /// What the CUDA driver probe said.
    status: String,
}

/// Succeeds when every ordinal in `wanted` names a GPU this process sees.
pub(crate) fn check(wanted: &[u32]) -> Result<(), MissingGpus> {
    let driver = Driver::get();
    // A driver that fails to list its GPUs lists none: the message then carries its status.
    let seen = driver.devices().map(|gpus| gpus.len()).unwrap_or(0);
    missing(wanted, seen, &driver.status().to_string())
}

/// The error for `wanted` when `seen` GPUs (ordinals `0..seen`) are visible, if any is missing.
fn missing(wanted: &[u32], seen: usize, status: &str) -> Result<(), MissingGpus> {
    if wanted.iter().all(|&ordinal| (ordinal as usize) < seen) {
        return Ok(());
    }
    let mut ordinals = wanted.to_vec();
    ordinals.sort_unstable();
    ordinals.dedup();
    let found = match seen {
        0 => "no GPUs".to_owned(),
        1 => "1 GPU (GPU0)".to_owned(),
        n => format!("{n} GPUs ({})", names(0..n as u32)),
    };
    Err(MissingGpus {
        wanted: names(ordinals),
        found,
        status: status.to_owned(),
    })
}

/// `GPU0, GPU1` for ordinals 0 and 1.
fn names(ordinals: impl IntoIterator<Item = u32>) -> String {
    ordinals
        .into_iter()
        .map(|ordinal| format!("GPU{ordinal}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::missing;

    #[test]
    fn gpus_that_are_all_seen_pass() {
        assert!(missing(&[0, 1], 2, "CUDA driver ready, 2 GPU(s)").is_ok());
        assert!(missing(&[0, 0, 0], 1, "CUDA driver ready, 1 GPU(s)").is_ok());
    }

    #[test]
    fn no_gpus_names_what_was_wanted_and_what_the_driver_said() {
        let error = missing(&[0, 1], 0, "no CUDA driver library (libcuda) found")
            .expect_err("no GPUs cannot run the bench")
            .to_string();
        assert!(
            error.starts_with(
                "ferry bench needs CUDA GPUs (GPU0, GPU1) but found no GPUs \
                 (no CUDA driver library (libcuda) found)"
            ),
            "{error}"
        );
        assert!(error.contains("--prefill-gpu/--decode-gpu"), "{error}");
    }

    #[test]
    fn a_missing_second_gpu_lists_the_ones_seen() {
        let error = missing(&[1, 0, 1], 1, "CUDA driver ready, 1 GPU(s)")
            .expect_err("GPU1 is missing")
            .to_string();
        assert!(
            error.contains("(GPU0, GPU1) but found 1 GPU (GPU0)"),
            "{error}"
        );
    }
}
