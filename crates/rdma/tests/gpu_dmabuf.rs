//! dma-buf export of GPU memory on a real GPU, as the rdma transport will register it:
//! `cudaMalloc` and VMM memory, unaligned ranges, and ranges the export must refuse. Run on the
//! GPU machine with `--features gpu-tests`; without a GPU every test fails.
#![cfg(feature = "gpu-tests")]

use ferry_core::cuda::{
    create_vmm, dmabuf_supported, export_dmabuf, Context, DeviceBuffer, DmaBuf, Driver,
};
use ferry_core::Error;
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
/// The smallest host page size; the export's bounds are multiples of the real one, which is
/// a multiple of this.
const PAGE: u64 = 4096;

/// GPU 0's context, after checking that the GPU can export dma-buf at all.
fn gpu() -> Arc<Context> {
    let driver = Driver::get();
    assert!(
        driver.is_ready(),
        "this test needs a GPU: {}",
        driver.status()
    );
    let supported = dmabuf_supported(0).expect("GPU 0 answers the dma-buf attribute query");
    assert!(
        supported,
        "GPU 0 cannot export dma-buf (driver {}): GPUDirect RDMA would need nvidia-peermem",
        driver.version()
    );
    Context::get(0).expect("GPU 0 opens")
}

/// Exports `len` bytes at `addr` and checks that the dma-buf covers them as promised: page
/// bounds around the range, and a file whose own size reaches the range's end.
fn export_and_check(addr: u64, len: u64) {
    let buffer = export_dmabuf(addr, len)
        .unwrap_or_else(|error| panic!("exporting {len} bytes at {addr:#x} failed: {error}"));
    let DmaBuf {
        fd,
        base,
        len: span,
        ordinal,
    } = buffer;
    eprintln!("{len} bytes at {addr:#x} -> dma-buf {base:#x}+{span:#x} on GPU {ordinal}");
    assert_eq!(ordinal, 0, "the memory is on GPU 0");
    assert!(
        base <= addr,
        "the buffer starts at {base:#x}, after {addr:#x}"
    );
    assert!(
        base + span >= addr + len,
        "the buffer ends at {:#x}, before the range's end {:#x}",
        base + span,
        addr + len
    );
    assert_eq!(base % PAGE, 0, "base {base:#x} is not page-aligned");
    assert_eq!(span % PAGE, 0, "length {span:#x} is not whole pages");
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .expect("the descriptor is open");
    assert!(
        link.to_string_lossy().contains("dmabuf"),
        "descriptor {} is {link:?}, not a dma-buf",
        fd.as_raw_fd()
    );
    // A dma-buf reports its size through lseek(SEEK_END).
    let size = File::from(fd)
        .seek(SeekFrom::End(0))
        .expect("a dma-buf tells its size");
    assert!(
        size >= addr + len - base,
        "the dma-buf holds {size} bytes from {base:#x}, short of the range's end {:#x}",
        addr + len
    );
}

#[test]
fn an_unaligned_range_of_cudamalloc_memory_exports_as_whole_pages() {
    let context = gpu();
    let buffer = DeviceBuffer::new(context, (64 * MIB + PAGE) as usize).expect("64 MiB + 4 KiB");
    export_and_check(buffer.addr() + 3 * PAGE + 123, MIB + 77);
    export_and_check(buffer.addr() + 64 * MIB - 5, 5 + PAGE);
    export_and_check(buffer.addr(), buffer.len() as u64);
    export_and_check(buffer.addr() + 1, 1);
}

#[test]
fn a_range_over_several_vmm_pieces_exports_as_one_buffer() {
    let context = gpu();
    let mapping = create_vmm(context, (2 * MIB) as usize, 3).expect("three 2 MiB VMM pieces");
    let base = mapping.base();
    // Starts in the first piece, ends in the third.
    export_and_check(base + MIB + 5, 4 * MIB);
    export_and_check(base + 2 * MIB - 1, 2);
    export_and_check(base, mapping.len() as u64);
}

#[test]
fn small_cudamalloc_allocations_export_the_pages_they_share() {
    let context = gpu();
    let buffers: Vec<DeviceBuffer> = (0..3)
        .map(|_| DeviceBuffer::new(Arc::clone(&context), 1000).expect("1000 bytes"))
        .collect();
    for buffer in &buffers {
        export_and_check(buffer.addr(), buffer.len() as u64);
    }
}

#[test]
fn ranges_outside_gpu_memory_are_refused_without_panicking() {
    let context = gpu();
    let host = vec![0u8; 8192];
    let refused = export_dmabuf(host.as_ptr() as u64, host.len() as u64);
    assert!(
        matches!(&refused, Err(Error::Unsupported { memory, .. }) if memory.contains("not GPU memory")),
        "host memory: {refused:?}"
    );

    // Nothing is ever mapped in the first pages of the address space.
    let refused = export_dmabuf(PAGE, PAGE);
    assert!(
        matches!(&refused, Err(Error::Unsupported { memory, .. }) if memory.contains("not GPU memory")),
        "an address no allocation holds: {refused:?}"
    );

    // The walk past the allocation's end stops at the first gap or change of kind, whatever
    // other tests have allocated next to it.
    let buffer = DeviceBuffer::new(context, (2 * MIB) as usize).expect("2 MiB");
    let refused = export_dmabuf(buffer.addr() + 2 * MIB - 100, 1 << 40);
    assert!(
        matches!(&refused, Err(Error::Unsupported { .. })),
        "a range past the end of its allocation: {refused:?}"
    );
    let refused = export_dmabuf(buffer.addr(), 0);
    assert!(
        matches!(&refused, Err(Error::ApiMisuse(_))),
        "an empty range: {refused:?}"
    );
    let refused = export_dmabuf(buffer.addr(), u64::MAX);
    assert!(
        matches!(&refused, Err(Error::ApiMisuse(_))),
        "a range that wraps: {refused:?}"
    );
}
