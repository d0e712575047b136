//! The CUDA layer: loads the driver at run time, so one binary serves machines with and without
//! GPUs. Every `unsafe` driver call of ferry-core lives below this module, wrapped once.
//!
//! The ladder is `cudarc::driver::sys` (raw symbols) -> one thin function per driver call here
//! (returning [`CudaError`]) -> safe types above.

mod driver;
mod error;
mod pointer;

pub use driver::{Driver, DriverStatus};
pub use error::CudaError;
pub use pointer::MemoryKind;
