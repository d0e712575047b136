//! The per-connection protocol of the listener as a plain state machine: no sockets, no
//! runtime, no clock. A thin driver (`crate::tcp::server`) pumps bytes and time through it;
//! tests and the fuzz targets drive it from memory. The caller's side of a connection reads
//! the listener's answers with another such machine, [`ClientSession`] (its call order is in
//! the `client` module's docs).
//!
//! # Call order
//!
//! A [`ServerSession`] is made with the time the connection was accepted. Then, in a loop:
//!
//! 1. [`ServerSession::poll_event`] until `None`, doing what each [`Event`] asks and answering
//!    with the matching `handle_*` call (`Store` -> `handle_stored`, `Load` -> `handle_loaded`,
//!    `Notify` -> `handle_delivery`). At most one event is outstanding: the session reads no
//!    further frame until it is answered, so frames are handled in order.
//! 2. [`ServerSession::poll_transmit`] until `None`, writing the bytes it returns and reporting
//!    how many went out with [`ServerSession::handle_transmitted`].
//! 3. Stop once [`ServerSession::closed`] says so.
//! 4. Read from the peer into [`ServerSession::read_target`] (when it offers one) and report
//!    the count with [`ServerSession::handle_read`], or the end of the stream with
//!    [`ServerSession::handle_end`]; whatever happens first of that and
//!    [`ServerSession::poll_timeout`] passing, which is reported with
//!    [`ServerSession::handle_timeout`].
//!
//! Every `handle_*` takes the current time; the session never reads a clock, so its timeouts
//! (hello, a stalled frame, an idle connection, a peer that reads no answers) are tested by
//! passing times in.
//!
//! # Zero-copy receive
//!
//! While a write frame's data is being received, [`ServerSession::read_target`] returns the
//! not yet filled part of the destination itself (the registered memory, or the staging buffer
//! of GPU memory) whenever no received bytes are buffered and the part is at least as large as
//! the session's input buffer; block-sized payloads so land straight in their destination.
//! Smaller pieces go through the 16 KiB input buffer, so many small frames cost one read.
//! Targets and the bytes [`ServerSession::poll_transmit`] offers are raw (address and length,
//! `crate::memory::RawDestination` and `RawSource`), never slices: registered memory may be
//! written by others at any time, and only the read and write system calls and a few copies
//! in `crate::memory` touch it.
//!
//! # What a destination holds
//!
//! Bytes land as they arrive. A frame that stalls or whose connection breaks part-way leaves
//! the bytes that already arrived in its destination; the sender sees the frame fail, never
//! succeed. A destination range is therefore undefined until its frame is acknowledged.

mod client;
#[cfg(test)]
mod client_tests;
mod event;
mod input;
mod output;
#[cfg(test)]
mod sealed_tests;
mod served;
mod server;
#[cfg(any(test, fuzzing))]
pub(crate) mod test_memory;
#[cfg(any(test, fuzzing))]
pub(crate) mod test_pair;
#[cfg(test)]
mod tests;

pub(crate) use client::{Answer, ClientSession, Request};

pub(crate) use event::{Closed, Event};
pub(crate) use served::{Landing, Served, SessionConfig};
pub(crate) use server::ServerSession;
