//! The batches of one call of the address-based APIs, moving: a long list of entries is
//! submitted in parts, so the first part's bytes move while the next parts are planned,
//! and the call ends when every part ended.

use ferry::{Completion, Transfer};
use futures::FutureExt;
use std::time::Duration;

/// The parts of one call's transfer, and the outcome of those that ended.
pub(crate) struct Moving {
    /// Parts still moving (`None` once ended).
    parts: Vec<Option<Transfer>>,
    /// What the ended parts add up to; the first failure, once one failed.
    ended: ferry::Result<Completion>,
}

impl Moving {
    /// The parts of one call, in submission order.
    pub(crate) fn new(parts: Vec<Transfer>) -> Moving {
        Moving {
            parts: parts.into_iter().map(Some).collect(),
            ended: Ok(Completion {
                bytes: 0,
                transports: Vec::new(),
                elapsed: Duration::ZERO,
            }),
        }
    }

    /// Folds one part's outcome in: bytes add up, transports join, the longest time counts,
    /// and the first failure is the outcome.
    fn fold(&mut self, outcome: ferry::Result<Completion>) {
        let (Ok(total), Ok(part)) = (&mut self.ended, outcome.as_ref()) else {
            if self.ended.is_ok() {
                self.ended = outcome;
            }
            return;
        };
        total.bytes += part.bytes;
        for transport in &part.transports {
            if !total.transports.contains(transport) {
                total.transports.push(transport);
            }
        }
        total.elapsed = total.elapsed.max(part.elapsed);
    }

    /// The outcome once every part ended, without waiting; `None` while one still moves.
    pub(crate) fn try_outcome(&mut self) -> Option<ferry::Result<Completion>> {
        self.settle(|part| part.now_or_never())
    }

    /// Waits for every part until `deadline`, each first by looking for its end for up to
    /// `spin` as [`Transfer::wait_until`] does; `None` when the deadline passed first (the
    /// parts that ended are kept, and a later call waits for the rest).
    pub(crate) fn wait_until(
        &mut self,
        spin: Duration,
        deadline: std::time::Instant,
    ) -> Option<ferry::Result<Completion>> {
        self.settle(|part| part.wait_until(spin, deadline))
    }

    /// Folds in each part that `ended` reports ended, in order; the outcome once all have,
    /// `None` at the first that has not (the ones before it stay folded in).
    fn settle(
        &mut self,
        mut ended: impl FnMut(&mut Transfer) -> Option<ferry::Result<Completion>>,
    ) -> Option<ferry::Result<Completion>> {
        for index in 0..self.parts.len() {
            let Some(part) = self.parts[index].as_mut() else {
                continue;
            };
            let outcome = ended(part)?;
            self.parts[index] = None;
            self.fold(outcome);
        }
        Some(std::mem::replace(
            &mut self.ended,
            Err(ferry::Error::ApiMisuse(
                "the outcome of this transfer was already reported".into(),
            )),
        ))
    }

    /// Waits for every part, each first by looking for its end for up to `spin` as
    /// [`Transfer::wait_spinning`] does.
    pub(crate) fn wait_spinning(mut self, spin: Duration) -> ferry::Result<Completion> {
        for part in std::mem::take(&mut self.parts).into_iter().flatten() {
            let outcome = part.wait_spinning(spin);
            self.fold(outcome);
        }
        self.ended
    }
}
