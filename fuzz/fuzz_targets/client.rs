//! A listener's answers, arbitrary bytes, fed to the caller's side of a connection waiting on
//! a fixed set of writes, reads and a notification (sealed or not, by the first byte): no
//! panic, bounded memory, each request answered at most once, no hang once the stream ends
//! (ferry_core::fuzzing::client).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ferry_core::fuzzing::client(data);
});
