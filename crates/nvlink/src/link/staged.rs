//! Copies to and from a peer's `cudaMalloc` memory that does not map into this process,
//! through the staging buffer the peer hands over ([`crate::staging`]): this GPU's copies go
//! into or out of the staging buffer, the peer's into or out of its memory, a slot at a time.

use super::*;
use crate::fd_passing::STAGE_MAX_ENTRIES;
use crate::staging::{
    plan_chunks, slots_of, Chunk, Piece, SessionEnded, StageEntry, StageOp, StagingSession,
    ANSWER_TIMEOUT,
};
use ferry_core::cuda::GpuId;

/// The staging session of one local GPU with one GPU of the peer, opened at its first staged
/// transfer; one staged transfer at a time uses it.
pub(super) type StagingSlot = Arc<tokio::sync::Mutex<Option<StagingSession>>>;

impl NvlinkLink {
    /// Whether GPU `ordinal` reaches the peer's `cudaMalloc` memory only through staging: its
    /// trial mapping failed and a trial staging session worked.
    pub(super) fn stages(&self, ordinal: u32) -> bool {
        self.trials
            .as_ref()
            .is_some_and(|trials| trials.stages(ordinal, self.instance))
    }

    /// Whether some of `remotes` is `cudaMalloc` memory that GPU `ordinal` reaches only
    /// through staging.
    pub(super) fn any_staged<'a>(
        &self,
        ordinal: u32,
        mut remotes: impl Iterator<Item = &'a Arc<BufferDescriptor>>,
    ) -> Result<bool> {
        if !self.stages(ordinal) {
            return Ok(false);
        }
        remotes.try_fold(false, |any, remote| Ok(any || self.is_ipc(remote)?))
    }

    /// Takes out of `ops` (of GPU `ordinal`, among `all`) those that go through staging.
    pub(super) fn take_staged<'a>(
        &self,
        all: &TransferOps,
        ordinal: u32,
        ops: &mut Vec<&'a TransferOp>,
    ) -> Result<Vec<&'a TransferOp>> {
        if !self.stages(ordinal) {
            return Ok(Vec::new());
        }
        let mut last: Option<(*const BufferDescriptor, bool)> = None;
        let mut staged = Vec::new();
        let mut direct = Vec::with_capacity(ops.len());
        for op in ops.drain(..) {
            let remote = all.remote(op);
            let ipc = match last {
                Some((key, ipc)) if key == Arc::as_ptr(remote) => ipc,
                _ => {
                    let ipc = self.is_ipc(remote)?;
                    last = Some((Arc::as_ptr(remote), ipc));
                    ipc
                }
            };
            match ipc {
                true => staged.push(op),
                false => direct.push(op),
            }
        }
        *ops = direct;
        Ok(staged)
    }

    /// Whether `remote` is `cudaMalloc` memory, shared by IPC handle.
    fn is_ipc(&self, remote: &BufferDescriptor) -> Result<bool> {
        match GpuExport::of(remote, self.transport) {
            Ok(export) => Ok(matches!(export, Some(GpuExport::CudaIpc { .. }))),
            Err(violation) => Err(self.fail(violation)),
        }
    }

    /// Moves `ops` (of GPU `ordinal`, among `all`) through the peer's staging buffers, one
    /// session per GPU of the peer.
    pub(super) async fn move_staged(
        &self,
        all: &TransferOps,
        ordinal: u32,
        ops: &[&TransferOp],
    ) -> Result<()> {
        // Usually one GPU of the peer: a short list beats a map here.
        let mut by_owner_gpu: Vec<(GpuId, Vec<&TransferOp>)> = Vec::new();
        for op in ops {
            let Location::Device { gpu, .. } = all.remote(op).location else {
                return Err(self.refused("the peer's buffer of a staged op is not GPU memory"));
            };
            match by_owner_gpu.iter_mut().find(|(owner, _)| *owner == gpu) {
                Some((_, owner_ops)) => owner_ops.push(op),
                None => by_owner_gpu.push((gpu, vec![op])),
            }
        }
        for (gpu, owner_ops) in by_owner_gpu {
            self.move_staged_on(all, ordinal, gpu, &owner_ops).await?;
        }
        Ok(())
    }

    /// Moves `ops` (of GPU `ordinal`, among `all`, into or out of the peer's GPU `owner_gpu`)
    /// through that GPU's staging buffer: the writes, then the reads.
    async fn move_staged_on(
        &self,
        all: &TransferOps,
        ordinal: u32,
        owner_gpu: GpuId,
        ops: &[&TransferOp],
    ) -> Result<()> {
        let Some(first) = ops.first() else {
            return Ok(());
        };
        let lane = self.lane(ordinal)?;
        let reaches =
            lane.kernels.is_some() && self.kernel_reaches(&lane, ordinal, all.remote(first));
        let slot = self.staging_slot(ordinal, owner_gpu);
        let mut held = slot.lock().await;
        // Taken out while in use: a transfer that fails or is dropped half-way leaves no
        // session with answers still owed behind, and the next one opens a fresh one.
        let mut session = match held.take() {
            Some(session) if !session.is_stale() => session,
            _ => StagingSession::open(
                &self.socket,
                all.remote(first).addr,
                self.config.staging_bytes,
                ordinal,
                self.secret.as_ref(),
            )
            .await
            .map_err(|error| {
                self.refused(&format!(
                    "opening a staging session with the peer failed: {error}"
                ))
            })?,
        };
        let same_gpu = self
            .gpus
            .iter()
            .any(|info| info.ordinal == ordinal && info.uuid == owner_gpu);
        let (slot_len, slots) = slots_of(
            session.staging().len() as u64,
            self.config.staging_slots_for(same_gpu),
        );
        for direction in [Direction::Write, Direction::Read] {
            let pieces = ops
                .iter()
                .filter(|op| op.direction == direction)
                .map(|op| Piece {
                    local: op.local_addr,
                    buffer: all.remote(op).addr,
                    remote: op.remote_addr,
                    len: op.len,
                });
            let chunks = plan_chunks(pieces, slot_len, slots, STAGE_MAX_ENTRIES as usize);
            if chunks.is_empty() {
                continue;
            }
            let staged = Staged {
                lane: &lane,
                chunks: &chunks,
                slots,
                reaches,
            };
            match direction {
                Direction::Write => self.staged_writes(&mut session, staged).await?,
                Direction::Read => self.staged_reads(&mut session, staged).await?,
            }
        }
        *held = Some(session);
        self.still_alive()
    }

    /// Copies each chunk into its slot, then has the peer scatter it, while the next chunk is
    /// copied into the next slot.
    async fn staged_writes(&self, session: &mut StagingSession, staged: Staged<'_>) -> Result<()> {
        let (chunks, slots) = (staged.chunks, staged.slots);
        let mut times = PhaseTimes::start();
        for chunk in chunks {
            while session.unanswered() as u64 >= slots {
                times.waiting(self.staging_answer(session)).await?;
            }
            times
                .copying(self.copy_slot(session, staged, chunk, Direction::Write))
                .await?;
            session
                .send(StageOp::Scatter, &entries(chunk))
                .await
                .map_err(|error| self.staging_failed(error))?;
        }
        while session.unanswered() > 0 {
            times.waiting(self.staging_answer(session)).await?;
        }
        times.report("write", session, chunks.len(), slots);
        Ok(())
    }

    /// Has the peer gather up to one chunk per slot ahead, and copies each out of its slot
    /// once gathered.
    async fn staged_reads(&self, session: &mut StagingSession, staged: Staged<'_>) -> Result<()> {
        let (chunks, slots) = (staged.chunks, staged.slots);
        let mut times = PhaseTimes::start();
        let mut asked = 0;
        for (index, chunk) in chunks.iter().enumerate() {
            while asked < chunks.len() && (asked as u64) < index as u64 + slots {
                session
                    .send(StageOp::Gather, &entries(&chunks[asked]))
                    .await
                    .map_err(|error| self.staging_failed(error))?;
                asked += 1;
            }
            times.waiting(self.staging_answer(session)).await?;
            times
                .copying(self.copy_slot(session, staged, chunk, Direction::Read))
                .await?;
        }
        times.report("read", session, chunks.len(), slots);
        Ok(())
    }

    /// Runs this GPU's copies of `chunk` into its slot (a write) or out of it (a read); the
    /// staging stays mapped until they finished.
    async fn copy_slot(
        &self,
        session: &StagingSession,
        staged: Staged<'_>,
        chunk: &Chunk,
        direction: Direction,
    ) -> Result<()> {
        let staging = Arc::clone(session.staging());
        let copies = slot_copies(chunk, staging.base(), direction, staged.reaches);
        let lane = staged.lane;
        let launches = plan::launches(
            &copies,
            self.config.copy_path,
            Driver::get().has_batched_copies(),
            lane.copy_streams(),
            lane.pieces(&self.config),
        );
        let work = launches
            .into_iter()
            .map(|launch| (0, Work::Copies(launch)))
            .collect();
        self.run(vec![Arc::clone(lane)], work, staging).await
    }

    /// The staging session of local GPU `ordinal` with the peer's GPU `owner_gpu`.
    fn staging_slot(&self, ordinal: u32, owner_gpu: GpuId) -> StagingSlot {
        Arc::clone(self.staging.lock().entry((ordinal, owner_gpu)).or_default())
    }

    /// The owner's answer to the oldest request of `session` not answered yet.
    async fn staging_answer(&self, session: &mut StagingSession) -> Result<()> {
        session
            .answer()
            .await
            .map_err(|error| self.staging_failed(error))
    }

    /// The error of a transfer whose staging session failed half-way: the peer's memory may
    /// hold part of it.
    fn staging_failed(&self, error: SessionEnded) -> Error {
        match error {
            SessionEnded::TimedOut => Error::Timeout {
                what: "a staged copy on the peer's GPU".into(),
                after: ANSWER_TIMEOUT,
            },
            error => Error::PeerGone {
                peer: self.peer.clone(),
                reason: format!("a staged copy through its staging buffer failed: {error}"),
            },
        }
    }
}

