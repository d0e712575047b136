//! The prefill side of one copy path: its engine, its memory and the peer, and how one row
//! of the bench is prepared, measured and verified on it.

use super::*;

/// Per-round times of one row, microseconds.
#[derive(Default)]
pub(super) struct Timing {
    /// From the start of building the batch to the result in hand.
    pub(super) latencies: Vec<f64>,
    /// Building and submitting the batch.
    pub(super) submits: Vec<f64>,
    /// Inside the engine ([`ferry::Completion::elapsed`]).
    pub(super) inside: Vec<f64>,
}

/// What one row's timed rounds measured.
pub(super) struct Measured {
    /// GB/s; absent for latency-only workloads.
    pub(super) gbps: Option<f64>,
    pub(super) timing: Timing,
    /// `kv-layerwise`: one layer's transfer alone, p50 microseconds.
    pub(super) one_layer_us: Option<f64>,
    /// `kv-layerwise`: from the host's release of the last layer's compute, p50 microseconds.
    pub(super) released_us: Option<f64>,
    /// `small-write`: the path its notifications took and one notification alone.
    pub(super) notified: Option<Notified>,
}

impl Measured {
    pub(super) fn new(gbps: Option<f64>, timing: Timing) -> Measured {
        Measured {
            gbps,
            timing,
            one_layer_us: None,
            released_us: None,
            notified: None,
        }
    }
}

/// The prefill side of one copy path: an engine and its GPU memory.
pub(super) struct Side {
    pub(super) engine: Engine,
    pub(super) peer: Peer,
    /// Blocks are copied from (write) or into (read) this area.
    pub(super) local: Region,
    /// Zeros, to clear destinations.
    pub(super) zeros: Region,
    /// Staging for verification and for filling the peer before reads.
    pub(super) check: Region,
    /// The decode process's area, at this address in its buffer `remote_buffer`.
    pub(super) remote: u64,
    pub(super) remote_buffer: BufferDescriptor,
    /// Echoes from the decode process, for `small-write`.
    pub(super) inbox: std::cell::RefCell<Notifications>,
    /// The one transport every transfer must take (`--rdma`, `--tcp`); any transport when
    /// `None`.
    pub(super) only: Option<&'static str>,
    /// The copy path asked for.
    pub(super) path: CopyPath,
    /// The copy kernel's multiprocessor cap; `None` for all.
    pub(super) cap: Option<u32>,
    /// `kv-layerwise`'s stand-in for prefill's computing stream: it waits on `gate` and
    /// records the event a layer's blocks start after; `None` with host memory (`--host`),
    /// which runs no `kv-layerwise`.
    pub(super) computing: Option<Stream>,
    /// The word the host raises as each layer's compute ends (`kv-layerwise`).
    pub(super) gate: Region,
}

impl Side {
    pub(super) fn new(
        options: &Options,
        path: CopyPath,
        cap: Option<u32>,
        area: u64,
        check: u64,
        decode: &mut ServeChild,
    ) -> Result<Side, BoxError> {
        let only = options.only_transport();
        let links = Links::default()
            .gpu_links(only.is_none())
            .nvlink(options.socket_dir.config(NvlinkConfig {
                streams_per_gpu: options.streams.max(1),
                copy_path: path,
                kernel_blocks_per_sm: options.kernel_blocks_per_sm.max(1),
                kernel_chunk_bytes: options.kernel_chunk_bytes.max(16),
                kernel_max_sms: cap,
                shared_memory_notifications: !options.notify_over_tcp,
                gpu_notification_max_bytes: options.gpu_notification_max_bytes,
                socket_dir: None,
                // Set either way, so the environment cannot stage the direct rows.
                cuda_malloc_staging: Some(match options.stage_cuda_malloc {
                    true => ferry::CudaMallocStaging::Always,
                    false => ferry::CudaMallocStaging::Never,
                }),
                staging_bytes: options.staging_bytes,
                staging_slots: options.staging_slots,
            }));
        // `--tcp` measures TCP: RDMA, which would win over it, stays out.
        #[cfg(feature = "rdma")]
        let links = links.rdma((!options.tcp && !options.host).then(ferry::RdmaConfig::default));
        let engine = sending_engine(links, &options.secret, &options.metadata)?;
        let gpu = (!options.host).then_some(options.prefill_gpu);
        let allocate = |bytes: u64| match gpu {
            Some(gpu) => engine.allocate_device(gpu, bytes),
            None => engine.allocate(bytes),
        };
        let local = allocate(area)?;
        let zeros = allocate(GIB.min(area))?;
        let check = allocate(check)?;
        let gate = allocate(4096)?;
        gate.write_at(0, &[0u8; 4096])?;
        let computing = gpu.map(|gpu| Stream::new(Context::get(gpu)?)).transpose()?;
        let peer = engine.connect_blocking(&decode.name)?;
        decode.reply_to(engine.name())?;
        let inbox = std::cell::RefCell::new(engine.notifications()?);
        let remote = decode.buffer_addr;
        let remote_buffer = peer
            .buffer_at(remote)
            .ok_or_else(|| format!("the decode process registered no buffer at {remote:#x}"))?;
        if let Some(wanted) = only {
            routed_over(&engine, &local, &peer, &remote_buffer, wanted)?;
        }
        Ok(Side {
            inbox,
            engine,
            peer,
            local,
            zeros,
            check,
            remote,
            remote_buffer,
            only,
            path,
            cap,
            computing,
            gate,
        })
    }

