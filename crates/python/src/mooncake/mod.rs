//! `ferry_kv.mooncake`: Mooncake's Python `TransferEngine`, with its call conventions exactly
//! (positional arguments, `0`/`-1` returns, batch ids where `0` means failure), on ferry.
//!
//! Failures are returned as codes, as Mooncake's callers expect, and the reason is logged
//! (stderr, `FERRY_LOG`). Any `protocol` is accepted: ferry picks the fastest transport for
//! each pair of buffers itself.

mod batches;
mod host;

use crate::compat::moving::Moving;
use crate::compat::notify;
use crate::compat::session::{self, Entry, RdmaChoice, Session};
use crate::lists::{u64_or_reason, u64s_or_reason, Arg};
use batches::Batches;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::OnceLock;
use std::time::Duration;

/// What `send_probe` returns for a peer it could not reach: the code Mooncake's wheel returns
/// there, which its callers may test for.
const PROBE_FAILED: i32 = -102;

/// Seconds a transfer may take when `MC_TRANSFER_TIMEOUT` is not set.
const DEFAULT_TIMEOUT_SECONDS: u64 = 30;
/// The shortest transfer timeout; Mooncake raises smaller `MC_TRANSFER_TIMEOUT` values to it.
const MIN_TIMEOUT_SECONDS: u64 = 5;

/// Which way a transfer moves bytes, as Mooncake's `TransferOpcode`.
#[pyclass(module = "ferry_kv.mooncake", eq, eq_int, frozen)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransferOpcode {
    /// From the peer into local memory.
    Read = 0,
    /// From local memory to the peer.
    Write = 1,
}

impl TransferOpcode {
    fn direction(self) -> ferry::Direction {
        match self {
            TransferOpcode::Read => ferry::Direction::Read,
            TransferOpcode::Write => ferry::Direction::Write,
        }
    }
}

/// A message delivered to the target after a transfer's data, as Mooncake's `TransferNotify`.
#[pyclass(module = "ferry_kv.mooncake", get_all, set_all)]
#[derive(Clone)]
pub(crate) struct TransferNotify {
    /// Who the message is from, as the sender states it.
    name: String,
    /// The message.
    msg: String,
}

#[pymethods]
impl TransferNotify {
    #[new]
    #[pyo3(signature = (name = String::new(), msg = String::new()))]
    fn new(name: String, msg: String) -> Self {
        TransferNotify { name, msg }
    }

    fn __repr__(&self) -> String {
        format!("TransferNotify(name={:?}, msg={:?})", self.name, self.msg)
    }
}

/// Mooncake's `TransferEngine` on ferry. Create it, call `initialize`, register memory, then
/// transfer to other engines by their session name (`host:port`).
#[pyclass(module = "ferry_kv.mooncake", frozen)]
pub(crate) struct TransferEngine {
    session: OnceLock<Session>,
    batches: Batches,
    /// `MC_TRANSFER_TIMEOUT` as it was when the engine was created (Mooncake reads it there).
    timeout: Result<Duration, String>,
}

/// Logs `error` and returns Mooncake's failure code.
fn failed(call: &str, error: impl std::fmt::Display) -> i32 {
    tracing::error!("{call}: {error}");
    -1
}

/// Whether a list-taking call got lists of one length.
fn same_lengths(call: &str, lengths: &[usize]) -> Result<(), String> {
    if lengths.windows(2).all(|pair| pair[0] == pair[1]) {
        Ok(())
    } else {
        Err(format!("{call} was given lists of different lengths {lengths:?}; pass one address and one length per buffer"))
    }
}

fn entries(bufs: &[u64], peer_addrs: &[u64], lens: &[u64]) -> Vec<Entry> {
    bufs.iter()
        .zip(peer_addrs)
        .zip(lens)
        .map(|((&local, &remote), &len)| (local, remote, len))
        .collect()
}

impl TransferEngine {
    fn session(&self) -> Result<&Session, String> {
        self.session
            .get()
            .ok_or_else(|| "the engine is not initialized; call initialize(local_hostname, metadata_server, protocol, device_name) first".to_owned())
    }

