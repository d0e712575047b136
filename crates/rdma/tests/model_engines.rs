//! The RDMA transport between two real engines in this process, over the in-memory verbs
//! model: each engine's "host" has its own NICs, and the model's NICs read and write the
//! memory the engines registered. Nothing here touches RDMA hardware.

use ferry_core::{
    BlockCopy, Engine, EngineBuilder, Error, Location, Peer, Region, RegionInfo, TcpOnly, Transport,
};
use ferry_rdma::model::{Fabric, HostConfig, HostMemory, ModelVerbs};
use ferry_rdma::{DmaBufRange, DmaBufSource, Gid, NoDmaBuf, RdmaConfig, RdmaTransport, VerbsError};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Memory a test owns, that its engine registers and its model NIC reads and writes.
#[derive(Debug, Clone, Default)]
struct TestMemory {
    buffers: Arc<Mutex<BTreeMap<u64, Box<[u8]>>>>,
}

impl TestMemory {
    fn locate(&self, addr: u64, len: u64) -> Option<(u64, usize)> {
        let buffers = self.buffers.lock();
        let (base, buffer) = buffers.range(..=addr).next_back()?;
        let start = usize::try_from(addr - base).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        (end <= buffer.len()).then_some((*base, start))
    }

    /// Fills `len` bytes with `fill` and returns their address.
    fn buffer(&self, len: usize, fill: u8) -> u64 {
        let buffer = vec![fill; len].into_boxed_slice();
        let addr = buffer.as_ptr() as u64;
        self.buffers.lock().insert(addr, buffer);
        addr
    }

    fn bytes(&self, addr: u64, len: u64) -> Vec<u8> {
        HostMemory::read(self, addr, len).expect("the range is test memory")
    }

    fn set(&self, addr: u64, bytes: &[u8]) {
        let mut this = self.clone();
        HostMemory::write(&mut this, addr, bytes).expect("the range is test memory");
    }
}

impl HostMemory for TestMemory {
    fn alloc(&mut self, len: u64) -> Result<u64, VerbsError> {
        Ok(self.buffer(len as usize, 0))
    }

    fn is_mapped(&self, addr: u64, len: u64) -> bool {
        self.locate(addr, len).is_some()
    }

    fn read(&self, addr: u64, len: u64) -> Option<Vec<u8>> {
        let (base, start) = self.locate(addr, len)?;
        let buffers = self.buffers.lock();
        Some(buffers.get(&base)?[start..start + len as usize].to_vec())
    }

    fn write(&mut self, addr: u64, bytes: &[u8]) -> Option<()> {
        let (base, start) = self.locate(addr, bytes.len() as u64)?;
        let mut buffers = self.buffers.lock();
        buffers.get_mut(&base)?[start..start + bytes.len()].copy_from_slice(bytes);
        Some(())
    }
}

/// Stands in for CUDA: a file of the asked size is the dma-buf.
struct FileDmaBuf;

