use crate::import::PeerMapping;
use crate::transport::NvlinkConfig;
use ferry_core::cuda::{Context, Event, Poller, Stream};
use ferry_core::{Direction, Error, Link, Location, Result, TransferOp};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Mappings of one peer's allocations and the local streams that copy to and from them.
pub(crate) struct NvlinkLink {
    peer: String,
    /// Both engines live in this process: remote addresses are usable as they are.
    same_process: bool,
    config: NvlinkConfig,
    /// The peer's allocations mapped here, by the export that names them.
    mappings: Mutex<HashMap<String, Arc<(PeerMapping, u64)>>>,
    /// Copy streams of each local GPU, by ordinal.
    streams: Mutex<HashMap<u32, Arc<Vec<Stream>>>>,
    alive: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update is one insert, so a poisoned map is still consistent.
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl NvlinkLink {
    pub(crate) fn new(peer: String, same_process: bool, config: NvlinkConfig) -> NvlinkLink {
        NvlinkLink {
            peer,
            same_process,
            config,
            mappings: Mutex::default(),
            streams: Mutex::default(),
            alive: AtomicBool::new(true),
        }
    }

    fn streams(&self, ordinal: u32) -> Result<Arc<Vec<Stream>>> {
        let cached = lock(&self.streams).get(&ordinal).cloned();
        if let Some(streams) = cached {
            return Ok(streams);
        }
        let context = Context::get(ordinal)?;
        let streams = (0..self.config.streams_per_gpu.max(1))
            .map(|_| Stream::new(Arc::clone(&context)))
            .collect::<Result<Vec<_>, _>>()?;
        let streams = Arc::new(streams);
        lock(&self.streams).insert(ordinal, Arc::clone(&streams));
        Ok(streams)
    }

    /// Where the remote range of `op` is mapped in this process.
    fn remote_address(&self, op: &TransferOp, ordinal: u32) -> Result<u64> {
        if self.same_process {
            return Ok(op.remote_addr);
        }
        let Some(export) = &op.remote.export else {
            return Err(self.refused("its buffer carries no export"));
        };
        let key = format!("{export:?}");
        // The lookup is its own statement so its guard is released before the insert below.
        let cached = lock(&self.mappings).get(&key).cloned();
        let mapping = match cached {
            Some(mapping) => mapping,
            None => {
                let opened = PeerMapping::open(Context::get(ordinal)?, export)
                    .map_err(|reason| self.refused(&reason))?;
                let mapping = Arc::new(opened);
                lock(&self.mappings).insert(key, Arc::clone(&mapping));
                mapping
            }
        };
        let (mapping, offset) = mapping.as_ref();
        Ok(mapping.base() + offset + (op.remote_addr - op.remote.addr))
    }

    fn refused(&self, reason: &str) -> Error {
        Error::Unavailable {
            local: "GPU memory".into(),
            peer: self.peer.clone(),
            reason: format!("nvlink: {reason}"),
        }
    }
}

#[async_trait::async_trait]
impl Link for NvlinkLink {
    async fn transfer(&self, ops: Vec<TransferOp>) -> Result<()> {
        let mut events = Vec::new();
        let mut by_gpu: HashMap<u32, Vec<&TransferOp>> = HashMap::new();
        for op in &ops {
            let Location::Device { ordinal, .. } = op.region.info().location else {
                return Err(self.refused("a local range is not GPU memory"));
            };
            by_gpu.entry(ordinal).or_default().push(op);
        }
        for (ordinal, gpu_ops) in by_gpu {
            let streams = self.streams(ordinal)?;
            for (index, op) in gpu_ops.iter().enumerate() {
                let remote = self.remote_address(op, ordinal)?;
                let (dst, src) = match op.direction {
                    Direction::Write => (remote, op.local_addr),
                    Direction::Read => (op.local_addr, remote),
                };
                let len = usize::try_from(op.len).map_err(|_| {
                    self.refused("an op is longer than this machine's address space")
                })?;
                // SAFETY: the engine checked the local range against a live registration (the
                // op's RegionUse keeps it registered until `ops` drops, after the events below
                // fired) and the remote range against the peer's registered buffer, which the
                // IPC mapping covers from its allocation base; the two belong to different
                // registrations, so they do not overlap.
                unsafe { streams[index % streams.len()].copy(dst, src, len)? };
            }
            for stream in streams.iter() {
                events.push(Event::record(stream)?);
            }
        }
        let waits = events.into_iter().map(|event| Poller::global().wait(event));
        futures::future::try_join_all(waits).await?;
        drop(ops);
        Ok(())
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.alive.store(false, Ordering::Release);
        lock(&self.mappings).clear();
    }
}
