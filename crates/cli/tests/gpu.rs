//! The GPU suite: registration of GPU memory, and the nvlink transport between two processes
//! (GPU0 -> GPU1, and within one GPU). Run on the GPU machine with `--features gpu-tests`;
//! without a GPU every test fails, and the two-GPU tests fail on a one-GPU machine.
#![cfg(feature = "gpu-tests")]

mod common;

use common::{assert_bytes_eq, pattern, ServeProcess};
use cudarc::driver::{CudaContext, DevicePtr};
use ferry::transport::{GpuExport as Export, NVLINK};
use ferry::{Engine, Error, Location};
use std::time::{Duration, Instant};

fn gpus() -> u32 {
    let driver = ferry::cuda::Driver::get();
    assert!(
        driver.is_ready(),
        "the GPU suite needs a GPU: {}",
        driver.status()
    );
    driver.devices().expect("GPUs listed").len() as u32
}

fn two_gpus() {
    assert!(gpus() >= 2, "this test needs two GPUs");
}

fn engine() -> Engine {
    ferry::builder()
        .transfer_timeout(Duration::from_secs(20))
        .build_blocking()
        .expect("engine starts")
}

#[test]
fn a_range_inside_a_cudamalloc_block_registers_with_its_offset() {
    gpus();
    let context = ferry::cuda::Context::get(0).expect("GPU 0 opens");
    let buffer = ferry::cuda::DeviceBuffer::new(context, 4 << 20).expect("4 MiB cudaMalloc");
    let pointer = buffer.addr();
    let engine = engine();
    // SAFETY: the range lies inside `buffer`, which outlives `region` (dropped first).
    let region = unsafe { engine.register((pointer + 4096) as *mut u8, 1 << 20) }.unwrap();
    assert!(matches!(
        region.location(),
        Location::Device { ordinal: 0, .. }
    ));
    let descriptor = engine.descriptor();
    match &Export::of(&descriptor.buffers[0], NVLINK).unwrap() {
        Some(Export::CudaIpc { handle, offset }) => {
            assert_eq!(*offset, 4096);
            assert_eq!(handle.len(), 128);
        }
        other => panic!("expected a CUDA IPC export, got {other:?}"),
    }
    assert_eq!(descriptor.gpus.len() as u32, gpus());
    drop(region);
}

