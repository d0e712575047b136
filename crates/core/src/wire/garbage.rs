//! Arbitrary bytes into every decoder: each returns a value or an error, never panics, and
//! never accepts a body larger than its kind's limit.

use super::*;

/// A small deterministic generator, so a failure reproduces from its iteration number.
struct Bytes(u64);

impl Bytes {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn fill(&mut self, out: &mut [u8]) {
        for byte in out {
            *byte = self.next() as u8;
        }
    }
}

#[test]
fn random_headers_decode_within_limits_or_fail() {
    let limits = Limits::default();
    let mut bytes = Bytes(0x1234_5678);
    let mut accepted = 0;
    for iteration in 0..200_000 {
        let mut header = [0u8; HEADER_LEN];
        bytes.fill(&mut header);
        // Half the time make the prefix valid so the kind and length checks are reached.
        if iteration % 2 == 0 {
            header[..4].copy_from_slice(&MAGIC);
            header[4] = VERSION;
            header[5] = (bytes.next() % 11) as u8;
        }
        if let Ok(decoded) = Header::decode(&header, &limits) {
            accepted += 1;
            assert!(
                u64::from(decoded.len) <= limits.body_limit(decoded.kind),
                "iteration {iteration}"
            );
            assert_eq!(Header::decode(&decoded.encode(), &limits), Ok(decoded));
        }
    }
    assert!(
        accepted > 0,
        "some random headers must get through to the length check"
    );
}

#[test]
fn random_bodies_never_panic_a_decoder() {
    let mut bytes = Bytes(0x9abc_def0);
    for iteration in 0..50_000 {
        let len = (bytes.next() % 96) as usize;
        let mut body = vec![0u8; len];
        bytes.fill(&mut body);
        let _ = decode_hello(&body);
        let _ = decode_ack(&body);
        let _ = decode_read_request(&body);
        let data_len = bytes.next() % (1 << 20);
        if let Ok(entries) = decode_write_many_table(&body, data_len) {
            let total: u64 = entries.iter().map(|entry| u64::from(entry.len)).sum();
            assert_eq!(total, data_len, "iteration {iteration}");
        }
        if len >= 4 {
            let count: [u8; 4] = body[..4].try_into().unwrap_or_default();
            if let Ok(table_len) = decode_write_many_count(count, len as u32, 4096) {
                assert!(4 + table_len <= len, "iteration {iteration}");
            }
        }
    }
}
