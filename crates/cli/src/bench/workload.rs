//! The workloads of `ferry bench` as block lists: which bytes of the sending side go where on
//! the receiving side. Pure functions, so shapes and permutations are tested without a GPU.

use std::sync::Arc;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// One benchmark workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Workload {
    /// One 1 GiB buffer.
    Contiguous,
    /// Llama-3-70B fp16: 80 layers x {K, V} pools of 4,096 blocks of 32 KiB, 256 blocks a
    /// request, sent as one paged block copy.
    KvLlama70b4k,
    /// The same cache sent as 40,960 separate entries (what an engine without paged copies
    /// submits).
    KvLlama70b4kEntries,
    /// The same cache sent as vLLM's MooncakeConnector sends it: the request's block ids come
    /// in runs of 1-64 blocks consecutive on both sides, and each run is one entry per pool.
    KvLlama70b4kRuns,
    /// 40,960 scattered 4 KiB blocks, sent as one block copy (a pool and two id lists).
    Blocks4k,
    /// The same blocks sent as 40,960 separate entries.
    Blocks4kEntries,
    /// 1,024 scattered 1 MiB blocks, sent as one block copy.
    Blocks1m,
    /// The same blocks sent as 1,024 separate entries.
    Blocks1mEntries,
    /// A DeepSeek-V3-style latent (MLA) cache: 61 layer pools of 16,384 tokens of 1,152 bytes,
    /// a request of 4,096 tokens a layer in runs of 1-64 tokens consecutive on both sides,
    /// sent as one paged copy of token ids (an MLA server keeps a request's token slots as an
    /// id list).
    MlaTokens,
    /// The same request with each run one entry per pool.
    MlaTokensRuns,
    /// `count` scattered blocks of `bytes`.
    Blocks {
        /// Bytes per block.
        bytes: u64,
        /// Number of blocks.
        count: u64,
    },
    /// One 4 KiB write and a notification, timed until the receiver holds the notification.
    SmallWrite,
    /// The `kv-llama70b-4k` cache sent layer by layer as prefill computes it: each layer's K
    /// and V blocks are submitted at once, to start after an event of the computing stream;
    /// timed from the end of the last layer's compute to its last byte landed.
    KvLayerwise,
}

/// Every named workload, in table order.
pub(crate) const ALL: &str = "contiguous,kv-llama70b-4k,kv-llama70b-4k-entries,kv-llama70b-4k-runs,blocks-4k,blocks-4k-entries,blocks-1m,blocks-1m-entries,mla-tokens,mla-tokens-runs,small-write,kv-layerwise";

impl std::str::FromStr for Workload {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "contiguous" => Ok(Workload::Contiguous),
            "kv-llama70b-4k" => Ok(Workload::KvLlama70b4k),
            "kv-llama70b-4k-entries" => Ok(Workload::KvLlama70b4kEntries),
            "kv-llama70b-4k-runs" => Ok(Workload::KvLlama70b4kRuns),
            "blocks-4k" => Ok(Workload::Blocks4k),
            "blocks-4k-entries" => Ok(Workload::Blocks4kEntries),
            "blocks-1m" => Ok(Workload::Blocks1m),
            "blocks-1m-entries" => Ok(Workload::Blocks1mEntries),
            "mla-tokens" => Ok(Workload::MlaTokens),
            "mla-tokens-runs" => Ok(Workload::MlaTokensRuns),
            "small-write" => Ok(Workload::SmallWrite),
            "kv-layerwise" => Ok(Workload::KvLayerwise),
            other => Err(format!("unknown workload {other:?}; known: {ALL}")),
        }
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Workload::Contiguous => f.write_str("contiguous"),
            Workload::KvLlama70b4k => f.write_str("kv-llama70b-4k"),
            Workload::KvLlama70b4kEntries => f.write_str("kv-llama70b-4k-entries"),
            Workload::KvLlama70b4kRuns => f.write_str("kv-llama70b-4k-runs"),
            Workload::Blocks4k => f.write_str("blocks-4k"),
            Workload::Blocks4kEntries => f.write_str("blocks-4k-entries"),
            Workload::Blocks1m => f.write_str("blocks-1m"),
            Workload::Blocks1mEntries => f.write_str("blocks-1m-entries"),
            Workload::MlaTokens => f.write_str("mla-tokens"),
            Workload::MlaTokensRuns => f.write_str("mla-tokens-runs"),
            Workload::Blocks { bytes, count } => write!(f, "blocks-{}x{count}", size(*bytes)),
            Workload::SmallWrite => f.write_str("small-write"),
            Workload::KvLayerwise => f.write_str("kv-layerwise"),
        }
    }
}