#[test]
fn pool_memory_from_cudamallocasync_is_refused_naming_the_remedy() {
    gpus();
    let context = CudaContext::new(0).expect("GPU 0 opens");
    let stream = context.default_stream();
    // cudarc allocates from the stream-ordered pool (cuMemAllocAsync).
    let buffer = stream
        .alloc_zeros::<u8>(1 << 20)
        .expect("1 MiB from the pool");
    let (pointer, _sync) = buffer.device_ptr(&stream);
    let engine = engine();
    // SAFETY: the range lies inside `buffer`, which outlives the call; it is refused anyway.
    let outcome = unsafe { engine.register(pointer as *mut u8, 1 << 20) };
    match outcome {
        Err(error @ Error::Unsupported { .. }) => {
            assert!(error.to_string().contains("cudaMalloc"), "{error}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn managed_memory_is_refused() {
    gpus();
    let context = CudaContext::new(0).expect("GPU 0 opens");
    // SAFETY: the contents are never read; the pointer is only registered (and refused).
    let managed = unsafe { context.alloc_unified::<u8>(1 << 20, true) }.expect("1 MiB managed");
    let stream = context.default_stream();
    let (pointer, _sync) = managed.device_ptr(&stream);
    let engine = engine();
    // SAFETY: the range lies inside `managed`, which outlives the call.
    let outcome = unsafe { engine.register(pointer as *mut u8, 1 << 20) };
    assert!(
        matches!(outcome, Err(Error::Unsupported { ref memory, .. }) if memory.contains("managed")),
        "{outcome:?}"
    );
}

#[test]
fn pinned_host_memory_registers_as_pinned_and_moves() {
    gpus();
    let context = CudaContext::new(0).expect("GPU 0 opens");
    // SAFETY: every byte is written below before anything reads it.
    let mut pinned = unsafe { context.alloc_pinned::<u8>(4 << 20) }.expect("4 MiB pinned");
    let pointer = pinned.as_mut_ptr().expect("pinned pointer");
    let decode = engine();
    // SAFETY: `pinned` outlives `region` (dropped at the end of the test, before it).
    let region = unsafe { decode.register(pointer, 4 << 20) }.unwrap();
    assert_eq!(region.location(), Location::Host { pinned: true });
    region.write_at(0, &vec![0u8; 4 << 20]).unwrap();
    let prefill = engine();
    let source = prefill.allocate(4 << 20).unwrap();
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

/// Writes every size to a `ferry serve --gpu REMOTE` process from GPU `local`, at odd offsets,
/// reads each back into a second buffer, and checks both directions byte for byte.
fn write_and_read_every_size(local: u32, remote_gpu: &str, env: &[(&str, &str)]) {
    const REMOTE: usize = 64 << 20;
    let target = ServeProcess::start_with(REMOTE, &["--gpu", remote_gpu], env);
    let sizes = [1usize, 999, 4096, 32 << 10, 1 << 20, 16 << 20];
    write_and_read_sizes(&engine(), &target, local, 32 << 20, &sizes);
}

/// Writes each of `sizes` from GPU `local` of `engine` to `target` over nvlink, at odd offsets
/// one after another, reads each back into a second buffer (both of `area` bytes), and checks
/// both directions byte for byte.
fn write_and_read_sizes(
    engine: &Engine,
    target: &ServeProcess,
    local: u32,
    area: u64,
    sizes: &[usize],
) {
    let source = engine.allocate_device(local, area).unwrap();
    let back = engine.allocate_device(local, area).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    let mut remote_offset = 3u64;
    for (seed, &size) in sizes.iter().enumerate() {
        let bytes = pattern(seed as u64 + 40, size);
        source.write_at(5, &bytes).unwrap();
        let done = engine
            .batch(&peer)
            .write(&source, 5, target.buffer_addr + remote_offset, size as u64)
            .submit_blocking()
            .unwrap();
        assert_eq!(done.transports, vec!["nvlink"], "{size}-byte write");
        back.write_at(7, &vec![0u8; size]).unwrap();
        let done = engine
            .batch(&peer)
            .read(&back, 7, target.buffer_addr + remote_offset, size as u64)
            .submit_blocking()
            .unwrap();
        assert_eq!(done.transports, vec!["nvlink"], "{size}-byte read");
        let mut arrived = vec![0u8; size];
        back.read_at(7, &mut arrived).unwrap();
        assert_bytes_eq(
            &arrived,
            &bytes,
            &format!("{size} bytes written then read back"),
        );
        remote_offset += size as u64 + 513;
    }
}

#[test]
fn gpu0_to_gpu1_write_and_read_between_processes() {
    two_gpus();
    write_and_read_every_size(0, "1", &[]);
}

#[test]
fn same_gpu_ipc_between_processes() {
    gpus();
    write_and_read_every_size(0, "0", &[]);
}

/// `cudaMalloc` memory of a peer whose IPC handles do not open here (two pods whose servers
/// have equal PIDs) moves through the staging buffer the peer's engine hands over by file
/// descriptor; forced here between plain processes (staging `Always`), which nvlink then
/// reaches only through staging, so a transfer that says "nvlink" went through it. Once with
/// the default geometry (one 256 MiB slot, both processes being on GPU 0) and once with three
/// slots (a third of 256 MiB each, rounded down to a multiple of 256 bytes, and reused):
/// sizes from one byte to 300 MiB, at odd offsets, and 4,096 scattered 32 KiB entries in one
/// batch, each written and read back.
#[test]
fn cudamalloc_memory_moves_through_the_owners_staging_buffer() {
    gpus();
    const REMOTE: usize = 640 << 20;
    let target = ServeProcess::start_with(REMOTE, &["--gpu", "0"], &[]);
    for slots in [None, Some(3)] {
        staged_round_trips(&target, slots);
    }
}

/// The round trips of [`cudamalloc_memory_moves_through_the_owners_staging_buffer`] with
/// `slots` staging slots.
fn staged_round_trips(target: &ServeProcess, slots: Option<u32>) {
    const LOCAL: u64 = 320 << 20;
    let engine = ferry::Links::default()
        .nvlink(ferry::NvlinkConfig {
            cuda_malloc_staging: Some(ferry::CudaMallocStaging::Always),
            staging_slots: slots,
            ..ferry::NvlinkConfig::default()
        })
        .builder()
        .transfer_timeout(Duration::from_secs(20))
        .build_blocking()
        .expect("engine starts");
    write_and_read_sizes(
        &engine,
        target,
        0,
        LOCAL,
        &[1, 999, 32 << 10, 1 << 20, 300 << 20],
    );
    let source = engine.allocate_device(0, LOCAL).unwrap();
    let back = engine.allocate_device(0, LOCAL).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    // Scattered blocks: block i of the source goes to remote slot (i * 7) % 8192.
    const BLOCK: u64 = 32 << 10;
    const BLOCKS: u64 = 4096;
    let blocks = pattern(90, (BLOCKS * BLOCK) as usize);
    source.write_at(0, &blocks).unwrap();
    let slot = |block: u64| (block * 7) % 8192 * BLOCK;
    let mut write = engine.batch(&peer);
    for block in 0..BLOCKS {
        write = write.write(
            &source,
            block * BLOCK,
            target.buffer_addr + slot(block),
            BLOCK,
        );
    }
    let done = write.submit_blocking().unwrap();
    assert_eq!(done.transports, vec!["nvlink"], "scattered staged write");
    back.write_at(0, &vec![0u8; blocks.len()]).unwrap();
    let mut read = engine.batch(&peer);
    for block in 0..BLOCKS {
        read = read.read(
            &back,
            block * BLOCK,
            target.buffer_addr + slot(block),
            BLOCK,
        );
    }
    read.submit_blocking().unwrap();
    let mut arrived = vec![0u8; blocks.len()];
    back.read_at(0, &mut arrived).unwrap();
    assert_bytes_eq(
        &arrived,
        &blocks,
        &format!("4,096 scattered blocks through staging, {slots:?} slots"),
    );
}

#[test]
fn a_peer_that_sees_only_its_own_gpu() {
    two_gpus();
    // The target process sees only GPU 1 (as its ordinal 0); this process sees both.
    write_and_read_every_size(0, "0", &[("CUDA_VISIBLE_DEVICES", "1")]);
}

#[test]
fn many_blocks_land_in_their_slots_on_the_other_gpu() {
    two_gpus();
    const BLOCK: usize = 32 << 10;
    const BLOCKS: usize = 2048;
    let target = ServeProcess::start_with(BLOCK * BLOCKS, &["--gpu", "1"], &[]);
    let engine = engine();
    let source = engine.allocate_device(0, (BLOCK * BLOCKS) as u64).unwrap();
    let back = engine.allocate_device(0, (BLOCK * BLOCKS) as u64).unwrap();
    let bytes = pattern(77, BLOCK * BLOCKS);
    source.write_at(0, &bytes).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    let slot = |block: usize| (block * 7 + 3) % BLOCKS;
    let mut batch = engine.batch(&peer);
    for block in 0..BLOCKS {
        let remote = target.buffer_addr + (slot(block) * BLOCK) as u64;
        batch = batch.write(&source, (block * BLOCK) as u64, remote, BLOCK as u64);
    }
    batch.submit_blocking().unwrap();
    engine
        .batch(&peer)
        .read(&back, 0, target.buffer_addr, (BLOCK * BLOCKS) as u64)
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0u8; BLOCK * BLOCKS];
    back.read_at(0, &mut landed).unwrap();
    for block in 0..BLOCKS {
        let at = slot(block) * BLOCK;
        assert_bytes_eq(
            &landed[at..at + BLOCK],
            &bytes[block * BLOCK..(block + 1) * BLOCK],
            &format!("block {block}"),
        );
    }
}

#[test]
fn remote_ranges_outside_the_registration_are_refused_and_nothing_lands() {
    gpus();
    let remote_gpu = if gpus() >= 2 { "1" } else { "0" };
    let target = ServeProcess::start_with(1 << 20, &["--gpu", remote_gpu], &[]);
    let engine = engine();
    let source = engine.allocate_device(0, 2 << 20).unwrap();
    source.write_at(0, &vec![0xabu8; 2 << 20]).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    let outcome = engine
        .batch(&peer)
        .write(&source, 0, target.buffer_addr, 4096)
        .write(&source, 0, target.buffer_addr + (1 << 20) - 100, 4096)
        .submit_blocking();
    assert!(matches!(outcome, Err(Error::Range(_))), "{outcome:?}");
    let back = engine.allocate_device(0, 1 << 20).unwrap();
    engine
        .batch(&peer)
        .read(&back, 0, target.buffer_addr, 1 << 20)
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0xffu8; 1 << 20];
    back.read_at(0, &mut landed).unwrap();
    assert!(
        landed.iter().all(|&byte| byte == 0),
        "nothing may be written"
    );
}

#[test]
fn a_peer_killed_mid_transfer_fails_the_transfer_and_the_survivor_goes_on() {
    gpus();
    let remote_gpu = if gpus() >= 2 { "1" } else { "0" };
    let mut target = ServeProcess::start_with(1 << 30, &["--gpu", remote_gpu], &[]);
    let engine = engine();
    let source = engine.allocate_device(0, 1 << 30).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    let mut batch = engine.batch(&peer);
    for _ in 0..64 {
        batch = batch.write(&source, 0, target.buffer_addr, 1 << 30);
    }
    let transfer = batch.notify("done").submit().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    target.child.kill().unwrap();
    let killed = Instant::now();
    let outcome = transfer.wait();
    assert!(
        killed.elapsed() < Duration::from_secs(30),
        "resolved in {:?}",
        killed.elapsed()
    );
    assert!(
        outcome.is_err(),
        "the notification cannot reach a dead peer: {outcome:?}"
    );

    let other = ServeProcess::start_with(1 << 20, &["--gpu", remote_gpu], &[]);
    let peer = engine.connect_blocking(&other.name).unwrap();
    source.write_at(0, &pattern(5, 1 << 20)).unwrap();
    engine
        .batch(&peer)
        .write(&source, 0, other.buffer_addr, 1 << 20)
        .submit_blocking()
        .unwrap();
    let back = engine.allocate_device(0, 1 << 20).unwrap();
    engine
        .batch(&peer)
        .read(&back, 0, other.buffer_addr, 1 << 20)
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0u8; 1 << 20];
    back.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(5, 1 << 20), "write after the peer died");
}

#[test]
fn the_fabric_probe_reports_what_the_driver_said() {
    for gpu in 0..gpus() {
        match ferry::probe::fabric(gpu) {
            ferry::probe::FabricSupport::Permitted => {}
            ferry::probe::FabricSupport::Refused(error) => {
                assert_eq!(error.call, "cuMemCreate(FABRIC)", "{error}");
                assert!(!error.name.is_empty(), "{error}");
            }
        }
        // The answer is probed once and then remembered.
        assert_eq!(ferry::probe::fabric(gpu), ferry::probe::fabric(gpu));
    }
}

