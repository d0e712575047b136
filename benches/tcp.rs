//! TCP over loopback: ferry against a plain tokio socket copy loop with no protocol, moving the
//! same bytes in the same block sizes in the same run; ferry both without a secret and with
//! one, whose connections tag every frame (the cost of integrity, `ferry::wire::seal`).
//!
//! Each iteration moves 256 MiB: as 1 MiB blocks and as 32 KiB blocks scattered over the
//! destination (a permutation, so no two blocks merge). The baseline writes the same block
//! sizes down one connection into a buffer of the same size and ends with a one-byte reply, so
//! both sides count the time until the last byte is in the receiver's memory.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferry::{Engine, Peer, Region};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

const TOTAL: usize = 256 << 20;

struct FerryPair {
    _decode: Engine,
    pool: Region,
    prefill: Engine,
    source: Region,
    peer: Peer,
}

/// A random-looking 32-byte secret, as `ferry secret` makes them.
fn secret() -> Vec<u8> {
    (0..32u8)
        .map(|index| index.wrapping_mul(151).wrapping_add(89))
        .collect()
}

fn ferry_pair(secret: Option<Vec<u8>>) -> FerryPair {
    let builder = || match &secret {
        Some(secret) => ferry::builder()
            .secret(secret.clone())
            .frame_tags(ferry::FrameTags::Always),
        None => ferry::builder(),
    };
    let decode = builder().build_blocking().expect("decode engine");
    let pool = decode.allocate(TOTAL as u64).expect("pool");
    let prefill = builder().build_blocking().expect("prefill engine");
    let source = prefill.allocate(TOTAL as u64).expect("source");
    // Touch every page once, so no iteration pays for first-touch page faults.
    let bytes: Vec<u8> = (0..TOTAL).map(|index| (index % 251) as u8).collect();
    source.write_at(0, &bytes).expect("fill source");
    pool.write_at(0, &vec![0u8; TOTAL]).expect("touch pool");
    let peer = prefill.connect_blocking(decode.name()).expect("connect");
    FerryPair {
        _decode: decode,
        pool,
        prefill,
        source,
        peer,
    }
}

/// Block `index` goes to slot `(index * 7 + 3) % count`: a permutation with no neighbours.
fn slot(index: usize, count: usize) -> usize {
    (index * 7 + 3) % count
}

fn ferry_once(pair: &FerryPair, block: usize) -> Duration {
    let count = TOTAL / block;
    let remote = pair.pool.addr();
    let started = Instant::now();
    let mut batch = pair.prefill.batch(&pair.peer);
    for index in 0..count {
        batch = batch.write(
            &pair.source,
            (index * block) as u64,
            remote + (slot(index, count) * block) as u64,
            block as u64,
        );
    }
    batch.submit_blocking().expect("ferry transfer");
    started.elapsed()
}

fn verify(pair: &FerryPair, block: usize) {
    let count = TOTAL / block;
    let mut expected = vec![0u8; block];
    let mut found = vec![0u8; block];
    for index in [0, count / 2, count - 1] {
        pair.source
            .read_at((index * block) as u64, &mut expected)
            .expect("read source");
        pair.pool
            .read_at((slot(index, count) * block) as u64, &mut found)
            .expect("read pool");
        assert!(
            found == expected,
            "block {index} of {block} bytes did not land intact"
        );
    }
}

/// The baseline's two ends: the receiver runs in its own task (so on its own worker thread,
/// as ferry's receiving engine does) and reads each round's blocks into their slots.
struct SocketPair {
    sender: TcpStream,
    source: Vec<u8>,
    rounds: tokio::sync::mpsc::Sender<usize>,
}

async fn socket_pair() -> SocketPair {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let (sender, accepted) = tokio::join!(TcpStream::connect(address), listener.accept());
    let sender = sender.expect("connect");
    let (mut receiver, _) = accepted.expect("accept");
    sender.set_nodelay(true).expect("nodelay");
    receiver.set_nodelay(true).expect("nodelay");
    let (rounds, mut blocks) = tokio::sync::mpsc::channel::<usize>(1);
    tokio::spawn(async move {
        let mut sink = vec![0u8; TOTAL];
        while let Some(block) = blocks.recv().await {
            let count = TOTAL / block;
            for index in 0..count {
                let at = slot(index, count) * block;
                receiver
                    .read_exact(&mut sink[at..at + block])
                    .await
                    .expect("receive");
            }
            receiver.write_all(&[1]).await.expect("reply");
        }
    });
    SocketPair {
        sender,
        source: (0..TOTAL).map(|index| (index % 251) as u8).collect(),
        rounds,
    }
}

async fn socket_once(pair: &mut SocketPair, block: usize) -> Duration {
    let count = TOTAL / block;
    let started = Instant::now();
    pair.rounds.send(block).await.expect("receiver task alive");
    for index in 0..count {
        pair.sender
            .write_all(&pair.source[index * block..(index + 1) * block])
            .await
            .expect("send");
    }
    let mut reply = [0u8; 1];
    pair.sender.read_exact(&mut reply).await.expect("reply");
    started.elapsed()
}

fn tcp(criterion: &mut Criterion) {
    let plain = ferry_pair(None);
    let sealed = ferry_pair(Some(secret()));
    let runtime = Runtime::new().expect("runtime");
    let mut sockets = runtime.block_on(socket_pair());
    let mut group = criterion.benchmark_group("tcp");
    group.throughput(Throughput::Bytes(TOTAL as u64));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(6));
    for (label, block) in [("1MiB", 1 << 20), ("32KiB", 32 << 10)] {
        for (name, pair) in [("ferry", &plain), ("ferry-tagged", &sealed)] {
            group.bench_function(BenchmarkId::new(name, label), |bencher| {
                bencher.iter_custom(|iterations| {
                    (0..iterations).map(|_| ferry_once(pair, block)).sum()
                })
            });
            verify(pair, block);
        }
        group.bench_function(BenchmarkId::new("baseline", label), |bencher| {
            bencher.iter_custom(|iterations| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iterations {
                        total += socket_once(&mut sockets, block).await;
                    }
                    total
                })
            })
        });
    }
    group.finish();
}

criterion_group!(benches, tcp);
criterion_main!(benches);
