//! Where the committed fuzz corpora are, for the tests that replay them: beside the test
//! binary when it was copied elsewhere (as to the GPU machine), else in the source tree it was
//! built from. Not part of the API.

use std::path::{Path, PathBuf};

/// The folder of `krate`'s committed fuzz corpora (`crates/<krate>/tests/data/fuzz`):
/// `fuzz-data/<krate>` beside the running test binary when there is one, else that folder
/// under `manifest_dir` (the crate's `CARGO_MANIFEST_DIR` when it was built).
///
/// # Panics
/// When neither exists, naming both and what to copy where: a replay that finds no corpus
/// must fail, not pass having replayed nothing.
pub fn fuzz_corpus(manifest_dir: &str, krate: &str) -> PathBuf {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("fuzz-data").join(krate)));
    let built = Path::new(manifest_dir).join("tests/data/fuzz");
    match beside {
        Some(beside) if beside.is_dir() => beside,
        _ if built.is_dir() => built,
        beside => panic!(
            "the {krate} fuzz corpus is neither beside the test binary ({}) nor where it was built ({}): copy crates/{krate}/tests/data/fuzz to the first",
            beside.map_or_else(|| "unknown".into(), |path| path.display().to_string()),
            built.display()
        ),
    }
}
