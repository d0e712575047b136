//! Arbitrary bytes as a descriptor from a store or a peer, parsed and its signature checked:
//! no panic, a stable JSON round trip, never a signature that checks out
//! (ferry_core::fuzzing::descriptor).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ferry_core::fuzzing::descriptor(data);
});