    /// Runs `work` on the initialized session with the GIL released. A failure, an engine
    /// not yet initialized included, is logged and answered with `failure`, Mooncake's code.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        call: &str,
        failure: T,
        work: impl FnOnce(&Session) -> Result<T, String> + Send,
    ) -> T {
        let outcome = match self.session() {
            Ok(session) => py.detach(|| work(session)),
            Err(error) => Err(error),
        };
        outcome.unwrap_or_else(|error| {
            failed(call, error);
            failure
        })
    }

    /// Registers each `(buffer_addrs[i], capacities[i])`, all or none, for the Python call
    /// `call` (which failures name). Returns 0 or -1.
    fn register_ranges(
        &self,
        py: Python<'_>,
        call: &str,
        buffer_addrs: Arg<Vec<u64>>,
        capacities: Arg<Vec<u64>>,
    ) -> i32 {
        self.run(py, call, -1, |session| {
            let (buffer_addrs, capacities) = (buffer_addrs?, capacities?);
            same_lengths(call, &[buffer_addrs.len(), capacities.len()])?;
            let ranges: Vec<(u64, u64)> = buffer_addrs.into_iter().zip(capacities).collect();
            // SAFETY: Mooncake's contract: registered memory stays valid until it is
            // unregistered, which is what the caller promises by registering it.
            unsafe { session.register(&ranges) }.map(|()| 0)
        })
    }

    /// Runs a blocking transfer of `entries` with the GIL released; Mooncake's code. Ctrl-C
    /// interrupts the wait (`KeyboardInterrupt`); the transfer goes on.
    fn transfer_blocking(
        &self,
        py: Python<'_>,
        call: &str,
        target: &str,
        opcode: TransferOpcode,
        entries: Arg<Vec<Entry>>,
        notify: Option<(Vec<u8>, Vec<u8>)>,
    ) -> PyResult<i32> {
        let submitted = self.run(py, call, None, |session| {
            let entries = entries?;
            if entries.is_empty() && notify.is_none() {
                return Ok(Some(None));
            }
            let notify = notify.map(|(name, msg)| notify::encode(&name, &msg));
            let transfer = session.submit(target, opcode.direction(), &entries, notify)?;
            Ok(Some(Some(transfer)))
        });
        match submitted {
            None => Ok(-1),
            Some(None) => Ok(0),
            Some(Some(transfer)) => Ok(match batches::code_of(wait(py, transfer)?) {
                batches::DONE => 0,
                _ => -1,
            }),
        }
    }

    /// Submits `entries` with the GIL released and returns the batch id (0 on failure).
    fn submit_tracked(
        &self,
        py: Python<'_>,
        call: &str,
        target: &str,
        opcode: TransferOpcode,
        entries: Arg<Vec<Entry>>,
    ) -> u64 {
        self.run(py, call, 0, |session| {
            let entries = entries?;
            let transfer = session.submit(target, opcode.direction(), &entries, None)?;
            Ok(self.batches.track(transfer))
        })
    }
}

#[pymethods]
impl TransferEngine {
    #[new]
    fn new() -> Self {
        TransferEngine {
            session: OnceLock::new(),
            batches: Batches::default(),
            timeout: transfer_timeout(),
        }
    }

    /// Mooncake's `TransferOpcode`, also reachable as `TransferEngine.TransferOpcode`.
    #[classattr]
    #[pyo3(name = "TransferOpcode")]
    fn opcode_type(py: Python<'_>) -> Py<PyAny> {
        py.get_type::<TransferOpcode>().into_any().unbind()
    }

