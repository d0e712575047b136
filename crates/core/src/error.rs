//! The one error type of ferry-core, sorted by whose fault it is.

use std::fmt;

/// Everything that can go wrong in ferry. Each message says what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The peer sent something the protocol does not allow; the connection was closed.
    #[error("protocol violation by {peer}: {violation}; the connection was closed, check that both sides run the same ferry version")]
    Protocol {
        /// The peer's address or name.
        peer: String,
        /// What exactly was wrong.
        violation: ProtocolViolation,
    },
    /// A local or remote range is not covered by a registration, or is empty.
    #[error(transparent)]
    Range(#[from] RangeError),
    /// Memory of a kind this build cannot register or move yet.
    #[error("{memory} at {addr:#x} is not supported yet: {remedy}")]
    Unsupported {
        /// What the memory was found to be.
        memory: String,
        /// The address the caller passed.
        addr: u64,
        /// What to do instead.
        remedy: String,
    },
    /// No transport can reach the remote buffer from the local region.
    #[error("no transport can move data between local {local} and peer {peer}: {reason}")]
    Unavailable {
        /// The local memory location.
        local: String,
        /// The peer's name.
        peer: String,
        /// Why each transport declined.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The peer could not be reached at all.
    #[error("cannot reach peer {peer}: {reason}; check that its engine is running and that the name is its `host:port`")]
    Unreachable {
        /// The name that was asked for.
        peer: String,
        /// What failed.
        reason: String,
    },
    /// The peer went away while work was in flight; nothing further was delivered.
    #[error("peer {peer} went away: {reason}; the transfer failed and may have written part of its destination, so resend it after reconnecting")]
    PeerGone {
        /// The peer's name.
        peer: String,
        /// What was observed.
        reason: String,
    },
    /// The work did not finish in time.
    #[error("{what} did not finish within {after:?}; the peer may be overloaded or hung, raise the engine's transfer timeout or check the peer")]
    Timeout {
        /// What timed out.
        what: String,
        /// The limit that passed.
        after: std::time::Duration,
    },
    /// The engine was shut down before the work finished.
    #[error("the engine was shut down before {what} finished; keep the engine alive until transfers complete")]
    Shutdown {
        /// What was cut short.
        what: String,
    },
    /// The peer refused a request after it was sent; nothing of the refused frame was written.
    #[error("peer {peer} refused the request: {reason}")]
    Rejected {
        /// The peer's name.
        peer: String,
        /// Why, as the peer answered.
        reason: Refusal,
    },
    /// No live engine has published this name in the metadata store.
    #[error("no live engine is published as {name}: {reason}")]
    NotPublished {
        /// The engine name asked for.
        name: String,
        /// Where it was looked up, and what to check.
        reason: String,
    },
    /// Metadata could not be stored, fetched or parsed.
    #[error("metadata for {name}: {reason}")]
    Metadata {
        /// The engine name involved.
        name: String,
        /// What failed and what to do.
        reason: String,
    },
    /// Local I/O failed (binding the listener, for example).
    #[error("{what} failed: {source}")]
    Io {
        /// The operation that failed.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The peer did not prove it holds this engine's shared secret, or refused this engine's
    /// proof; nothing about registered memory was exchanged.
    #[error("authenticating with {peer} failed: {reason}")]
    Unauthenticated {
        /// The peer's address or name.
        peer: String,
        /// What went wrong, with what to do.
        reason: AuthFailure,
    },
    /// The caller used the API in a way it does not allow.
    #[error("{0}")]
    ApiMisuse(String),
    /// The operating system could not give the host memory asked for.
    #[error("allocating {bytes} bytes of host memory for {what} failed: the system is out of memory; free memory, lower the size, or register memory you allocated yourself")]
    OutOfMemory {
        /// What the memory was for.
        what: &'static str,
        /// How many bytes were asked for.
        bytes: u64,
    },
    /// A registration or allocation size that cannot be registered.
    #[error("cannot register {len} bytes at {addr:#x}: {problem}")]
    Registration {
        /// The address asked for; 0 for an allocation.
        addr: u64,
        /// The length asked for.
        len: u64,
        /// What is wrong with it, and what to do.
        problem: RegistrationProblem,
    },
    /// ferry reached a state it should never be in: a bug in ferry, not in the caller.
    #[error("internal error in ferry: {what}; this is a bug, please report it with this message")]
    Internal {
        /// The state that was found, with the numbers involved.
        what: String,
    },
}

/// Why a registration or allocation size was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistrationProblem {
    /// The length is 0.
    #[error("a registration must hold at least one byte; pass the buffer's real length")]
    Empty,
    /// The pointer is null.
    #[error("the pointer is null; pass the address of memory this process owns")]
    Null,
    /// The range runs past the end of the address space.
    #[error("the range runs past the end of the address space; check the address and length")]
    Wraps,
    /// Part of a host range is not mapped readable and writable in this process.
    #[error("host memory from {first:#x} is not mapped readable and writable in this process; pass memory this process allocated, with its real length")]
    NotMapped {
        /// The first byte of the range that no such mapping covers.
        first: u64,
    },
}

/// Why a peer refused a request, as it answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// A remote range is not inside one of the peer's registered regions as the peer sees
    /// them now (it may have deregistered the memory after its descriptor was fetched).
    #[error("{}its range {addr:#x}..+{len} is not inside one of its registered regions; it may have deregistered that memory since its descriptor was fetched, so fetch it again (reconnect) or fix the address", entry_prefix(.entry))]
    NotRegistered {
        /// Position in the caller's batch of the entry the range belongs to, when the range
        /// came from a batch entry.
        entry: Option<usize>,
        /// First byte of the refused range.
        addr: u64,
        /// Length of the refused range.
        len: u64,
    },
    /// Any other reason, in the peer's words.
    #[error("{0}")]
    Other(String),
}

