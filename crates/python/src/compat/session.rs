//! The engine behind the address-based compatible APIs (Mooncake's and NIXL's): ferry's engine
//! plus the bookkeeping such callers imply (registrations by containment, peers by session
//! name, paged copies named by addresses).

use super::moving::Moving;
use super::paged::{extent, PagedCopy};
use super::regions::Regions;
use super::spans::{self, Outside, Span};
use super::templates::Templates;
use ferry::{BlockCopy, BufferDescriptor, Direction, Engine, Notifications, Peer};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// One entry of a transfer: local address, the peer's address, length.
pub(crate) type Entry = (u64, u64, u64);

/// How long a synchronous call looks for its transfer's end before it parks: the
/// caller waits for nothing else, and a parked thread's wake-up (and the cold core it wakes
/// on) costs a 1.25 GiB request about a quarter of its rate on an H200.
pub(crate) const WAIT_SPIN: Duration = Duration::from_millis(20);

/// Whether the engine uses RDMA, and with which devices, as `initialize` was asked.
#[derive(Debug, Clone, Default)]
pub(crate) struct RdmaChoice {
    /// `None`: no RDMA (protocol `tcp`); `Some(None)`: every device with an active port;
    /// `Some(Some(names))`: those devices, in that order (Mooncake's `device_name`).
    pub(crate) devices: Option<Option<Vec<String>>>,
}

impl RdmaChoice {
    /// From `initialize`'s `protocol` and `device_name`: RDMA unless the protocol is `tcp`;
    /// the comma-separated device names, or every device when there are none.
    pub(crate) fn new(protocol: Option<&str>, device_name: Option<&str>) -> RdmaChoice {
        if protocol.is_some_and(|protocol| protocol.eq_ignore_ascii_case("tcp")) {
            return RdmaChoice { devices: None };
        }
        let names: Vec<String> = device_name
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
            .collect();
        RdmaChoice {
            devices: Some((!names.is_empty()).then_some(names)),
        }
    }
}

/// The state behind an initialized `TransferEngine`.
pub(crate) struct Session {
    engine: Engine,
    regions: RwLock<Regions>,
    peers: Mutex<HashMap<String, OpenPeer>>,
    inbox: Mutex<Notifications>,
}

/// A peer opened by session name, with its buffers sorted by address and as spans in the
/// same order (computed once per descriptor, not per transfer), and the block copies of its
/// last paged submit.
#[derive(Clone)]
pub(crate) struct OpenPeer {
    pub(crate) peer: Peer,
    buffers: Arc<[BufferDescriptor]>,
    spans: Arc<[Span]>,
    templates: Templates,
}

impl OpenPeer {
    fn new(peer: Peer) -> OpenPeer {
        let mut buffers = peer.buffers();
        buffers.sort_unstable_by_key(|buffer| (buffer.addr, buffer.len));
        let spans: Vec<Span> = buffers
            .iter()
            .map(|buffer| (buffer.addr, buffer.len))
            .collect();
        OpenPeer {
            peer,
            buffers: buffers.into(),
            spans: spans.into(),
            templates: Templates::default(),
        }
    }
}

impl Session {
    /// Starts an engine listening on `listen`, advertised as `host`.
    pub(crate) fn start(
        listen: &str,
        host: &str,
        store: Arc<dyn ferry::metadata::MetadataStore>,
        timeout: Duration,
        rdma: RdmaChoice,
    ) -> Result<Session, String> {
        let links = ferry::Links::default();
        #[cfg(feature = "rdma")]
        let links = links.rdma(rdma.devices.map(|devices| ferry::RdmaConfig {
            devices,
            ..ferry::RdmaConfig::default()
        }));
        #[cfg(not(feature = "rdma"))]
        if rdma.devices.is_some_and(|devices| devices.is_some()) {
            tracing::warn!("this ferry_kv was built without RDMA, so device_name is ignored: build the wheel with `--features rdma`");
        }
        let engine = links
            .builder()
            .listen(listen)
            .advertise(host)
            .metadata(store)
            .transfer_timeout(timeout)
            .build_blocking()
            .map_err(|error| error.to_string())?;
        let inbox = engine.notifications().map_err(|error| error.to_string())?;
        Ok(Session {
            engine,
            regions: RwLock::default(),
            peers: Mutex::default(),
            inbox: Mutex::new(inbox),
        })
    }

    /// The engine's session name, `host:port`.
    pub(crate) fn name(&self) -> &str {
        self.engine.name()
    }

    /// The port peers reach this engine at.
    pub(crate) fn port(&self) -> u16 {
        self.engine.local_addr().port()
    }