    /// `done`, when the transport the run asked for carried all of it.
    pub(super) fn carried(&self, done: Completion) -> Result<Completion, BoxError> {
        match self.only {
            Some(wanted) if done.transports != [wanted] => Err(format!(
                "a transfer of {} bytes went over {} where the run asked for {wanted} alone; \
                 stopping rather than report another transport's figures",
                done.bytes,
                done.transports.join("+")
            )
            .into()),
            _ => Ok(done),
        }
    }

    /// One row: `job`'s rounds timed and its bytes verified; with `gemm`, the GEMM's rate
    /// alone just before and beside the rounds.
    pub(super) fn row(
        &self,
        job: Job<'_>,
        options: &Options,
        baseline: Option<f64>,
        base: &[u8],
        gemm: Option<&Gemm>,
    ) -> Result<Row, BoxError> {
        let Job {
            workload,
            shape,
            direction,
        } = job;
        let blocks = shape.blocks();
        self.prepare(&blocks, direction, base)?;
        let rounds = || self.rounds(workload, shape, direction, options);
        let (measured, contention) = match gemm {
            None => (rounds()?, None),
            Some(gemm) => {
                let alone = gemm.rate_for(GEMM_ALONE)?;
                let (measured, during) = beside(gemm, rounds)?;
                (measured, Some(Contention::new(&alone, &during)))
            }
        };
        let verified = self.verify(&blocks, direction, base)?;
        Ok(Row {
            workload: workload.to_string(),
            path: self
                .only
                .map_or_else(|| self.path.to_string(), str::to_owned),
            direction: direction_name(direction).into(),
            block_bytes: blocks.iter().map(|block| block.2).max().unwrap_or(0),
            bytes: shape.bytes(),
            gbps: measured.gbps,
            ratio: measured
                .gbps
                .zip(baseline)
                .map(|(gbps, baseline)| gbps / baseline),
            p50_us: quantile(&measured.timing.latencies, 0.5),
            p99_us: quantile(&measured.timing.latencies, 0.99),
            submit_us: median(&measured.timing.submits),
            engine_us: median(&measured.timing.inside),
            verified,
            one_layer_us: measured.one_layer_us,
            released_us: measured.released_us,
            notified: measured.notified,
            kernel_max_sms: self.cap,
            contention,
        })
    }

    /// A row's timed rounds: its GB/s (absent for latency-only workloads), the rounds' times,
    /// for `kv-layerwise` one layer's transfer alone, and for `small-write` how its
    /// notifications went.
    pub(super) fn rounds(
        &self,
        workload: &Workload,
        shape: &Shape,
        direction: Direction,
        options: &Options,
    ) -> Result<Measured, BoxError> {
        Ok(match shape {
            Shape::Paged(paged) if *workload == Workload::KvLayerwise => {
                let compute = Duration::from_micros(options.layer_compute_us);
                let (timing, released, alone) = self.layerwise(paged, compute, options.rounds())?;
                Measured {
                    one_layer_us: Some(alone),
                    released_us: Some(quantile(&released, 0.5)),
                    ..Measured::new(None, timing)
                }
            }
            Shape::Ping(len) => {
                let (latencies, alone) = self.ping(*len, options.rounds().max(200))?;
                let timing = Timing {
                    latencies,
                    ..Timing::default()
                };
                Measured {
                    notified: Some(Notified {
                        through: self.peer.notifications_through().unwrap_or("-").to_owned(),
                        alone_p50_us: quantile(&alone, 0.5),
                        alone_p99_us: quantile(&alone, 0.99),
                    }),
                    ..Measured::new(None, timing)
                }
            }
            _ => {
                let (gbps, timing) =
                    self.measure(shape, direction, options.rounds(), options.notify_requests)?;
                Measured::new(Some(gbps), timing)
            }
        })
    }