/// `4K`, `1M`, `3000B`: a block size as the table and plot show it.
pub(crate) fn size(bytes: u64) -> String {
    match bytes {
        bytes if bytes >= GIB && bytes % GIB == 0 => format!("{}G", bytes / GIB),
        bytes if bytes >= MIB && bytes % MIB == 0 => format!("{}M", bytes / MIB),
        bytes if bytes >= KIB && bytes % KIB == 0 => format!("{}K", bytes / KIB),
        bytes => format!("{bytes}B"),
    }
}

/// A paged-KV cache: `pools` pools of `pool_blocks` blocks of `block_bytes` on each side, laid
/// out back to back, and the block ids of one request on each side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Paged {
    pub(crate) pools: u64,
    pub(crate) pool_blocks: u64,
    pub(crate) block_bytes: u64,
    /// Shared, so a batch takes them without copying (as a server would keep a request's ids).
    pub(crate) local_ids: Arc<[u32]>,
    pub(crate) remote_ids: Arc<[u32]>,
}

impl Paged {
    pub(crate) fn pool_bytes(&self) -> u64 {
        self.pool_blocks * self.block_bytes
    }

    /// The same copy as one (local offset, remote offset, len) per block.
    pub(crate) fn blocks(&self) -> Vec<(u64, u64, u64)> {
        let mut blocks = Vec::with_capacity(self.local_ids.len() * self.pools as usize);
        for pool in 0..self.pools {
            let base = pool * self.pool_bytes();
            for (&local, &remote) in self.local_ids.iter().zip(self.remote_ids.iter()) {
                blocks.push((
                    base + u64::from(local) * self.block_bytes,
                    base + u64::from(remote) * self.block_bytes,
                    self.block_bytes,
                ));
            }
        }
        blocks
    }
}

/// What a workload moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Shape {
    /// (local offset, remote offset, len) per block.
    Entries(Vec<(u64, u64, u64)>),
    /// One paged block copy.
    Paged(Paged),
    /// One write of `len` bytes and a notification, for latency.
    Ping(u64),
}

impl Shape {
    /// Bytes one round moves.
    pub(crate) fn bytes(&self) -> u64 {
        match self {
            Shape::Entries(blocks) => blocks.iter().map(|block| block.2).sum(),
            Shape::Paged(paged) => paged.pools * paged.local_ids.len() as u64 * paged.block_bytes,
            Shape::Ping(len) => *len,
        }
    }

    /// Bytes each side's area must hold.
    pub(crate) fn area(&self) -> u64 {
        match self {
            Shape::Entries(blocks) => blocks
                .iter()
                .map(|&(local, remote, len)| local.max(remote) + len)
                .max()
                .unwrap_or(0),
            Shape::Paged(paged) => paged.pools * paged.pool_bytes(),
            Shape::Ping(len) => *len,
        }
    }

    /// Per block (local offset, remote offset, len), whatever the shape.
    pub(crate) fn blocks(&self) -> Vec<(u64, u64, u64)> {
        match self {
            Shape::Entries(blocks) => blocks.clone(),
            Shape::Paged(paged) => paged.blocks(),
            Shape::Ping(len) => vec![(0, 0, *len)],
        }
    }
}

