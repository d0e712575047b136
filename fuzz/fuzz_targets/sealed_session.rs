//! Arbitrary bytes as one connection into a sealed listener session (frames tagged with the
//! connection's keys): no panic, bounded memory, only well-formed and rightly tagged answers
//! (ferry_core::fuzzing::sealed_session).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ferry_core::fuzzing::sealed_session(data);
});