impl DmaBufSource for FileDmaBuf {
    fn export(&self, _addr: u64, len: u64) -> Result<DmaBufRange, NoDmaBuf> {
        let io = |what: &str| {
            let what = what.to_owned();
            move |source| NoDmaBuf::Io { what, source }
        };
        let path = std::env::temp_dir().join(format!(
            "ferry-dmabuf-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io("creating the dma-buf's file"))?;
        std::fs::remove_file(&path).map_err(io("removing the dma-buf's file"))?;
        file.set_len(len + 4096)
            .map_err(io("sizing the dma-buf's file"))?;
        Ok(DmaBufRange {
            fd: file.into(),
            offset: 4096,
        })
    }

    fn pci_bus_id(&self, ordinal: u32) -> Option<String> {
        Some(format!("0000:{:02x}:00.0", 0x18 + ordinal))
    }
}

/// A RoCE host with `nics` NICs, `mlx5_0`.. on 10.0.`host`.`n`.
fn roce(host: u8, nics: u8) -> HostConfig {
    let mut config = HostConfig::roce(&format!("host{host}"), [10, 0, host, 1]);
    let template = config.devices[0].clone();
    config.devices.clear();
    for nic in 0..nics {
        let mut device = template.clone();
        device.name = format!("mlx5_{nic}");
        for port in &mut device.ports {
            for entry in &mut port.gids {
                if entry.gid.is_ipv4_mapped() {
                    entry.gid = Gid::from_ipv4([10, 0, host, nic + 1]);
                }
            }
        }
        config.devices.push(device);
    }
    config
}

fn config() -> RdmaConfig {
    RdmaConfig {
        listen: "127.0.0.1:0".into(),
        slice_bytes: 64 * 1024,
        ..RdmaConfig::default()
    }
}

/// One engine on a model host.
struct Side {
    engine: Engine,
    memory: TestMemory,
    verbs: ModelVerbs,
}

impl Side {
    async fn new(fabric: &Fabric, host: HostConfig, config: RdmaConfig) -> Side {
        Side::build(fabric, host, config, |builder| builder).await
    }

    /// An engine whose builder `tune` adjusts.
    async fn build(
        fabric: &Fabric,
        host: HostConfig,
        config: RdmaConfig,
        tune: impl FnOnce(EngineBuilder) -> EngineBuilder,
    ) -> Side {
        let memory = TestMemory::default();
        let verbs = fabric.add_host_with_memory(host, Box::new(memory.clone()));
        let transport = RdmaTransport::new(verbs.clone(), config, Arc::new(FileDmaBuf));
        assert_eq!(transport.unavailable(), None, "the model host has NICs");
        let builder = EngineBuilder::new(TcpOnly)
            .transfer_timeout(Duration::from_secs(10))
            .transport(Arc::new(transport));
        let engine = tune(builder).build().await.expect("engine starts");
        Side {
            engine,
            memory,
            verbs,
        }
    }

    /// `len` bytes of test memory filled with `fill`, registered with the engine.
    fn region(&self, len: usize, fill: u8) -> (Region, u64) {
        let addr = self.memory.buffer(len, fill);
        // SAFETY: the buffer lives in `self.memory` for the whole test, longer than the
        // engine; while it is registered only the model's NIC writes it.
        let region =
            unsafe { self.engine.register(addr as *mut u8, len as u64) }.expect("registers");
        (region, addr)
    }
}

struct Pair {
    fabric: Fabric,
    prefill: Side,
    decode: Side,
}

impl Pair {
    async fn new(nics: u8, config: RdmaConfig) -> Pair {
        let fabric = Fabric::new();
        let decode = Side::new(&fabric, roce(2, nics), config.clone()).await;
        let prefill = Side::new(&fabric, roce(1, nics), config).await;
        Pair {
            fabric,
            prefill,
            decode,
        }
    }

    async fn connect(&self) -> Peer {
        self.prefill
            .engine
            .connect(self.decode.engine.name())
            .await
            .expect("connects")
    }
}

/// Stops the fabric, then submits a 1 MiB write from `source` to the peer's `addr` on a task
/// of its own: work posted and left in flight, for a test to fail it there.
fn stalled_write(
    fabric: &Fabric,
    side: &Side,
    peer: &Peer,
    source: &Region,
    addr: u64,
) -> tokio::task::JoinHandle<ferry_core::Result<ferry_core::Completion>> {
    fabric.set_auto_progress(false);
    let transfer = side
        .engine
        .batch(peer)
        .write(source, 0, addr, 1 << 20)
        .submit()
        .expect("submits");
    tokio::spawn(transfer)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut bytes);
    bytes
}

async fn bounded<T>(work: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), work)
        .await
        .expect("finishes within 20 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_of_every_size_move_over_rdma_and_land_intact() {
    let pair = Pair::new(1, config()).await;
    let (pool, pool_addr) = pair.decode.region(8 << 20, 0);
    let (source, source_addr) = pair.prefill.region(8 << 20, 0);
    let peer = pair.connect().await;
    let remote = peer.buffers()[0].addr;
    assert_eq!(remote, pool_addr);
    let mut offset = 0u64;
    for (seed, size) in [1usize, 999, 4096, 64 << 10, (1 << 20) + 3, 3 << 20]
        .into_iter()
        .enumerate()
    {
        let bytes = pattern(seed as u64, size);
        pair.prefill.memory.set(source_addr + offset, &bytes);
        let done = bounded(
            pair.prefill
                .engine
                .batch(&peer)
                .write(&source, offset, remote + offset + 5, size as u64)
                .submit()
                .expect("submits"),
        )
        .await
        .expect("write completes");
        assert_eq!(done.transports, vec!["rdma"]);
        assert_eq!(
            pair.decode
                .memory
                .bytes(pool_addr + offset + 5, size as u64),
            bytes,
            "{size}-byte write"
        );
        offset += size as u64 + 4096;
    }
    let bytes = pattern(77, 2 << 20);
    pair.decode.memory.set(pool_addr + 11, &bytes);
    let done = bounded(
        pair.prefill
            .engine
            .batch(&peer)
            .read(&source, 3, remote + 11, 2 << 20)
            .submit()
            .expect("submits"),
    )
    .await
    .expect("read completes");
    assert_eq!(done.transports, vec!["rdma"]);
    assert_eq!(pair.prefill.memory.bytes(source_addr + 3, 2 << 20), bytes);
    drop((pool, source));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_entries_are_sliced_and_striped_over_every_nic_and_queue_pair() {
    let pair = Pair::new(
        2,
        RdmaConfig {
            qps_per_nic_pair: 2,
            ..config()
        },
    )
    .await;
    let (_pool, pool_addr) = pair.decode.region(4 << 20, 0);
    let (source, source_addr) = pair.prefill.region(4 << 20, 0);
    let peer = pair.connect().await;
    let bytes = pattern(5, 4 << 20);
    pair.prefill.memory.set(source_addr, &bytes);
    bounded(
        pair.prefill
            .engine
            .batch(&peer)
            .write(&source, 0, pool_addr, 4 << 20)
            .submit()
            .expect("submits"),
    )
    .await
    .expect("write completes");
    assert_eq!(pair.decode.memory.bytes(pool_addr, 4 << 20), bytes);
    // 4 MiB in 64 KiB slices is 64 requests over 2 x 2 NIC pairs x 2 queue pairs.
    let executed = pair.prefill.verbs.executed();
    let busy: Vec<_> = executed
        .iter()
        .filter(|(_, _, requests)| *requests > 0)
        .collect();
    assert_eq!(busy.len(), 8, "every queue pair carried work: {executed:?}");
    assert!(
        busy.iter().any(|(nic, ..)| nic == "mlx5_0")
            && busy.iter().any(|(nic, ..)| nic == "mlx5_1")
    );
    assert_eq!(
        busy.iter().map(|(_, _, requests)| requests).sum::<u64>(),
        64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paged_blocks_land_in_their_slots_and_contiguous_ones_share_a_request() {
    const BLOCK: u64 = 4096;
    let pair = Pair::new(
        1,
        RdmaConfig {
            qps_per_nic_pair: 1,
            ..config()
        },
    )
    .await;
    let (pool, pool_addr) = pair.decode.region(256 * BLOCK as usize, 0);
    let (source, source_addr) = pair.prefill.region(64 * BLOCK as usize, 0);
    let peer = pair.connect().await;
    let bytes = pattern(9, 64 * BLOCK as usize);
    pair.prefill.memory.set(source_addr, &bytes);
    // Source blocks 0..64 in reverse order go to pool blocks 100..164: each lands next to the
    // one before it at the peer, so the plan gathers them into few requests.
    let source_ids: Vec<u32> = (0..64).rev().collect();
    let pool_ids: Vec<u32> = (100..164).collect();
    let remote = peer.buffers()[0].clone();
    let copy =
        BlockCopy::packed(BLOCK, source_ids.clone(), pool_ids.clone()).pool(&source, &remote);
    let done = bounded(
        pair.prefill
            .engine
            .batch(&peer)
            .write_blocks(copy)
            .submit()
            .expect("submits"),
    )
    .await
    .expect("block copy completes");
    assert_eq!(done.transports, vec!["rdma"]);
    for (&from, &to) in source_ids.iter().zip(&pool_ids) {
        let expected =
            &bytes[(u64::from(from) * BLOCK) as usize..(u64::from(from + 1) * BLOCK) as usize];
        let landed = pair
            .decode
            .memory
            .bytes(pool_addr + u64::from(to) * BLOCK, BLOCK);
        assert_eq!(landed, expected, "block {from} -> slot {to}");
    }
    // 256 KiB of blocks contiguous at the peer, at most 16 SG entries per request and 64 KiB
    // per slice: 4 requests, not 64.
    let requests: u64 = pair
        .prefill
        .verbs
        .executed()
        .iter()
        .map(|(_, _, requests)| requests)
        .sum();
    assert_eq!(requests, 4, "{:?}", pair.prefill.verbs.executed());
    drop(pool);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_fails_the_transfer_naming_retry_exceeded_and_nothing_hangs() {
    let pair = Pair::new(1, config()).await;
    let (_pool, pool_addr) = pair.decode.region(1 << 20, 0);
    let (source, _) = pair.prefill.region(1 << 20, 7);
    let peer = pair.connect().await;
    bounded(
        pair.prefill
            .engine
            .batch(&peer)
            .write(&source, 0, pool_addr, 4096)
            .submit()
            .expect("submits"),
    )
    .await
    .expect("first write completes");
    pair.decode.verbs.die();
    let error = bounded(
        pair.prefill
            .engine
            .batch(&peer)
            .write(&source, 0, pool_addr, 1 << 20)
            .submit()
            .expect("submits"),
    )
    .await
    .expect_err("the peer's host is dead");
    let message = error.to_string();
    assert!(matches!(error, Error::PeerGone { .. }), "{error:?}");
    assert!(message.contains("IBV_WC_RETRY_EXC_ERR"), "{message}");
    drop(pair.fabric);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deregistered_peer_buffer_is_a_remote_access_error_and_the_next_transfer_reconnects() {
    let pair = Pair::new(1, config()).await;
    let (pool, pool_addr) = pair.decode.region(1 << 20, 0);
    let (source, source_addr) = pair.prefill.region(1 << 20, 0);
    let peer = pair.connect().await;
    // The decode side deregisters the pool; the prefill side still holds its old rkey.
    let descriptor = peer.buffers()[0].clone();
    drop(pool);
    let error = bounded(
        pair.prefill
            .engine
            .batch(&peer)
            .write(&source, 0, descriptor.addr, 4096)
            .submit()
            .expect("submits"),
    )
    .await
    .expect_err("the rkey is gone");
    assert!(
        error.to_string().contains("IBV_WC_REM_ACCESS_ERR"),
        "{error}"
    );
    // Registered again, the pool is reachable through a new connection's queue pairs.
    // SAFETY: as in `Side::region`: the buffer is still the test's.
    let again =
        unsafe { pair.decode.engine.register(pool_addr as *mut u8, 1 << 20) }.expect("registers");
    let bytes = pattern(3, 8192);
    pair.prefill.memory.set(source_addr, &bytes);
    let peer = pair
        .prefill
        .engine
        .connect(pair.decode.engine.name())
        .await
        .expect("reconnects");
    bounded(
        pair.prefill
            .engine
            .batch(&peer)
            .write(&source, 0, pool_addr, 8192)
            .submit()
            .expect("submits"),
    )
    .await
    .expect("the write after the failure completes");
    assert_eq!(pair.decode.memory.bytes(pool_addr, 8192), bytes);
    drop(again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_registers_through_a_dma_buf() {
    let fabric = Fabric::new();
    let memory = TestMemory::default();
    let verbs = fabric.add_host_with_memory(roce(1, 1), Box::new(memory.clone()));
    let transport = RdmaTransport::new(verbs, config(), Arc::new(FileDmaBuf));
    let addr = memory.buffer(1 << 20, 0);
    let region = RegionInfo {
        addr,
        len: 1 << 20,
        location: Location::Device {
            gpu: ferry_core::cuda::GpuId([7; 16]),
            ordinal: 0,
        },
    };
    let exported = transport
        .export(&region)
        .expect("exports")
        .expect("registered with the NIC");
    assert_eq!(exported.export.transport, "rdma");
    assert!(
        exported.export.data.contains("mlx5_0"),
        "{}",
        exported.export.data
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers_on_one_link_each_complete_with_their_own_bytes() {
    let pair = Pair::new(
        1,
        RdmaConfig {
            max_outstanding: 8,
            signal_every: 3,
            ..config()
        },
    )
    .await;
    let (_pool, pool_addr) = pair.decode.region(16 << 20, 0);
    let (source, source_addr) = pair.prefill.region(16 << 20, 0);
    let peer = pair.connect().await;
    let chunk = 1usize << 20;
    let mut transfers = Vec::new();
    for index in 0..16u64 {
        let bytes = pattern(200 + index, chunk);
        pair.prefill
            .memory
            .set(source_addr + index * chunk as u64, &bytes);
        let offset = index * chunk as u64;
        let transfer = pair
            .prefill
            .engine
            .batch(&peer)
            .write(&source, offset, pool_addr + offset, chunk as u64)
            .submit()
            .expect("submits");
        transfers.push(tokio::spawn(transfer));
    }
    for transfer in transfers {
        bounded(transfer).await.expect("joins").expect("completes");
    }
    for index in 0..16u64 {
        let landed = pair
            .decode
            .memory
            .bytes(pool_addr + index * chunk as u64, chunk as u64);
        assert_eq!(landed, pattern(200 + index, chunk), "chunk {index}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_rdma_devices_the_transport_says_why_and_transfers_use_tcp() {
    let fabric = Fabric::new();
    let mut bare = roce(2, 1);
    bare.devices.clear();
    let memory = TestMemory::default();
    let verbs = fabric.add_host_with_memory(bare, Box::new(memory.clone()));
    let transport = RdmaTransport::new(verbs, config(), Arc::new(FileDmaBuf));
    let reason = transport.unavailable().expect("no device").to_string();
    assert!(reason.contains("no RDMA device"), "{reason}");
    let decode = EngineBuilder::new(TcpOnly)
        .transport(Arc::new(transport))
        .build()
        .await
        .expect("engine starts");
    assert!(decode
        .descriptor()
        .endpoints
        .iter()
        .all(|endpoint| endpoint.transport != "rdma"));
    let pool = decode.allocate(1 << 20).expect("allocates");
    let prefill = Side::new(&fabric, roce(1, 1), config()).await;
    let (source, source_addr) = prefill.region(1 << 20, 0);
    let bytes = pattern(4, 1 << 20);
    prefill.memory.set(source_addr, &bytes);
    let peer = prefill
        .engine
        .connect(decode.name())
        .await
        .expect("connects");
    let done = bounded(
        prefill
            .engine
            .batch(&peer)
            .write(&source, 0, peer.buffers()[0].addr, 1 << 20)
            .submit()
            .expect("submits"),
    )
    .await
    .expect("completes over TCP");
    assert_eq!(done.transports, vec!["tcp"]);
    let mut landed = vec![0u8; 1 << 20];
    pool.read_at(0, &mut landed).expect("reads");
    assert_eq!(landed, bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_queue_pairs_come_up_after_authenticating_and_anonymous_requests_are_refused()
{
    let fabric = Fabric::new();
    let secret =
        |builder: EngineBuilder| builder.secret(b"a shared secret of some length".to_vec());
    let decode = Side::build(&fabric, roce(2, 1), config(), secret).await;
    let prefill = Side::build(&fabric, roce(1, 1), config(), secret).await;
    let (_pool, pool_addr) = decode.region(1 << 20, 0);
    let (source, source_addr) = prefill.region(1 << 20, 0);
    let bytes = pattern(8, 1 << 20);
    prefill.memory.set(source_addr, &bytes);
    let peer = prefill
        .engine
        .connect(decode.engine.name())
        .await
        .expect("connects");
    let done = bounded(
        prefill
            .engine
            .batch(&peer)
            .write(&source, 0, pool_addr, 1 << 20)
            .submit()
            .expect("submits"),
    )
    .await
    .expect("completes");
    assert_eq!(done.transports, vec!["rdma"]);
    assert_eq!(decode.memory.bytes(pool_addr, 1 << 20), bytes);

    // A client that skips authentication learns why it is refused, and gets no queue pair.
    let port = decode
        .engine
        .descriptor()
        .endpoints
        .iter()
        .find(|endpoint| endpoint.transport == "rdma")
        .and_then(|endpoint| endpoint.address.strip_prefix(':').map(str::to_owned))
        .expect("an rdma endpoint");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
        .await
        .expect("dials");
    stream.write_all(&[0]).await.expect("writes");
    let mut answer = Vec::new();
    bounded(stream.read_to_end(&mut answer))
        .await
        .expect("reads the refusal");
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.contains("Refused") && answer.contains("shared secret"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_stuck_in_the_fabric_times_out_and_its_work_is_flushed() {
    let fabric = Fabric::new();
    let short = |builder: EngineBuilder| builder.transfer_timeout(Duration::from_millis(300));
    let decode = Side::build(&fabric, roce(2, 1), config(), short).await;
    let prefill = Side::build(&fabric, roce(1, 1), config(), short).await;
    let (_pool, pool_addr) = decode.region(1 << 20, 0);
    let (source, _) = prefill.region(1 << 20, 1);
    let peer = prefill
        .engine
        .connect(decode.engine.name())
        .await
        .expect("connects");
    let transfer = stalled_write(&fabric, &prefill, &peer, &source, pool_addr);
    // Past the timeout the engine closes the link: its queue pairs move to ERROR. The NIC
    // flushes their work when it runs again (at once, on hardware).
    tokio::time::sleep(Duration::from_millis(600)).await;
    fabric.set_auto_progress(true);
    let error = bounded(transfer)
        .await
        .expect("joins")
        .expect_err("nothing moved before the timeout");
    assert!(matches!(error, Error::Timeout { .. }), "{error:?}");
    assert_eq!(
        decode.memory.bytes(pool_addr, 16),
        vec![0; 16],
        "flushed work wrote nothing"
    );
}

/// A sysfs tree where GPU 0 (`0000:18:00.0`) shares a PCIe switch with `mlx5_1`, and
/// `mlx5_0` hangs off another root port.
fn sysfs_with_gpu_next_to_mlx5_1() -> tempfile::TempDir {
    use std::os::unix::fs::symlink;
    let root = tempfile::tempdir().expect("a temporary directory");
    let device = |path: &str| {
        let dir = root.path().join("sys/devices").join(path);
        std::fs::create_dir_all(&dir).expect("a PCI device");
        std::fs::write(dir.join("numa_node"), "0\n").expect("numa_node");
        dir
    };
    let class = root.path().join("sys/class/infiniband");
    std::fs::create_dir_all(&class).expect("the infiniband class");
    for (name, path) in [
        ("mlx5_0", "pci0000:00/0000:00:02.0/0000:03:00.0"),
        (
            "mlx5_1",
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:04.0/0000:05:00.0",
        ),
    ] {
        let pci = device(path);
        let dir = pci.join("infiniband").join(name);
        std::fs::create_dir_all(dir.join("ports/1")).expect("a port");
        std::fs::write(dir.join("ports/1/state"), "4: ACTIVE\n").expect("the port state");
        symlink(&pci, dir.join("device")).expect("the device link");
        symlink(&dir, class.join(name)).expect("the class link");
    }
    let gpu = device("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:18:00.0");
    let bus = root.path().join("sys/bus/pci/devices");
    std::fs::create_dir_all(&bus).expect("the PCI bus");
    symlink(gpu, bus.join("0000:18:00.0")).expect("the GPU link");
    root
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_registers_only_with_the_nic_nearest_its_gpu_and_host_memory_with_all() {
    let sysfs = sysfs_with_gpu_next_to_mlx5_1();
    let fabric = Fabric::new();
    let memory = TestMemory::default();
    let verbs = fabric.add_host_with_memory(roce(1, 2), Box::new(memory.clone()));
    let config = RdmaConfig {
        sysfs_root: sysfs.path().to_owned(),
        ..config()
    };
    let transport = RdmaTransport::new(verbs, config, Arc::new(FileDmaBuf));
    let info = |addr, location| RegionInfo {
        addr,
        len: 1 << 20,
        location,
    };
    let gpu = Location::Device {
        gpu: ferry_core::cuda::GpuId([7; 16]),
        ordinal: 0,
    };
    let exported = transport
        .export(&info(memory.buffer(1 << 20, 0), gpu))
        .expect("exports")
        .expect("registered");
    assert!(
        exported.export.data.contains("mlx5_1"),
        "{}",
        exported.export.data
    );
    assert!(
        !exported.export.data.contains("mlx5_0"),
        "{}",
        exported.export.data
    );
    let host = Location::Host { pinned: false };
    let exported = transport
        .export(&info(memory.buffer(1 << 20, 0), host))
        .expect("exports")
        .expect("registered");
    assert!(exported.export.data.contains("mlx5_0") && exported.export.data.contains("mlx5_1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_nic_that_dies_mid_transfer_fails_it_instead_of_hanging() {
    let pair = Pair::new(1, config()).await;
    let (_pool, pool_addr) = pair.decode.region(1 << 20, 0);
    let (source, _) = pair.prefill.region(1 << 20, 3);
    let peer = pair.connect().await;
    let transfer = stalled_write(&pair.fabric, &pair.prefill, &peer, &source, pool_addr);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The NIC under the posted work goes away: no completion will ever come for it.
    pair.prefill.verbs.die();
    let error = bounded(transfer)
        .await
        .expect("joins")
        .expect_err("the NIC died");
    assert!(error.to_string().contains("mlx5_0"), "{error}");
    assert_eq!(pair.decode.memory.bytes(pool_addr, 16), vec![0; 16]);
}