    /// Puts each block's bytes at its source and zeros at its destination.
    pub(super) fn prepare(
        &self,
        blocks: &[(u64, u64, u64)],
        direction: Direction,
        base: &[u8],
    ) -> Result<(), BoxError> {
        match direction {
            Direction::Write => {
                for (index, &(local, _, len)) in blocks.iter().enumerate() {
                    self.local.write_at(local, block_bytes(base, index, len))?;
                }
                let mut clear = self.engine.batch(&self.peer);
                for &(_, remote, len) in blocks {
                    clear = clear.write(&self.zeros, 0, self.remote + remote, len);
                }
                self.carried(clear.submit_blocking()?)?;
            }
            Direction::Read => {
                let mut fill = self.engine.batch(&self.peer);
                let mut at = 0;
                for (index, &(_, remote, len)) in blocks.iter().enumerate() {
                    self.check.write_at(at, block_bytes(base, index, len))?;
                    fill = fill.write(&self.check, at, self.remote + remote, len);
                    at += len;
                }
                self.carried(fill.submit_blocking()?)?;
                let zeros = vec![0u8; blocks.iter().map(|b| b.2).max().unwrap_or(0) as usize];
                for &(local, _, len) in blocks {
                    self.local.write_at(local, &zeros[..len as usize])?;
                }
            }
        }
        Ok(())
    }

    /// Two warm-up rounds, then `iterations` timed ones: median GB/s and the rounds' times;
    /// with `notify`, each request carries a notification (`--notify-requests`).
    pub(super) fn measure(
        &self,
        shape: &Shape,
        direction: Direction,
        iterations: usize,
        notify: bool,
    ) -> Result<(f64, Timing), BoxError> {
        let bytes = shape.bytes() as f64;
        let mut gbps = Vec::new();
        let mut timing = Timing::default();
        for round in 0..iterations + 2 {
            let started = Instant::now();
            let mut batch = self.batch(shape, direction);
            if notify {
                batch = batch.notify(format!("request {round}").into_bytes());
            }
            let transfer = batch.submit()?;
            let submitted = started.elapsed();
            // This thread has nothing else to do: it looks for the end as a latency-critical
            // server thread would, so the figures are the transfer's and not a wake-up's.
            let done = transfer.wait_spinning(WAIT_SPIN)?;
            let elapsed = started.elapsed();
            let done = self.carried(done)?;
            if notify {
                self.echoed()?;
            }
            if round >= 2 {
                gbps.push(bytes / elapsed.as_secs_f64() / 1e9);
                timing.latencies.push(elapsed.as_secs_f64() * 1e6);
                timing.submits.push(submitted.as_secs_f64() * 1e6);
                timing.inside.push(done.elapsed.as_secs_f64() * 1e6);
            }
        }
        Ok((median(&gbps), timing))
    }

