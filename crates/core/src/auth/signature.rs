//! Descriptors signed with the shared secret: an engine with a secret signs the descriptor it
//! publishes and serves, and refuses one whose signature does not match, so a process that can
//! write the metadata store (or answer in an engine's place) cannot point a peer at other
//! memory or hand it another engine's GPU handles.

use super::Secret;
use crate::descriptor::SegmentDescriptor;
use hmac::Mac;

/// Keeps a descriptor's MAC apart from every other MAC made with the secret.
const LABEL: &[u8] = b"ferry-descriptor-v1";

/// `descriptor` without its signature, and the MAC of that.
fn unsigned_and_mac(
    descriptor: &SegmentDescriptor,
    secret: &Secret,
) -> (SegmentDescriptor, hmac::Hmac<sha2::Sha256>) {
    let unsigned = SegmentDescriptor {
        signature: None,
        ..descriptor.clone()
    };
    let mac = secret
        .mac()
        .chain_update(LABEL)
        .chain_update(unsigned.to_json());
    (unsigned, mac)
}

/// `descriptor` signed with `secret` (an older signature replaced), as an engine with that
/// secret publishes and serves it; for tools that write descriptors into a store themselves.
pub fn sign_descriptor(descriptor: &SegmentDescriptor, secret: &Secret) -> SegmentDescriptor {
    let (unsigned, mac) = unsigned_and_mac(descriptor, secret);
    SegmentDescriptor {
        signature: Some(hex::encode(mac.finalize().into_bytes())),
        ..unsigned
    }
}

/// Why `descriptor` is not signed with `secret`, if it is not (compared in constant time).
pub(crate) fn check(descriptor: &SegmentDescriptor, secret: &Secret) -> Result<(), &'static str> {
    let Some(signature) = &descriptor.signature else {
        return Err("carries no signature (its engine has no shared secret)");
    };
    let Ok(bytes) = hex::decode(signature) else {
        return Err("carries a signature that is not hex");
    };
    unsigned_and_mac(descriptor, secret)
        .1
        .verify_slice(&bytes)
        .map_err(|_| "carries a signature that does not match this engine's secret (it was altered or forged, or its engine has another secret)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{BufferDescriptor, HostIdentity, DESCRIPTOR_VERSION};
    use crate::memory::Location;
    use crate::InstanceId;

    fn descriptor() -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "127.0.0.1:7000".into(),
            host: HostIdentity::current(),
            generation: 2,
            instance: InstanceId::from_u128(5),
            process: InstanceId::from_u128(6),
            pid: 9,
            endpoints: Vec::new(),
            gpus: Vec::new(),
            buffers: vec![BufferDescriptor {
                addr: 0x7000_0000,
                len: 1 << 20,
                location: Location::Host { pinned: false },
                name: None,
                exports: Vec::new(),
            }],
            signature: None,
        }
    }

    #[test]
    fn a_signed_descriptor_checks_out_through_json_and_any_change_is_refused() {
        let secret = Secret::new(b"signature-test-secret-0123456789".to_vec()).unwrap();
        let signed = sign_descriptor(&descriptor(), &secret);
        let parsed = SegmentDescriptor::from_json("key", &signed.to_json()).unwrap();
        assert_eq!(check(&parsed, &secret), Ok(()));

        let mut rotated = parsed.clone();
        rotated.buffers[0].addr += 4096;
        assert!(check(&rotated, &secret).is_err_and(|why| why.contains("does not match")));
        let other = Secret::new(b"another-secret-for-this-test-987".to_vec()).unwrap();
        assert!(check(&parsed, &other).is_err_and(|why| why.contains("does not match")));
        assert!(check(&descriptor(), &secret).is_err_and(|why| why.contains("no signature")));
        let garbled = SegmentDescriptor {
            signature: Some("zz".into()),
            ..parsed
        };
        assert!(check(&garbled, &secret).is_err_and(|why| why.contains("not hex")));
    }
}
