//! The owner's end of a staging session: makes the staging buffer, hands its descriptor over,
//! then carries out the initiator's gathers and scatters on its own GPU, each range checked
//! against this engine's registrations first.

use super::wire::{self, StageEntry, StageOp, DONE, HEADER_BYTES};
use super::{SessionEnded, MAX_STAGING_BYTES, MIN_STAGING_BYTES};
use crate::args::ArgumentPool;
use crate::config::NvlinkConfig;
use crate::fd_passing::{send_fds, Vouched};
use crate::kernels::{CopyKernels, KernelShare, THREADS_PER_BLOCK};
use crate::plan;
use ferry_core::cuda::{
    create_vmm, AllocationHandle, Context, Event, KernelArg, Poller, Stream, VmmMapping,
};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Weak};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::OwnedSemaphorePermit;

/// One staging session being served.
pub(crate) struct OwnerSession {
    stream: UnixStream,
    gpu: OwnerGpu,
    /// This engine's `cudaMalloc` registrations; the session ends once they are gone.
    vouched: Weak<Vouched>,
    /// Held while the session runs: the fd server serves a bounded number at once.
    _slot: OwnedSemaphorePermit,
}

/// What the owner copies with: the staging buffer and one stream and the copy kernels of its
/// GPU.
struct OwnerGpu {
    ordinal: u32,
    /// Freed only after `Drop` waited for the stream: a copy still queued when the session
    /// ends finishes first.
    staging: VmmMapping,
    stream: Stream,
    kernels: KernelShare,
    args: ArgumentPool,
}

impl Drop for OwnerGpu {
    fn drop(&mut self) {
        if let Err(error) = self.stream.synchronize() {
            tracing::warn!(%error, "waiting for a staging session's copies failed");
        }
    }
}

impl OwnerSession {
    /// Starts a session for the `cudaMalloc` buffer registered at `buffer` with `bytes` of
    /// staging (cut to [`MIN_STAGING_BYTES`]..=[`MAX_STAGING_BYTES`]): allocates the staging
    /// buffer on the buffer's GPU and sends its descriptor and length. `Err` gives the stream
    /// back with the reason to refuse it with.
    pub(crate) async fn start(
        mut stream: UnixStream,
        vouched: Arc<Vouched>,
        buffer: u64,
        bytes: u64,
        slot: OwnedSemaphorePermit,
    ) -> Result<OwnerSession, (UnixStream, String)> {
        let Some(ordinal) = vouched.with(buffer, |vouch| vouch.map(|vouch| vouch.ordinal)) else {
            return Err((
                stream,
                format!("no cudaMalloc buffer is registered at {buffer:#x}; the descriptor is out of date, fetch the peer's descriptor again"),
            ));
        };
        let bytes = bytes.clamp(MIN_STAGING_BYTES, MAX_STAGING_BYTES);
        let made = tokio::task::spawn_blocking(move || OwnerGpu::new(ordinal, bytes)).await;
        let (gpu, fd) = match made {
            Ok(Ok(made)) => made,
            Ok(Err(error)) => {
                return Err((
                    stream,
                    format!("making {bytes} bytes of staging on GPU {ordinal} failed: {error}"),
                ))
            }
            Err(error) => {
                return Err((
                    stream,
                    format!("making the staging buffer stopped: {error}"),
                ))
            }
        };
        let len = gpu.staging.len() as u64;
        let sent = async {
            send_fds(&stream, &[fd]).await?;
            stream.write_u64_le(len).await
        };
        if let Err(error) = sent.await {
            return Err((
                stream,
                format!("sending the staging buffer failed: {error}"),
            ));
        }
        Ok(OwnerSession {
            stream,
            gpu,
            vouched: Arc::downgrade(&vouched),
            _slot: slot,
        })
    }

    /// Carries out requests until the initiator closes the session (`Ok`) or one fails: its
    /// reason goes to the initiator, and the session ends with it.
    pub(crate) async fn run(mut self) -> Result<(), SessionEnded> {
        loop {
            let mut head = [0u8; HEADER_BYTES];
            match self.stream.read_exact(&mut head).await {
                Ok(_) => {}
                Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(error) => return Err(SessionEnded::io("reading a request from")(error)),
            }
            match self.carry_out(head).await {
                Ok(()) => self
                    .stream
                    .write_u8(DONE)
                    .await
                    .map_err(SessionEnded::io("answering on"))?,
                Err(failure) => {
                    let answer = wire::encode_failure(&failure.to_string());
                    // The initiator hears why; the session ends either way.
                    let _ = self.stream.write_all(&answer).await;
                    return Err(failure);
                }
            }
        }
    }

    /// Reads the rest of the request headed `head`, checks it and copies it on the GPU.
    async fn carry_out(&mut self, head: [u8; HEADER_BYTES]) -> Result<(), SessionEnded> {
        let header = wire::decode_header(head)?;
        let mut bytes = vec![0u8; header.entry_bytes()];
        self.stream
            .read_exact(&mut bytes)
            .await
            .map_err(SessionEnded::io("reading a request from"))?;
        let entries = wire::decode_entries(header, &bytes, self.gpu.staging.len() as u64)?;
        drop(bytes);
        let copies = {
            let Some(vouched) = self.vouched.upgrade() else {
                return Err(SessionEnded::NotRegistered(
                    "the engine is stopping; its memory is not copied any more".into(),
                ));
            };
            self.gpu.copies(header.op, &entries, &vouched)?
        };
        let fence = self.gpu.launch(&copies)?;
        Poller::global().wait(fence).await?;
        Ok(())
    }
}