    /// `kv-layerwise`: per round, every layer's blocks are submitted up front, each to start
    /// after an event of the computing stream, which waits on the gate word; the host then
    /// "computes" each layer for `compute` and raises the gate. The latency is from the end of
    /// the last layer's compute, as this thread sees the computing stream pass its gate (an
    /// event after it, polled), to the last transfer's end; also returned, per round, the same
    /// from the return of the gate write, which adds the GPU's noticing the gate. Also returns
    /// one layer's transfer alone, with its data ready (p50, microseconds). The row's submit
    /// time is that of all layers of a round. Transfers that end while later layers compute
    /// are collected then, as a serving loop polls its finished layers, so the tail holds
    /// only the waits for the layers still moving.
    pub(super) fn layerwise(
        &self,
        paged: &Paged,
        compute: Duration,
        rounds: usize,
    ) -> Result<(Timing, Vec<f64>, f64), BoxError> {
        let computing = self
            .computing
            .as_ref()
            .ok_or("kv-layerwise needs a GPU stream; it does not run with --host")?;
        let layers = paged.pools / 2;
        // A layer's K and V pools; layer `index` starts this far into both areas.
        let layer = Paged {
            pools: 2,
            ..paged.clone()
        };
        let layer_at = |index: u64| index * 2 * paged.pool_bytes();
        let mut timing = Timing::default();
        let mut released = Vec::with_capacity(rounds);
        let mut gate = 0u32;
        for round in 0..rounds + 2 {
            let started = Instant::now();
            let mut transfers = Vec::with_capacity(layers as usize);
            let mut last = None;
            let mut queue = || -> Result<(), BoxError> {
                for index in 0..layers {
                    computing.wait_value32(&self.gate, 0, gate + index as u32 + 1)?;
                    let computed = computing.record_event()?;
                    if index + 1 == layers {
                        last = Some(computing.record_event()?);
                    }
                    let copy = self.block_copy_at(&layer, layer_at(index));
                    transfers.push(
                        self.engine
                            .batch(&self.peer)
                            .write_blocks(copy)
                            .after(computed)
                            .submit()?,
                    );
                }
                Ok(())
            };
            let queued = queue();
            self.raise_gates_on_error(queued)?;
            let submitted = started.elapsed();
            let mut moving = transfers.into_iter().peekable();
            let mut compute_all = || -> Result<(), BoxError> {
                for _ in 0..layers {
                    let until = Instant::now() + compute;
                    while Instant::now() < until {
                        // Layers queue on one stream, so they end in order: the oldest one
                        // still moving is the one to look at.
                        if let Some(done) = moving.peek_mut().and_then(FutureExt::now_or_never) {
                            self.carried(done?)?;
                            moving.next();
                        }
                        std::hint::spin_loop();
                    }
                    gate += 1;
                    self.gate.write_at(0, &gate.to_le_bytes())?;
                }
                Ok(())
            };
            let ran = compute_all();
            self.raise_gates_on_error(ran)?;
            let release = Instant::now();
            if let Some(last) = &last {
                while !last.query()? {
                    if release.elapsed() > Duration::from_secs(10) {
                        return Err(
                            "the computing stream did not pass its last gate within 10 s".into(),
                        );
                    }
                }
            }
            let computed = Instant::now();
            for transfer in moving {
                self.carried(transfer.wait_spinning(WAIT_SPIN)?)?;
            }
            let tail = computed.elapsed();
            // A layer's time inside the engine includes its wait for the compute, so the row
            // leaves it out (0).
            if round >= 2 {
                released.push(release.elapsed().as_secs_f64() * 1e6);
                timing.latencies.push(tail.as_secs_f64() * 1e6);
                timing.submits.push(submitted.as_secs_f64() * 1e6);
            }
        }
        let mut alone = Vec::with_capacity(rounds);
        for round in 0..rounds + 2 {
            let started = Instant::now();
            let done = self
                .engine
                .batch(&self.peer)
                .write_blocks(self.block_copy_at(&layer, 0))
                .submit()?
                .wait_spinning(WAIT_SPIN)?;
            let elapsed = started.elapsed();
            self.carried(done)?;
            if round >= 2 {
                alone.push(elapsed.as_secs_f64() * 1e6);
            }
        }
        Ok((timing, released, median(&alone)))
    }

    /// `outcome`, after raising every `kv-layerwise` gate when it is an error: a layer that
    /// failed to queue or to end leaves gates down that nothing raises now, and every stream
    /// behind them would stay held.
    pub(super) fn raise_gates_on_error(
        &self,
        outcome: Result<(), BoxError>,
    ) -> Result<(), BoxError> {
        if outcome.is_err() {
            self.gate.write_at(0, &u32::MAX.to_le_bytes())?;
        }
        outcome
    }

    pub(super) fn batch(&self, shape: &Shape, direction: Direction) -> ferry::Batch {
        let mut batch = self.engine.batch(&self.peer);
        match shape {
            Shape::Paged(paged) => {
                let copy = self.block_copy(paged);
                batch = match direction {
                    Direction::Write => batch.write_blocks(copy),
                    Direction::Read => batch.read_blocks(copy),
                };
            }
            Shape::Entries(blocks) => {
                // The list in one call, as a server holding a request's entries adds them.
                let entries = blocks
                    .iter()
                    .map(|&(local, remote, len)| (local, self.remote + remote, len));
                batch = match direction {
                    Direction::Write => batch.write_entries(&self.local, entries),
                    Direction::Read => batch.read_entries(&self.local, entries),
                };
            }
            Shape::Ping(len) => {
                batch = batch.write(&self.local, 0, self.remote, *len);
            }
        }
        batch
    }

