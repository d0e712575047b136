//! The fuzz target's narrow way in: compiled only for `cargo fuzz` (`--cfg fuzzing`) and for
//! this crate's tests, which replay the committed seeds through the same function.

use crate::transport::fuzz_peer_input;

/// Feeds `data` to every decoder of what an RDMA peer sends (the side channel's request and
/// answer, a buffer's export), checks that whatever decodes encodes back to the same value,
/// and returns how many decoders accepted it. Panics on a decoder that panics or disagrees.
pub fn peer_input(data: &[u8]) -> usize {
    fuzz_peer_input(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_seeds_decode_without_panicking_and_some_are_accepted() {
        let dir =
            ferry_core::corpus::fuzz_corpus(env!("CARGO_MANIFEST_DIR"), "rdma").join("peer_input");
        let mut accepted = 0;
        let mut seeds = 0;
        for entry in std::fs::read_dir(&dir).expect("the seed directory") {
            let bytes = std::fs::read(entry.expect("a seed").path()).expect("a seed's bytes");
            accepted += peer_input(&bytes);
            seeds += 1;
        }
        assert!(seeds >= 3, "{seeds} seeds in {}", dir.display());
        assert!(accepted >= 3, "only {accepted} decodes accepted the seeds");
    }
}
