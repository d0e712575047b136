//! `ferry_kv.nixl`: the agent behind NIXL's Python API (`nixl._api.nixl_agent`), on ferry.
//!
//! The Python half (`ferry_kv/_nixl_api.py`) takes NIXL's argument forms (tensors, tuples,
//! numpy arrays, handle objects) and hands this agent plain bytes and integers; everything
//! that scales with the request (descriptor rows, index arrays, planning) is done here, with
//! the GIL released. Errors are NIXL's exception classes ([`errors`]).

mod dlist;
mod errors;
mod in_place;
mod metadata;
mod notes;
mod xfer;

use crate::compat::moving::Moving;
use crate::compat::session::{RdmaChoice, Session};
use dlist::DescList;
use errors::NixlError;
use ferry::Direction;
use metadata::{AgentMetadata, Registration};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use xfer::Moves;

/// A remote agent as its metadata described it; `generation` tells lists prepared for an
/// earlier load of the same name from lists of this one.
struct Remote {
    metadata: AgentMetadata,
    generation: u64,
}

/// A prepared descriptor list: local, or of a remote agent (name and generation).
struct Prepared {
    list: Arc<DescList>,
    remote: Option<(String, u64)>,
}

/// Where a prepared transfer stands.
enum State {
    /// Made, never posted.
    Ready,
    /// Posted and moving.
    Running {
        transfer: Moving,
        posted: Instant,
        started_us: u64,
        post_us: u64,
    },
    /// The last post moved every byte.
    Done {
        started_us: u64,
        post_us: u64,
        xfer_us: u64,
    },
    /// The last post failed; the reason was logged.
    Failed { started_us: u64, post_us: u64 },
}

/// Where a prepared transfer stands, as `poll` finds it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    /// Never posted.
    Ready,
    /// Moving.
    Proc,
    /// The last post moved every byte.
    Done,
    /// The last post failed.
    Err,
}

impl Status {
    /// The state name NIXL reports (`Ready` has none: NIXL raises for it).
    fn name(self) -> &'static str {
        match self {
            Status::Ready => "READY",
            Status::Proc => "PROC",
            Status::Done => "DONE",
            Status::Err => "ERR",
        }
    }
}

/// A prepared transfer.
struct Xfer {
    direction: Direction,
    remote: (String, u64),
    moves: Moves,
    bytes: u64,
    descriptors: u64,
    notif: Vec<u8>,
    state: State,
}

impl Xfer {
    /// Looks at a running transfer's end without waiting.
    fn poll(&mut self) -> Status {
        if let State::Running {
            transfer,
            posted,
            started_us,
            post_us,
        } = &mut self.state
        {
            let (started_us, post_us) = (*started_us, *post_us);
            match transfer.try_outcome() {
                None => return Status::Proc,
                Some(Ok(_)) => {
                    let xfer_us = posted.elapsed().as_micros() as u64;
                    self.state = State::Done {
                        started_us,
                        post_us,
                        xfer_us,
                    };
                }
                Some(Err(error)) => {
                    tracing::error!("a NIXL transfer to {} failed: {error}", self.remote.0);
                    self.state = State::Failed {
                        started_us,
                        post_us,
                    };
                }
            }
        }
        match self.state {
            State::Ready => Status::Ready,
            State::Running { .. } => Status::Proc,
            State::Done { .. } => Status::Done,
            State::Failed { .. } => Status::Err,
        }
    }
}

/// NIXL's agent on a ferry engine.
#[pyclass(module = "ferry_kv._ferry", frozen)]
pub(crate) struct NixlAgent {
    name: String,
    session: Session,
    telemetry: bool,
    registrations: Mutex<Vec<Registration>>,
    remotes: Mutex<HashMap<String, Remote>>,
    lists: Mutex<HashMap<u64, Prepared>>,
    xfers: Mutex<HashMap<u64, Arc<Mutex<Xfer>>>>,
    next_handle: AtomicU64,
    next_generation: AtomicU64,
    next_message: AtomicU64,
    assembler: Mutex<notes::Assembler>,
}