    /// Starts the engine: listens on `local_hostname` (a port in it is ignored; see
    /// `get_rpc_port`), keeps descriptors where `metadata_server` says (`P2PHANDSHAKE`, or a
    /// `redis://` URL). `protocol` and `device_name` (either may be None) are accepted and
    /// ferry picks the transport. Returns 0, or -1 with the reason logged.
    #[pyo3(signature = (local_hostname, metadata_server, protocol = None, device_name = None))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: Option<&str>,
        device_name: Option<&str>,
    ) -> i32 {
        if self.session.get().is_some() {
            return failed(
                "initialize",
                "the engine is initialized already; create another TransferEngine for a second one",
            );
        }
        let host = match host::host_of(local_hostname) {
            Ok(host) => host,
            Err(error) => return failed("initialize", error),
        };
        let store = match host::store_for(metadata_server) {
            Ok(store) => store,
            Err(error) => return failed("initialize", error),
        };
        let timeout = match &self.timeout {
            Ok(timeout) => *timeout,
            Err(error) => return failed("initialize", error),
        };
        tracing::debug!(
            protocol,
            device_name,
            "ferry picks the transport for each pair of buffers itself; `tcp` leaves RDMA out, device_name lists the RDMA devices"
        );
        let listen = host::listen_address(&host);
        let rdma = RdmaChoice::new(protocol, device_name);
        let started = py.detach(|| Session::start(&listen, &host, store, timeout, rdma));
        match started {
            Ok(session) => {
                if self.session.set(session).is_err() {
                    return failed(
                        "initialize",
                        "another thread initialized this engine at the same time",
                    );
                }
                0
            }
            Err(error) => failed("initialize", error),
        }
    }

    /// The port peers reach this engine at; its session name is `host:port`. 0 before
    /// `initialize`.
    fn get_rpc_port(&self) -> u16 {
        self.session.get().map_or(0, |session| session.port())
    }

    /// This engine's session name, `host:port` (IPv6 hosts bracketed), as peers name it.
    fn get_session_id(&self) -> String {
        self.session
            .get()
            .map_or_else(String::new, |session| session.name().to_owned())
    }

    /// Registers `length` bytes at `buffer_addr` (host or GPU memory; the kind is detected).
    /// Transfers may then use any range inside it. Returns 0 or -1.
    #[pyo3(signature = (buffer_addr, capacity, location = "*", remote_accessible = true))]
    fn register_memory(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = u64_or_reason)] buffer_addr: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] capacity: Arg<u64>,
        location: &str,
        remote_accessible: bool,
    ) -> i32 {
        let _ = (location, remote_accessible);
        let one = |value: Arg<u64>| value.map(|value| vec![value]);
        self.register_ranges(py, "register_memory", one(buffer_addr), one(capacity))
    }

    /// Registers each `(buffer_addrs[i], capacities[i])`, all or none. Returns 0 or -1.
    #[pyo3(signature = (buffer_addrs, capacities, location = "*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = u64s_or_reason)] buffer_addrs: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] capacities: Arg<Vec<u64>>,
        location: &str,
    ) -> i32 {
        let _ = location;
        self.register_ranges(py, "batch_register_memory", buffer_addrs, capacities)
    }

    /// Unregisters the memory registered at `buffer_addr`. Returns 0 or -1.
    fn unregister_memory(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = u64_or_reason)] buffer_addr: Arg<u64>,
    ) -> i32 {
        self.batch_unregister_memory(py, buffer_addr.map(|addr| vec![addr]))
    }

    /// Unregisters the memory registered at each address. Returns 0 or -1.
    fn batch_unregister_memory(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = u64s_or_reason)] buffer_addrs: Arg<Vec<u64>>,
    ) -> i32 {
        self.run(py, "batch_unregister_memory", -1, |session| {
            session.unregister(&buffer_addrs?).map(|()| 0)
        })
    }

    /// Writes `length` bytes at `buffer` to `peer_buffer_address` of `target_hostname`;
    /// returns 0 once they are visible there, or -1 (a timeout included).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64_or_reason)] buffer: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] peer_buffer_address: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] length: Arg<u64>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let entries = one_entry(buffer, peer_buffer_address, length);
        self.transfer_blocking(
            py,
            "transfer_sync_write",
            target_hostname,
            TransferOpcode::Write,
            entries,
            None,
        )
    }

    /// Reads `length` bytes at `peer_buffer_address` of `target_hostname` into `buffer`.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64_or_reason)] buffer: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] peer_buffer_address: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] length: Arg<u64>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let entries = one_entry(buffer, peer_buffer_address, length);
        self.transfer_blocking(
            py,
            "transfer_sync_read",
            target_hostname,
            TransferOpcode::Read,
            entries,
            None,
        )
    }

    /// One transfer in the direction of `opcode`, with `notify` delivered after its data.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64_or_reason)] buffer: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] peer_buffer_address: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] length: Arg<u64>,
        opcode: PyRef<'_, TransferOpcode>,
        notify: Option<PyRef<'_, TransferNotify>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let entries = one_entry(buffer, peer_buffer_address, length);
        let notify = notify.map(|note| note_bytes(&note));
        self.transfer_blocking(
            py,
            "transfer_sync",
            target_hostname,
            *opcode,
            entries,
            notify,
        )
    }

    /// Writes every `(buffers[i], peer_buffer_addresses[i], lengths[i])` as one batch.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64s_or_reason)] buffers: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] peer_buffer_addresses: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] lengths: Arg<Vec<u64>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let call = "batch_transfer_sync_write";
        let lists = (buffers, peer_buffer_addresses, lengths);
        self.batch_blocking(
            py,
            call,
            target_hostname,
            TransferOpcode::Write,
            lists,
            None,
        )
    }

    /// Reads every `(buffers[i], peer_buffer_addresses[i], lengths[i])` as one batch.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64s_or_reason)] buffers: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] peer_buffer_addresses: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] lengths: Arg<Vec<u64>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let call = "batch_transfer_sync_read";
        let lists = (buffers, peer_buffer_addresses, lengths);
        self.batch_blocking(py, call, target_hostname, TransferOpcode::Read, lists, None)
    }

    /// One batch in the direction of `opcode`, with `notify` delivered after all its data.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64s_or_reason)] buffers: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] peer_buffer_addresses: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] lengths: Arg<Vec<u64>>,
        opcode: PyRef<'_, TransferOpcode>,
        notify: Option<PyRef<'_, TransferNotify>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let lists = (buffers, peer_buffer_addresses, lengths);
        let notify = notify.map(|note| note_bytes(&note));
        self.batch_blocking(
            py,
            "batch_transfer_sync",
            target_hostname,
            *opcode,
            lists,
            notify,
        )
    }

    /// Starts a write and returns its batch id for `transfer_check_status` (0 on failure).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64_or_reason)] buffer: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] peer_buffer_address: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] length: Arg<u64>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let entries = one_entry(buffer, peer_buffer_address, length);
        self.submit_tracked(
            py,
            "transfer_submit_write",
            target_hostname,
            TransferOpcode::Write,
            entries,
        )
    }

    /// 1 when batch `batch_id` is done, 0 while it moves, -1 when it failed (or the id is
    /// unknown), -2 when it timed out. A finished batch's id is forgotten once reported.
    fn transfer_check_status(
        &self,
        #[pyo3(from_py_with = u64_or_reason)] batch_id: Arg<u64>,
    ) -> i32 {
        match self.session().and(batch_id) {
            Ok(batch_id) => self.batches.status(batch_id),
            Err(error) => failed("transfer_check_status", error),
        }
    }

    /// Starts a batch of writes and returns its id (0 on failure).
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64s_or_reason)] buffers: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] peer_buffer_addresses: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] lengths: Arg<Vec<u64>>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        self.batch_async(
            py,
            "batch_transfer_async_write",
            target_hostname,
            TransferOpcode::Write,
            buffers,
            peer_buffer_addresses,
            lengths,
        )
    }

    /// Starts a batch of reads and returns its id (0 on failure).
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64s_or_reason)] buffers: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] peer_buffer_addresses: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] lengths: Arg<Vec<u64>>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        self.batch_async(
            py,
            "batch_transfer_async_read",
            target_hostname,
            TransferOpcode::Read,
            buffers,
            peer_buffer_addresses,
            lengths,
        )
    }

    /// Starts a batch in the direction of `opcode` and returns its id (0 on failure).
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        #[pyo3(from_py_with = u64s_or_reason)] buffers: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] peer_buffer_addresses: Arg<Vec<u64>>,
        #[pyo3(from_py_with = u64s_or_reason)] lengths: Arg<Vec<u64>>,
        opcode: PyRef<'_, TransferOpcode>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let call = "batch_transfer_async";
        self.batch_async(
            py,
            call,
            target_hostname,
            *opcode,
            buffers,
            peer_buffer_addresses,
            lengths,
        )
    }

    /// Waits for every batch of `batch_ids`: 0 when all moved, -1 when any failed, timed out
    /// or is unknown. The ids are forgotten afterwards.
    fn get_batch_transfer_status(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = u64s_or_reason)] batch_ids: Arg<Vec<u64>>,
    ) -> i32 {
        self.run(py, "get_batch_transfer_status", -1, |_| {
            Ok(self.batches.wait_all(&batch_ids?))
        })
    }

    /// Opens `target_hostname` (fetching its descriptor): 0 when it answered, else
    /// [`PROBE_FAILED`] as Mooncake returns.
    fn send_probe(&self, py: Python<'_>, target_hostname: &str) -> i32 {
        self.run(py, "send_probe", PROBE_FAILED, |session| {
            session.peer(target_hostname).map(|_| 0)
        })
    }

    /// Mooncake hands its C++ engine to Mooncake Store (SGLang's HiCache) through this; ferry
    /// has no such engine to share, so the call raises and says what to use instead rather
    /// than return something Mooncake Store would crash on.
    fn get_engine(&self) -> PyResult<()> {
        Err(pyo3::exceptions::PyNotImplementedError::new_err(
            "ferry's TransferEngine has no Mooncake C++ engine to hand to Mooncake Store (SGLang's HiCache storage backend calls get_engine for it); for HiCache's Mooncake backend run Mooncake's own mooncake-transfer-engine package (FERRY_MOONCAKE=0 when both are installed), or choose a HiCache storage backend that needs no transfer engine",
        ))
    }

    /// The address of the first buffer `target_hostname` registered (0 when it has none or
    /// cannot be reached).
    fn get_first_buffer_address(&self, py: Python<'_>, target_hostname: &str) -> u64 {
        self.run(py, "get_first_buffer_address", 0, |session| {
            let open = session.peer(target_hostname)?;
            Ok(open.peer.buffers().first().map_or(0, |buffer| buffer.addr))
        })
    }

    /// The notifies delivered to this engine since the last call.
    fn get_notifies(&self) -> Vec<TransferNotify> {
        let Ok(session) = self.session() else {
            return Vec::new();
        };
        session
            .notifications()
            .into_iter()
            .map(|note| notify::decode(&note.from, &note.payload))
            .map(|(name, msg)| TransferNotify {
                name: String::from_utf8_lossy(&name).into_owned(),
                msg: String::from_utf8_lossy(&msg).into_owned(),
            })
            .collect()
    }

    /// A registered host buffer of `length` bytes owned by the engine; its address, 0 on
    /// failure. Free it with `free_managed_buffer`.
    fn allocate_managed_buffer(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = u64_or_reason)] length: Arg<u64>,
    ) -> u64 {
        self.run(py, "allocate_managed_buffer", 0, |session| {
            session.allocate(length?)
        })
    }

    /// Frees a buffer from `allocate_managed_buffer`. Returns 0 or -1.
    fn free_managed_buffer(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = u64_or_reason)] buffer_addr: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] length: Arg<u64>,
    ) -> i32 {
        let _ = length;
        self.batch_unregister_memory(py, buffer_addr.map(|addr| vec![addr]))
    }

    /// Copies the first `length` bytes of `src_data` (`bytes`, or `str` as UTF-8) into
    /// registered memory at `dest_address`. Returns 0 or -1.
    fn write_bytes_to_buffer(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = u64_or_reason)] dest_address: Arg<u64>,
        #[pyo3(from_py_with = source_bytes)] src_data: Arg<SourceBytes>,
        #[pyo3(from_py_with = u64_or_reason)] length: Arg<u64>,
    ) -> i32 {
        self.run(py, "write_bytes_to_buffer", -1, |session| {
            let (dest_address, src_data, length) = (dest_address?, src_data?, length?);
            let src_data = src_data.as_bytes();
            let bytes = usize::try_from(length)
                .ok()
                .and_then(|length| src_data.get(..length))
                .ok_or_else(|| {
                    format!(
                        "length {length} is more than the {} bytes given",
                        src_data.len()
                    )
                })?;
            session.write_local(dest_address, bytes).map(|()| 0)
        })
    }

    /// `length` bytes of registered memory at `source_address`, as `bytes` (empty on failure).
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = u64_or_reason)] source_address: Arg<u64>,
        #[pyo3(from_py_with = u64_or_reason)] length: Arg<u64>,
    ) -> Bound<'py, PyBytes> {
        let bytes = self.run(py, "read_bytes_from_buffer", Vec::new(), |session| {
            session.read_local(source_address?, length?)
        });
        PyBytes::new(py, &bytes)
    }
}

