//! The checks verbs makes on a call's arguments before it touches anything, shared by every
//! [`Verbs`](crate::Verbs) implementation so each names the fault the same way.

use crate::error::VerbsError;
use crate::memory::AccessFlags;

/// A registration's access flags and length, as `ibv_reg_mr` checks them.
///
/// # Errors
/// [`VerbsError::InvalidAccess`] for REMOTE_WRITE without LOCAL_WRITE,
/// [`VerbsError::InvalidSize`] for a zero length.
pub(crate) fn registration(access: AccessFlags, len: u64) -> Result<(), VerbsError> {
    if access.contains(AccessFlags::REMOTE_WRITE) && !access.contains(AccessFlags::LOCAL_WRITE) {
        return Err(VerbsError::InvalidAccess {
            access,
            remedy: "REMOTE_WRITE needs LOCAL_WRITE as well: add it",
        });
    }
    if len == 0 {
        return Err(VerbsError::InvalidSize {
            what: "region length",
            value: 0,
            remedy: "register at least one byte",
        });
    }
    Ok(())
}

/// The SG-list lengths of the work requests posted together to QP `qpn`, against its
/// `max` entries per request.
///
/// # Errors
/// [`VerbsError::TooManySge`] naming the first request over the limit.
pub(crate) fn sge_counts(
    qpn: u32,
    counts: impl Iterator<Item = usize>,
    max: u32,
) -> Result<(), VerbsError> {
    for (index, count) in counts.enumerate() {
        if count > max as usize {
            return Err(VerbsError::TooManySge {
                qpn,
                index,
                count,
                max,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_sg_entries_name_the_request() {
        assert_eq!(
            sge_counts(4, [1, 2, 3, 1].into_iter(), 2),
            Err(VerbsError::TooManySge {
                qpn: 4,
                index: 2,
                count: 3,
                max: 2
            })
        );
        assert_eq!(sge_counts(4, [0, 2].into_iter(), 2), Ok(()));
    }

    #[test]
    fn remote_write_needs_local_write_and_a_length() {
        assert!(matches!(
            registration(AccessFlags::REMOTE_WRITE, 8),
            Err(VerbsError::InvalidAccess { .. })
        ));
        assert!(matches!(
            registration(AccessFlags::LOCAL_WRITE, 0),
            Err(VerbsError::InvalidSize { value: 0, .. })
        ));
        assert_eq!(
            registration(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE, 8),
            Ok(())
        );
    }
}
