//! Arbitrary bytes as one connection into a listener session: no panic, bounded memory, only
//! well-formed answers (ferry_core::fuzzing::session).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ferry_core::fuzzing::session(data);
});
