//! The KV-cache shape and the two roles shared by the `decode`, `prefill` and `pd_demo`
//! examples: a vLLM-style cache with one tensor per layer for K and one for V, each a pool of
//! fixed-size blocks, and one request's blocks scattered over it.

pub(crate) mod decode;
pub(crate) mod prefill;

use clap::Args;
use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The name of the buffer the decode role gathers a request's blocks into to check them; the
/// prefill role writes into every other buffer of the decode engine.
pub(crate) const STAGING: &str = "verify-staging";

/// The cache's shape; the defaults are `ferry bench`'s `kv-llama70b-4k` workload
/// (Llama-3-70B fp16).
#[derive(Args, Debug, Clone)]
pub(crate) struct Shape {
    /// Transformer layers; each has a K and a V tensor.
    #[arg(long, default_value_t = 80)]
    pub(crate) layers: u32,
    /// Bytes per block (16 tokens x 8 KV heads x 128 dim x 2 bytes).
    #[arg(long, default_value_t = 32 << 10)]
    pub(crate) block_bytes: u64,
    /// Blocks in each tensor's pool.
    #[arg(long, default_value_t = 4096)]
    pub(crate) pool_blocks: u32,
    /// Blocks one request occupies in every tensor.
    #[arg(long, default_value_t = 256)]
    pub(crate) request_blocks: u32,
    /// Seed for the block ids and the data.
    #[arg(long, default_value_t = 42)]
    pub(crate) seed: u64,
    /// Metadata store URL.
    #[arg(long, default_value = "p2p")]
    pub(crate) metadata: String,
}

impl Shape {
    /// K and V tensors for every layer.
    pub(crate) fn tensors(&self) -> u32 {
        self.layers * 2
    }

    /// Bytes of one tensor's pool.
    pub(crate) fn pool_bytes(&self) -> u64 {
        u64::from(self.pool_blocks) * self.block_bytes
    }

    /// Bytes one request moves.
    pub(crate) fn request_bytes(&self) -> u64 {
        u64::from(self.tensors()) * u64::from(self.request_blocks) * self.block_bytes
    }

    /// Checks the numbers fit together.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.request_blocks == 0 || self.request_blocks > self.pool_blocks {
            return Err(format!(
                "--request-blocks {} must be between 1 and --pool-blocks {}",
                self.request_blocks, self.pool_blocks
            ));
        }
        if self.block_bytes == 0 || self.block_bytes % 8 != 0 || self.layers == 0 {
            return Err(
                "--block-bytes must be a non-zero multiple of 8 and --layers non-zero".into(),
            );
        }
        Ok(())
    }

    /// The request's block ids in a pool: the first `request_blocks` of a seeded permutation.
    pub(crate) fn block_ids(&self, salt: u64) -> Vec<u32> {
        block_ids(self.pool_blocks, self.request_blocks, self.seed ^ salt)
    }
}

/// The first `take` ids of a permutation of `0..pool_blocks` drawn from `seed`.
pub(crate) fn block_ids(pool_blocks: u32, take: u32, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..pool_blocks).collect();
    fastrand::Rng::with_seed(seed).shuffle(&mut ids);
    ids.truncate(take as usize);
    ids
}

/// `--secret-file`: the shared secret of this process's engine, and of the children it starts.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct SecretFile {
    /// File holding the shared secret peers must prove they hold (trailing whitespace is
    /// ignored). Overrides FERRY_SECRET; without either, any process that reaches the
    /// listener can read and write the registered pools.
    #[arg(long, value_name = "PATH")]
    pub(crate) secret_file: Option<PathBuf>,
}

impl SecretFile {
    /// `builder` with the file's secret, when a file was named.
    pub(crate) fn apply(
        &self,
        builder: ferry::EngineBuilder,
    ) -> Result<ferry::EngineBuilder, ferry::Error> {
        Ok(match &self.secret_file {
            Some(path) => builder.secret(ferry::auth::read_secret_file(path)?),
            None => builder,
        })
    }

    /// The argument again, for a child process that must use the same secret.
    pub(crate) fn args(&self) -> Vec<String> {
        match &self.secret_file {
            Some(path) => vec![
                "--secret-file".to_owned(),
                path.to_string_lossy().into_owned(),
            ],
            None => Vec::new(),
        }
    }
}

