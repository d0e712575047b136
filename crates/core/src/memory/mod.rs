//! Registered memory: the table of regions an engine owns, the handles callers hold, and the
//! guards that keep a region registered while bytes move through it.
//!
//! A region is `(addr, len)` plus where it lives. Transfers take a [`RegionUse`] for every region
//! they touch; dropping a [`Region`] first unpublishes it (new transfers are refused) and then
//! waits until every use has ended, so memory is never written after `drop` returns.

mod host;
mod locate;
mod maps;
mod raw;
mod region;
mod span;
mod staging;
mod table;

pub(crate) use host::OwnedBuffer;
pub use host::{read_caller_memory, write_caller_memory};
pub(crate) use locate::device_location;
pub(crate) use maps::{first_unmapped_here, first_unmapped_strictly};
pub(crate) use raw::{RawDestination, RawSource};
pub use region::{ExportGuard, RegionUse};
pub use region::{Location, Region, RegionInfo};
pub(crate) use region::{OwnedMemory, RegionEntry};
pub(crate) use span::Span;
pub(crate) use table::RegionTable;
