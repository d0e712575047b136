//! Mooncake's batch ids: transfers started by the `*_async` calls, kept until their end is
//! reported, and the status codes Mooncake returns for them.

use crate::compat::moving::Moving;
use crate::compat::session::WAIT_SPIN;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Status codes of `transfer_check_status`, as Mooncake returns them.
pub(crate) const DONE: i32 = 1;
/// Still moving.
pub(crate) const PENDING: i32 = 0;
/// Failed, or an id this engine never gave out.
pub(crate) const FAILED: i32 = -1;
/// Did not finish within the transfer timeout.
pub(crate) const TIMED_OUT: i32 = -2;

/// The transfers behind the batch ids handed out; ids start at 1 (0 is Mooncake's failure).
pub(crate) struct Batches {
    transfers: Mutex<HashMap<u64, Moving>>,
    next: AtomicU64,
}

impl Default for Batches {
    fn default() -> Self {
        Batches {
            transfers: Mutex::default(),
            next: AtomicU64::new(1),
        }
    }
}

impl Batches {
    /// Keeps `transfer` under a new batch id.
    pub(crate) fn track(&self, transfer: Moving) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.transfers.lock().insert(id, transfer);
        id
    }

    /// Where batch `id` stands; a finished batch is forgotten once its end is reported.
    pub(crate) fn status(&self, id: u64) -> i32 {
        let mut transfers = self.transfers.lock();
        let Some(transfer) = transfers.get_mut(&id) else {
            return FAILED;
        };
        let Some(outcome) = transfer.try_outcome() else {
            return PENDING;
        };
        transfers.remove(&id);
        code_of(outcome)
    }

    /// Waits for every batch of `ids`: `0` when all moved, `-1` when any failed, timed out
    /// or is unknown. The ids are forgotten.
    pub(crate) fn wait_all(&self, ids: &[u64]) -> i32 {
        let transfers: Vec<Option<Moving>> = {
            let mut tracked = self.transfers.lock();
            ids.iter().map(|id| tracked.remove(id)).collect()
        };
        let mut code = 0;
        for transfer in transfers {
            let moved =
                transfer.is_some_and(|transfer| code_of(transfer.wait_spinning(WAIT_SPIN)) == DONE);
            if !moved {
                code = FAILED;
            }
        }
        code
    }
}

/// Mooncake's code for how a transfer ended.
pub(crate) fn code_of(outcome: ferry::Result<ferry::Completion>) -> i32 {
    match outcome {
        Ok(_) => DONE,
        Err(ferry::Error::Timeout { .. }) => TIMED_OUT,
        Err(error) => {
            tracing::error!("transfer failed: {error}");
            FAILED
        }
    }
}
