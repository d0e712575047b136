//! What a peer of the same host can send an owner's staging session: a staged-copy request.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_nvlink::fuzzing::staging_request(data);
});