/// The names of the engines to answer: `given` (`--reply-to`), or else the line
/// `reply-to NAME[,NAME...]` the parent writes on stdin once it started them (they start
/// after this process). Never a notification's `from`: that is the sender's own,
/// unauthenticated claim, and answering it would let anyone point this process at any address.
pub(crate) fn reply_to(given: &[String]) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    if !given.is_empty() {
        return Ok(given.to_vec());
    }
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let names = line
        .trim()
        .strip_prefix("reply-to ")
        .ok_or("no engine to answer: give --reply-to NAME")?;
    Ok(names.split(',').map(str::to_owned).collect())
}

/// Waits up to `limit` for the next notification that `expected` accepts (others are logged
/// and skipped), and gives up as soon as one of `peers` is gone (its connections closed: the
/// process died), instead of waiting out the limit.
pub(crate) fn await_answer(
    inbox: &mut ferry::Notifications,
    peers: &[ferry::Peer],
    limit: Duration,
    expected: impl Fn(&[u8]) -> bool,
) -> Result<ferry::Notification, Box<dyn std::error::Error>> {
    let deadline = Instant::now() + limit;
    let next = |inbox: &mut ferry::Notifications, wait| match inbox.recv_timeout_blocking(wait) {
        Ok(Some(note)) if expected(&note.payload) => Ok(Some(note)),
        Ok(Some(note)) => {
            // Anyone who reaches the port may send one: say so, quoted, and wait on.
            tracing::warn!(
                from = ?note.from,
                payload = ?String::from_utf8_lossy(&note.payload),
                "ignoring a notification that is not the awaited answer"
            );
            Ok(None)
        }
        Ok(None) => Err("the engine stopped before the answer came".into()),
        Err(ferry::Error::Timeout { .. }) => Ok(None),
        Err(error) => Err(Box::<dyn std::error::Error>::from(error)),
    };
    loop {
        if let Some(note) = next(inbox, Duration::from_millis(100))? {
            return Ok(note);
        }
        if let Some(gone) = peers.iter().find(|peer| !peer.is_alive()) {
            // An answer sent just before the peer exited may still be on its way in.
            if let Some(note) = next(inbox, Duration::from_millis(200))? {
                return Ok(note);
            }
            return Err(format!("{} went away before it answered", gone.name()).into());
        }
        if Instant::now() >= deadline {
            return Err(format!("no answer within {limit:?}").into());
        }
    }
}

/// `--flag value` pairs as a child process's arguments.
pub(crate) fn flag_args(pairs: impl IntoIterator<Item = (&'static str, String)>) -> Vec<String> {
    pairs
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value])
        .collect()
}

/// Where an example's pools live.
#[derive(Args, Debug, Clone, Copy)]
pub(crate) struct Placement {
    /// Put the pools on this GPU instead of in host memory.
    #[arg(long)]
    pub(crate) gpu: Option<u32>,
    /// With --gpu: make each pool VMM memory in this many allocations mapped back to back
    /// (as PyTorch's expandable segments are) instead of one `cudaMalloc` block.
    #[arg(long, requires = "gpu")]
    pub(crate) vmm_pieces: Option<usize>,
}

/// `tensors` pools of `pool_bytes` (one per K and V tensor of every layer), registered in
/// that order: on the placement's GPU (`cudaMalloc` or VMM memory) or in host memory.
pub(crate) fn allocate_pools(
    engine: &ferry::Engine,
    tensors: u32,
    pool_bytes: u64,
    placement: Placement,
) -> Result<Vec<ferry::Region>, ferry::Error> {
    (0..tensors)
        .map(|_| match placement {
            Placement {
                gpu: Some(ordinal),
                vmm_pieces: Some(pieces),
            } => engine.allocate_device_vmm(
                ordinal,
                pool_bytes.div_ceil(pieces.max(1) as u64),
                pieces.max(1),
            ),
            Placement {
                gpu: Some(ordinal),
                vmm_pieces: None,
            } => engine.allocate_device(ordinal, pool_bytes),
            Placement { gpu: None, .. } => engine.allocate(pool_bytes),
        })
        .collect()
}