impl NixlAgent {
    fn handle(&self) -> u64 {
        self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    fn xfer(&self, handle: u64) -> Result<Arc<Mutex<Xfer>>, NixlError> {
        self.xfers.lock().get(&handle).cloned().ok_or_else(|| {
            NixlError::NotFound(format!(
                "transfer handle {handle:#x} is not live (released, or of another agent)"
            ))
        })
    }

    /// The engine name of remote agent `name` as loaded in `generation`, or why not.
    fn remote_engine(&self, (name, generation): &(String, u64)) -> Result<String, NixlError> {
        match self.remotes.lock().get(name) {
            Some(remote) if remote.generation == *generation => Ok(remote.metadata.engine.clone()),
            _ => Err(NixlError::NotFound(format!(
                "remote agent {name} was removed (or loaded again) since its lists were prepared; add_remote_agent and prepare them again"
            ))),
        }
    }

    /// Whether `notif` can ride on a transfer: it must fit one ferry notification.
    fn check_attached(&self, notif: &[u8]) -> Result<(), NixlError> {
        if notes::fits_whole(&self.name, notif.len()) {
            Ok(())
        } else {
            Err(NixlError::InvalidParam(format!(
                "a transfer's notification of {} bytes does not fit one ferry notification (64 KiB with the agent's name); send it with send_notif after the transfer",
                notif.len()
            )))
        }
    }

    /// Posts `xfer` (whose lock the caller holds) with `notif`.
    fn post(&self, xfer: &mut Xfer, notif: &[u8]) -> Result<&'static str, NixlError> {
        if xfer.poll() == Status::Proc {
            return Err(NixlError::RepostActive(
                "the transfer is still moving; post it again once check_xfer_state says DONE or ERR".into(),
            ));
        }
        let engine = self.remote_engine(&xfer.remote)?;
        let payload = if notif.is_empty() {
            None
        } else {
            self.check_attached(notif)?;
            let id = self.next_message.fetch_add(1, Ordering::Relaxed);
            notes::encode(&self.name, id, notif).pop()
        };
        let started_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_micros() as u64);
        let posted = Instant::now();
        let submitted = match &xfer.moves {
            Moves::Paged(copies) => {
                self.session
                    .submit_paged(&engine, xfer.direction, copies, payload)
            }
            Moves::Flat(entries) => self
                .session
                .submit(&engine, xfer.direction, entries, payload),
        };
        let post_us = posted.elapsed().as_micros() as u64;
        match submitted {
            Ok(transfer) => {
                xfer.state = State::Running {
                    transfer,
                    posted,
                    started_us,
                    post_us,
                };
                // A short transfer may already be over: NIXL reports DONE at once then.
                Ok(xfer.poll().name())
            }
            Err(error) => {
                xfer.state = State::Failed {
                    started_us,
                    post_us,
                };
                Err(NixlError::Backend(error))
            }
        }
    }
}

#[pymethods]
impl NixlAgent {
    /// Starts agent `name` on a ferry engine listening on `listen` (`host:port`, port 0 for
    /// any), reached by peers at `host`. Transfers fail after `timeout_s` seconds; with
    /// `telemetry`, finished transfers report their times.
    #[new]
    fn new(
        py: Python<'_>,
        name: String,
        listen: &str,
        host: &str,
        timeout_s: f64,
        telemetry: bool,
    ) -> PyResult<Self> {
        if name.is_empty() {
            return Err(NixlError::InvalidParam("an agent needs a name".into()).into());
        }
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(NixlError::InvalidParam(format!(
                "transfer timeout {timeout_s} s is not a positive number of seconds"
            ))
            .into());
        }
        let store = Arc::new(ferry::metadata::PeerToPeer::default());
        let timeout = Duration::from_secs_f64(timeout_s);
        let session = py
            .detach(|| Session::start(listen, host, store, timeout, RdmaChoice::new(None, None)))
            .map_err(NixlError::Backend)?;
        Ok(NixlAgent {
            name,
            session,
            telemetry,
            registrations: Mutex::default(),
            remotes: Mutex::default(),
            lists: Mutex::default(),
            xfers: Mutex::default(),
            next_handle: AtomicU64::new(1),
            next_generation: AtomicU64::new(1),
            next_message: AtomicU64::new(1),
            assembler: Mutex::default(),
        })
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The ferry engine's name, `host:port`, which the metadata carries to peers.
    #[getter]
    fn engine(&self) -> &str {
        self.session.name()
    }