/// What `write_bytes_to_buffer` copies: `bytes`, or a `str` (its UTF-8), as Mooncake takes.
#[derive(FromPyObject)]
enum SourceBytes {
    Bytes(Vec<u8>),
    Text(String),
}

/// What `write_bytes_to_buffer` copies, or why `value` is neither `bytes` nor `str`.
fn source_bytes(value: &Bound<'_, PyAny>) -> PyResult<Arg<SourceBytes>> {
    Ok(value
        .extract::<SourceBytes>()
        .map_err(|error| format!("the data to write must be bytes or str: {error}")))
}

impl SourceBytes {
    fn as_bytes(&self) -> &[u8] {
        match self {
            SourceBytes::Bytes(bytes) => bytes,
            SourceBytes::Text(text) => text.as_bytes(),
        }
    }
}

/// The three lists of a batch call: local addresses, the peer's addresses, lengths.
type Lists = (Arg<Vec<u64>>, Arg<Vec<u64>>, Arg<Vec<u64>>);

/// The one entry of a single-transfer call.
fn one_entry(buffer: Arg<u64>, peer_address: Arg<u64>, length: Arg<u64>) -> Arg<Vec<Entry>> {
    Ok(vec![(buffer?, peer_address?, length?)])
}

/// The entries of a batch call's three lists, which must be of one length.
fn list_entries(
    call: &str,
    buffers: Arg<Vec<u64>>,
    peer_addresses: Arg<Vec<u64>>,
    lengths: Arg<Vec<u64>>,
) -> Arg<Vec<Entry>> {
    let (buffers, peer_addresses, lengths) = (buffers?, peer_addresses?, lengths?);
    same_lengths(call, &[buffers.len(), peer_addresses.len(), lengths.len()])?;
    Ok(entries(&buffers, &peer_addresses, &lengths))
}

