//! Tensor-parallel KV transfer between process groups: `--prefill-tp P` prefill ranks send one
//! request's KV cache to `--decode-tp D` decode ranks, each rank its own process and engine,
//! each prefill rank writing to every decode rank that holds some of its heads the byte slice
//! of each block those heads occupy (one paged block copy per pair, concurrently). Every decode
//! rank checks every head of every block it received, byte for byte.
//!
//! With two or more GPUs the prefill ranks share GPU 0 and the decode ranks GPU 1; with one,
//! all share GPU 0; without, host memory over TCP.
//!
//! `cargo run --release --example tp_demo -- --prefill-tp 2 --decode-tp 1`

// The shared module's block pattern, ids, pools, child processes, arguments and logging are
// used; its roles are not.
#[allow(dead_code)]
mod kv;

use clap::{Args, Parser, Subcommand};
use ferry::tp::HeadSplit;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "Moves a TP-sharded KV cache from P prefill ranks to D decode ranks")]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    split: Split,
    /// Keep the caches in host memory even when GPUs are present.
    #[arg(long)]
    host: bool,
    /// Passed to every rank.
    #[command(flatten)]
    secret: kv::SecretFile,
}

#[derive(Subcommand)]
enum Role {
    #[command(hide = true)]
    Decode(RankArgs),
    #[command(hide = true)]
    Prefill(RankArgs),
}

/// The model and the two splits.
#[derive(Args, Clone, Debug)]
struct Split {
    /// Layers; each has a K and a V tensor per rank.
    #[arg(long, default_value_t = 80)]
    layers: u32,
    /// KV heads of the model.
    #[arg(long, default_value_t = 8)]
    heads: u32,
    /// Bytes of one head in one block (16 tokens x 128 dim x 2 B).
    #[arg(long, default_value_t = 4096)]
    head_bytes: u64,
    /// Blocks in each tensor's pool.
    #[arg(long, default_value_t = 1024)]
    pool_blocks: u32,
    /// Blocks of the request in every tensor.
    #[arg(long, default_value_t = 256)]
    request_blocks: u32,
    /// Prefill tensor-parallel ranks.
    #[arg(long, default_value_t = 2)]
    prefill_tp: u32,
    /// Decode tensor-parallel ranks.
    #[arg(long, default_value_t = 2)]
    decode_tp: u32,
    /// Metadata store URL.
    #[arg(long, default_value = "p2p")]
    metadata: String,
}

#[derive(Args, Clone, Debug)]
struct RankArgs {
    #[command(flatten)]
    split: Split,
    /// This process's rank on its side.
    #[arg(long)]
    rank: u32,
    /// GPU of the pools (host memory when absent).
    #[arg(long)]
    gpu: Option<u32>,
    /// Decode ranks' engine names, in rank order (prefill ranks only).
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Prefill ranks' engine names, in rank order, to answer (decode ranks only); without
    /// them, the line `reply-to NAME,...` is read from stdin when the answers are due.
    #[arg(long, value_delimiter = ',')]
    reply_to: Vec<String>,
    #[command(flatten)]
    secret: kv::SecretFile,
}

impl Split {
    fn heads(&self) -> HeadSplit {
        HeadSplit {
            heads: self.heads,
            head_bytes: self.head_bytes,
            prefill_tp: self.prefill_tp,
            decode_tp: self.decode_tp,
        }
    }

    fn ids(&self, salt: u64) -> Vec<u32> {
        kv::block_ids(self.pool_blocks, self.request_blocks, 42 ^ salt)
    }

    fn args(&self) -> Vec<String> {
        kv::flag_args([
            ("--layers", self.layers.to_string()),
            ("--heads", self.heads.to_string()),
            ("--head-bytes", self.head_bytes.to_string()),
            ("--pool-blocks", self.pool_blocks.to_string()),
            ("--request-blocks", self.request_blocks.to_string()),
            ("--prefill-tp", self.prefill_tp.to_string()),
            ("--decode-tp", self.decode_tp.to_string()),
            ("--metadata", self.metadata.clone()),
        ])
    }
}

/// What head `head` of logical block `block` of tensor `tensor` holds: the kv module's block
/// pattern, keyed by block and head.
fn fill_head(bytes: &mut [u8], tensor: u32, block: u32, head: u32) {
    kv::fill_block(bytes, 0, tensor, block * 1024 + head);
}

fn engine(args: &RankArgs) -> Result<ferry::Engine, Box<dyn std::error::Error>> {
    Ok(args
        .secret
        .apply(ferry::builder())?
        .metadata(ferry::metadata::from_url(&args.split.metadata)?)
        .build_blocking()?)
}