fn entry_prefix(entry: &Option<usize>) -> String {
    entry.map_or_else(String::new, |index| format!("batch entry {index}: "))
}

/// Shorthand for results whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// [`Error::Registration`] for `len` bytes at `addr`.
    pub(crate) fn registration(addr: u64, len: u64, problem: RegistrationProblem) -> Self {
        Error::Registration { addr, len, problem }
    }

    /// `len` as this machine's size type for an allocation `what` (`"Engine::allocate"`, say)
    /// asked for: [`Error::ApiMisuse`] for none, [`Error::OutOfMemory`] for more than the
    /// address space holds.
    pub(crate) fn check_allocation(what: &'static str, len: u64) -> Result<usize> {
        if len == 0 {
            return Err(Error::ApiMisuse(format!(
                "{what} was asked for 0 bytes; ask for at least one byte"
            )));
        }
        usize::try_from(len)
            .ok()
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or(Error::OutOfMemory { what, bytes: len })
    }

    /// `len` as this machine's size type when `len` bytes at `addr` are not empty and do not
    /// run past the end of the address space.
    pub(crate) fn check_registration(addr: u64, len: u64) -> Result<usize> {
        if len == 0 {
            return Err(Error::registration(addr, len, RegistrationProblem::Empty));
        }
        match (addr.checked_add(len), usize::try_from(len)) {
            (Some(_), Ok(len)) => Ok(len),
            _ => Err(Error::registration(addr, len, RegistrationProblem::Wraps)),
        }
    }

    /// `self`, with a peer's refusal of a range outside its registrations naming the batch
    /// entry it came from: the first of `ranges` (remote address and length, in batch order)
    /// that holds the refused range's first byte. The peer only knows the range, since the
    /// sender splits and merges entries into frames.
    pub(crate) fn in_batch(self, ranges: &[(u64, u64)]) -> Self {
        match self {
            Error::Rejected {
                peer,
                reason:
                    Refusal::NotRegistered {
                        entry: None,
                        addr,
                        len,
                    },
            } => Error::Rejected {
                peer,
                reason: Refusal::NotRegistered {
                    entry: ranges
                        .iter()
                        .position(|&(start, size)| addr >= start && addr - start < size),
                    addr,
                    len,
                },
            },
            other => other,
        }
    }

    /// [`Error::Internal`] describing `what`.
    pub(crate) fn internal(what: impl Into<String>) -> Self {
        Error::Internal { what: what.into() }
    }
}