#[test]
fn vmm_memory_over_several_allocations_registers_as_one_range() {
    gpus();
    let engine = engine();
    let region = engine.allocate_device_vmm(0, 2 << 20, 3).unwrap();
    assert!(matches!(
        region.location(),
        Location::Device { ordinal: 0, .. }
    ));
    match &Export::of(&engine.descriptor().buffers[0], NVLINK).unwrap() {
        Some(Export::VmmFd {
            pieces,
            offset,
            region: at,
            ..
        }) => {
            assert_eq!(pieces.len(), 3, "{pieces:?}");
            assert_eq!(pieces.iter().sum::<u64>(), region.len());
            assert_eq!((*offset, *at), (0, region.addr()));
        }
        other => panic!("expected a VMM export, got {other:?}"),
    }
    let bytes = pattern(61, region.len() as usize);
    region.write_at(0, &bytes).unwrap();
    let mut back = vec![0u8; bytes.len()];
    region.read_at(0, &mut back).unwrap();
    assert_bytes_eq(&back, &bytes, "VMM memory written and read in place");
}

/// Writes a range spanning every allocation of a VMM buffer in a `ferry serve --vmm-pieces`
/// process on GPU `remote_gpu`, from VMM memory here, reads it back and compares.
fn vmm_between_processes(remote_gpu: &str) {
    let target =
        ServeProcess::start_with(6 << 20, &["--gpu", remote_gpu, "--vmm-pieces", "3"], &[]);
    let engine = engine();
    let source = engine.allocate_device_vmm(0, 2 << 20, 3).unwrap();
    let back = engine.allocate_device(0, 6 << 20).unwrap();
    let length = (6 << 20) - 4096 - 513;
    let bytes = pattern(62, length);
    source.write_at(100, &bytes).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    let remote = target.buffer_addr + 4096;
    let done = engine
        .batch(&peer)
        .write(&source, 100, remote, length as u64)
        .submit_blocking()
        .unwrap();
    assert_eq!(done.transports, vec!["nvlink"]);
    back.write_at(0, &vec![0u8; length]).unwrap();
    engine
        .batch(&peer)
        .read(&back, 0, remote, length as u64)
        .submit_blocking()
        .unwrap();
    let mut arrived = vec![0u8; length];
    back.read_at(0, &mut arrived).unwrap();
    assert_bytes_eq(
        &arrived,
        &bytes,
        "a range over three VMM allocations, written and read back",
    );
}

#[test]
fn vmm_memory_between_processes_on_one_gpu() {
    gpus();
    vmm_between_processes("0");
}

#[test]
fn vmm_memory_between_processes_gpu0_to_gpu1() {
    two_gpus();
    vmm_between_processes("1");
}

#[test]
fn vmm_memory_crosses_nvlink_between_engines_sharing_a_secret() {
    // The fd-passing socket of the serving process refuses a client that does not prove the
    // secret, so nvlink only works if this engine's fd client authenticates.
    gpus();
    const SECRET: &[u8] = b"gpu-suite-secret-0123456789abcdef";
    let path = std::env::temp_dir().join(format!("ferry-gpu-secret-{}", std::process::id()));
    std::fs::write(&path, SECRET).unwrap();
    let target = ServeProcess::start_with(
        6 << 20,
        &[
            "--gpu",
            "0",
            "--vmm-pieces",
            "3",
            "--secret-file",
            path.to_str().unwrap(),
        ],
        &[],
    );
    std::fs::remove_file(&path).unwrap();
    let engine = ferry::builder()
        .secret(SECRET)
        .transfer_timeout(Duration::from_secs(20))
        .build_blocking()
        .unwrap();
    let source = engine.allocate_device(0, 1 << 20).unwrap();
    let bytes = pattern(63, 1 << 20);
    source.write_at(0, &bytes).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    let done = engine
        .batch(&peer)
        .write(&source, 0, target.buffer_addr, 1 << 20)
        .submit_blocking()
        .unwrap();
    assert_eq!(done.transports, vec!["nvlink"]);
    let back = engine.allocate_device(0, 1 << 20).unwrap();
    engine
        .batch(&peer)
        .read(&back, 0, target.buffer_addr, 1 << 20)
        .submit_blocking()
        .unwrap();
    let mut arrived = vec![0u8; 1 << 20];
    back.read_at(0, &mut arrived).unwrap();
    assert_bytes_eq(
        &arrived,
        &bytes,
        "VMM memory behind an authenticated fd socket",
    );
}

fn engine_with(path: ferry::CopyPath) -> Engine {
    ferry::Links::default()
        .nvlink(ferry::NvlinkConfig {
            copy_path: path,
            ..ferry::NvlinkConfig::default()
        })
        .builder()
        .transfer_timeout(Duration::from_secs(20))
        .build_blocking()
        .expect("engine starts")
}

/// (local offset, remote offset, len) of entries between a local region and a peer's buffer.
type Entries = [(u64, u64, u64)];

/// Writes every entry of `source` to `base + remote` at the peer, as one batch.
fn write_entries(
    engine: &Engine,
    peer: &ferry::Peer,
    source: &ferry::Region,
    base: u64,
    entries: &Entries,
) -> ferry::Completion {
    let mut batch = engine.batch(peer);
    for &(local, remote, len) in entries {
        batch = batch.write(source, local, base + remote, len);
    }
    batch.submit_blocking().unwrap()
}

/// Reads every entry's range at the peer back into `back` at its remote offset, as one batch.
fn read_entries(
    engine: &Engine,
    peer: &ferry::Peer,
    back: &ferry::Region,
    base: u64,
    entries: &Entries,
) {
    let mut batch = engine.batch(peer);
    for &(_, remote, len) in entries {
        batch = batch.read(back, remote, base + remote, len);
    }
    batch.submit_blocking().unwrap();
}

/// An area of `len` zeros with every entry of `source` copied to its remote offset.
fn expected_area(entries: &Entries, source: &[u8], len: usize) -> Vec<u8> {
    let mut expected = vec![0u8; len];
    for &(local, remote, len) in entries {
        let (local, remote, len) = (local as usize, remote as usize, len as usize);
        expected[remote..remote + len].copy_from_slice(&source[local..local + len]);
    }
    expected
}

#[test]
fn every_copy_path_moves_unaligned_entries_and_touches_nothing_else() {
    two_gpus();
    const AREA: usize = 8 << 20;
    let target = ServeProcess::start_with(AREA, &["--gpu", "1"], &[]);
    // (local offset, remote offset, len): every alignment the kernel distinguishes, a gap of
    // untouched bytes after each destination.
    let entries: [(u64, u64, u64); 9] = [
        (0, 0, 1),
        (16, 33, 3),
        (48, 100, 15),
        (129, 257, 17),
        (1000, 2004, 4095),
        (8192, 12288, 4104),
        (20000, 30001, 65537),
        (100_000, 200_008, (1 << 20) + 3),
        (2 << 20, 3 << 20, 2 << 20),
    ];
    let source_bytes = pattern(90, AREA);
    for path in [
        ferry::CopyPath::Kernel,
        ferry::CopyPath::CopyEngine,
        ferry::CopyPath::Batched,
        ferry::CopyPath::Auto,
    ] {
        let engine = engine_with(path);
        let source = engine.allocate_device(0, AREA as u64).unwrap();
        let zeros = engine.allocate_device(0, AREA as u64).unwrap();
        let back = engine.allocate_device(0, AREA as u64).unwrap();
        source.write_at(0, &source_bytes).unwrap();
        zeros.write_at(0, &vec![0u8; AREA]).unwrap();
        back.write_at(0, &vec![0u8; AREA]).unwrap();
        let peer = engine.connect_blocking(&target.name).unwrap();
        engine
            .batch(&peer)
            .write(&zeros, 0, target.buffer_addr, AREA as u64)
            .submit_blocking()
            .unwrap();
        write_entries(&engine, &peer, &source, target.buffer_addr, &entries);
        // Read the peer's whole area back through the same path, entry by entry, and check
        // every byte: copied ranges carry the source, all others are still zero.
        read_entries(&engine, &peer, &back, target.buffer_addr, &entries);
        engine
            .batch(&peer)
            .read(&zeros, 0, target.buffer_addr, AREA as u64)
            .submit_blocking()
            .unwrap();
        let mut landed = vec![0u8; AREA];
        zeros.read_at(0, &mut landed).unwrap();
        let mut read_back = vec![0u8; AREA];
        back.read_at(0, &mut read_back).unwrap();
        let expected = expected_area(&entries, &source_bytes, AREA);
        assert_bytes_eq(
            &landed,
            &expected,
            &format!("peer area after {path} writes"),
        );
        assert_bytes_eq(&read_back, &expected, &format!("{path} reads"));
    }
}