/// The name and message of a notify, as bytes.
fn note_bytes(note: &TransferNotify) -> (Vec<u8>, Vec<u8>) {
    (
        note.name.clone().into_bytes(),
        note.msg.clone().into_bytes(),
    )
}

impl TransferEngine {
    /// A blocking batch from Mooncake's three lists; Mooncake's code.
    fn batch_blocking(
        &self,
        py: Python<'_>,
        call: &str,
        target: &str,
        opcode: TransferOpcode,
        (buffers, peer_addresses, lengths): Lists,
        notify: Option<(Vec<u8>, Vec<u8>)>,
    ) -> PyResult<i32> {
        let entries = list_entries(call, buffers, peer_addresses, lengths);
        self.transfer_blocking(py, call, target, opcode, entries, notify)
    }

    #[allow(clippy::too_many_arguments)]
    fn batch_async(
        &self,
        py: Python<'_>,
        call: &str,
        target: &str,
        opcode: TransferOpcode,
        buffers: Arg<Vec<u64>>,
        peer_buffer_addresses: Arg<Vec<u64>>,
        lengths: Arg<Vec<u64>>,
    ) -> u64 {
        let entries = list_entries(call, buffers, peer_buffer_addresses, lengths);
        self.submit_tracked(py, call, target, opcode, entries)
    }
}

