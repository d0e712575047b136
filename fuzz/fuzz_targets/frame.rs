//! One frame: decoded, encoded again, and the two compared (ferry_core::fuzzing::frame).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ferry_core::fuzzing::frame(data);
});