#[test]
fn paged_blocks_cross_gpus_in_one_kernel_launch_and_come_back() {
    two_gpus();
    const BLOCK: u64 = 32 << 10;
    const POOL_BLOCKS: u64 = 128;
    const POOL: u64 = BLOCK * POOL_BLOCKS;
    const POOLS: u64 = 8;
    let area = (POOL * POOLS) as usize;
    let target = ServeProcess::start_with(area, &["--gpu", "1"], &[]);
    let engine = engine();
    let source = engine.allocate_device(0, area as u64).unwrap();
    let back = engine.allocate_device(0, area as u64).unwrap();
    let bytes = pattern(91, area);
    source.write_at(0, &bytes).unwrap();
    back.write_at(0, &vec![0u8; area]).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    let remote = peer.buffer_at(target.buffer_addr).unwrap();
    let at = target.buffer_addr - remote.addr;
    let layout = ferry::BlockLayout::packed(POOL, BLOCK);
    let local_ids: Vec<u32> = (0..48).map(|i| (i * 37 + 5) % 128).collect();
    let remote_ids: Vec<u32> = (0..48).map(|i| (i * 53 + 11) % 128).collect();
    let copy = |region: &ferry::Region| {
        let mut copy =
            ferry::BlockCopy::new(BLOCK, layout, layout, local_ids.clone(), remote_ids.clone());
        for pool in 0..POOLS {
            copy = copy.pool_at(region, pool * POOL, &remote, at + pool * POOL);
        }
        copy
    };
    let done = engine
        .batch(&peer)
        .write_blocks(copy(&source))
        .submit_blocking()
        .unwrap();
    assert_eq!(done.transports, vec!["nvlink"]);
    assert_eq!(done.bytes, BLOCK * 48 * POOLS);
    engine
        .batch(&peer)
        .read_blocks(copy(&back))
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0u8; area];
    back.read_at(0, &mut landed).unwrap();
    let mut expected = vec![0u8; area];
    for pool in 0..POOLS {
        for &id in &local_ids {
            let at = (pool * POOL + u64::from(id) * BLOCK) as usize;
            expected[at..at + BLOCK as usize].copy_from_slice(&bytes[at..at + BLOCK as usize]);
        }
    }
    assert_bytes_eq(
        &landed,
        &expected,
        "blocks after a paged write and read back",
    );
    // A head slice: the second half of each remote block into half-size local blocks.
    let half = ferry::BlockLayout::packed(POOL / 2, BLOCK / 2);
    let sliced = ferry::BlockLayout {
        offset: BLOCK / 2,
        ..layout
    };
    let mut slice = ferry::BlockCopy::new(BLOCK / 2, half, sliced, vec![3u32], vec![remote_ids[0]]);
    slice = slice.pool_at(&back, 0, &remote, at);
    back.write_at(0, &vec![0u8; area]).unwrap();
    engine
        .batch(&peer)
        .read_blocks(slice)
        .submit_blocking()
        .unwrap();
    let mut got = vec![0u8; (BLOCK / 2) as usize];
    back.read_at(3 * BLOCK / 2, &mut got).unwrap();
    let from = (u64::from(local_ids[0]) * BLOCK + BLOCK / 2) as usize;
    assert_bytes_eq(
        &got,
        &bytes[from..from + (BLOCK / 2) as usize],
        "head slice",
    );
}

#[test]
fn a_signal_releases_a_waiting_stream_on_the_other_gpu_after_the_data() {
    two_gpus();
    const DATA: usize = 4 << 20;
    let decode = engine();
    // The data, then the 32-bit word the decode stream waits on.
    let pool = decode.allocate_device(1, (DATA + 4096) as u64).unwrap();
    pool.write_at(0, &vec![0u8; DATA + 4096]).unwrap();
    let flag = pool.addr() + DATA as u64;
    let context = ferry::cuda::Context::get(1).unwrap();
    let stream = ferry_core::cuda::Stream::new(context.clone()).unwrap();
    let copy = ferry::cuda::DeviceBuffer::new(context.clone(), DATA).unwrap();
    // Words the GPU could not safely wait on are refused before anything is queued.
    let host = decode.allocate(4096).unwrap();
    let other_gpu = decode.allocate_device(0, 4096).unwrap();
    for (region, offset, expected) in [
        (&pool, 2, "not 4-byte aligned"),
        (&host, 0, "a stream waits on GPU memory"),
        (&other_gpu, 0, "the stream is on GPU 1, the region on GPU 0"),
    ] {
        match region.wait_value32(&stream, offset, 7) {
            Err(Error::ApiMisuse(text)) => assert!(text.contains(expected), "{text}"),
            other => panic!("expected a refusal saying {expected:?}, got {other:?}"),
        }
    }
    match pool.wait_value32(&stream, (DATA + 4096 - 2) as u64, 7) {
        Err(Error::Range(ferry::RangeError::OutsideRegion { offset, len: 4, .. })) => {
            assert_eq!(offset, (DATA + 4096 - 2) as u64)
        }
        other => panic!("expected the word past the end to be refused, got {other:?}"),
    }
    pool.wait_value32(&stream, DATA as u64, 7).unwrap();
    // SAFETY: the copy reads `pool` and writes `copy`, both alive until the stream is
    // synchronised below, and disjoint.
    unsafe { stream.copy(copy.addr(), pool.addr(), DATA) }.unwrap();
    let after = ferry_core::cuda::Event::record(&stream).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !after.query().unwrap(),
        "the stream ran past the wait before any signal"
    );
    let prefill = engine();
    let source = prefill.allocate_device(0, DATA as u64).unwrap();
    let bytes = pattern(92, DATA);
    source.write_at(0, &bytes).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    prefill
        .batch(&peer)
        .write(&source, 0, pool.addr(), DATA as u64)
        .signal(flag, 7)
        .submit_blocking()
        .unwrap();
    stream.synchronize().unwrap();
    assert!(after.query().unwrap());
    let mut seen = vec![0u8; DATA];
    // SAFETY: `copy` holds DATA bytes and the stream that wrote it has finished.
    unsafe { ferry_core::cuda::download(&context, copy.addr(), &mut seen) }.unwrap();
    assert_bytes_eq(&seen, &bytes, "what the released stream copied");
}

