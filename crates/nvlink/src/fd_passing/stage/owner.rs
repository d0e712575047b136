//! The owner's end of a staging session: makes the staging buffer, hands its descriptor over,
//! then carries out the initiator's gathers and scatters on its own GPU, each range checked
//! against this engine's registrations first.

use super::wire::{self, StageEntry, StageOp, DONE, HEADER_BYTES};
use super::{SessionEnded, MAX_STAGING_BYTES, MIN_STAGING_BYTES};
use crate::args::ArgumentPool;
use crate::config::NvlinkConfig;
use crate::fd_passing::{send_fds, InUse, Vouched};
use crate::kernels::{CopyKernels, KernelShare};
use crate::plan;
use ferry_core::cuda::{
    create_vmm, AllocationHandle, Context, CudaError, Event, KernelArg, Pollable, Poller, Stream,
    VmmMapping,
};
use rustc_hash::FxHashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::OwnedSemaphorePermit;

/// One staging session being served.
pub(crate) struct OwnerSession {
    stream: UnixStream,
    gpu: OwnerGpu,
    /// This engine's `cudaMalloc` registrations; a request that finds them gone ends the
    /// session.
    vouched: Weak<Vouched>,
    /// Changes when the fd server stops: an idle session ends then.
    stopped: tokio::sync::watch::Receiver<()>,
    /// Held while the session runs: the fd server serves a bounded number at once.
    _slot: OwnedSemaphorePermit,
}

/// What a session needs from the fd server that serves it.
pub(crate) struct Serving {
    /// This engine's `cudaMalloc` registrations.
    pub(crate) vouched: Arc<Vouched>,
    /// Changes when the fd server stops.
    pub(crate) stopped: tokio::sync::watch::Receiver<()>,
    /// How the engine's copies may use the GPU (the copy kernel's grid and piece size).
    pub(crate) config: NvlinkConfig,
    /// The server's hold on one of its bounded session slots.
    pub(crate) slot: OwnedSemaphorePermit,
}

/// How long a session may sit without a request before the owner ends it and frees its
/// staging buffer; the initiator opens a fresh one for a transfer after [`crate::staging::REUSE_IDLE`].
const SESSION_IDLE: Duration = Duration::from_secs(60);

/// How long the rest of a request may take once its header arrived.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// What the owner copies with: the staging buffer and one stream and the copy kernels of its
/// GPU.
struct OwnerGpu {
    ordinal: u32,
    config: NvlinkConfig,
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
        serving: Serving,
        buffer: u64,
        bytes: u64,
    ) -> Result<OwnerSession, (UnixStream, String)> {
        let Serving {
            vouched,
            stopped,
            config,
            slot,
        } = serving;
        let Some(ordinal) = vouched.with(buffer, |vouch| vouch.map(|vouch| vouch.ordinal)) else {
            return Err((
                stream,
                format!("no cudaMalloc buffer is registered at {buffer:#x}; the descriptor is out of date, fetch the peer's descriptor again"),
            ));
        };
        let bytes = bytes.clamp(MIN_STAGING_BYTES, MAX_STAGING_BYTES);
        let made = tokio::task::spawn_blocking(move || OwnerGpu::new(ordinal, bytes, config)).await;
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
            stopped,
            _slot: slot,
        })
    }

    /// Carries out requests until the initiator closes the session, it sits idle for
    /// [`SESSION_IDLE`] or the fd server stops (`Ok`), or one fails: its reason goes to the
    /// initiator, and the session ends with it.
    pub(crate) async fn run(mut self) -> Result<(), SessionEnded> {
        loop {
            let mut head = [0u8; HEADER_BYTES];
            let read = tokio::select! {
                _ = self.stopped.changed() => return Ok(()),
                read = tokio::time::timeout(SESSION_IDLE, self.stream.read_exact(&mut head)) => read,
            };
            match read {
                Err(_) => return Ok(()),
                Ok(Ok(_)) => {}
                Ok(Err(error)) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return Ok(())
                }
                Ok(Err(error)) => return Err(SessionEnded::io("reading a request from")(error)),
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
        let started = std::time::Instant::now();
        let header = wire::decode_header(head)?;
        let mut bytes = vec![0u8; header.entry_bytes()];
        tokio::time::timeout(REQUEST_TIMEOUT, self.stream.read_exact(&mut bytes))
            .await
            .map_err(|_| SessionEnded::TimedOut)?
            .map_err(SessionEnded::io("reading a request from"))?;
        let entries = wire::decode_entries(header, &bytes, self.gpu.staging.len() as u64)?;
        drop(bytes);
        let Some(vouched) = self.vouched.upgrade() else {
            return Err(SessionEnded::Stopping);
        };
        let staging = self.gpu.staging.base();
        let (copies, in_use) =
            checked_copies(header.op, &entries, staging, self.gpu.ordinal, |buffer| {
                vouched.with(buffer, |vouch| {
                    vouch.map(|vouch| (vouch.ordinal, vouch.len, vouch.in_use()))
                })
            })?;
        drop(vouched);
        let checked = started.elapsed();
        let fence = self.gpu.launch(&copies)?;
        // The buffers stay counted as in use until the poller sees the copies end, even if
        // this session stops waiting: a deregistration waits for them.
        Poller::global()
            .wait(CopiesDone {
                fence,
                _in_use: in_use,
            })
            .await?;
        tracing::trace!(
            op = ?header.op,
            entries = entries.len(),
            read_and_checked_us = checked.as_micros() as u64,
            total_us = started.elapsed().as_micros() as u64,
            "staged copy carried out"
        );
        Ok(())
    }
}