/// Where one direction of a staged transfer spent its time, for its debug line.
struct PhaseTimes {
    started: std::time::Instant,
    /// On this GPU's copies into or out of the slots.
    copying: std::time::Duration,
    /// On the owner's answers.
    waiting: std::time::Duration,
}

impl PhaseTimes {
    /// Times from now on, nothing counted yet.
    fn start() -> PhaseTimes {
        PhaseTimes {
            started: std::time::Instant::now(),
            copying: std::time::Duration::ZERO,
            waiting: std::time::Duration::ZERO,
        }
    }

    /// `copy`, its time counted as this GPU's copying.
    async fn copying<T>(&mut self, copy: impl std::future::Future<Output = T>) -> T {
        let started = std::time::Instant::now();
        let out = copy.await;
        self.copying += started.elapsed();
        out
    }

    /// `answer`, its time counted as waiting for the owner.
    async fn waiting<T>(&mut self, answer: impl std::future::Future<Output = T>) -> T {
        let started = std::time::Instant::now();
        let out = answer.await;
        self.waiting += started.elapsed();
        out
    }

    /// One debug line: the direction's chunks, the staging they went through, and where its
    /// time went.
    fn report(&self, direction: &str, session: &StagingSession, chunks: usize, slots: u64) {
        tracing::debug!(
            direction,
            chunks,
            slots,
            staging_bytes = session.staging().len(),
            total_us = self.started.elapsed().as_micros() as u64,
            copying_us = self.copying.as_micros() as u64,
            waiting_for_owner_us = self.waiting.as_micros() as u64,
            "staged transfer"
        );
    }
}