#[test]
fn a_signal_releases_a_stream_waiting_through_the_safe_api_on_one_gpu() {
    gpus();
    const DATA: u64 = 1 << 20;
    let decode = engine();
    let pool = decode.allocate_device(0, DATA + 4096).unwrap();
    pool.write_at(0, &vec![0u8; (DATA + 4096) as usize])
        .unwrap();
    let stream = ferry::cuda::Stream::new(ferry::cuda::Context::get(0).unwrap()).unwrap();
    // Words the GPU could not safely wait on are refused before anything is queued.
    let host = decode.allocate(4096).unwrap();
    for (region, offset, expected) in [
        (&pool, 2, "not 4-byte aligned"),
        (&host, 0, "a stream waits on GPU memory"),
    ] {
        match stream.wait_value32(region, offset, 7) {
            Err(Error::ApiMisuse(text)) => assert!(text.contains(expected), "{text}"),
            other => panic!("expected a refusal saying {expected:?}, got {other:?}"),
        }
    }
    assert!(matches!(
        stream.wait_value32(&pool, DATA + 4094, 7),
        Err(Error::Range(ferry::RangeError::OutsideRegion {
            len: 4,
            ..
        }))
    ));
    // Both engines share this process's context, so everything that may wait for the whole
    // context (allocating, freeing, the first transfer's set-up) happens before the stream
    // blocks; what follows the wait is the transfer a decode process's sender would make.
    let prefill = engine();
    let source = prefill.allocate_device(0, DATA).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    prefill
        .batch(&peer)
        .write(&source, 0, pool.addr(), DATA)
        .submit_blocking()
        .unwrap();
    let bytes = pattern(94, DATA as usize);
    source.write_at(0, &bytes).unwrap();
    stream.wait_value32(&pool, DATA, 7).unwrap();
    let passed = stream.record_event().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !passed.query().unwrap(),
        "the stream ran past the wait before any signal"
    );
    let done = prefill
        .batch(&peer)
        .write(&source, 0, pool.addr(), DATA)
        .signal(pool.addr() + DATA, 7)
        .submit_blocking()
        .unwrap();
    assert_eq!(done.transports, vec!["nvlink"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !passed.query().unwrap() {
        assert!(
            Instant::now() < deadline,
            "the signal did not release the waiting stream"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut landed = vec![0u8; DATA as usize];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &bytes, "the data the signal announced");
}

/// Over nvlink the GPU publishes the notification of a batch of at most
/// `gpu_notification_max_bytes` into the message ring right after the copies: the decode side
/// holds it with every byte in place, and it keeps its place, so a notification sent once the
/// submit returned arrives after it. A larger batch leaves the ring free while it copies: its
/// notification goes once the host saw the copies end, after the one sent meanwhile.
#[test]
fn a_notification_the_gpu_publishes_follows_its_data_and_keeps_its_place() {
    gpus();
    const DATA: u64 = 512 << 20;
    let decode = engine();
    let mut inbox = decode.notifications().unwrap();
    let target = decode.allocate_device(0, DATA).unwrap();
    let next = |inbox: &mut ferry::Notifications| {
        let note = inbox
            .recv_timeout_blocking(Duration::from_secs(10))
            .unwrap()
            .expect("a notification within 10 s");
        String::from_utf8(note.payload).unwrap()
    };
    let mut landed = vec![0u8; DATA as usize];
    for (max_bytes, published_by_gpu) in [(DATA, true), (DATA - 1, false)] {
        let prefill = ferry::Links::default()
            .nvlink(ferry::NvlinkConfig {
                gpu_notification_max_bytes: max_bytes,
                ..Default::default()
            })
            .builder()
            .transfer_timeout(Duration::from_secs(20))
            .build_blocking()
            .unwrap();
        let source = prefill.allocate_device(0, DATA).unwrap();
        let peer = prefill.connect_blocking(decode.name()).unwrap();
        prefill
            .batch(&peer)
            .write(&source, 0, target.addr(), 4096)
            .notify("warm")
            .submit_blocking()
            .unwrap();
        assert_eq!(next(&mut inbox), "warm");
        assert_eq!(peer.notifications_through(), Some("nvlink"));
        for round in 0..3u8 {
            let bytes = pattern(101 + u64::from(round), DATA as usize);
            source.write_at(0, &bytes).unwrap();
            let transfer = prefill
                .batch(&peer)
                .write(&source, 0, target.addr(), DATA)
                .notify(format!("data {round}"))
                .submit()
                .unwrap();
            prefill
                .notify_blocking(&peer, format!("later {round}"))
                .unwrap();
            let (data, later) = (format!("data {round}"), format!("later {round}"));
            match published_by_gpu {
                true => {
                    assert_eq!(next(&mut inbox), data);
                    target.read_at(0, &mut landed).unwrap();
                    assert_bytes_eq(&landed, &bytes, "the data its notification announced");
                    assert_eq!(next(&mut inbox), later);
                }
                false => {
                    assert_eq!(next(&mut inbox), later, "a large batch held the ring");
                    assert_eq!(next(&mut inbox), data);
                    target.read_at(0, &mut landed).unwrap();
                    assert_bytes_eq(&landed, &bytes, "the data its notification announced");
                }
            }
            let done = transfer.wait().unwrap();
            assert_eq!(done.transports, vec!["nvlink"]);
        }
    }
}

/// A short write's notification, which the copy kernel itself publishes after the copy (one
/// launch), reaches the decode side only with every byte of the write in place and no byte
/// beside it touched: aligned, odd-sized at addresses that disagree modulo 16, one byte, and
/// the longest that takes that path.
#[test]
fn a_short_write_published_by_its_copy_kernel_follows_every_byte() {
    gpus();
    const AREA: u64 = 1 << 20;
    let (decode, prefill) = (engine(), engine());
    let mut inbox = decode.notifications().unwrap();
    let target = decode.allocate_device(0, AREA).unwrap();
    let source = prefill.allocate_device(0, AREA).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    let zeros = vec![0u8; AREA as usize];
    let mut landed = vec![0u8; AREA as usize];
    for (case, (from, to, len)) in [
        (0, 0, 4096),
        (3, 4101, 4099),
        (0, 7, 1),
        (16, 65_536, 64 << 10),
    ]
    .into_iter()
    .enumerate()
    {
        for round in 0..20u64 {
            let bytes = pattern(200 + case as u64 * 64 + round, AREA as usize);
            source.write_at(0, &bytes).unwrap();
            target.write_at(0, &zeros).unwrap();
            // Not waited for before the notification: the bytes are read as soon as it came.
            let transfer = prefill
                .batch(&peer)
                .write(&source, from, target.addr() + to, len)
                .notify(format!("{case} {round}"))
                .submit()
                .unwrap();
            let note = inbox
                .recv_timeout_blocking(Duration::from_secs(10))
                .unwrap()
                .expect("a notification within 10 s");
            assert_eq!(note.payload, format!("{case} {round}").into_bytes());
            assert_eq!(peer.notifications_through(), Some("nvlink"));
            target.read_at(0, &mut landed).unwrap();
            let mut expected = zeros.clone();
            let (from, to, len) = (from as usize, to as usize, len as usize);
            expected[to..to + len].copy_from_slice(&bytes[from..from + len]);
            assert_bytes_eq(
                &landed,
                &expected,
                &format!("case {case}, round {round}: the write its notification announced"),
            );
            assert_eq!(transfer.wait().unwrap().transports, vec!["nvlink"]);
        }
    }
}

/// Paged blocks whose size is not a multiple of 16 (so their ends disagree modulo 16) land
/// whole in their slots on both sides of the size where the kernel's `_shifted` build takes
/// over from the plain one, and nothing beside them is touched.
#[test]
fn odd_sized_blocks_land_whole_on_both_builds_of_the_kernel() {
    gpus();
    const POOL_BLOCKS: u32 = 4096;
    const IDS: u32 = 3001;
    let (decode, prefill) = (engine(), engine());
    let sizes = [1000u64, 2047, 2052, 4100];
    // Every target registered before the peer is opened, so its descriptor names them all.
    let targets: Vec<ferry::Region> = sizes
        .iter()
        .map(|block| {
            decode
                .allocate_device(0, 2 * block * u64::from(POOL_BLOCKS))
                .unwrap()
        })
        .collect();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    for (block, target) in sizes.into_iter().zip(&targets) {
        let pool = block * u64::from(POOL_BLOCKS);
        let area = 2 * pool;
        let zeros = vec![0u8; area as usize];
        target.write_at(0, &zeros).unwrap();
        let source = prefill.allocate_device(0, area).unwrap();
        let bytes = pattern(300 + block, area as usize);
        source.write_at(0, &bytes).unwrap();
        let remote = peer.buffer_at(target.addr()).unwrap();
        let at = target.addr() - remote.addr;
        let local_ids: Vec<u32> = (0..IDS).map(|i| (i * 2897 + 1) % POOL_BLOCKS).collect();
        let remote_ids: Vec<u32> = (0..IDS).map(|i| (i * 1231 + 5) % POOL_BLOCKS).collect();
        let layout = ferry::BlockLayout::packed(pool, block);
        let mut copy =
            ferry::BlockCopy::new(block, layout, layout, local_ids.clone(), remote_ids.clone());
        for index in 0..2 {
            copy = copy.pool_at(&source, index * pool, &remote, at + index * pool);
        }
        let done = prefill
            .batch(&peer)
            .write_blocks(copy)
            .submit_blocking()
            .unwrap();
        assert_eq!(done.transports, vec!["nvlink"]);
        let mut expected = zeros.clone();
        for index in 0..2u64 {
            for (&from, &to) in local_ids.iter().zip(&remote_ids) {
                let from = (index * pool + u64::from(from) * block) as usize;
                let to = (index * pool + u64::from(to) * block) as usize;
                expected[to..to + block as usize]
                    .copy_from_slice(&bytes[from..from + block as usize]);
            }
        }
        let mut landed = vec![0u8; area as usize];
        target.read_at(0, &mut landed).unwrap();
        assert_bytes_eq(&landed, &expected, &format!("{block}-byte blocks"));
    }
}

/// A block copy with a long id list (40,001 scattered ids over two pools) lands every block
/// in its slot and nothing anywhere else, written out and read back.
#[test]
fn a_long_id_list_lands_every_block_in_its_slot_and_reads_back() {
    gpus();
    const BLOCK: u64 = 64;
    const POOL_BLOCKS: u32 = 1 << 16;
    const IDS: u32 = 40_001;
    const POOL: u64 = BLOCK * POOL_BLOCKS as u64;
    const AREA: u64 = 2 * POOL;
    let (decode, prefill) = (engine(), engine());
    let pool = decode.allocate_device(0, AREA).unwrap();
    pool.write_at(0, &vec![0u8; AREA as usize]).unwrap();
    let source = prefill.allocate_device(0, AREA).unwrap();
    let back = prefill.allocate_device(0, AREA).unwrap();
    back.write_at(0, &vec![0u8; AREA as usize]).unwrap();
    let bytes = pattern(97, AREA as usize);
    source.write_at(0, &bytes).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    let remote = peer.buffer_at(pool.addr()).unwrap();
    let at = pool.addr() - remote.addr;
    // Distinct and scattered on both sides: odd strides through a power-of-two pool.
    let local_ids: Vec<u32> = (0..IDS).map(|i| (i * 40_503 + 7) % POOL_BLOCKS).collect();
    let remote_ids: Vec<u32> = (0..IDS).map(|i| (i * 25_013 + 3) % POOL_BLOCKS).collect();
    let copy = |region: &ferry::Region| {
        let layout = ferry::BlockLayout::packed(POOL, BLOCK);
        let mut copy =
            ferry::BlockCopy::new(BLOCK, layout, layout, local_ids.clone(), remote_ids.clone());
        for index in 0..2 {
            copy = copy.pool_at(region, index * POOL, &remote, at + index * POOL);
        }
        copy
    };
    let done = prefill
        .batch(&peer)
        .write_blocks(copy(&source))
        .submit_blocking()
        .unwrap();
    assert_eq!(done.transports, vec!["nvlink"]);
    assert_eq!(done.bytes, 2 * BLOCK * u64::from(IDS));
    let mut expected = vec![0u8; AREA as usize];
    for index in 0..2u64 {
        for (&from, &to) in local_ids.iter().zip(&remote_ids) {
            let from = (index * POOL + u64::from(from) * BLOCK) as usize;
            let to = (index * POOL + u64::from(to) * BLOCK) as usize;
            expected[to..to + BLOCK as usize].copy_from_slice(&bytes[from..from + BLOCK as usize]);
        }
    }
    let mut landed = vec![0u8; AREA as usize];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &expected, "the peer's pools after the write");
    prefill
        .batch(&peer)
        .read_blocks(copy(&back))
        .submit_blocking()
        .unwrap();
    let mut read = vec![0u8; AREA as usize];
    back.read_at(0, &mut read).unwrap();
    let mut returned = vec![0u8; AREA as usize];
    for index in 0..2u64 {
        for &id in &local_ids {
            let at = (index * POOL + u64::from(id) * BLOCK) as usize;
            returned[at..at + BLOCK as usize].copy_from_slice(&bytes[at..at + BLOCK as usize]);
        }
    }
    assert_bytes_eq(&read, &returned, "the blocks read back");
}

/// Block copies with long id lists, one after another, each with other ids in the argument
/// buffer the one before used: every round lands exactly its own blocks, none where a stale id
/// of an earlier round points.
#[test]
fn long_id_lists_back_to_back_land_each_round_s_own_blocks() {
    gpus();
    const BLOCK: u64 = 256;
    const POOL_BLOCKS: u32 = 1 << 16;
    const IDS: u32 = 50_000;
    const POOL: u64 = BLOCK * POOL_BLOCKS as u64;
    let (decode, prefill) = (engine(), engine());
    let pool = decode.allocate_device(0, POOL).unwrap();
    let source = prefill.allocate_device(0, POOL).unwrap();
    let bytes = pattern(31, POOL as usize);
    source.write_at(0, &bytes).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    let remote = peer.buffer_at(pool.addr()).unwrap();
    let at = pool.addr() - remote.addr;
    // Odd multipliers walk a power-of-two pool without repeating: distinct ids, other ones
    // every round.
    for (round, (local_step, remote_step)) in
        [(40_503u32, 30_001u32), (25_013, 54_321), (12_345, 777)]
            .into_iter()
            .enumerate()
    {
        let round = round as u32;
        pool.write_at(0, &vec![0u8; POOL as usize]).unwrap();
        let local_ids: Vec<u32> = (0..IDS)
            .map(|i| (i * local_step + round) % POOL_BLOCKS)
            .collect();
        let remote_ids: Vec<u32> = (0..IDS)
            .map(|i| (i * remote_step + 3 * round) % POOL_BLOCKS)
            .collect();
        let layout = ferry::BlockLayout::packed(POOL, BLOCK);
        let copy =
            ferry::BlockCopy::new(BLOCK, layout, layout, local_ids.clone(), remote_ids.clone())
                .pool_at(&source, 0, &remote, at);
        let done = prefill
            .batch(&peer)
            .write_blocks(copy)
            .submit_blocking()
            .unwrap();
        assert_eq!(done.transports, vec!["nvlink"]);
        let mut expected = vec![0u8; POOL as usize];
        for (&from, &to) in local_ids.iter().zip(&remote_ids) {
            let (from, to) = (
                (u64::from(from) * BLOCK) as usize,
                (u64::from(to) * BLOCK) as usize,
            );
            expected[to..to + BLOCK as usize].copy_from_slice(&bytes[from..from + BLOCK as usize]);
        }
        let mut landed = vec![0u8; POOL as usize];
        pool.read_at(0, &mut landed).unwrap();
        assert_bytes_eq(&landed, &expected, &format!("round {round}"));
    }
}

/// A block copy told to start after an event holds every byte back until the event fires and
/// then moves them all: over nvlink the copy waits on the GPU, over TCP (GPU memory staged
/// through the host) the engine waits on the host. The event stands for prefill's "layer N
/// is computed"; a stream held on a word of GPU memory stands for the computing stream.
#[test]
fn a_block_copy_after_an_event_moves_nothing_before_it_fires() {
    gpus();
    const BLOCK: u64 = 4096;
    const BLOCKS: u32 = 64;
    const AREA: u64 = BLOCK * BLOCKS as u64;
    for (gpu_links, transport) in [(true, "nvlink"), (false, "tcp")] {
        let engine = || {
            ferry::Links::default()
                .gpu_links(gpu_links)
                .builder()
                .transfer_timeout(Duration::from_secs(20))
                .build_blocking()
                .expect("engine starts")
        };
        let (decode, prefill) = (engine(), engine());
        let pool = decode.allocate_device(0, AREA).unwrap();
        let zeros = vec![0u8; AREA as usize];
        pool.write_at(0, &zeros).unwrap();
        let source = prefill.allocate_device(0, AREA).unwrap();
        let bytes = pattern(95, AREA as usize);
        source.write_at(0, &bytes).unwrap();
        let gate = prefill.allocate_device(0, 4096).unwrap();
        gate.write_at(0, &[0u8; 4096]).unwrap();
        let peer = prefill.connect_blocking(decode.name()).unwrap();
        let remote = peer.buffer_at(pool.addr()).unwrap();
        let local_ids: Vec<u32> = (0..BLOCKS).collect();
        let remote_ids: Vec<u32> = (0..BLOCKS).rev().collect();
        let copy = || {
            ferry::BlockCopy::packed(BLOCK, local_ids.clone(), remote_ids.clone()).pool_at(
                &source,
                0,
                &remote,
                pool.addr() - remote.addr,
            )
        };
        // Both engines share this process's context: everything that may wait for the whole
        // context (mappings, kernel and buffer set-up) happens before the stream is held.
        prefill
            .batch(&peer)
            .write_blocks(copy())
            .submit_blocking()
            .unwrap();
        pool.write_at(0, &zeros).unwrap();
        let computing = ferry::cuda::Stream::new(ferry::cuda::Context::get(0).unwrap()).unwrap();
        computing.wait_value32(&gate, 0, 1).unwrap();
        let computed = computing.record_event().unwrap();
        let transfer = prefill
            .batch(&peer)
            .write_blocks(copy())
            .after(computed)
            .submit()
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let mut landed = vec![0u8; AREA as usize];
        pool.read_at(0, &mut landed).unwrap();
        assert!(
            landed.iter().all(|&byte| byte == 0),
            "{transport}: bytes landed before the event fired"
        );
        gate.write_at(0, &1u32.to_le_bytes()).unwrap();
        let done = transfer.wait().unwrap();
        assert_eq!(done.transports, vec![transport]);
        pool.read_at(0, &mut landed).unwrap();
        let mut expected = vec![0u8; AREA as usize];
        for (&from, &to) in local_ids.iter().zip(&remote_ids) {
            let (from, to) = (u64::from(from) * BLOCK, u64::from(to) * BLOCK);
            expected[to as usize..(to + BLOCK) as usize]
                .copy_from_slice(&bytes[from as usize..(from + BLOCK) as usize]);
        }
        assert_bytes_eq(
            &landed,
            &expected,
            &format!("{transport}: the blocks after the event"),
        );
    }
}

#[test]
fn gpu_memory_crosses_tcp_staged_through_pinned_buffers() {
    gpus();
    let remote_gpu = if gpus() >= 2 { "1" } else { "0" };
    const AREA: usize = 48 << 20;
    let target = ServeProcess::start_with(AREA, &["--gpu", remote_gpu], &[]);
    let engine = ferry::Links::default()
        .gpu_links(false)
        .builder()
        .transfer_timeout(Duration::from_secs(20))
        .build_blocking()
        .unwrap();
    let source = engine.allocate_device(0, AREA as u64).unwrap();
    let back = engine.allocate_device(0, AREA as u64).unwrap();
    let bytes = pattern(93, AREA);
    source.write_at(0, &bytes).unwrap();
    back.write_at(0, &vec![0u8; AREA]).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    // A large entry (sliced over the connections), odd-sized ones, and small ones that are
    // packed into write-many frames.
    let mut entries = vec![
        (0u64, 0u64, 20u64 << 20),
        (21 << 20, (21 << 20) + 5, 3_000_001),
    ];
    for block in 0..64u64 {
        entries.push((
            (30 << 20) + block * 8192,
            (30 << 20) + block * 8192 + 3,
            4093,
        ));
    }
    let done = write_entries(&engine, &peer, &source, target.buffer_addr, &entries);
    assert_eq!(done.transports, vec!["tcp"]);
    read_entries(&engine, &peer, &back, target.buffer_addr, &entries);
    let mut landed = vec![0u8; AREA];
    back.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(
        &landed,
        &expected_area(&entries, &bytes, AREA),
        "GPU bytes written and read back over tcp",
    );
}

/// A metadata store that plays hostile peers: it answers the descriptors planted in it for
/// their names, and asks the real engines for every other name.
#[derive(Default)]
struct CraftedPeers {
    crafted: std::sync::Mutex<std::collections::HashMap<String, ferry::SegmentDescriptor>>,
    real: ferry::metadata::PeerToPeer,
}

impl CraftedPeers {
    /// Serves `real`'s descriptor under `name` with its one buffer replaced by `buffer`.
    fn plant(&self, name: &str, real: &ferry::SegmentDescriptor, buffer: ferry::BufferDescriptor) {
        let mut crafted = real.clone();
        crafted.name = name.to_owned();
        crafted.buffers = vec![buffer];
        self.crafted
            .lock()
            .unwrap()
            .insert(name.to_owned(), crafted);
    }
}

#[async_trait::async_trait]
impl ferry::metadata::MetadataStore for CraftedPeers {
    async fn publish(&self, _descriptor: &ferry::SegmentDescriptor) -> ferry::Result<()> {
        Ok(())
    }

    async fn fetch(&self, name: &str) -> ferry::Result<ferry::SegmentDescriptor> {
        let planted = self.crafted.lock().unwrap().get(name).cloned();
        match planted {
            Some(descriptor) => Ok(descriptor),
            None => self.real.fetch(name).await,
        }
    }

    async fn unpublish(&self, _name: &str) -> ferry::Result<()> {
        Ok(())
    }
}

/// Writes 4 KiB to `addr` of the crafted peer `name` and expects the nvlink transport to
/// refuse it as a protocol violation naming `field`, with the peer closed.
fn expect_refusal(engine: &Engine, source: &ferry::Region, name: &str, addr: u64, field: &str) {
    let peer = engine.connect_blocking(name).unwrap();
    let outcome = engine
        .batch(&peer)
        .write(source, 0, addr, 4096)
        .submit_blocking();
    match outcome {
        Err(Error::Protocol {
            violation: ferry::ProtocolViolation::Descriptor { field: found, .. },
            ..
        }) => assert_eq!(found, field, "{name}"),
        other => panic!("{name}: expected a violation naming {field}, got {other:?}"),
    }
    assert!(
        !peer.is_alive(),
        "{name}: the peer is closed after its violation"
    );
}

/// A good transfer after the hostile ones: written to `target`'s real buffer, read back and
/// compared, all over nvlink on the same engine.
fn good_transfer_follows(engine: &Engine, source: &ferry::Region, target: &ServeProcess) {
    let peer = engine.connect_blocking(&target.name).unwrap();
    let bytes = pattern(94, 1 << 20);
    source.write_at(0, &bytes).unwrap();
    let done = engine
        .batch(&peer)
        .write(source, 0, target.buffer_addr + 4096, 1 << 20)
        .submit_blocking()
        .unwrap();
    assert_eq!(done.transports, vec!["nvlink"]);
    let back = engine.allocate_device(0, 1 << 20).unwrap();
    back.write_at(0, &vec![0u8; 1 << 20]).unwrap();
    engine
        .batch(&peer)
        .read(&back, 0, target.buffer_addr + 4096, 1 << 20)
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0u8; 1 << 20];
    back.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &bytes, "the good transfer after the crafted ones");
}