/// A request's copies on the GPU, and the holds on the buffers they touch.
struct CopiesDone {
    fence: Arc<Event>,
    _in_use: Vec<InUse>,
}

impl Pollable for CopiesDone {
    fn query(&self) -> Result<bool, CudaError> {
        self.fence.query()
    }
}

/// The copies of `entries` between the owner's memory and a staging buffer at `staging` on
/// GPU `ordinal`, each owner range checked to lie inside the registered `cudaMalloc` buffer
/// it names on that GPU; `find` gives a buffer's GPU, registered length and a hold on it
/// (taken where it is found), or `None` where none is registered. `find` is asked once per
/// distinct buffer (a request of scattered KV blocks names each layer's pool thousands of
/// times, interleaved), and the copies keep one hold per buffer until they end. The staging
/// ranges were checked when the request was read.
fn checked_copies(
    op: StageOp,
    entries: &[StageEntry],
    staging: u64,
    ordinal: u32,
    mut find: impl FnMut(u64) -> Option<(u32, u64, InUse)>,
) -> Result<(Vec<plan::Copy>, Vec<InUse>), SessionEnded> {
    let mut last: Option<(u64, u64)> = None;
    let mut known: FxHashMap<u64, u64> = FxHashMap::default();
    let mut in_use = Vec::new();
    let mut copies = Vec::with_capacity(entries.len());
    for (index, entry) in entries.iter().enumerate() {
        let registered = match last {
            Some((buffer, len)) if buffer == entry.buffer => len,
            _ => {
                let len = match known.get(&entry.buffer) {
                    Some(&len) => len,
                    None => {
                        let len = match find(entry.buffer) {
                            Some((found, len, hold)) if found == ordinal => {
                                in_use.push(hold);
                                len
                            }
                            Some((found, _, _)) => return Err(SessionEnded::NotRegistered(format!(
                                "entry {index} names the buffer at {:#x} on GPU {found}, but this session stages on GPU {ordinal}; open a session per GPU",
                                entry.buffer
                            ))),
                            None => return Err(SessionEnded::NotRegistered(format!(
                                "entry {index} names {:#x}, where no cudaMalloc buffer is registered (any more); fetch the peer's descriptor again",
                                entry.buffer
                            ))),
                        };
                        known.insert(entry.buffer, len);
                        len
                    }
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
        let staged = staging + entry.staging;
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
    Ok((copies, in_use))
}

impl OwnerGpu {
    /// A staging buffer of `bytes` on GPU `ordinal`, its descriptor, and what copies into and
    /// out of it.
    fn new(
        ordinal: u32,
        bytes: u64,
        config: NvlinkConfig,
    ) -> ferry_core::Result<(OwnerGpu, OwnedFd)> {
        let context = Context::get(ordinal)?;
        let staging = create_vmm(Arc::clone(&context), bytes as usize, 1)?;
        let fd = AllocationHandle::retain(staging.base())?.export_fd()?;
        let kernels = CopyKernels::of(&context)?.share();
        let gpu = OwnerGpu {
            ordinal,
            config,
            stream: Stream::new(Arc::clone(&context))?,
            args: ArgumentPool::new(context),
            staging,
            kernels,
        };
        Ok((gpu, fd))
    }

    /// Queues `copies` as one launch of the copy kernel on the session's stream; returns the
    /// event recorded after it.
    fn launch(&self, copies: &[plan::Copy]) -> Result<Arc<Event>, SessionEnded> {
        let config = &self.config;
        let bytes = copies.iter().map(|copy| copy.len).sum();
        let pieces = plan::Pieces {
            most: config.kernel_chunk_bytes,
            full_grid: self.kernels.items_for_full_grid(config),
        };
        let indices: Vec<usize> = (0..copies.len()).collect();
        let entries = plan::kernel_entries(copies, &indices, pieces.len_for(bytes));
        let shifted = plan::any_shifted(&entries);
        let kernel = match shifted {
            true => &self.kernels.list_shifted,
            false => &self.kernels.list,
        };
        let count = entries.len() as u64;
        let grid = self.kernels.grid(count, config, shifted);
        self.stream
            .context()
            .bind()
            .map_err(ferry_core::Error::from)?;
        // SAFETY: `ferry_copy_list` takes (entries, count), as given; every range the entries
        // name was checked: the owner's against this engine's live registrations on this GPU
        // (held in use until the fence fires), the staging ones against the staging buffer,
        // which lives until the stream drained (see `OwnerGpu`'s drop).
        let fence = unsafe {
            self.args.launch(
                &self.stream,
                kernel,
                grid,
                entries.len() * plan::ENTRY_BYTES,
                |args, base| {
                    plan::write_entries(&entries, args);
                    vec![KernelArg::U64(base), KernelArg::U64(count)]
                },
            )
        }?;
        Ok(fence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fd_passing::Vouch;
    use ferry_core::cuda::IpcHandle;

    /// Two buffers on GPU 0 (4 KiB at 0x10000, 8 KiB at 0x20000) and one on GPU 1.
    fn registered(buffer: u64) -> Option<(u32, u64, InUse)> {
        let hold = || Vouch::new(IpcHandle([0; 64]), 0, 0).in_use();
        match buffer {
            0x10000 => Some((0, 4096, hold())),
            0x20000 => Some((0, 8192, hold())),
            0x30000 => Some((1, 4096, hold())),
            _ => None,
        }
    }

    fn entry(buffer: u64, addr: u64, staging: u64, len: u64) -> StageEntry {
        StageEntry {
            buffer,
            addr,
            staging,
            len,
        }
    }

    #[test]
    fn ranges_inside_their_buffers_become_copies_with_one_hold_per_buffer() {
        let entries = [
            entry(0x10000, 0x10000, 0, 4096),
            entry(0x20000, 0x21000, 4096, 4096),
            entry(0x20000, 0x20000, 8192, 16),
        ];
        for (op, forward) in [(StageOp::Scatter, true), (StageOp::Gather, false)] {
            let (copies, holds) = checked_copies(op, &entries, 0x9000_0000, 0, registered).unwrap();
            assert_eq!(holds.len(), 2, "one hold per buffer named in a row");
            let staged = 0x9000_0000 + 4096;
            let (src, dst) = match forward {
                true => (staged, 0x21000),
                false => (0x21000, staged),
            };
            assert_eq!(
                (copies[1].src, copies[1].dst, copies[1].len),
                (src, dst, 4096)
            );
        }
    }

    #[test]
    fn interleaved_buffers_are_looked_up_once_each_and_held_once_each() {
        let entries: Vec<StageEntry> = (0..64)
            .map(|index| {
                let buffer = [0x10000, 0x20000][index % 2];
                entry(
                    buffer,
                    buffer + 16 * (index as u64 / 2),
                    64 * index as u64,
                    16,
                )
            })
            .collect();
        let mut asked = Vec::new();
        let (copies, holds) = checked_copies(StageOp::Gather, &entries, 0x9000_0000, 0, |buffer| {
            asked.push(buffer);
            registered(buffer)
        })
        .unwrap();
        assert_eq!(asked, [0x10000, 0x20000]);
        assert_eq!(holds.len(), 2);
        assert_eq!(copies.len(), 64);
        assert_eq!(
            (copies[5].src, copies[5].dst),
            (0x20000 + 32, 0x9000_0000 + 320)
        );
    }

    #[test]
    fn ranges_past_their_buffer_on_another_gpu_or_unregistered_are_refused_by_entry() {
        let cases = [
            (entry(0x10000, 0x10001, 0, 4096), "outside the 4096 bytes"),
            (entry(0x10000, 0x0fff0, 0, 16), "outside the 4096 bytes"),
            (
                entry(0x10000, u64::MAX - 8, 0, 16),
                "outside the 4096 bytes",
            ),
            (entry(0x30000, 0x30000, 0, 16), "on GPU 1"),
            (entry(0x40000, 0x40000, 0, 16), "no cudaMalloc buffer"),
        ];
        for (bad, expected) in cases {
            let entries = [entry(0x20000, 0x20000, 0, 64), bad];
            match checked_copies(StageOp::Scatter, &entries, 0x9000_0000, 0, registered) {
                Err(SessionEnded::NotRegistered(reason)) => {
                    assert!(reason.contains("entry 1"), "{reason}");
                    assert!(reason.contains(expected), "{reason}");
                }
                Err(other) => panic!("{bad:?}: expected a refusal, got {other}"),
                Ok(_) => panic!("{bad:?} was taken"),
            }
        }
    }
}