/// `len` pseudo-random bytes of `seed`: the same in every process of one build, so a
/// receiver can check what a sender wrote from the seed alone.
pub(crate) fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut bytes);
    bytes
}

/// A permutation of `0..n` from `seed`, the first `take` of it (distinct ids).
pub(crate) fn distinct_ids(n: u64, take: u64, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..n as u32).collect();
    let mut random = fastrand::Rng::with_seed(seed);
    for index in 0..take.min(n) as usize {
        let pick = random.usize(index..ids.len());
        ids.swap(index, pick);
    }
    ids.truncate(take.min(n) as usize);
    ids
}

/// `count` blocks of `bytes` scattered over a pool of `count * spread` blocks on each side,
/// at random distinct ids.
fn scattered(bytes: u64, count: u64, spread: u64, seed: u64) -> Paged {
    let slots = count * spread;
    Paged {
        pools: 1,
        pool_blocks: slots,
        block_bytes: bytes,
        local_ids: distinct_ids(slots, count, seed).into(),
        remote_ids: distinct_ids(slots, count, seed ^ 0xfeed).into(),
    }
}

/// Layers of `kv-llama70b-4k` (a K and a V pool each).
pub(crate) const LLAMA_LAYERS: u64 = 80;

/// Bytes of one `kv-llama70b-4k` block.
pub(crate) const LLAMA_BLOCK_BYTES: u64 = 32 * KIB;

/// The pools and block ids of `kv-llama70b-4k`: 80 layers x {K, V} pools of 4,096 blocks of
/// 32 KiB (16 tokens x 8 KV heads x 128 dim x 2 bytes), 256 blocks a request.
pub(crate) fn llama(seed: u64) -> Paged {
    Paged {
        pools: 2 * LLAMA_LAYERS,
        pool_blocks: 4096,
        block_bytes: LLAMA_BLOCK_BYTES,
        local_ids: distinct_ids(4096, 256, seed).into(),
        remote_ids: distinct_ids(4096, 256, seed ^ 0xfeed).into(),
    }
}

/// Longest run of consecutive blocks (or tokens) in the run-based workloads.
const MOST_RUN: u64 = 64;

/// A cache sent as runs: `pools` pools of `pool_units` units (blocks or tokens) of
/// `unit_bytes` on each side, laid out back to back, a request of `request_units` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RunCache {
    pools: u64,
    /// Units a pool holds.
    pool_units: u64,
    /// Bytes of a unit.
    unit_bytes: u64,
    /// Units of one request, in every pool.
    request_units: u64,
}

/// `kv-llama70b-4k-runs`: the `kv-llama70b-4k` cache (see [`llama`]) as runs of blocks.
const LLAMA_RUNS: RunCache = RunCache {
    pools: 2 * LLAMA_LAYERS,
    pool_units: 4096,
    unit_bytes: LLAMA_BLOCK_BYTES,
    request_units: 256,
};

/// `mla-tokens`: DeepSeek-V3's 61 layers, a token's latent of 576 bf16 values (512 compressed
/// KV and 64 rotary dims) per layer, 16,384 tokens a pool and 4,096 a request.
const MLA: RunCache = RunCache {
    pools: 61,
    pool_units: 16_384,
    unit_bytes: 1152,
    request_units: 4096,
};

impl RunCache {
    /// The request as one paged copy: the units of its runs as ids, the same in every pool.
    fn paged(&self, seed: u64) -> Paged {
        let runs = runs(self.request_units, self.pool_units, seed);
        let ids = |side: fn(&(u64, u64, u64)) -> u64| -> Arc<[u32]> {
            runs.iter()
                .flat_map(|run| (side(run)..side(run) + run.2).map(|unit| unit as u32))
                .collect()
        };
        Paged {
            pools: self.pools,
            pool_blocks: self.pool_units,
            block_bytes: self.unit_bytes,
            local_ids: ids(|run| run.0),
            remote_ids: ids(|run| run.1),
        }
    }

