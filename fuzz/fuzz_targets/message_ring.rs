//! What a peer of the same host can leave in a message ring's shared words, and the verdicts
//! a ring's reader sends back.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_nvlink::fuzzing::message_ring(data);
});
