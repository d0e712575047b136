//! Completion queues: creation and polling.

use ::sideway::ibverbs::completion::{CreateCompletionQueueErrorKind, PollCompletionQueueError};

use super::failure::{self, errno};
use super::handles::{SidewayContext, SidewayCq};
use super::raw::{self, RawCompletion};
use crate::error::VerbsError;
use crate::work::WorkCompletion;

/// Creates a basic CQ (`ibv_create_cq`) with room for `capacity` completions.
///
/// # Errors
/// [`VerbsError::InvalidSize`] for zero, for more than verbs' `int` holds, or when the device
/// refuses the size; others of [`failure::os`].
pub(super) fn create(context: &SidewayContext, capacity: u32) -> Result<SidewayCq, VerbsError> {
    let too_large = |value: u32| VerbsError::InvalidSize {
        what: "CQ capacity",
        value: value.into(),
        remedy: "stay within the device's max_cqe (`ibv_devinfo -v` prints it)",
    };
    if capacity == 0 {
        return Err(VerbsError::InvalidSize {
            what: "CQ capacity",
            value: 0,
            remedy: "make room for every outstanding work request of the CQ's QP",
        });
    }
    // sideway passes the capacity on as a C `int`.
    if i32::try_from(capacity).is_err() {
        return Err(too_large(capacity));
    }
    let cq = context
        .inner
        .create_cq_builder()
        .setup_cqe(capacity)
        .build()
        .map_err(|error| {
            let CreateCompletionQueueErrorKind::Ibverbs(io) = &error.0 else {
                return failure::failed("ibv_create_cq", &error);
            };
            match io.raw_os_error() {
                Some(errno::EINVAL) => too_large(capacity),
                _ => failure::os("ibv_create_cq", &context.name, io),
            }
        })?;
    Ok(SidewayCq::new(
        context.name.clone(),
        std::sync::Arc::clone(&context.inner),
        cq,
    ))
}

/// Moves up to `max` completions to `out`: first those an earlier call took off the queue
/// beyond its `max`, then from `ibv_poll_cq`. sideway's basic poller takes completions off the
/// queue in batches of 32, so the rest of a batch is kept for the next call rather than lost.
///
/// # Errors
/// [`VerbsError::Failed`] when `ibv_poll_cq` fails (a CQ overrun ends that way) and no
/// completion was moved; completions already moved are returned first, and the error comes
/// on the next call.
pub(super) fn poll(
    cq: &SidewayCq,
    max: usize,
    out: &mut Vec<WorkCompletion>,
) -> Result<usize, VerbsError> {
    let mut backlog = cq.backlog.lock();
    let mut moved = max.min(backlog.len());
    out.extend(backlog.drain(..moved));
    if moved == max {
        return Ok(moved);
    }
    let qp_num = cq.qp_num();
    match cq.inner.start_poll() {
        Ok(poller) => {
            // Drain the poller: what it yields is off the queue already.
            for wc in poller {
                let completion = raw::completion(
                    RawCompletion {
                        wr_id: wc.wr_id(),
                        status: wc.status(),
                        opcode: wc.opcode(),
                        byte_len: wc.byte_len(),
                        imm_data: wc.imm_data(),
                    },
                    qp_num,
                );
                if moved < max {
                    out.push(completion);
                    moved += 1;
                } else {
                    backlog.push_back(completion);
                }
            }
            Ok(moved)
        }
        Err(PollCompletionQueueError::CompletionQueueEmpty) => Ok(moved),
        Err(_) if moved > 0 => Ok(moved),
        Err(error) => Err(VerbsError::Failed {
            call: "ibv_poll_cq",
            message: format!(
                "{}; a CQ overrun (more completions than the CQ holds) ends this way: give \
                 the CQ room for every outstanding work request of its QP and reset the QP",
                failure::chain(&error)
            ),
        }),
    }
}