    /// One (local offset, remote offset, len) entry per run per pool, pool by pool: the
    /// request's runs are the same in every pool, as an engine keeps one id list per request.
    fn entries(&self, seed: u64) -> Vec<(u64, u64, u64)> {
        let runs = runs(self.request_units, self.pool_units, seed);
        let pool_bytes = self.pool_units * self.unit_bytes;
        let mut entries = Vec::with_capacity(runs.len() * self.pools as usize);
        for pool in 0..self.pools {
            let base = pool * pool_bytes;
            for &(local, remote, len) in &runs {
                entries.push((
                    base + local * self.unit_bytes,
                    base + remote * self.unit_bytes,
                    len * self.unit_bytes,
                ));
            }
        }
        entries
    }
}

/// `total` units of a pool of `pool` as runs (local first unit, remote first unit, length):
/// lengths at random in `1..=MOST_RUN`, the last one trimmed to end at `total`, each run
/// consecutive on both sides and the runs scattered differently on each side.
fn runs(total: u64, pool: u64, seed: u64) -> Vec<(u64, u64, u64)> {
    let lengths = run_lengths(total, seed);
    let local = place(&lengths, pool, seed ^ 0xbeef);
    let remote = place(&lengths, pool, seed ^ 0xfeed);
    local
        .into_iter()
        .zip(remote)
        .zip(lengths)
        .map(|((local, remote), len)| (local, remote, len))
        .collect()
}

/// Random run lengths in `1..=MOST_RUN` that add up to `total`.
fn run_lengths(total: u64, seed: u64) -> Vec<u64> {
    let mut random = fastrand::Rng::with_seed(seed);
    let mut lengths = Vec::new();
    let mut left = total;
    while left > 0 {
        let len = random.u64(1..=MOST_RUN).min(left);
        lengths.push(len);
        left -= len;
    }
    lengths
}

/// The first units of runs of `lengths` placed at random, disjoint, in a pool of `pool` units:
/// the runs go in the order a [`distinct_ids`] permutation gives, and the pool's free units
/// fall as random gaps between them, so any number of runs fits whenever their total does.
fn place(lengths: &[u64], pool: u64, seed: u64) -> Vec<u64> {
    let free = pool.saturating_sub(lengths.iter().sum());
    let mut random = fastrand::Rng::with_seed(seed);
    // Sorted cuts of the free units: the free units before each slot, never decreasing.
    let mut gaps: Vec<u64> = lengths.iter().map(|_| random.u64(0..=free)).collect();
    gaps.sort_unstable();
    let count = lengths.len() as u64;
    let mut starts = vec![0; lengths.len()];
    let mut taken = 0;
    // A seed of its own for the order, so it does not follow the gaps' draws.
    let order = distinct_ids(count, count, random.u64(..));
    for (&run, gap) in order.iter().zip(gaps) {
        starts[run as usize] = gap + taken;
        taken += lengths[run as usize];
    }
    starts
}

impl Workload {
    /// The blocks of this workload; deterministic for a seed.
    pub(crate) fn shape(&self, seed: u64) -> Shape {
        let llama = || llama(seed);
        match *self {
            Workload::Contiguous => Shape::Entries(vec![(0, 0, GIB)]),
            Workload::KvLlama70b4k | Workload::KvLayerwise => Shape::Paged(llama()),
            Workload::KvLlama70b4kEntries => Shape::Entries(llama().blocks()),
            Workload::KvLlama70b4kRuns => Shape::Entries(LLAMA_RUNS.entries(seed)),
            Workload::Blocks4k => Shape::Paged(scattered(4 * KIB, 40_960, 4, seed)),
            Workload::Blocks4kEntries => {
                Shape::Entries(scattered(4 * KIB, 40_960, 4, seed).blocks())
            }
            Workload::Blocks1m => Shape::Paged(scattered(MIB, 1024, 1, seed)),
            Workload::Blocks1mEntries => Shape::Entries(scattered(MIB, 1024, 1, seed).blocks()),
            Workload::MlaTokens => Shape::Paged(MLA.paged(seed)),
            Workload::MlaTokensRuns => Shape::Entries(MLA.entries(seed)),
            Workload::Blocks { bytes, count } => Shape::Paged(scattered(bytes, count, 1, seed)),
            Workload::SmallWrite => Shape::Ping(4 * KIB),
        }
    }