fn engine_asking(store: &std::sync::Arc<CraftedPeers>) -> Engine {
    ferry::builder()
        .metadata(std::sync::Arc::clone(store) as std::sync::Arc<dyn ferry::metadata::MetadataStore>)
        .transfer_timeout(Duration::from_secs(20))
        .build_blocking()
        .expect("engine starts")
}

#[test]
fn ipc_exports_that_overreach_their_allocation_or_are_disowned_are_refused_and_a_good_transfer_follows(
) {
    gpus();
    const AREA: usize = 4 << 20;
    let target = ServeProcess::start_with(AREA, &["--gpu", "0"], &[]);
    let store = std::sync::Arc::new(CraftedPeers::default());
    let engine = engine_asking(&store);
    let source = engine.allocate_device(0, AREA as u64).unwrap();
    let real = engine.connect_blocking(&target.name).unwrap().descriptor();
    let buffer = real
        .buffers
        .iter()
        .find(|buffer| buffer.addr == target.buffer_addr)
        .expect("the served buffer")
        .clone();
    let Some(Export::CudaIpc { handle, offset }) = Export::of(&buffer, NVLINK).unwrap() else {
        panic!("expected a CUDA IPC export, got {:?}", buffer.exports);
    };
    let with = |export_offset: u64, len: u64| ferry::BufferDescriptor {
        len,
        exports: vec![Export::CudaIpc {
            handle: handle.clone(),
            offset: export_offset,
        }
        .to_export(NVLINK)],
        ..buffer.clone()
    };
    let area = AREA as u64;
    // (name, buffer as the peer claims it, where the write goes, the field named)
    let cases = [
        (
            "offset-past-the-allocation",
            with(1 << 40, area),
            buffer.addr,
            "export.offset",
        ),
        (
            "len-past-the-allocation",
            with(offset, area + (1 << 30)),
            buffer.addr + area + 4096,
            "len",
        ),
        (
            "offset-plus-len-wraps",
            with(4096, u64::MAX - 4095),
            buffer.addr + area,
            "len",
        ),
        // Another handle (as another engine's would be) for the engine's real buffer: its fd
        // socket disowns it before anything is mapped.
        (
            "handle-of-another-engine",
            ferry::BufferDescriptor {
                exports: vec![Export::CudaIpc {
                    handle: "ab".repeat(64),
                    offset,
                }
                .to_export(NVLINK)],
                ..buffer.clone()
            },
            buffer.addr,
            "export.handle",
        ),
    ];
    for (name, crafted, addr, field) in cases {
        store.plant(name, &real, crafted);
        expect_refusal(&engine, &source, name, addr, field);
    }
    good_transfer_follows(&engine, &source, &target);
}