/// One direction of a staged transfer, as planned.
#[derive(Clone, Copy)]
struct Staged<'a> {
    /// This GPU's lane, whose streams run its copies.
    lane: &'a Arc<GpuLane>,
    /// The direction's chunks, chunk `k` in slot `k % slots`.
    chunks: &'a [Chunk],
    slots: u64,
    /// Whether the copy kernels reach this GPU's side of the copies.
    reaches: bool,
}

/// This GPU's copies of `chunk` between its memory and the staging buffer mapped at `base`:
/// into the slot for a write, out of it for a read.
fn slot_copies(chunk: &Chunk, base: u64, direction: Direction, reaches: bool) -> Vec<plan::Copy> {
    chunk
        .pieces
        .iter()
        .map(|(piece, at)| {
            let (src, dst) = match direction {
                Direction::Write => (piece.local, base + at),
                Direction::Read => (base + at, piece.local),
            };
            plan::Copy {
                src,
                dst,
                len: piece.len,
                kernel_reaches: reaches,
            }
        })
        .collect()
}

/// What the owner copies for `chunk`.
fn entries(chunk: &Chunk) -> Vec<StageEntry> {
    chunk
        .pieces
        .iter()
        .map(|(piece, at)| StageEntry {
            buffer: piece.buffer,
            addr: piece.remote,
            staging: *at,
            len: piece.len,
        })
        .collect()
}