/// One pool per K and V tensor of every layer, of `block_bytes` blocks.
fn pools(
    engine: &ferry::Engine,
    split: &Split,
    block_bytes: u64,
    gpu: Option<u32>,
) -> Result<Vec<ferry::Region>, ferry::Error> {
    let pool_bytes = u64::from(split.pool_blocks) * block_bytes;
    let placement = kv::Placement {
        gpu,
        vmm_pieces: None,
    };
    kv::allocate_pools(engine, split.layers * 2, pool_bytes, placement)
}

fn run_prefill(args: RankArgs) -> Result<bool, Box<dyn std::error::Error>> {
    let heads = args.split.heads();
    let engine = engine(&args)?;
    // First, so the orchestrator can tell the decode ranks whom to answer.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "segment: {}", engine.name())?;
    stdout.flush()?;
    let block = heads.prefill_block_bytes();
    let pools = pools(&engine, &args.split, block, args.gpu)?;
    let sources: Arc<[u32]> = args.split.ids(1).into();
    let destinations: Arc<[u32]> = args.split.ids(2).into();
    let first = args.rank * (args.split.heads / args.split.prefill_tp);
    let mut head = vec![0u8; args.split.head_bytes as usize];
    let mut bytes = vec![0u8; block as usize];
    for (tensor, pool) in pools.iter().enumerate() {
        for (logical, &slot) in sources.iter().enumerate() {
            for (index, chunk) in bytes.chunks_exact_mut(head.len()).enumerate() {
                fill_head(
                    &mut head,
                    tensor as u32,
                    logical as u32,
                    first + index as u32,
                );
                chunk.copy_from_slice(&head);
            }
            pool.write_at(u64::from(slot) * block, &bytes)?;
        }
    }
    let mut inbox = engine.notifications()?;
    let started = Instant::now();
    let mut transfers = Vec::new();
    let mut peers = Vec::new();
    for slice in heads
        .slices()
        .iter()
        .filter(|s| s.prefill_rank == args.rank)
    {
        let name = args
            .peers
            .get(slice.decode_rank as usize)
            .ok_or("fewer --peers than decode ranks")?;
        let peer = engine.connect_blocking(name)?;
        peers.push(peer.clone());
        let remote = peer.buffers();
        let mut copy = heads.block_copy(
            slice,
            u64::from(args.split.pool_blocks),
            Arc::clone(&sources),
            Arc::clone(&destinations),
        );
        for (pool, target) in pools.iter().zip(&remote) {
            copy = copy.pool(pool, target);
        }
        let note = format!(
            "tp from={} heads={}+{}",
            args.rank, slice.first_head, slice.heads
        );
        transfers.push((
            slice.decode_rank,
            engine
                .batch(&peer)
                .write_blocks(copy)
                .notify(note)
                .submit()?,
        ));
    }
    let mut answers = 0;
    for (decode_rank, transfer) in transfers {
        let done = transfer.wait()?;
        answers += 1;
        writeln!(
            stdout,
            "prefill {} -> decode {decode_rank}: {} bytes over {} in {:.3} ms ({:.1} GB/s)",
            args.rank,
            done.bytes,
            done.transports.join(","),
            done.elapsed.as_secs_f64() * 1e3,
            done.bytes as f64 / done.elapsed.as_secs_f64() / 1e9
        )?;
    }
    writeln!(
        stdout,
        "prefill {}: all pairs done in {:.3} ms",
        args.rank,
        started.elapsed().as_secs_f64() * 1e3
    )?;
    stdout.flush()?;
    // Every decode rank that got data answers once it checked it; a rank that died will not.
    let mut good = true;
    for _ in 0..answers {
        let verdict = kv::await_answer(&mut inbox, &peers, Duration::from_secs(120), |payload| {
            payload.starts_with(b"tp verified ")
        })
        .map_err(|error| format!("a decode rank did not answer: {error}"))?;
        good &= verdict.payload == b"tp verified ok";
    }
    Ok(good)
}