#[test]
fn vmm_piece_lists_that_do_not_match_the_allocations_are_refused_and_a_good_transfer_follows() {
    gpus();
    let target = ServeProcess::start_with(6 << 20, &["--gpu", "0", "--vmm-pieces", "3"], &[]);
    let store = std::sync::Arc::new(CraftedPeers::default());
    let engine = engine_asking(&store);
    let source = engine.allocate_device(0, 4 << 20).unwrap();
    let real = engine.connect_blocking(&target.name).unwrap().descriptor();
    let buffer = real
        .buffers
        .iter()
        .find(|buffer| buffer.addr == target.buffer_addr)
        .expect("the served buffer")
        .clone();
    let Some(Export::VmmFd {
        socket,
        socket_path,
        region,
        offset,
        pieces,
    }) = Export::of(&buffer, NVLINK).unwrap()
    else {
        panic!("expected a VMM export, got {:?}", buffer.exports);
    };
    assert_eq!(pieces.len(), 3, "{pieces:?}");
    let with = |pieces: Vec<u64>| ferry::BufferDescriptor {
        exports: vec![Export::VmmFd {
            socket: socket.clone(),
            socket_path: socket_path.clone(),
            region,
            offset,
            pieces,
        }
        .to_export(NVLINK)],
        ..buffer.clone()
    };
    let piece = pieces[0];
    let cases = [
        ("no-pieces", with(Vec::new())),
        ("a-piece-of-size-zero", with(vec![piece, 0, piece])),
        ("more-pieces-than-the-peer-has", with(vec![piece; 4])),
        (
            "pieces-whose-sum-overflows",
            with(vec![u64::MAX, piece, piece]),
        ),
        (
            "a-piece-larger-than-its-allocation",
            with(vec![piece * 2, piece, piece]),
        ),
    ];
    for (name, crafted) in cases {
        store.plant(name, &real, crafted);
        expect_refusal(&engine, &source, name, buffer.addr, "export.pieces");
    }
    // Pieces smaller than the peer says it registered: the buffer no longer fits the mapping.
    store.plant(
        "pieces-smaller-than-the-buffer",
        &real,
        with(vec![piece, piece]),
    );
    let peer = engine
        .connect_blocking("pieces-smaller-than-the-buffer")
        .unwrap();
    let outcome = engine
        .batch(&peer)
        .write(&source, 0, buffer.addr, 4096)
        .submit_blocking();
    assert!(
        matches!(outcome, Err(Error::Protocol { .. })),
        "two pieces for a buffer over three: {outcome:?}"
    );
    good_transfer_follows(&engine, &source, &target);
}