/// Which side of a transfer a range belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// This process's memory.
    Local,
    /// The peer's memory.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// A range that cannot be used, found before any byte moved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RangeError {
    /// The entry moves no bytes.
    #[error("entry {index} has length 0; drop empty entries before submitting")]
    ZeroLength {
        /// Position of the entry in its batch.
        index: usize,
    },
    /// The range is not inside one registered region.
    #[error("entry {index}: {side} range {addr:#x}..+{len} is not inside one registered region; register the memory first, or fix the address")]
    NotRegistered {
        /// Position of the entry in its batch.
        index: usize,
        /// Whose memory it is.
        side: Side,
        /// First byte of the range.
        addr: u64,
        /// Length of the range.
        len: u64,
    },
    /// An offset into a region runs past its end.
    #[error("entry {index}: offset {offset} + length {len} runs past the end of the {region_len}-byte local region")]
    PastRegionEnd {
        /// Position of the entry in its batch.
        index: usize,
        /// Offset into the region.
        offset: u64,
        /// Length of the entry.
        len: u64,
        /// Size of the region.
        region_len: u64,
    },
    /// An offset and length given to [`Region::write_at`](crate::Region::write_at) or
    /// [`Region::read_at`](crate::Region::read_at) run past the region's end.
    #[error("offset {offset} + length {len} runs past the end of the {region_len}-byte region; pass an offset and length that end inside the region")]
    OutsideRegion {
        /// Offset into the region.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// Size of the region.
        region_len: u64,
    },
    /// A new registration overlaps an existing one.
    #[error("region {addr:#x}..+{len} overlaps the registered region {existing_addr:#x}..+{existing_len}; deregister it first or register disjoint ranges")]
    Overlap {
        /// First byte of the new range.
        addr: u64,
        /// Length of the new range.
        len: u64,
        /// First byte of the existing region.
        existing_addr: u64,
        /// Length of the existing region.
        existing_len: u64,
    },
    /// A paged block copy is malformed: lengths, layouts or block ids.
    #[error("block copy {copy}: {problem}")]
    Blocks {
        /// Position of the block copy in its batch.
        copy: usize,
        /// What is wrong, naming the offending index.
        problem: String,
    },
    /// A pool of a block copy is not inside one registered range.
    #[error("block copy {copy}, pool {pool}: {side} range {addr:#x}..+{len} is not inside one registered region; register the whole pool, or fix its address or layout")]
    PoolNotRegistered {
        /// Position of the block copy in its batch.
        copy: usize,
        /// Position of the pool in the copy.
        pool: usize,
        /// Whose memory it is.
        side: Side,
        /// First byte of the pool.
        addr: u64,
        /// Bytes from the pool's first byte to the last one the copy can touch.
        len: u64,
    },
    /// A region handle from another engine was used.
    #[error(
        "entry {index} uses a region registered with another engine; register it with this engine"
    )]
    ForeignRegion {
        /// Position of the entry in its batch.
        index: usize,
    },
}

/// What a peer did wrong on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// The frame did not start with ferry's magic bytes.
    #[error("{}", describe_magic(.found))]
    BadMagic {
        /// The four bytes received.
        found: [u8; 4],
    },
    /// The peer speaks another protocol version.
    #[error("protocol version {found}, this build speaks {expected}")]
    Version {
        /// What the peer sent.
        found: u8,
        /// What this build speaks.
        expected: u8,
    },
    /// The frame kind is unknown.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The frame kind is not allowed in this direction or state.
    #[error("unexpected {kind} frame {context}")]
    Unexpected {
        /// The frame kind's name.
        kind: &'static str,
        /// Where it arrived.
        context: &'static str,
    },
    /// The frame is larger than the limit for its kind.
    #[error("{kind} frame of {len} bytes exceeds the {limit}-byte limit")]
    Oversized {
        /// The frame kind's name.
        kind: &'static str,
        /// The announced body length.
        len: u64,
        /// The limit for that kind.
        limit: u64,
    },
    /// The body ended before a field was complete.
    #[error("{what} needs {needed} more bytes than the frame holds")]
    TooShort {
        /// The field being read.
        what: &'static str,
        /// How many bytes were missing.
        needed: usize,
    },
    /// Bytes were left over after the last field.
    #[error("{0} trailing bytes after the last field")]
    TrailingBytes(usize),
    /// The body's contents do not add up.
    #[error("malformed body: {0}")]
    Malformed(&'static str),
    /// A response named a request that is not outstanding.
    #[error("response to unknown request {0}")]
    UnknownRequest(u64),
    /// A frame's integrity tag did not match its bytes.
    #[error("a {kind} frame's integrity tag does not match its bytes: they were altered on the way (or dropped or replayed), so the connection is closed; look for a middlebox or a path that rewrites traffic between the engines")]
    Tampered {
        /// The frame's kind.
        kind: &'static str,
    },
    /// A field of the peer's descriptor or export does not fit what its memory
    /// really is (as the CUDA driver reports it once mapped); nothing was copied.
    #[error("its descriptor's {field} {problem}")]
    Descriptor {
        /// The field, such as `export.offset` or `export.pieces`.
        field: &'static str,
        /// What is wrong with it, with the numbers involved.
        problem: String,
    },
}