    /// Registers every `(addr, len)`, or none of them.
    ///
    /// # Safety
    /// Each range stays valid memory until it is unregistered.
    pub(crate) unsafe fn register(&self, ranges: &[(u64, u64)]) -> Result<(), String> {
        let mut regions = self.regions.write();
        let mut added = Vec::new();
        for &(addr, len) in ranges {
            // SAFETY: passed on from this fn's contract.
            match unsafe { regions.register(&self.engine, addr, len) } {
                Ok(true) => added.push(addr),
                Ok(false) => {}
                Err(error) => {
                    // Only this call's new regions go; ranges registered before it stay.
                    for earlier in added {
                        let _ = regions.unregister(earlier);
                    }
                    return Err(error);
                }
            }
        }
        if !added.is_empty() {
            self.forget_templates();
        }
        Ok(())
    }

    /// Unregisters the regions starting at each address; stops at the first unknown one.
    pub(crate) fn unregister(&self, addrs: &[u64]) -> Result<(), String> {
        let mut regions = self.regions.write();
        let mut removed = Vec::with_capacity(addrs.len());
        let mut outcome = Ok(());
        for &addr in addrs {
            match regions.unregister(addr) {
                Ok(region) => removed.push(region),
                Err(unknown) => {
                    outcome = Err(unknown);
                    break;
                }
            }
        }
        self.forget_templates();
        drop(regions);
        // Dropping a region waits for transfers still using it, outside the table's lock.
        drop(removed);
        outcome
    }

    /// Drops every peer's kept block copies: they hold regions, and a region replaced or
    /// unregistered would stay allocated (an allocated buffer's memory with it) while they do.
    fn forget_templates(&self) {
        for peer in self.peers.lock().values() {
            peer.templates.clear();
        }
    }

    /// Whether `[addr, addr + len)` lies inside one registered region; the reason when not.
    pub(crate) fn check_local(&self, addr: u64, len: u64) -> Result<(), String> {
        self.regions.read().containing(addr, len).map(|_| ())
    }

    /// A host buffer of `len` bytes, registered; its address.
    pub(crate) fn allocate(&self, len: u64) -> Result<u64, String> {
        let length = usize::try_from(len).map_err(|_| format!("length {len} is too large"))?;
        let region = self
            .engine
            .allocate(length as u64)
            .map_err(|error| error.to_string())?;
        let addr = region.addr();
        self.regions.write().insert(region);
        Ok(addr)
    }

    /// Copies `bytes` to `addr`: into registered memory, or else, as Mooncake does, into
    /// host memory of the caller's own that touches no registration.
    pub(crate) fn write_local(&self, addr: u64, bytes: &[u8]) -> Result<(), String> {
        let regions = self.regions.read();
        match regions.containing(addr, bytes.len() as u64) {
            Ok((region, offset)) => region
                .write_at(offset, bytes)
                .map_err(|error| error.to_string()),
            Err(reason) if !regions.is_callers_own(addr, bytes.len() as u64) => Err(reason),
            // SAFETY: Mooncake's contract for write_bytes_to_buffer: the caller names memory
            // of its own, which it leaves alone during the call; it touches no registration,
            // and the copy checks that it is mapped host memory first.
            Err(_) => unsafe { ferry::write_caller_memory(addr, bytes) }
                .map_err(|error| error.to_string()),
        }
    }

    /// Reads `len` bytes at `addr`: registered memory, or else host memory of the caller's.
    pub(crate) fn read_local(&self, addr: u64, len: u64) -> Result<Vec<u8>, String> {
        let regions = self.regions.read();
        let length = usize::try_from(len).map_err(|_| format!("length {len} is too large"))?;
        let mut bytes = vec![0; length];
        match regions.containing(addr, len) {
            Ok((region, offset)) => region
                .read_at(offset, &mut bytes)
                .map_err(|error| error.to_string())?,
            Err(reason) if !regions.is_callers_own(addr, len) => return Err(reason),
            // SAFETY: as in `write_local`, for read_bytes_from_buffer.
            Err(_) => unsafe { ferry::read_caller_memory(addr, &mut bytes) }
                .map_err(|error| error.to_string())?,
        }
        Ok(bytes)
    }

    /// The open peer named `target`, connecting (again, when it went away) as needed.
    pub(crate) fn peer(&self, target: &str) -> Result<OpenPeer, String> {
        if let Some(peer) = self.peers.lock().get(target) {
            if peer.peer.is_alive() {
                return Ok(peer.clone());
            }
        }
        self.reconnect(target)
    }

