//! `Batch`: transfers with one peer, built up and submitted together.

use super::region::Region;
use super::transfer::Transfer;
use crate::errors::{to_py, FerryError, RangeError};
use crate::lists;
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyInt;

/// One side's pool layout as Python passes it: `(pool_bytes, block_stride, offset)`.
type Layout = (u64, u64, u64);

/// One pool of a block copy: the local region, the pool's offset in it, the peer's address.
type Pool<'py> = (PyRef<'py, Region>, u64, u64);

/// Reads and writes with one peer, submitted together and completed as one transfer. Each
/// method adds to the batch; mistakes are reported by `submit`, before anything moves (a
/// block pool at an address where the peer has no buffer, as soon as it is added).
#[pyclass(module = "ferry_kv._ferry", frozen)]
pub(crate) struct Batch {
    batch: Mutex<Option<ferry::Batch>>,
    /// The peer, whose buffers turn pool addresses into buffers.
    peer: ferry::Peer,
}

impl Batch {
    pub(super) fn new(batch: ferry::Batch, peer: ferry::Peer) -> Self {
        Batch {
            batch: Mutex::new(Some(batch)),
            peer,
        }
    }

    /// Replaces the batch with what `add` makes of it.
    fn update(&self, add: impl FnOnce(ferry::Batch) -> PyResult<ferry::Batch>) -> PyResult<()> {
        let mut slot = self.batch.lock();
        let batch = slot.take().ok_or_else(submitted)?;
        *slot = Some(add(batch)?);
        Ok(())
    }

    /// Adds a block copy in `direction`.
    #[allow(clippy::too_many_arguments)]
    fn blocks(
        &self,
        direction: ferry::Direction,
        nbytes: u64,
        local_layout: Layout,
        remote_layout: Layout,
        local_ids: Vec<u32>,
        remote_ids: Vec<u32>,
        pools: Vec<Pool<'_>>,
    ) -> PyResult<()> {
        let layout = |(pool_bytes, block_stride, offset): Layout| ferry::BlockLayout {
            pool_bytes,
            block_stride,
            offset,
        };
        let mut copy = ferry::BlockCopy::new(
            nbytes,
            layout(local_layout),
            layout(remote_layout),
            local_ids,
            remote_ids,
        );
        for (index, (region, offset, remote_addr)) in pools.iter().enumerate() {
            let buffer = self.peer.buffer_at(*remote_addr).ok_or_else(|| {
                RangeError::new_err(format!(
                    "pool {index}: the peer has no buffer at {remote_addr:#x}; pass an address inside one of peer.buffers (connect again to see newer ones)"
                ))
            })?;
            let remote_offset = remote_addr - buffer.addr;
            copy = region.with(|region| copy.pool_at(region, *offset, &buffer, remote_offset))?;
        }
        self.update(|batch| {
            Ok(match direction {
                ferry::Direction::Write => batch.write_blocks(copy),
                ferry::Direction::Read => batch.read_blocks(copy),
            })
        })
    }
}

/// The `(offset, remote_addr, nbytes)` entries of `write_entries` / `read_entries`: one offset
/// and one peer address per entry, and either one length for all or one per entry.
fn entry_list(
    offsets: &Bound<'_, PyAny>,
    remote_addrs: &Bound<'_, PyAny>,
    nbytes: &Bound<'_, PyAny>,
) -> PyResult<Vec<(u64, u64, u64)>> {
    let py = offsets.py();
    // A list's conversion error, with the argument it came from.
    let named =
        |name: &str, error: PyErr| PyTypeError::new_err(format!("{name}: {}", error.value(py)));
    let offsets = lists::u64s(offsets).map_err(|error| named("offsets", error))?;
    let remote_addrs = lists::u64s(remote_addrs).map_err(|error| named("remote_addrs", error))?;
    let lengths = match nbytes.is_instance_of::<PyInt>() {
        true => vec![
            nbytes
                .extract::<u64>()
                .map_err(|error| named("nbytes", error))?;
            offsets.len()
        ],
        false => lists::u64s(nbytes).map_err(|error| named("nbytes", error))?,
    };
    if remote_addrs.len() != offsets.len() || lengths.len() != offsets.len() {
        return Err(PyValueError::new_err(format!(
            "{} offsets, {} remote_addrs and {} lengths; pass one of each per entry (or one int as nbytes)",
            offsets.len(),
            remote_addrs.len(),
            lengths.len()
        )));
    }
    Ok(offsets
        .into_iter()
        .zip(remote_addrs)
        .zip(lengths)
        .map(|((offset, remote_addr), len)| (offset, remote_addr, len))
        .collect())
}

fn submitted() -> PyErr {
    FerryError::new_err("the batch was submitted already; start another with engine.batch(peer)")
}

#[pymethods]
impl Batch {
    /// Adds a write of `nbytes` from `region` at `offset` to the peer's `remote_addr`.
    fn write(
        &self,
        region: PyRef<'_, Region>,
        offset: u64,
        remote_addr: u64,
        nbytes: u64,
    ) -> PyResult<()> {
        self.update(|batch| region.with(|region| batch.write(region, offset, remote_addr, nbytes)))
    }

