//! What [`SidewayVerbs`] answers on this machine, through the real rdma-core loader.
//!
//! Where rdma-core is missing (CI, and the development machines), that is the
//! [`VerbsError::Unsupported`] answer naming the packages to install; where it is installed,
//! another reason or the devices. Each is a real outcome of the same code, and the test checks
//! the one this machine should give.

use std::io;
use std::path::Path;

use super::failure::{self, errno, RDMA};
use super::SidewayVerbs;
use crate::error::VerbsError;
use crate::verbs::Verbs;

/// Whether the dynamic loader can find `libibverbs.so.1` in the usual library directories.
fn libibverbs_installed() -> bool {
    [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/aarch64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .any(|dir| Path::new(dir).join("libibverbs.so.1").exists())
}

#[test]
fn rdma_is_unavailable_with_what_to_install_where_rdma_core_is_missing() {
    let answer = SidewayVerbs::new().and_then(|verbs| verbs.devices());
    if !libibverbs_installed() {
        // The exact answer: libibverbs could not be loaded, so every call says EOPNOTSUPP.
        let expected = failure::unavailable(Some(&io::Error::from_raw_os_error(errno::EOPNOTSUPP)));
        assert_eq!(answer, Err(expected.clone()));
        let message = expected.to_string();
        assert!(
            message.starts_with("RDMA is not supported here: "),
            "{message}"
        );
        assert!(message.contains("rdma-core"), "{message}");
        assert!(message.contains("install"), "{message}");
        assert!(message.contains("libibverbs1"), "{message}");
        assert!(message.contains("ibverbs-providers"), "{message}");
        return;
    }
    // rdma-core is here: no kernel support or no device is still "unavailable" with a reason
    // naming what to load; devices are listed otherwise.
    match answer {
        Err(VerbsError::Unsupported { what, reason }) => {
            assert_eq!(what, RDMA);
            assert!(reason.contains("rdma-core"), "{reason}");
            assert!(!reason.contains("not installed"), "{reason}");
            assert!(reason.contains("load"), "{reason}");
        }
        Ok(devices) => {
            assert!(!devices.is_empty(), "an empty list must be Unsupported");
            for device in devices {
                assert!(!device.name.is_empty(), "{device:?}");
            }
        }
        Err(other) => panic!("neither unavailable nor a device list: {other:?}"),
    }
}