    /// Opens `target` afresh (its descriptor fetched again) and keeps it for later calls.
    fn reconnect(&self, target: &str) -> Result<OpenPeer, String> {
        let peer = OpenPeer::new(
            self.engine
                .connect_blocking(target)
                .map_err(|error| error.to_string())?,
        );
        self.peers.lock().insert(target.to_owned(), peer.clone());
        Ok(peer)
    }

    /// Submits `entries` to `target`, with the notification payload `notify` delivered after
    /// the data. Every range is checked first; then long lists without a notification go as
    /// several batches of [`PART_ENTRIES`], each submitted as soon as it is built, so the
    /// first part's bytes move while the rest are planned.
    pub(crate) fn submit(
        &self,
        target: &str,
        direction: Direction,
        entries: &[Entry],
        notify: Option<Vec<u8>>,
    ) -> Result<Moving, String> {
        if entries.is_empty() && notify.is_none() {
            return Err("the batch is empty; pass at least one buffer".into());
        }
        let mut peer = self.peer(target)?;
        let regions = self.regions.read();
        match check(&regions, &peer, entries) {
            Err(Outside::Peer(outside)) => {
                // The peer may have registered it after this engine fetched its descriptor.
                peer = self.reconnect(target)?;
                check(&regions, &peer, entries).map_err(|_| outside)?;
            }
            checked => checked.map_err(|outside| outside.to_string())?,
        }
        let size = match notify {
            Some(_) => entries.len().max(1),
            None => PART_ENTRIES,
        };
        let mut parts = Vec::with_capacity(entries.len().div_ceil(size));
        let mut notify = notify;
        for part in entries.chunks(size) {
            let mut batch = self.engine.batch(&peer.peer);
            // Callers list one tensor's blocks one after another: the entries are added a run
            // of one region at a time, the region searched once per run. (The engine plans
            // entries of block shape into block copies for links that move those faster.)
            let mut rest = part;
            while let Some(&(local, _, len)) = rest.first() {
                let (region, offset) = regions.containing(local, len)?;
                let (start, end) = (local - offset, local - offset + region.len());
                // `check` found every range inside a registration: no end overflows, and the
                // run holds at least its first entry.
                let run = rest
                    .iter()
                    .position(|&(local, _, len)| local < start || local + len > end)
                    .unwrap_or(rest.len());
                let entries = rest[..run]
                    .iter()
                    .map(|&(local, remote, len)| (local - start, remote, len));
                batch = match direction {
                    Direction::Write => batch.write_entries(region, entries),
                    Direction::Read => batch.read_entries(region, entries),
                };
                rest = &rest[run..];
            }
            if let Some(payload) = notify.take() {
                batch = batch.notify(payload);
            }
            parts.push(batch.submit().map_err(|error| error.to_string())?);
        }
        if let Some(payload) = notify {
            // No entries: the notification alone.
            let batch = self.engine.batch(&peer.peer).notify(payload);
            parts.push(batch.submit().map_err(|error| error.to_string())?);
        }
        Ok(Moving::new(parts))
    }

    /// Submits paged copies named by addresses to `target` as one batch, with the
    /// notification payload `notify` delivered after the data. Each pool must lie inside one
    /// local registration and one buffer the peer registered.
    pub(crate) fn submit_paged(
        &self,
        target: &str,
        direction: Direction,
        copies: &[PagedCopy],
        notify: Option<Vec<u8>>,
    ) -> Result<Moving, String> {
        if copies.is_empty() && notify.is_none() {
            return Err("the transfer is empty; pass at least one descriptor".into());
        }
        let mut peer = self.peer(target)?;
        let regions = self.regions.read();
        let built = match block_copies(&regions, &peer, copies) {
            Err(Outside::Peer(_)) => {
                // The peer may have registered it after this engine fetched its descriptor.
                peer = self.reconnect(target)?;
                block_copies(&regions, &peer, copies)
            }
            built => built,
        }
        .map_err(|outside| outside.to_string())?;
        let mut batch = built
            .into_iter()
            .fold(self.engine.batch(&peer.peer), |batch, copy| {
                with_blocks(batch, direction, copy)
            });
        if let Some(payload) = notify {
            batch = batch.notify(payload);
        }
        batch
            .submit()
            .map(|transfer| Moving::new(vec![transfer]))
            .map_err(|error| error.to_string())
    }

    /// Sends `payload` to `target` on its own, once the peer accepted it.
    pub(crate) fn notify(&self, target: &str, payload: Vec<u8>) -> Result<(), String> {
        let peer = self.peer(target)?;
        self.engine
            .notify_blocking(&peer.peer, payload)
            .map_err(|error| error.to_string())
    }