impl OwnerGpu {
    /// A staging buffer of `bytes` on GPU `ordinal`, its descriptor, and what copies into and
    /// out of it.
    fn new(ordinal: u32, bytes: u64) -> ferry_core::Result<(OwnerGpu, OwnedFd)> {
        let context = Context::get(ordinal)?;
        let staging = create_vmm(Arc::clone(&context), bytes as usize, 1)?;
        let fd = AllocationHandle::retain(staging.base())?.export_fd()?;
        let kernels = CopyKernels::of(&context)?.share();
        let gpu = OwnerGpu {
            ordinal,
            stream: Stream::new(Arc::clone(&context))?,
            args: ArgumentPool::new(context),
            staging,
            kernels,
        };
        Ok((gpu, fd))
    }

    /// The copies of `entries`, each owner range checked to lie in a `cudaMalloc` buffer this
    /// engine registered on the staging buffer's GPU; the staging ranges were checked when
    /// the request was read.
    fn copies(
        &self,
        op: StageOp,
        entries: &[StageEntry],
        vouched: &Vouched,
    ) -> Result<Vec<plan::Copy>, SessionEnded> {
        let mut last: Option<(u64, u64)> = None;
        let mut copies = Vec::with_capacity(entries.len());
        for (index, entry) in entries.iter().enumerate() {
            let registered = match last {
                Some((buffer, len)) if buffer == entry.buffer => len,
                _ => {
                    let found = vouched.with(entry.buffer, |vouch| {
                        vouch.map(|vouch| (vouch.ordinal, vouch.len))
                    });
                    let len = match found {
                        Some((ordinal, len)) if ordinal == self.ordinal => len,
                        Some((ordinal, _)) => return Err(SessionEnded::NotRegistered(format!(
                            "entry {index} names the buffer at {:#x} on GPU {ordinal}, but this session stages on GPU {}; open a session per GPU",
                            entry.buffer, self.ordinal
                        ))),
                        None => return Err(SessionEnded::NotRegistered(format!(
                            "entry {index} names {:#x}, where no cudaMalloc buffer is registered (any more); fetch the peer's descriptor again",
                            entry.buffer
                        ))),
                    };
                    last = Some((entry.buffer, len));
                    len
                }
            };
            let inside = entry.addr >= entry.buffer
                && entry
                    .addr
                    .checked_add(entry.len)
                    .is_some_and(|end| end <= entry.buffer.saturating_add(registered));
            if !inside {
                return Err(SessionEnded::NotRegistered(format!(
                    "entry {index} names {} bytes at {:#x}, outside the {registered} bytes registered at {:#x}",
                    entry.len, entry.addr, entry.buffer
                )));
            }
            let staged = self.staging.base() + entry.staging;
            let (src, dst) = match op {
                StageOp::Gather => (entry.addr, staged),
                StageOp::Scatter => (staged, entry.addr),
            };
            copies.push(plan::Copy {
                dst,
                src,
                len: entry.len,
                kernel_reaches: true,
            });
        }
        Ok(copies)
    }

    /// Queues `copies` as one launch of the copy kernel on the session's stream; returns the
    /// event recorded after it.
    fn launch(&self, copies: &[plan::Copy]) -> Result<Arc<Event>, SessionEnded> {
        let config = NvlinkConfig::default();
        let bytes = copies.iter().map(|copy| copy.len).sum();
        let pieces = plan::Pieces {
            most: config.kernel_chunk_bytes,
            full_grid: self.kernels.items_for_full_grid(&config),
        };
        let indices: Vec<usize> = (0..copies.len()).collect();
        let entries = plan::kernel_entries(copies, &indices, pieces.len_for(bytes));
        let shifted = plan::any_shifted(&entries);
        let kernel = match shifted {
            true => &self.kernels.list_shifted,
            false => &self.kernels.list,
        };
        let count = entries.len() as u64;
        let grid = self.kernels.grid(count, &config, shifted);
        self.stream
            .context()
            .bind()
            .map_err(ferry_core::Error::from)?;
        let mut args = self
            .args
            .take(entries.len() * plan::ENTRY_BYTES)
            .map_err(ferry_core::Error::from)?;
        plan::write_entries(&entries, args.as_mut_slice());
        let launch_args = [KernelArg::U64(args.addr()), KernelArg::U64(count)];
        // SAFETY: `ferry_copy_list` takes (entries, count), as given; every range the entries
        // name was checked: the owner's against this engine's live registrations on this GPU,
        // the staging ones against the staging buffer, which lives until the stream drained
        // (see `OwnerGpu`'s drop). The argument buffer goes back to the pool only with the
        // fence recorded after this launch.
        let launched =
            unsafe { kernel.launch(&self.stream, grid, THREADS_PER_BLOCK, &launch_args) };
        let fence = match Event::record(&self.stream) {
            Ok(fence) => Arc::new(fence),
            Err(error) => {
                // The launch may still read the arguments: leak them rather than free them
                // under the GPU.
                std::mem::forget(args);
                return Err(ferry_core::Error::from(error).into());
            }
        };
        self.args.give_back(args, Arc::clone(&fence));
        launched?;
        Ok(fence)
    }
}
