//! Everything an RDMA peer sends: the side channel's request and answer, a buffer's export.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_rdma::fuzzing::peer_input(data);
});