fn run_decode(args: RankArgs) -> Result<bool, Box<dyn std::error::Error>> {
    let heads = args.split.heads();
    let engine = engine(&args)?;
    let block = heads.decode_block_bytes();
    let pools = pools(&engine, &args.split, block, args.gpu)?;
    let mut inbox = engine.notifications()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "segment: {}", engine.name())?;
    stdout.flush()?;
    let senders: Vec<u32> = heads
        .slices()
        .iter()
        .filter(|slice| slice.decode_rank == args.rank)
        .map(|slice| slice.prefill_rank)
        .collect();
    for _ in &senders {
        inbox
            .recv_blocking()?
            .ok_or("the engine stopped before every prefill rank sent")?;
    }
    let destinations = args.split.ids(2);
    let first = args.rank * (args.split.heads / args.split.decode_tp);
    let mut landed = vec![0u8; block as usize];
    let mut expected = vec![0u8; args.split.head_bytes as usize];
    let mut bad = None;
    'check: for (tensor, pool) in pools.iter().enumerate() {
        for (logical, &slot) in destinations.iter().enumerate() {
            pool.read_at(u64::from(slot) * block, &mut landed)?;
            for (index, chunk) in landed.chunks_exact(expected.len()).enumerate() {
                let head = first + index as u32;
                fill_head(&mut expected, tensor as u32, logical as u32, head);
                if chunk != expected.as_slice() {
                    bad = Some((tensor, logical, head));
                    break 'check;
                }
            }
        }
    }
    let verdict: &[u8] = if bad.is_none() {
        b"tp verified ok"
    } else {
        b"tp verified bad"
    };
    // The prefill ranks this rank's slices come from, by the names the operator gave: a
    // notification's `from` is only what its sender claims.
    let names = kv::reply_to(&args.reply_to)?;
    for rank in senders {
        let name = names
            .get(rank as usize)
            .ok_or("fewer reply-to names than prefill ranks")?;
        let peer = engine.connect_blocking(name)?;
        engine.notify_blocking(&peer, verdict.to_vec())?;
    }
    match bad {
        None => writeln!(
            stdout,
            "decode {}: heads {}..{} of {} blocks in {} tensors verified",
            args.rank,
            first,
            first + args.split.heads / args.split.decode_tp,
            destinations.len(),
            pools.len()
        )?,
        Some((tensor, logical, head)) => writeln!(
            stdout,
            "decode {}: tensor {tensor} block {logical} head {head} differs",
            args.rank
        )?,
    }
    Ok(bad.is_none())
}

fn orchestrate(cli: &Cli) -> Result<bool, Box<dyn std::error::Error>> {
    let split = &cli.split;
    split.heads().validate()?;
    let gpus = ferry::cuda::Driver::get()
        .devices()
        .map(|gpus| gpus.len())
        .unwrap_or(0);
    let (prefill_gpu, decode_gpu) = match gpus {
        _ if cli.host => (None, None),
        0 => (None, None),
        1 => (Some(0), Some(0)),
        _ => (Some(0), Some(1)),
    };
    println!(
        "tp_demo: {} KV heads, prefill TP={} (GPU {}) -> decode TP={} (GPU {}), {} layers x {{K,V}} x {} blocks",
        split.heads,
        split.prefill_tp,
        prefill_gpu.map_or("none".into(), |gpu| gpu.to_string()),
        split.decode_tp,
        decode_gpu.map_or("none".into(), |gpu| gpu.to_string()),
        split.layers,
        split.request_blocks
    );
    let rank_args = |rank: u32, gpu: Option<u32>| {
        let mut args = split.args();
        args.extend(cli.secret.args());
        args.extend(["--rank".to_owned(), rank.to_string()]);
        if let Some(gpu) = gpu {
            args.extend(["--gpu".to_owned(), gpu.to_string()]);
        }
        args
    };
    let mut decoders = Vec::new();
    let mut names = Vec::new();
    for rank in 0..split.decode_tp {
        let (process, mut lines) = kv::spawn_role("decode", rank_args(rank, decode_gpu), None)?;
        let name = lines
            .next()
            .and_then(|line| line.strip_prefix("segment: ").map(str::to_owned))
            .ok_or("a decode rank did not print its engine name")?;
        names.push(name);
        decoders.push((process, lines));
    }
    let mut prefills = Vec::new();
    let mut prefill_names = Vec::new();
    for rank in 0..split.prefill_tp {
        let mut args = rank_args(rank, prefill_gpu);
        args.extend(["--peers".to_owned(), names.join(",")]);
        let (process, mut lines) = kv::spawn_role("prefill", args, None)?;
        let name = lines
            .next()
            .and_then(|line| line.strip_prefix("segment: ").map(str::to_owned))
            .ok_or("a prefill rank did not print its engine name")?;
        prefill_names.push(name);
        prefills.push((process, lines));
    }
    // The decode ranks answer these engines, not whoever a notification claims to be.
    for (process, _) in &mut decoders {
        let input = process
            .0
            .stdin
            .as_mut()
            .ok_or("a decode rank's input was not captured")?;
        writeln!(input, "reply-to {}", prefill_names.join(","))?;
        input.flush()?;
    }
    let mut all_good = true;
    for (mut process, lines) in prefills.into_iter().chain(decoders) {
        for line in lines {
            println!("{line}");
        }
        all_good &= process.0.wait()?.success();
    }
    println!("verified: {all_good}");
    Ok(all_good)
}

fn main() -> ExitCode {
    kv::init_logging();
    let cli = Cli::parse();
    let (who, outcome) = match cli.role {
        Some(Role::Decode(args)) => (format!("decode rank {}", args.rank), run_decode(args)),
        Some(Role::Prefill(args)) => (format!("prefill rank {}", args.rank), run_prefill(args)),
        None => ("orchestrator".to_owned(), orchestrate(&cli)),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("tp_demo ({who}): {error}");
            ExitCode::FAILURE
        }
    }
}
