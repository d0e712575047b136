//! The fuzz target's narrow way in: compiled only for `cargo fuzz` (`--cfg fuzzing`) and for
//! this crate's tests, which replay the committed seeds through the same function.

use crate::fd_passing::fuzz_stage_request;
use crate::messages::fuzz_message_ring;

/// Reads `data` as a peer could leave it: the words of a message ring (reader and writer
/// facing them) and a stream of verdicts. Checks that every record taken fits its bound and
/// every verdict read back encodes to itself, and returns how many records and verdicts were
/// accepted. Panics on a decoder that panics or disagrees.
pub fn message_ring(data: &[u8]) -> usize {
    fuzz_message_ring(data)
}

/// Reads `data` as a staged-copy request an owner's staging session takes from a peer: every
/// request read whole must write back as itself. Returns how many entries were accepted.
/// Panics on a decoder that panics or disagrees.
pub fn staging_request(data: &[u8]) -> usize {
    fuzz_stage_request(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_staging_seeds_decode_without_panicking_and_some_are_accepted() {
        let dir = ferry_core::corpus::fuzz_corpus(env!("CARGO_MANIFEST_DIR"), "nvlink")
            .join("staging_request");
        let mut accepted = 0;
        let mut seeds = 0;
        for entry in std::fs::read_dir(&dir).expect("the seed directory") {
            let bytes = std::fs::read(entry.expect("a seed").path()).expect("a seed's bytes");
            accepted += staging_request(&bytes);
            seeds += 1;
        }
        assert!(seeds >= 3, "{seeds} seeds in {}", dir.display());
        assert!(
            accepted >= 3,
            "only {accepted} entries accepted from the seeds"
        );
    }

    #[test]
    fn the_committed_seeds_decode_without_panicking_and_some_are_accepted() {
        let dir = ferry_core::corpus::fuzz_corpus(env!("CARGO_MANIFEST_DIR"), "nvlink")
            .join("message_ring");
        let mut accepted = 0;
        let mut seeds = 0;
        for entry in std::fs::read_dir(&dir).expect("the seed directory") {
            let bytes = std::fs::read(entry.expect("a seed").path()).expect("a seed's bytes");
            accepted += message_ring(&bytes);
            seeds += 1;
        }
        assert!(seeds >= 3, "{seeds} seeds in {}", dir.display());
        assert!(
            accepted >= 3,
            "only {accepted} records and verdicts accepted the seeds"
        );
    }
}