/// A child process of an example, killed if the example ends early.
pub(crate) struct Process(pub(crate) std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts this example again as `role` with `args` (and `CUDA_VISIBLE_DEVICES` when given),
/// with its output read line by line and its input left to the caller
/// (`process.0.stdin`), for [`reply_to`].
pub(crate) fn spawn_role(
    role: &str,
    args: Vec<String>,
    visible_devices: Option<&str>,
) -> Result<(Process, impl Iterator<Item = String>), Box<dyn std::error::Error>> {
    use std::io::BufRead;
    let mut command = std::process::Command::new(std::env::current_exe()?);
    if let Some(devices) = visible_devices {
        command.env("CUDA_VISIBLE_DEVICES", devices);
    }
    let mut child = command
        .arg(role)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("child stdout was not captured")?;
    let lines = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok);
    Ok((Process(child), lines))
}

/// Fills `block` with the bytes logical block `block_index` of `tensor` holds for `request`.
pub(crate) fn fill_block(block: &mut [u8], request: u64, tensor: u32, block_index: u32) {
    let base = word_seed(request, tensor, block_index);
    for (index, chunk) in block.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(
            &(base ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes(),
        );
    }
}

/// The first byte offset where `block` differs from what [`fill_block`] writes.
pub(crate) fn first_mismatch(
    block: &[u8],
    request: u64,
    tensor: u32,
    block_index: u32,
) -> Option<usize> {
    let base = word_seed(request, tensor, block_index);
    block
        .chunks_exact(8)
        .enumerate()
        .find_map(|(index, chunk)| {
            let expected =
                (base ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes();
            chunk
                .iter()
                .zip(expected)
                .position(|(found, expected)| *found != expected)
                .map(|byte| index * 8 + byte)
        })
}

fn word_seed(request: u64, tensor: u32, block_index: u32) -> u64 {
    let mut x = request ^ (u64::from(tensor) << 40) ^ (u64::from(block_index) << 8) ^ 0x5bd1_e995;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x
}

/// A request's token: 64 random bits the decode side repeats in its verdict, so a verdict
/// that did not come from a process which saw the announcement is told apart (without a
/// shared secret anyone who reaches the port can send notifications).
pub(crate) fn request_token() -> Result<u64, String> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|error| format!("drawing a request token: {error}"))?;
    Ok(u64::from_le_bytes(bytes))
}

/// The notification announcing a request: `kv request=ID token=HEX blocks=ID,ID,...`
/// (destination ids).
pub(crate) fn encode_notification(request: u64, token: u64, blocks: &[u32]) -> Vec<u8> {
    let ids: Vec<String> = blocks.iter().map(u32::to_string).collect();
    format!(
        "kv request={request} token={token:016x} blocks={}",
        ids.join(",")
    )
    .into_bytes()
}

/// An announced request: its id, its token and its destination block ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Announced {
    pub(crate) request: u64,
    pub(crate) token: u64,
    pub(crate) blocks: Vec<u32>,
}

/// Parses [`encode_notification`]'s format.
pub(crate) fn decode_notification(payload: &[u8]) -> Result<Announced, String> {
    let text = std::str::from_utf8(payload).map_err(|_| "notification is not UTF-8".to_owned())?;
    let rest = text
        .strip_prefix("kv request=")
        .ok_or("notification is not a kv announcement")?;
    let (request, rest) = rest
        .split_once(" token=")
        .ok_or("notification carries no token")?;
    let (token, blocks) = rest
        .split_once(" blocks=")
        .ok_or("notification lists no blocks")?;
    let request = request
        .parse()
        .map_err(|_| format!("bad request id {request:?}"))?;
    let token = u64::from_str_radix(token, 16).map_err(|_| format!("bad token {token:?}"))?;
    let blocks = blocks
        .split(',')
        .map(|id| id.parse().map_err(|_| format!("bad block id {id:?}")))
        .collect::<Result<Vec<u32>, String>>()?;
    Ok(Announced {
        request,
        token,
        blocks,
    })
}

/// The decode side's answer once it has checked a request:
/// `kv verified request=ID token=HEX ok|bad`.
pub(crate) fn encode_verdict(request: u64, token: u64, verdict: &str) -> Vec<u8> {
    format!("kv verified request={request} token={token:016x} {verdict}").into_bytes()
}

/// Whether `payload` is a verdict on `request` with its `token`, whatever it says.
pub(crate) fn is_verdict_on(payload: &[u8], request: u64, token: u64) -> bool {
    // An empty verdict leaves the common prefix, up to the space before the verdict.
    payload.starts_with(&encode_verdict(request, token, ""))
}

/// Logs to stderr at `RUST_LOG` (default `info`).
pub(crate) fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