/// Waits for `transfer` (spinning first, as a latency-critical caller does) with the GIL
/// released, running Python's signal handlers every [`crate::interrupt::SLICE`] so that
/// Ctrl-C raises `KeyboardInterrupt` at once instead of when the transfer ends.
fn wait(py: Python<'_>, mut transfer: Moving) -> PyResult<ferry::Result<ferry::Completion>> {
    let mut outcome = None;
    let mut spin = session::WAIT_SPIN;
    crate::interrupt::wait_interruptibly(py, None, |until| {
        outcome = transfer.wait_until(std::mem::take(&mut spin), until);
        outcome.is_some()
    })?;
    Ok(outcome.unwrap_or_else(|| {
        Err(ferry::Error::Internal {
            what: "an interruptible wait ended without the transfer's outcome".into(),
        })
    }))
}

/// The transfer timeout: `MC_TRANSFER_TIMEOUT` seconds, as Mooncake reads it (at least
/// [`MIN_TIMEOUT_SECONDS`], so a setting tuned for Mooncake behaves the same here).
fn transfer_timeout() -> Result<Duration, String> {
    match std::env::var("MC_TRANSFER_TIMEOUT") {
        Err(_) => Ok(Duration::from_secs(DEFAULT_TIMEOUT_SECONDS)),
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(seconds) => Ok(Duration::from_secs(seconds.max(MIN_TIMEOUT_SECONDS))),
            _ => Err(format!(
                "MC_TRANSFER_TIMEOUT={text:?} is not a whole number of seconds; set it to one (5 or more) or unset it"
            )),
        },
    }
}

/// Adds the compatible classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TransferEngine>()?;
    m.add_class::<TransferOpcode>()?;
    m.add_class::<TransferNotify>()?;
    Ok(())
}