    /// Registers every `(addr, len, devID, mem)` range, or none of them. The memory must stay
    /// valid until it is deregistered (the Python half holds the tensors it was given).
    fn register(&self, py: Python<'_>, ranges: Vec<Registration>) -> PyResult<()> {
        let spans: Vec<(u64, u64)> = ranges
            .iter()
            .map(|&(addr, len, _, _)| (addr, len))
            .collect();
        // SAFETY: NIXL's contract, passed on to the caller: registered memory stays valid until
        // deregister_memory.
        py.detach(|| unsafe { self.session.register(&spans) })
            .map_err(NixlError::Backend)?;
        let mut registrations = self.registrations.lock();
        for range in ranges {
            if !registrations.contains(&range) {
                registrations.push(range);
            }
        }
        Ok(())
    }

    /// Deregisters the ranges starting at each address.
    fn deregister(&self, py: Python<'_>, addrs: Vec<u64>) -> PyResult<()> {
        {
            let registrations = self.registrations.lock();
            if let Some(addr) = addrs
                .iter()
                .find(|addr| !registrations.iter().any(|range| range.0 == **addr))
            {
                return Err(NixlError::NotFound(format!(
                    "no memory is registered at {addr:#x}; deregister_memory takes what register_memory returned"
                ))
                .into());
            }
        }
        py.detach(|| self.session.unregister(&addrs))
            .map_err(NixlError::NotFound)?;
        self.registrations
            .lock()
            .retain(|range| !addrs.contains(&range.0));
        Ok(())
    }