    /// Whether this workload always writes, whatever `--direction` says: `small-write` times
    /// a write's notification and `kv-layerwise` a prefill pushing its layers.
    pub(crate) fn always_writes(&self) -> bool {
        matches!(self, Workload::SmallWrite | Workload::KvLayerwise)
    }
}

/// The block sizes of the `--plot` sweep, from 512 B to 64 MiB. Sizes that are not multiples
/// of 16 (a latent-attention entry, a KV block of an unusual head size) sit next to the
/// multiple of 16 they should keep up with; scattered blocks of such sizes also start at odd
/// addresses.
pub(crate) const SWEEP_SIZES: [u64; 17] = [
    512,
    1000,
    KIB,
    2 * KIB,
    4 * KIB,
    4097,
    4100,
    16 * KIB,
    16 * KIB + 4,
    64 * KIB,
    256 * KIB,
    MIB,
    MIB + 12,
    4 * MIB,
    16 * MIB,
    64 * MIB,
    64 * MIB + 1,
];

/// Bytes each sweep point moves, at most.
pub(crate) const SWEEP_BYTES: u64 = 256 * MIB;

/// Blocks each sweep point moves, at most: small blocks stop here rather than at
/// `SWEEP_BYTES`, so the copy-engine rows (a copy call per block) stay short.
pub(crate) const SWEEP_MOST_BLOCKS: u64 = 65_536;