    /// Adds a read of `nbytes` from the peer's `remote_addr` into `region` at `offset`.
    fn read(
        &self,
        region: PyRef<'_, Region>,
        offset: u64,
        remote_addr: u64,
        nbytes: u64,
    ) -> PyResult<()> {
        self.update(|batch| region.with(|region| batch.read(region, offset, remote_addr, nbytes)))
    }

    /// Adds a write for each entry, from `region`: `nbytes` (or `nbytes[i]`) bytes at
    /// `offsets[i]` to the peer's `remote_addrs[i]`. The same as `write` once per entry, built
    /// in one call: lists of ints are read without a Python call per entry.
    fn write_entries(
        &self,
        region: PyRef<'_, Region>,
        offsets: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let entries = entry_list(offsets, remote_addrs, nbytes)?;
        self.update(|batch| region.with(|region| batch.write_entries(region, entries)))
    }

    /// Adds a read for each entry: `nbytes` (or `nbytes[i]`) bytes from the peer's
    /// `remote_addrs[i]` into `region` at `offsets[i]`; arguments as `write_entries`.
    fn read_entries(
        &self,
        region: PyRef<'_, Region>,
        offsets: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let entries = entry_list(offsets, remote_addrs, nbytes)?;
        self.update(|batch| region.with(|region| batch.read_entries(region, entries)))
    }

    /// Adds a paged copy to the peer: `nbytes` of block `local_ids[i]` of every local pool to
    /// block `remote_ids[i]` of the matching remote pool. Layouts are
    /// `(pool_bytes, block_stride, offset)`; pools are `(region, offset, remote_addr)`.
    #[allow(clippy::too_many_arguments)]
    fn write_blocks(
        &self,
        nbytes: u64,
        local_layout: Layout,
        remote_layout: Layout,
        local_ids: Vec<u32>,
        remote_ids: Vec<u32>,
        pools: Vec<Pool<'_>>,
    ) -> PyResult<()> {
        let direction = ferry::Direction::Write;
        self.blocks(
            direction,
            nbytes,
            local_layout,
            remote_layout,
            local_ids,
            remote_ids,
            pools,
        )
    }

    /// Adds a paged copy from the peer's pools into local ones; arguments as `write_blocks`.
    #[allow(clippy::too_many_arguments)]
    fn read_blocks(
        &self,
        nbytes: u64,
        local_layout: Layout,
        remote_layout: Layout,
        local_ids: Vec<u32>,
        remote_ids: Vec<u32>,
        pools: Vec<Pool<'_>>,
    ) -> PyResult<()> {
        let direction = ferry::Direction::Read;
        self.blocks(
            direction,
            nbytes,
            local_layout,
            remote_layout,
            local_ids,
            remote_ids,
            pools,
        )
    }

    /// Writes the 32-bit `value` into the peer's GPU memory at `remote_addr` once the batch's
    /// data is visible there, for a peer stream waiting on that word (nvlink batches only).
    fn signal(&self, remote_addr: u64, value: u32) -> PyResult<()> {
        self.update(|batch| Ok(batch.signal(remote_addr, value)))
    }

    /// Lets the batch's data move only once the work queued so far on the CUDA stream
    /// `handle` of GPU `device` has finished ([`ferry::Batch::after`] says where each part
    /// waits). `handle` is a driver handle (`torch.cuda.Stream.cuda_stream`;
    /// 0 and 2 are the default streams) that must stay alive until this call returns.
    fn after_stream(&self, handle: usize, device: u32) -> PyResult<()> {
        let context = ferry::cuda::Context::get(device).map_err(|error| {
            PyValueError::new_err(format!(
                "GPU {device} cannot be used for the stream: {error}"
            ))
        })?;
        // SAFETY: the caller passes a live stream handle, as `Batch.after` documents (it
        // reads the handle of a torch stream object the caller holds across this call).
        let event = unsafe { ferry::cuda::Event::record_on_handle(&context, handle) }.map_err(
            |error| {
                PyValueError::new_err(format!(
                    "stream {handle:#x} could not be waited for on GPU {device} ({error}); pass a stream of the GPU the batch's memory is on, e.g. torch.cuda.current_stream(device)"
                ))
            },
        )?;
        self.update(|batch| Ok(batch.after(event)))
    }

    /// Sends `payload` (at most 64 KiB) to the peer once the batch's data is visible there.
    fn notify(&self, payload: Vec<u8>) -> PyResult<()> {
        self.update(|batch| Ok(batch.notify(payload)))
    }

    /// Checks every entry and starts the transfer; the batch cannot be used again.
    fn submit(&self, py: Python<'_>) -> PyResult<Transfer> {
        let batch = self.batch.lock().take().ok_or_else(submitted)?;
        let transfer = py.detach(|| batch.submit()).map_err(to_py)?;
        Transfer::start(transfer)
    }

    /// Entries and block copies added so far.
    fn __len__(&self) -> PyResult<usize> {
        self.batch
            .lock()
            .as_ref()
            .map(ferry::Batch::len)
            .ok_or_else(submitted)
    }
}
