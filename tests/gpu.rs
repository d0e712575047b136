//! GPU checks for this build: the CUDA driver is found at run time, GPU and managed memory get
//! a clear "not supported yet" error, pinned and pageable host memory register and move.
//! Run on the GPU machine with `--features gpu-tests`; without a GPU every test fails.
#![cfg(feature = "gpu-tests")]

mod common;

use common::{assert_bytes_eq, pattern};
use cudarc::driver::{CudaContext, DevicePtr};
use ferry::{Engine, Error, Location};

fn context() -> std::sync::Arc<CudaContext> {
    let driver = ferry::cuda::Driver::get();
    assert!(
        driver.is_ready(),
        "the GPU suite needs a GPU: {}",
        driver.status()
    );
    CudaContext::new(0).expect("GPU 0 opens")
}

#[test]
fn gpu_memory_is_refused_naming_the_transport_that_will_take_it() {
    let context = context();
    let stream = context.default_stream();
    let buffer = stream.alloc_zeros::<u8>(1 << 20).expect("1 MiB on GPU 0");
    let (pointer, _sync) = buffer.device_ptr(&stream);
    let engine = Engine::builder().build_blocking().unwrap();
    // A pointer 4 KiB into the allocation, as a tensor inside a caching-allocator block is.
    // SAFETY: the range lies inside `buffer`, which outlives the call; it is refused anyway.
    let outcome = unsafe { engine.register((pointer + 4096) as *mut u8, 64 << 10) };
    match outcome {
        Err(error @ Error::Unsupported { .. }) => {
            let text = error.to_string();
            assert!(
                text.contains("GPU memory") && text.contains("nvlink"),
                "{text}"
            );
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert!(
        engine.descriptor().buffers.is_empty(),
        "nothing was registered"
    );
}

#[test]
fn managed_memory_is_refused() {
    let context = context();
    // SAFETY: the contents are never read; the pointer is only registered (and refused).
    let managed = unsafe { context.alloc_unified::<u8>(1 << 20, true) }.expect("1 MiB managed");
    let stream = context.default_stream();
    let (pointer, _sync) = managed.device_ptr(&stream);
    let engine = Engine::builder().build_blocking().unwrap();
    // SAFETY: the range lies inside `managed`, which outlives the call.
    let outcome = unsafe { engine.register(pointer as *mut u8, 1 << 20) };
    assert!(
        matches!(outcome, Err(Error::Unsupported { ref memory, .. }) if memory.contains("managed")),
        "{outcome:?}"
    );
}

#[test]
fn pinned_and_pageable_host_memory_register_and_move_with_a_gpu_present() {
    let context = context();
    // SAFETY: every byte is written below before anything reads it.
    let mut pinned = unsafe { context.alloc_pinned::<u8>(4 << 20) }.expect("4 MiB pinned");
    let pointer = pinned.as_mut_ptr().expect("pinned pointer");
    let decode = Engine::builder().build_blocking().unwrap();
    // SAFETY: `pinned` outlives `region` (dropped at the end of the test, after it).
    let region = unsafe { decode.register(pointer, 4 << 20) }.unwrap();
    assert_eq!(region.location(), Location::Host { pinned: true });
    region.write_at(0, &vec![0u8; 4 << 20]).unwrap();

    let prefill = Engine::builder().build_blocking().unwrap();
    let source = prefill.allocate(4 << 20).unwrap();
    assert_eq!(source.location(), Location::Host { pinned: false });
    source.write_at(0, &pattern(21, 4 << 20)).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    prefill
        .batch(&peer)
        .write(&source, 0, region.addr(), 4 << 20)
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0u8; 4 << 20];
    region.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(21, 4 << 20), "write into pinned memory");
    drop(region);
}
