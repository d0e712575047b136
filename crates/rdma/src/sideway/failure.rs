//! sideway's errors to [`VerbsError`]: the operating-system error of each call, read where
//! sideway keeps it, mapped to the variant that names the fault, else
//! [`VerbsError::Failed`] with the call and the whole error chain.

use std::error::Error;
use std::io;

use crate::error::VerbsError;

/// The Linux errno values the mapping looks at. Verbs is Linux-only, and `std::io::ErrorKind`
/// has no kind for some of them (`EFAULT`).
pub(super) mod errno {
    pub(in crate::sideway) const EIO: i32 = 5;
    pub(in crate::sideway) const ENOMEM: i32 = 12;
    pub(in crate::sideway) const EFAULT: i32 = 14;
    pub(in crate::sideway) const ENODEV: i32 = 19;
    pub(in crate::sideway) const EINVAL: i32 = 22;
    pub(in crate::sideway) const ENOSYS: i32 = 38;
    pub(in crate::sideway) const EOPNOTSUPP: i32 = 95;
}

/// What `VerbsError::Unsupported::what` says when this host has no usable RDMA.
pub(super) const RDMA: &str = "RDMA";

/// Why this host has no usable RDMA, and what would give it some, from the error of
/// `ibv_get_device_list` (`None`: the list was empty).
///
/// rdma-core is loaded at run time (sideway's rdma-mummy-sys `dlopen`s `libibverbs.so.1`), so
/// a binary built with RDMA support runs everywhere; without the library every verbs call
/// fails with `EOPNOTSUPP`. With the library but no kernel support (no `ib_uverbs`, or a
/// container without `/dev/infiniband`) the list fails with `ENOSYS`.
pub(super) fn unavailable(error: Option<&io::Error>) -> VerbsError {
    let reason = match error.map(io::Error::raw_os_error) {
        Some(Some(errno::EOPNOTSUPP)) => {
            "rdma-core's libibverbs (libibverbs.so.1) is not installed: install rdma-core's \
             libibverbs1 and ibverbs-providers packages (Debian and Ubuntu; rdma-core and \
             libibverbs on RHEL)"
                .to_owned()
        }
        Some(Some(errno::ENOSYS)) => {
            "rdma-core is installed but the kernel offers no RDMA: load the ib_uverbs module and \
             the NIC's driver (mlx5_ib), and in a container pass /dev/infiniband in \
             (--device /dev/infiniband)"
                .to_owned()
        }
        Some(_) => format!(
            "rdma-core cannot list RDMA devices ({}): check that rdma-core's libibverbs1 and \
             ibverbs-providers are installed, that ib_uverbs is loaded, and in a container that \
             /dev/infiniband is passed in",
            error.map_or_else(String::new, io::Error::to_string)
        ),
        None => "rdma-core found no RDMA device: load the NIC's kernel driver (mlx5_ib) and \
                 ib_uverbs, install ibverbs-providers (the user-space driver), and in a \
                 container pass /dev/infiniband in (--device /dev/infiniband)"
            .to_owned(),
    };
    VerbsError::Unsupported {
        what: RDMA.to_owned(),
        reason,
    }
}

/// The error and its sources, joined with ": " (sideway's outer errors only name the call).
pub(super) fn chain(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // thiserror's transparent wrappers repeat their inner error's text.
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// [`VerbsError::Failed`] for `call`, with the error chain as its message.
pub(super) fn failed(call: &'static str, error: &dyn Error) -> VerbsError {
    VerbsError::Failed {
        call,
        message: chain(error),
    }
}

/// The operating-system error `call` returned on `device`, as the variant that names it:
/// `ENODEV`/`EIO` (the device was removed or failed) is [`VerbsError::DeviceGone`],
/// `EOPNOTSUPP`/`ENOSYS` (the provider does not implement the call) is
/// [`VerbsError::Unsupported`]; anything else is [`VerbsError::Failed`].
pub(super) fn os(call: &'static str, device: &str, error: &io::Error) -> VerbsError {
    match error.raw_os_error() {
        Some(errno::ENODEV | errno::EIO) => VerbsError::DeviceGone {
            device: device.to_owned(),
        },
        Some(errno::EOPNOTSUPP | errno::ENOSYS) => VerbsError::Unsupported {
            what: call.to_owned(),
            reason: format!(
                "the driver of RDMA device {device:?} does not implement it ({error}); use \
                 another device or a newer rdma-core"
            ),
        },
        _ => failed(call, error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(error: VerbsError) -> String {
        match error {
            VerbsError::Unsupported { what, reason } => {
                assert_eq!(what, RDMA);
                reason
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }

    #[test]
    fn without_libibverbs_the_reason_says_which_packages_to_install() {
        let text = reason(unavailable(Some(&io::Error::from_raw_os_error(95))));
        assert!(text.contains("rdma-core"), "{text}");
        assert!(text.contains("install"), "{text}");
        assert!(text.contains("libibverbs1"), "{text}");
        assert!(text.contains("ibverbs-providers"), "{text}");
    }

    #[test]
    fn without_kernel_support_the_reason_names_the_module_and_the_device_files() {
        let text = reason(unavailable(Some(&io::Error::from_raw_os_error(38))));
        assert!(text.contains("rdma-core is installed"), "{text}");
        assert!(text.contains("ib_uverbs"), "{text}");
        assert!(text.contains("/dev/infiniband"), "{text}");
    }

    #[test]
    fn an_empty_device_list_names_the_drivers_and_the_device_files() {
        let text = reason(unavailable(None));
        assert!(text.contains("no RDMA device"), "{text}");
        assert!(text.contains("ibverbs-providers"), "{text}");
        assert!(text.contains("/dev/infiniband"), "{text}");
    }

    #[test]
    fn another_list_error_is_quoted_with_every_remedy() {
        let text = reason(unavailable(Some(&io::Error::from_raw_os_error(13))));
        assert!(text.contains("os error 13"), "{text}");
        assert!(text.contains("libibverbs1"), "{text}");
        assert!(text.contains("/dev/infiniband"), "{text}");
    }

    #[test]
    fn os_errors_map_to_the_variant_that_names_them() {
        let gone = os("ibv_alloc_pd", "mlx5_0", &io::Error::from_raw_os_error(19));
        assert_eq!(
            gone,
            VerbsError::DeviceGone {
                device: "mlx5_0".into()
            }
        );
        let unsupported = os("ibv_alloc_pd", "mlx5_0", &io::Error::from_raw_os_error(95));
        assert!(
            matches!(unsupported, VerbsError::Unsupported { what, .. } if what == "ibv_alloc_pd")
        );
        let other = os("ibv_alloc_pd", "mlx5_0", &io::Error::from_raw_os_error(12));
        assert!(
            matches!(&other, VerbsError::Failed { call: "ibv_alloc_pd", message } if message.contains("os error 12")),
            "{other:?}"
        );
    }

    #[test]
    fn the_chain_keeps_every_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("failed to register memory region")]
        struct Outer(#[source] Inner);
        #[derive(Debug, thiserror::Error)]
        #[error(transparent)]
        struct Inner(io::Error);
        let error = Outer(Inner(io::Error::from_raw_os_error(14)));
        let text = chain(&error);
        assert!(
            text.starts_with("failed to register memory region: "),
            "{text}"
        );
        assert_eq!(text.matches("os error 14").count(), 1, "{text}");
    }
}