    /// The metadata blob a peer passes to `add_remote`.
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let metadata = AgentMetadata {
            name: self.name.clone(),
            engine: self.session.name().to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            registrations: self.registrations.lock().clone(),
        };
        PyBytes::new(py, &metadata.encode())
    }

    /// Loads a peer's metadata; the peer's agent name. Loading a name again replaces it.
    fn add_remote(&self, blob: &[u8]) -> PyResult<String> {
        let metadata = AgentMetadata::decode(blob)?;
        let name = metadata.name.clone();
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        self.remotes.lock().insert(
            name.clone(),
            Remote {
                metadata,
                generation,
            },
        );
        Ok(name)
    }

    /// Forgets remote agent `name` (nothing happens for an unknown one); lists prepared for
    /// it stop working.
    fn remove_remote(&self, name: &str) {
        self.remotes.lock().remove(name);
    }

    /// Whether remote agent `name` is loaded and, when `rows` are given (3 columns), whether
    /// it registered every one of them.
    fn check_remote(&self, name: &str, rows: Option<&[u8]>) -> PyResult<bool> {
        let remotes = self.remotes.lock();
        let Some(remote) = remotes.get(name) else {
            return Ok(false);
        };
        let Some(rows) = rows else {
            return Ok(true);
        };
        let list = DescList::decode(rows, 3)?;
        Ok(list
            .rows()
            .iter()
            .all(|row| remote_holds(&remote.metadata, row.addr, row.extent())))
    }

    /// Prepares a list of `width`-column rows (3, or 5 for the strided form), local when
    /// `agent` is `None`, else of that remote agent; its handle. Every descriptor must be
    /// inside memory that side registered.
    fn prep_list(
        &self,
        py: Python<'_>,
        agent: Option<String>,
        rows: &[u8],
        width: usize,
    ) -> PyResult<u64> {
        let list = py.detach(|| DescList::decode(rows, width))?;
        let remote = match agent {
            None => {
                for (index, row) in list.rows().iter().enumerate() {
                    self.session
                        .check_local(row.addr, row.extent())
                        .map_err(|reason| {
                            NixlError::NotFound(format!("local descriptor row {index}: {reason}"))
                        })?;
                }
                None
            }
            Some(name) => {
                let remotes = self.remotes.lock();
                let remote = remotes.get(&name).ok_or_else(|| {
                    NixlError::NotFound(format!(
                        "no remote agent {name} is loaded; add_remote_agent its metadata first"
                    ))
                })?;
                if let Some((index, row)) = list
                    .rows()
                    .iter()
                    .enumerate()
                    .find(|(_, row)| !remote_holds(&remote.metadata, row.addr, row.extent()))
                {
                    return Err(NixlError::NotFound(format!(
                        "remote descriptor row {index} ({:#x}+{}) is not inside memory agent {name} registered",
                        row.addr,
                        row.extent()
                    ))
                    .into());
                }
                Some((name, remote.generation))
            }
        };
        let handle = self.handle();
        self.lists.lock().insert(
            handle,
            Prepared {
                list: Arc::new(list),
                remote,
            },
        );
        Ok(handle)
    }

    /// Releases a prepared list; unknown handles are ignored, as NIXL releases idempotently.
    fn release_list(&self, handle: u64) {
        self.lists.lock().remove(&handle);
    }

    /// Makes a transfer of descriptors `local_ids` of list `local` with `remote_ids` of list
    /// `remote`, `op` `"READ"` or `"WRITE"`, with `notif` sent to the remote agent after the
    /// data; its handle. The indices are native-endian `i64`s in the first `local_bytes` and
    /// `remote_bytes` of two buffers, read in place ([`in_place::plan`]): numpy arrays
    /// as the caller passed them, or bytearrays the Python layer reuses from call to call for
    /// other sequences (a fresh buffer per call cost more in page faults than planning).
    #[allow(clippy::too_many_arguments)]
    fn make_xfer(
        &self,
        op: &str,
        local: u64,
        local_ids: &Bound<'_, PyAny>,
        local_bytes: usize,
        remote: u64,
        remote_ids: &Bound<'_, PyAny>,
        remote_bytes: usize,
        notif: Vec<u8>,
    ) -> PyResult<u64> {
        let direction = direction(op)?;
        if !notif.is_empty() {
            self.check_attached(&notif)?;
        }
        let (local_list, remote_list, remote_agent) = {
            let lists = self.lists.lock();
            let find = |handle: u64| {
                lists.get(&handle).ok_or_else(|| {
                    NixlError::NotFound(format!(
                        "list handle {handle:#x} is not live (released, or of another agent)"
                    ))
                })
            };
            let (local, remote) = (find(local)?, find(remote)?);
            if local.remote.is_some() {
                return Err(NixlError::InvalidParam(
                    "the local side of a transfer is a remote agent's list; pass the one prepared with NIXL_INIT_AGENT".into(),
                )
                .into());
            }
            let Some(agent) = remote.remote.clone() else {
                return Err(NixlError::InvalidParam(
                    "the remote side of a transfer is a local list; pass one prepared for the remote agent".into(),
                )
                .into());
            };
            (Arc::clone(&local.list), Arc::clone(&remote.list), agent)
        };
        self.remote_engine(&remote_agent)?;
        let in_place::Planned {
            moves,
            bytes,
            descriptors,
        } = in_place::plan(
            &local_list,
            (local_ids, local_bytes),
            &remote_list,
            (remote_ids, remote_bytes),
        )?;
        let handle = self.handle();
        self.xfers.lock().insert(
            handle,
            Arc::new(Mutex::new(Xfer {
                direction,
                remote: remote_agent,
                moves,
                bytes,
                descriptors,
                notif,
                state: State::Ready,
            })),
        );
        Ok(handle)
    }

    /// Posts transfer `handle` (again, once an earlier post ended), with `notif` instead of
    /// the one it was made with when given; `"DONE"` or `"PROC"`.
    fn post_xfer(
        &self,
        py: Python<'_>,
        handle: u64,
        notif: Option<Vec<u8>>,
    ) -> PyResult<&'static str> {
        let xfer = self.xfer(handle)?;
        py.detach(|| {
            let mut xfer = xfer.lock();
            let notif = notif.unwrap_or_else(|| xfer.notif.clone());
            self.post(&mut xfer, &notif)
        })
        .map_err(PyErr::from)
    }

    /// `"DONE"`, `"PROC"` or `"ERR"` (the reason logged) for transfer `handle`.
    fn xfer_state(&self, handle: u64) -> PyResult<&'static str> {
        match self.xfer(handle)?.lock().poll() {
            Status::Ready => Err(NixlError::NotPosted(format!(
                "transfer handle {handle:#x} was never posted; call transfer() first"
            ))
            .into()),
            status => Ok(status.name()),
        }
    }

    /// `(startTime, postDuration, xferDuration, totalBytes, descCount)` of transfer `handle`'s
    /// last post, microseconds and counts; the transfer time is 0 until it ended.
    fn xfer_telemetry(&self, handle: u64) -> PyResult<(u64, u64, u64, u64, u64)> {
        if !self.telemetry {
            return Err(NixlError::NoTelemetry(
                "the agent was created with capture_telemetry=False".into(),
            )
            .into());
        }
        let xfer = self.xfer(handle)?;
        let mut xfer = xfer.lock();
        xfer.poll();
        let (started, post, took) = match xfer.state {
            State::Ready => (0, 0, 0),
            State::Running {
                started_us,
                post_us,
                ..
            }
            | State::Failed {
                started_us,
                post_us,
            } => (started_us, post_us, 0),
            State::Done {
                started_us,
                post_us,
                xfer_us,
            } => (started_us, post_us, xfer_us),
        };
        Ok((started, post, took, xfer.bytes, xfer.descriptors))
    }

    /// Releases transfer `handle`; raises while it still moves. Unknown handles are ignored.
    fn release_xfer(&self, handle: u64) -> PyResult<()> {
        let mut xfers = self.xfers.lock();
        let Some(xfer) = xfers.get(&handle) else {
            return Ok(());
        };
        if xfer.lock().poll() == Status::Proc {
            return Err(NixlError::RepostActive(format!(
                "transfer handle {handle:#x} is still moving and a GPU copy cannot be taken back; release it once check_xfer_state says DONE or ERR"
            ))
            .into());
        }
        xfers.remove(&handle);
        Ok(())
    }

    /// Sends `msg` to remote agent `agent` on its own, in pieces when it is long.
    fn send_notif(&self, py: Python<'_>, agent: &str, msg: Vec<u8>) -> PyResult<()> {
        if msg.len() > notes::MAX_MESSAGE_BYTES {
            return Err(NixlError::InvalidParam(format!(
                "a notification of {} bytes is longer than the {} accepted",
                msg.len(),
                notes::MAX_MESSAGE_BYTES
            ))
            .into());
        }
        let engine = match self.remotes.lock().get(agent) {
            Some(remote) => remote.metadata.engine.clone(),
            None => {
                return Err(NixlError::NotFound(format!(
                    "no remote agent {agent} is loaded; add_remote_agent its metadata first"
                ))
                .into())
            }
        };
        let id = self.next_message.fetch_add(1, Ordering::Relaxed);
        py.detach(|| {
            for piece in notes::encode(&self.name, id, &msg) {
                self.session.notify(&engine, piece)?;
            }
            Ok::<_, String>(())
        })
        .map_err(|error| NixlError::Backend(error).into())
    }

    /// The notifications that arrived since the last call, as `(agent name, message)` in
    /// arrival order.
    fn notifications<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        let arrived = self.session.notifications();
        let mut assembler = self.assembler.lock();
        arrived
            .iter()
            .filter_map(|note| assembler.accept(&note.from, &note.payload))
            .map(|(name, msg)| (name, PyBytes::new(py, &msg)))
            .collect()
    }
}

/// Whether `metadata` lists a registration holding `[addr, addr + len)`.
fn remote_holds(metadata: &AgentMetadata, addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    metadata
        .registrations
        .iter()
        .any(|&(start, length, _, _)| start <= addr && end <= start.saturating_add(length))
}

/// The direction of NIXL's `"READ"` / `"WRITE"`.
fn direction(op: &str) -> Result<Direction, NixlError> {
    match op {
        "READ" => Ok(Direction::Read),
        "WRITE" => Ok(Direction::Write),
        other => Err(NixlError::InvalidParam(format!(
            "operation {other:?} is neither \"READ\" nor \"WRITE\""
        ))),
    }
}

/// Adds the agent class and NIXL's exceptions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NixlAgent>()?;
    errors::register(m)
}
