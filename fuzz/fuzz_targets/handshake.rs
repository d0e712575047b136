//! Arbitrary bytes as the other side of an authentication handshake, this side a client or a
//! server with or without the secret: no panic, never more than a message wanted, never a
//! success (ferry_core::fuzzing::handshake).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ferry_core::fuzzing::handshake(data);
});
