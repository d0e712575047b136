//! The initiator's end of a staging session: the owner's staging buffer mapped here, and the
//! requests sent to it, whose answers come back in order.

use super::REUSE_IDLE;
use crate::fd_passing::{
    encode_stage_request, open_staging, FdSocket, ImportError, SessionEnded, StageEntry, StageOp,
    ANSWER_TIMEOUT, MAX_STAGING_BYTES, MIN_STAGING_BYTES, STAGE_DONE, STAGE_FAILED,
    STAGE_MAX_REASON_BYTES,
};
use ferry_core::auth::Secret;
use ferry_core::cuda::{AllocationHandle, Context, VmmMapping};
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// A staging session with one peer engine on one of its GPUs, mapped into one local GPU.
pub(crate) struct StagingSession {
    stream: UnixStream,
    /// The owner's staging buffer, mapped here; shared with the copies that use it, which keep
    /// it mapped until they finished.
    staging: Arc<VmmMapping>,
    /// Requests sent whose answers were not read yet.
    unanswered: usize,
    /// The last request's bytes, kept for its allocation.
    request: Vec<u8>,
    /// When the owner last answered (or the session opened).
    last_answer: Instant,
}

impl StagingSession {
    /// Opens a session with the engine behind fd socket `socket` for its `cudaMalloc` buffer
    /// registered at `buffer`, asking for `bytes` of staging, and maps the staging buffer
    /// into GPU `ordinal` here.
    ///
    /// # Errors
    /// The [`ImportError`] that says why the owner could not be asked, refused, or its
    /// staging could not be mapped.
    pub(crate) async fn open(
        socket: &FdSocket,
        buffer: u64,
        bytes: u64,
        ordinal: u32,
        secret: Option<&Secret>,
    ) -> Result<StagingSession, ImportError> {
        let (stream, fd, len) = open_staging(socket, buffer, bytes, secret).await?;
        // The owner clamps what is asked to these bounds and rounds it up to its GPU's
        // allocation granularity, so it may give more than asked, never more than the most.
        if !(MIN_STAGING_BYTES..=MAX_STAGING_BYTES).contains(&len) {
            return Err(ImportError::Refused {
                reason: format!(
                    "the peer gave {len} bytes of staging, not {MIN_STAGING_BYTES} to {MAX_STAGING_BYTES}"
                ),
            });
        }
        let context = Context::get(ordinal).map_err(ferry_core::Error::from)?;
        // The driver refuses a length past what the allocation holds, so the owner's word for
        // it cannot make this mapping larger than its memory.
        let staging = AllocationHandle::import_fd(&fd)
            .map_err(ferry_core::Error::from)
            .and_then(|handle| VmmMapping::map(context, vec![(handle, len as usize)]))?;
        Ok(StagingSession {
            stream,
            staging: Arc::new(staging),
            unanswered: 0,
            request: Vec::new(),
            last_answer: Instant::now(),
        })
    }

    /// The staging buffer as mapped here.
    pub(crate) fn staging(&self) -> &Arc<VmmMapping> {
        &self.staging
    }

    /// Whether the session has gone unused long enough that its owner may have ended it
    /// ([`REUSE_IDLE`]): a transfer then opens a fresh one.
    pub(crate) fn is_stale(&self) -> bool {
        self.last_answer.elapsed() >= REUSE_IDLE
    }

    /// Requests sent and not answered yet.
    pub(crate) fn unanswered(&self) -> usize {
        self.unanswered
    }

    /// Asks the owner to carry out `op` over `entries`; its answer is read by [`Self::answer`].
    pub(crate) async fn send(
        &mut self,
        op: StageOp,
        entries: &[StageEntry],
    ) -> Result<(), SessionEnded> {
        self.request.clear();
        encode_stage_request(op, entries, &mut self.request);
        if let Err(error) = self.stream.write_all(&self.request).await {
            // An owner that refused an earlier request closed the session: its reason, still
            // unread, says more than the broken pipe.
            while self.unanswered > 0 {
                if let Err(refused @ SessionEnded::Refused(_)) = self.answer().await {
                    return Err(refused);
                }
            }
            return Err(SessionEnded::io("sending a request on")(error));
        }
        self.unanswered += 1;
        Ok(())
    }

    /// Reads the answer to the oldest request not answered yet: `Ok` once the owner's copy
    /// of it has finished.
    ///
    /// # Errors
    /// [`SessionEnded::Refused`] with the owner's reason, [`SessionEnded::TimedOut`], or the
    /// socket's failure; the session is of no further use after any of them.
    pub(crate) async fn answer(&mut self) -> Result<(), SessionEnded> {
        let read = async {
            let status = self
                .stream
                .read_u8()
                .await
                .map_err(SessionEnded::io("reading an answer from"))?;
            match status {
                STAGE_DONE => Ok(()),
                STAGE_FAILED => {
                    let len = self
                        .stream
                        .read_u32_le()
                        .await
                        .map_err(SessionEnded::io("reading an answer from"))?
                        .min(STAGE_MAX_REASON_BYTES);
                    let mut reason = vec![0u8; len as usize];
                    self.stream
                        .read_exact(&mut reason)
                        .await
                        .map_err(SessionEnded::io("reading an answer from"))?;
                    Err(SessionEnded::Refused(
                        String::from_utf8_lossy(&reason).into_owned(),
                    ))
                }
                other => Err(SessionEnded::Refused(format!(
                    "its answer began with {other}, neither {STAGE_DONE} (done) nor {STAGE_FAILED} (failed)"
                ))),
            }
        };
        let answered = tokio::time::timeout(ANSWER_TIMEOUT, read)
            .await
            .unwrap_or(Err(SessionEnded::TimedOut));
        self.unanswered = self.unanswered.saturating_sub(1);
        self.last_answer = Instant::now();
        answered
    }
}