/// What a peer that sent `found` instead of ferry's magic looks like.
fn describe_magic(found: &[u8; 4]) -> String {
    let printable = found
        .iter()
        .all(|byte| byte.is_ascii_graphic() || *byte == b' ');
    let text = String::from_utf8_lossy(found);
    match found {
        b"HTTP" => "it answered like an HTTP server (\"HTTP\"), not a ferry engine; check the port".into(),
        b"SSH-" => "it answered like an SSH server (\"SSH-\"), not a ferry engine; check the port".into(),
        _ if printable => format!(
            "it sent {text:?} where ferry's magic \"FRRY\" belongs: not a ferry engine; check the port"
        ),
        _ => format!(
            "it sent the bytes {found:02x?} where ferry's magic \"FRRY\" belongs: not a ferry engine; check the port"
        ),
    }
}

/// Why a shared-secret handshake failed, seen from the side that reports it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthFailure {
    /// The peer's proof does not match this engine's secret.
    #[error("the peer's proof does not match this engine's shared secret; give both engines the same secret (EngineBuilder::secret, FERRY_SECRET or --secret-file)")]
    PeerProofMismatch,
    /// The peer found this engine's proof does not match its secret.
    #[error("the peer refused this engine's proof: the two hold different shared secrets; give both engines the same secret (EngineBuilder::secret, FERRY_SECRET or --secret-file)")]
    RejectedByPeer,
    /// This engine has a secret and the peer has none.
    #[error("the peer has no shared secret configured while this engine has one; give the peer the same secret, or remove it here")]
    PeerHasNoSecret,
    /// The peer has a secret and this engine has none.
    #[error("the peer requires a shared secret and this engine has none; give this engine the peer's secret (EngineBuilder::secret, FERRY_SECRET or --secret-file)")]
    NoLocalSecret,
    /// The peer speaks another version of the handshake.
    #[error("the peer speaks authentication version {found}, this build speaks {ours}; run the same ferry version on both sides")]
    Version {
        /// The version the peer sent.
        found: u8,
        /// The version this build speaks.
        ours: u8,
    },
    /// A handshake message broke the protocol.
    #[error("malformed handshake: {0}; check that the peer is a ferry engine of the same version")]
    Malformed(&'static str),
    /// The stream ended before the handshake was over.
    #[error("the peer closed the connection before authentication finished; it may run an older ferry, or have refused this engine (see its log)")]
    Closed,
    /// The handshake did not finish in time.
    #[error("authentication did not finish within {after:?}; check that the peer is a ferry engine and not overloaded")]
    TimedOut {
        /// The limit that passed.
        after: std::time::Duration,
    },
    /// Reading or writing the stream failed.
    #[error("the connection failed during authentication: {0}")]
    Io(String),
}

/// A CUDA driver call that returned something other than success, or could not be made at all
/// because no driver library is installed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaError {
    /// The driver function that failed (or would have been called).
    pub call: &'static str,
    /// The numeric `CUresult` the driver returned; `None` when no driver library could be
    /// loaded, so the call was never made.
    pub code: Option<u32>,
    /// The symbolic name of the result, as the driver reports it (`CUDA_ERROR_...`); for a
    /// missing driver library, a description of that.
    pub name: String,
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let CudaError { call, code, name } = self;
        match code {
            Some(code) => write!(f, "CUDA call {call} failed with {name} ({code}); see https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html for what it means"),
            None => write!(f, "CUDA is unavailable, so {call} could not be called: {name}; install the NVIDIA driver to use GPU memory, or register host memory only"),
        }
    }
}

impl std::error::Error for CudaError {}