    pub(super) fn block_copy(&self, paged: &Paged) -> BlockCopy {
        self.block_copy_at(paged, 0)
    }

    /// The block copy of `paged`'s pools, which start `at` bytes into both sides' areas.
    pub(super) fn block_copy_at(&self, paged: &Paged, at: u64) -> BlockCopy {
        let layout = BlockLayout::packed(paged.pool_bytes(), paged.block_bytes);
        let mut copy = BlockCopy::new(
            paged.block_bytes,
            layout,
            layout,
            Arc::clone(&paged.local_ids),
            Arc::clone(&paged.remote_ids),
        );
        let area = self.remote - self.remote_buffer.addr;
        for pool in 0..paged.pools {
            let offset = at + pool * paged.pool_bytes();
            copy = copy.pool_at(&self.local, offset, &self.remote_buffer, area + offset);
        }
        copy
    }

    /// `rounds` writes of `len` bytes with a notification each, after 20 warm-up ones: the
    /// microseconds from the start of each submit until the decode process held the
    /// notification, by the clock both processes share; and, interleaved with them, the same
    /// for a notification sent alone ([`ferry::Engine::notify_blocking`]).
    pub(super) fn ping(&self, len: u64, rounds: usize) -> Result<(Vec<f64>, Vec<f64>), BoxError> {
        let mut latencies = Vec::with_capacity(rounds);
        let mut alone = Vec::with_capacity(rounds);
        for round in 0..rounds + 20 {
            let sent = now_ns();
            self.carried(
                self.engine
                    .batch(&self.peer)
                    .write(&self.local, 0, self.remote, len)
                    .notify(format!("ping {sent}").into_bytes())
                    .submit_blocking()?,
            )?;
            let held = self.echoed()?;
            let sent_alone = now_ns();
            self.engine
                .notify_blocking(&self.peer, format!("alone {sent_alone}"))?;
            let held_alone = self.echoed()?;
            if round >= 20 {
                latencies.push(held.saturating_sub(sent) as f64 / 1e3);
                alone.push(held_alone.saturating_sub(sent_alone) as f64 / 1e3);
            }
        }
        Ok((latencies, alone))
    }

    /// The time the decode process says it held the last notification, from its echo.
    pub(super) fn echoed(&self) -> Result<u64, BoxError> {
        let echo = self
            .inbox
            .borrow_mut()
            .recv_timeout_blocking(Duration::from_secs(10))?
            .ok_or("the decode process did not echo a notification within 10 s")?;
        let text = String::from_utf8_lossy(&echo.payload).into_owned();
        let held = text
            .rsplit(' ')
            .next()
            .and_then(|field| field.parse().ok())
            .ok_or_else(|| format!("unexpected echo {text:?}"))?;
        Ok(held)
    }

    /// Checks every destination block against what its source block carries.
    pub(super) fn verify(
        &self,
        blocks: &[(u64, u64, u64)],
        direction: Direction,
        base: &[u8],
    ) -> Result<bool, BoxError> {
        match direction {
            Direction::Write => {
                let mut gather = self.engine.batch(&self.peer);
                let mut at = 0;
                for &(_, remote, len) in blocks {
                    gather = gather.read(&self.check, at, self.remote + remote, len);
                    at += len;
                }
                self.carried(gather.submit_blocking()?)?;
                let mut landed = vec![0u8; at as usize];
                self.check.read_at(0, &mut landed)?;
                let mut at = 0usize;
                for (index, &(_, _, len)) in blocks.iter().enumerate() {
                    let len = len as usize;
                    if landed[at..at + len] != *block_bytes(base, index, len as u64) {
                        return Ok(false);
                    }
                    at += len;
                }
                Ok(true)
            }
            Direction::Read => {
                let mut landed = Vec::new();
                for (index, &(local, _, len)) in blocks.iter().enumerate() {
                    landed.resize(len as usize, 0);
                    self.local.read_at(local, &mut landed)?;
                    if landed != block_bytes(base, index, len) {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }
}