    /// The notifications that arrived since the last call, in arrival order.
    pub(crate) fn notifications(&self) -> Vec<ferry::Notification> {
        let mut inbox = self.inbox.lock();
        let mut notes = Vec::new();
        while let Ok(Some(note)) = inbox.try_recv() {
            notes.push(note);
        }
        notes
    }
}

/// Entries of the address-based APIs go in batches of at most this many when they carry no
/// notification: large enough that each batch's block copies fill the GPU, small enough that
/// the first batch's bytes move early while the host plans the rest.
const PART_ENTRIES: usize = 8192;

/// Whether every entry's local range lies inside memory registered here and its peer range
/// inside a buffer the peer registered (as far as this engine knows); the first one outside
/// when not. Checked before anything is submitted, so that a bad entry fails the call with
/// nothing moved, as Mooncake's engine does.
fn check(regions: &Regions, peer: &OpenPeer, entries: &[Entry]) -> Result<(), Outside> {
    let mut local_span: Option<Span> = None;
    let mut remote_span: Option<usize> = None;
    let inside = |(start, len): Span, addr: u64, size: u64| {
        addr >= start
            && addr
                .checked_add(size)
                .is_some_and(|end| end <= start.saturating_add(len))
    };
    for &(local, remote, len) in entries {
        if !local_span.is_some_and(|span| inside(span, local, len)) {
            let (region, offset) = regions.containing(local, len).map_err(Outside::Local)?;
            local_span = Some((local - offset, region.len()));
        }
        if !remote_span.is_some_and(|index| inside(peer.spans[index], remote, len)) {
            remote_span = Some(spans::holding(&peer.spans, remote, len).ok_or_else(|| {
                Outside::Peer(format!("peer range {remote:#x}+{len} is not inside memory the peer registered; the peer must register_memory it first"))
            })?);
        }
    }
    Ok(())
}

/// `batch` with `copy` added in `direction`.
fn with_blocks(batch: ferry::Batch, direction: Direction, copy: BlockCopy) -> ferry::Batch {
    match direction {
        Direction::Write => batch.write_blocks(copy),
        Direction::Read => batch.read_blocks(copy),
    }
}

/// `copies` to `peer` as block copies, each pool found in the local `regions` and the peer's
/// buffers, or taken from the copies of the peer's last submit when it named the same pools.
fn block_copies(
    regions: &Regions,
    peer: &OpenPeer,
    copies: &[PagedCopy],
) -> Result<Vec<BlockCopy>, Outside> {
    let generation = regions.generation();
    if let Some(reused) = peer.templates.reuse(generation, copies) {
        return Ok(reused);
    }
    let built = copies
        .iter()
        .map(|paged| block_copy(regions, peer, paged))
        .collect::<Result<Vec<_>, _>>()?;
    peer.templates.keep(generation, copies, &built);
    Ok(built)
}

/// `paged` to `peer` as a block copy, each pool found in the local `regions` and the peer's
/// buffers.
fn block_copy(regions: &Regions, peer: &OpenPeer, paged: &PagedCopy) -> Result<BlockCopy, Outside> {
    let mut copy = BlockCopy::new(
        paged.len,
        paged.local,
        paged.remote,
        Arc::clone(&paged.local_ids),
        Arc::clone(&paged.remote_ids),
    );
    let local_extent = extent(&paged.local, paged.len);
    let remote_extent = extent(&paged.remote, paged.len);
    for &(local, remote) in &paged.pools {
        let (region, offset) = regions
            .containing(local, local_extent)
            .map_err(Outside::Local)?;
        let buffer = spans::holding(&peer.spans, remote, remote_extent).ok_or_else(|| {
            Outside::Peer(format!("peer range {remote:#x}+{remote_extent} is not inside memory the peer registered; the peer must register it first"))
        })?;
        let buffer = &peer.buffers[buffer];
        copy = copy.pool_at(region, offset, buffer, remote - buffer.addr);
    }
    Ok(copy)
}

#[cfg(test)]
mod tests {
    use super::RdmaChoice;

    #[test]
    fn tcp_leaves_rdma_out_and_device_names_are_split_on_commas() {
        assert_eq!(RdmaChoice::new(Some("tcp"), Some("mlx5_0")).devices, None);
        assert_eq!(RdmaChoice::new(Some("rdma"), None).devices, Some(None));
        assert_eq!(RdmaChoice::new(None, Some(" , ")).devices, Some(None));
        assert_eq!(
            RdmaChoice::new(Some("rdma"), Some("mlx5_0, mlx5_3")).devices,
            Some(Some(vec!["mlx5_0".to_owned(), "mlx5_3".to_owned()]))
        );
    }
}