/// The sweep's point for blocks of `bytes`.
pub(crate) fn sweep_point(bytes: u64) -> Workload {
    Workload::Blocks {
        bytes,
        count: (SWEEP_BYTES / bytes).clamp(1, SWEEP_MOST_BLOCKS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn disjoint(blocks: &[(u64, u64, u64)], side: impl Fn(&(u64, u64, u64)) -> u64) -> bool {
        let mut starts: Vec<(u64, u64)> = blocks.iter().map(|b| (side(b), b.2)).collect();
        starts.sort();
        starts
            .windows(2)
            .all(|pair| pair[0].0 + pair[0].1 <= pair[1].0)
    }

    /// Asserts that `shape` moves `bytes`, its blocks overlap on neither side and all of them
    /// lie inside its area.
    fn sized_disjoint_and_inside(shape: &Shape, bytes: u64, workload: &Workload) {
        assert_eq!(shape.bytes(), bytes, "{workload}");
        let all = shape.blocks();
        assert!(disjoint(&all, |b| b.0), "{workload}: sources overlap");
        assert!(disjoint(&all, |b| b.1), "{workload}: destinations overlap");
        let area = shape.area();
        assert!(all.iter().all(|b| b.0.max(b.1) + b.2 <= area));
    }

    #[test]
    fn workloads_have_their_documented_sizes() {
        let cases = [
            (Workload::Contiguous, GIB, 1),
            (Workload::KvLlama70b4k, 1280 * MIB, 40_960),
            (Workload::KvLlama70b4kEntries, 1280 * MIB, 40_960),
            (Workload::Blocks4k, 160 * MIB, 40_960),
            (Workload::Blocks4kEntries, 160 * MIB, 40_960),
            (Workload::Blocks1m, GIB, 1024),
            (Workload::Blocks1mEntries, GIB, 1024),
        ];
        for (workload, bytes, blocks) in cases {
            let shape = workload.shape(42);
            assert_eq!(shape.blocks().len(), blocks, "{workload}");
            sized_disjoint_and_inside(&shape, bytes, &workload);
        }
        // One entry per run: at least a run of 64 per 64 units, at most a run of 1 per unit.
        let run_cases = [
            (Workload::KvLlama70b4kRuns, LLAMA_RUNS, 1280 * MIB),
            (Workload::MlaTokensRuns, MLA, 61 * 4096 * 1152),
        ];
        for (workload, cache, bytes) in run_cases {
            for seed in [1, 42, 7777] {
                let shape = workload.shape(seed);
                sized_disjoint_and_inside(&shape, bytes, &workload);
                let units = cache.request_units * cache.pools;
                let entries = shape.blocks().len() as u64;
                assert!(
                    (units / MOST_RUN..=units).contains(&entries),
                    "{workload}: {entries} entries"
                );
                let pool_bytes = cache.pool_units * cache.unit_bytes;
                assert!(shape.area() <= cache.pools * pool_bytes, "{workload}");
            }
        }
        assert_eq!(
            Workload::KvLlama70b4k.shape(1).area(),
            160 * 4096 * 32 * KIB
        );
        assert_eq!(
            Workload::KvLayerwise.shape(3),
            Workload::KvLlama70b4k.shape(3),
            "kv-layerwise moves the same cache, a layer at a time"
        );
        let Shape::Paged(paged) = Workload::KvLayerwise.shape(3) else {
            panic!("kv-layerwise is paged");
        };
        assert_eq!(paged.pools, 2 * LLAMA_LAYERS);
    }

    /// The units (blocks or tokens) one side of `entries` covers in pool `pool` of `cache`.
    fn units_of(
        cache: &RunCache,
        entries: &[(u64, u64, u64)],
        pool: u64,
        side: impl Fn(&(u64, u64, u64)) -> u64,
    ) -> Vec<u64> {
        let pool_bytes = cache.pool_units * cache.unit_bytes;
        entries
            .iter()
            .filter(|entry| side(entry) / pool_bytes == pool)
            .flat_map(|entry| {
                let first = (side(entry) - pool * pool_bytes) / cache.unit_bytes;
                first..first + entry.2 / cache.unit_bytes
            })
            .collect()
    }

    #[test]
    fn run_shapes_are_runs_of_1_to_64_units_using_each_id_once_per_pool() {
        for (workload, cache) in [
            (Workload::KvLlama70b4kRuns, LLAMA_RUNS),
            (Workload::MlaTokensRuns, MLA),
        ] {
            let Shape::Entries(entries) = workload.shape(9) else {
                panic!("{workload} is entries");
            };
            for &(local, remote, len) in &entries {
                assert_eq!(
                    len % cache.unit_bytes,
                    0,
                    "{workload}: a whole number of units"
                );
                assert!(
                    (1..=MOST_RUN).contains(&(len / cache.unit_bytes)),
                    "{workload}"
                );
                assert_eq!(local % cache.unit_bytes, 0, "{workload}");
                assert_eq!(remote % cache.unit_bytes, 0, "{workload}");
            }
            let local = units_of(&cache, &entries, 0, |e| e.0);
            let remote = units_of(&cache, &entries, 0, |e| e.1);
            for ids in [&local, &remote] {
                assert_eq!(ids.len() as u64, cache.request_units, "{workload}");
                assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len());
                assert!(ids.iter().all(|&id| id < cache.pool_units), "{workload}");
            }
            assert_ne!(local, remote, "{workload}: the sides' ids should differ");
            for pool in 1..cache.pools {
                assert_eq!(units_of(&cache, &entries, pool, |e| e.0), local);
                assert_eq!(units_of(&cache, &entries, pool, |e| e.1), remote);
            }
            assert_eq!(workload.shape(9), workload.shape(9), "deterministic");
            assert_ne!(workload.shape(9), workload.shape(10), "seeded");
        }
    }

    #[test]
    fn mla_tokens_move_the_units_of_their_runs_as_paged_ids() {
        let Shape::Paged(paged) = Workload::MlaTokens.shape(9) else {
            panic!("mla-tokens is paged");
        };
        let Shape::Entries(entries) = Workload::MlaTokensRuns.shape(9) else {
            panic!("mla-tokens-runs is entries");
        };
        assert_eq!((paged.pools, paged.block_bytes), (61, 1152));
        let ids = |ids: &[u32]| ids.iter().map(|&id| u64::from(id)).collect::<Vec<u64>>();
        assert_eq!(ids(&paged.local_ids), units_of(&MLA, &entries, 0, |e| e.0));
        assert_eq!(ids(&paged.remote_ids), units_of(&MLA, &entries, 0, |e| e.1));
        let sorted = |shape: Shape| {
            let mut blocks = shape.blocks();
            blocks.sort_unstable();
            blocks
        };
        let split: Vec<(u64, u64, u64)> = entries
            .iter()
            .flat_map(|&(local, remote, len)| {
                (0..len / 1152).map(move |unit| (local + unit * 1152, remote + unit * 1152, 1152))
            })
            .collect();
        assert_eq!(
            sorted(Workload::MlaTokens.shape(9)),
            sorted(Shape::Entries(split))
        );
    }

    #[test]
    fn runs_are_scattered_and_fit_any_number_of_runs() {
        let runs = runs(256, 4096, 3);
        let packed: Vec<u64> = runs
            .iter()
            .scan(0, |at, run| {
                let start = *at;
                *at += run.2;
                Some(start)
            })
            .collect();
        let local: Vec<u64> = runs.iter().map(|run| run.0).collect();
        assert_ne!(local, packed, "runs should be scattered over the pool");
        // The worst case, every run a unit long, still fits a pool the request fills.
        let starts = place(&[1; 300], 300, 5);
        let mut sorted = starts.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..300).collect::<Vec<u64>>());
        assert_ne!(starts, sorted, "runs go in a shuffled order");
    }

    #[test]
    fn kv_ids_are_distinct_permutations_that_differ_between_sides() {
        let Shape::Paged(paged) = Workload::KvLlama70b4k.shape(7) else {
            panic!("kv-llama70b-4k is paged");
        };
        for ids in [&paged.local_ids, &paged.remote_ids] {
            assert_eq!(ids.len(), 256);
            assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 256);
            assert!(ids.iter().all(|&id| id < 4096));
        }
        assert_ne!(paged.local_ids, paged.remote_ids);
        assert_ne!(
            &paged.local_ids[..],
            &(0..256).collect::<Vec<u32>>()[..],
            "ids should be scattered"
        );
    }

    #[test]
    fn names_round_trip_and_sizes_print_short() {
        for name in ALL.split(',') {
            assert_eq!(
                name.parse::<Workload>().map(|w| w.to_string()),
                Ok(name.into())
            );
        }
        assert!("blocks-2k".parse::<Workload>().is_err());
        assert_eq!(size(4096), "4K");
        assert_eq!(size(64 << 20), "64M");
        assert_eq!(size(3000), "3000B");
        assert_eq!(
            Workload::Blocks {
                bytes: 16 * KIB,
                count: 8
            }
            .to_string(),
            "blocks-16Kx8"
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_bytes_and_ids_and_another_seed_does_not() {
        assert_eq!(random_bytes(7, 4099), random_bytes(7, 4099));
        assert_ne!(random_bytes(7, 4099), random_bytes(8, 4099));
        // A shorter run is a prefix of a longer one: a receiver may check any leading part.
        assert_eq!(random_bytes(7, 100)[..], random_bytes(7, 4099)[..100]);
        assert_eq!(distinct_ids(1000, 50, 3), distinct_ids(1000, 50, 3));
        assert_ne!(distinct_ids(1000, 50, 3), distinct_ids(1000, 50, 4));
        let ids = distinct_ids(1000, 1000, 3);
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 1000);
        assert!(ids.iter().all(|&id| id < 1000));
    }
}