#[test]
fn thousands_of_tiny_gpu_entries_cross_tcp_through_shared_staging_chunks() {
    gpus();
    const ENTRIES: u64 = 4096;
    const STRIDE: u64 = 256;
    const AREA: usize = (ENTRIES * STRIDE) as usize + 4096;
    let target = ServeProcess::start_with(AREA, &["--gpu", "0"], &[]);
    let engine = ferry::Links::default()
        .gpu_links(false)
        .builder()
        .transfer_timeout(Duration::from_secs(20))
        .build_blocking()
        .unwrap();
    let source = engine.allocate_device(0, AREA as u64).unwrap();
    let back = engine.allocate_device(0, AREA as u64).unwrap();
    let bytes = pattern(95, AREA);
    source.write_at(0, &bytes).unwrap();
    back.write_at(0, &vec![0u8; AREA]).unwrap();
    let peer = engine.connect_blocking(&target.name).unwrap();
    // 1 to 200 bytes each, at odd remote offsets, with untouched gaps between them: every
    // entry is staged through a slice of a shared pinned chunk on both sides.
    let entries: Vec<(u64, u64, u64)> = (0..ENTRIES)
        .map(|index| (index * STRIDE, index * STRIDE + 3, 1 + index * 7 % 200))
        .collect();
    let done = write_entries(&engine, &peer, &source, target.buffer_addr, &entries);
    assert_eq!(done.transports, vec!["tcp"]);
    read_entries(&engine, &peer, &back, target.buffer_addr, &entries);
    let mut landed = vec![0u8; AREA];
    back.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(
        &landed,
        &expected_area(&entries, &bytes, AREA),
        "tiny GPU entries written and read back over tcp",
    );
}
