//! One command that runs a prefill/decode pair: starts the decode and the prefill side as two
//! child processes, moves one request's KV cache (the `kv-llama70b-4k` shape: 80 layers x {K,V}
//! x 256 blocks of 32 KiB = 1.25 GiB in 40,960 blocks), verifies every block on the decode side
//! and prints the transport, the GB/s and `verified: true`. Exits non-zero on any mismatch.
//!
//! ```text
//! cargo run --release --example pd_demo
//! cargo run --release --example pd_demo -- --layers 8 --pool-blocks 512
//! ```

#[allow(dead_code)] // the shared roles module; each example uses its own part
mod kv;

use clap::{Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    about = "Runs a prefill and a decode process and moves one request's KV cache between them"
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    shape: kv::Shape,
    /// Keep the cache in host memory even when GPUs are present.
    #[arg(long)]
    host: bool,
    /// Start each process with `CUDA_VISIBLE_DEVICES` naming only its own GPU (two GPUs).
    #[arg(long)]
    split_visible_devices: bool,
    /// Requests to move, one after another into the same decode blocks. The first pays for
    /// first-touch page faults in the freshly allocated pool; the last shows the steady state.
    #[arg(long, default_value_t = 2)]
    requests: u32,
    /// Send each block as its own batch entry instead of one paged block copy.
    #[arg(long)]
    entries: bool,
    /// Passed to both processes.
    #[command(flatten)]
    secret: kv::SecretFile,
}

/// The roles the demo starts itself in; not meant to be typed by hand.
#[derive(Subcommand)]
enum Role {
    #[command(hide = true)]
    Decode(kv::decode::DecodeArgs),
    #[command(hide = true)]
    Prefill(kv::prefill::PrefillArgs),
}

fn main() -> ExitCode {
    kv::init_logging();
    let cli = Cli::parse();
    let outcome = match cli.role {
        Some(Role::Decode(args)) => kv::decode::run(args),
        Some(Role::Prefill(args)) => kv::prefill::run(args).map(|()| true),
        None => orchestrate(
            &cli.shape,
            cli.requests,
            cli.entries,
            &cli.secret,
            placement(&cli),
        ),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("pd_demo: {error}");
            ExitCode::FAILURE
        }
    }
}

fn shape_args(shape: &kv::Shape) -> Vec<String> {
    kv::flag_args([
        ("--layers", shape.layers.to_string()),
        ("--block-bytes", shape.block_bytes.to_string()),
        ("--pool-blocks", shape.pool_blocks.to_string()),
        ("--request-blocks", shape.request_blocks.to_string()),
        ("--seed", shape.seed.to_string()),
        ("--metadata", shape.metadata.clone()),
    ])
}

/// Where each side keeps its cache, and why.
struct Placement {
    decode: Side,
    prefill: Side,
    why: String,
}

struct Side {
    gpu: Option<u32>,
    visible_devices: Option<&'static str>,
}

fn placement(cli: &Cli) -> Placement {
    let driver = ferry::cuda::Driver::get();
    let gpus = driver.devices().map(|gpus| gpus.len()).unwrap_or(0);
    let on = |gpu, visible_devices| Side {
        gpu: Some(gpu),
        visible_devices,
    };
    let host = Side {
        gpu: None,
        visible_devices: None,
    };
    match gpus {
        _ if cli.host => Placement {
            decode: host,
            prefill: Side {
                gpu: None,
                visible_devices: None,
            },
            why: "host memory on both sides, as asked (--host)".into(),
        },
        0 => Placement {
            decode: host,
            prefill: Side {
                gpu: None,
                visible_devices: None,
            },
            why: format!("host memory on both sides: {}", driver.status()),
        },
        1 => Placement {
            decode: on(0, None),
            prefill: on(0, None),
            why: "one GPU: both processes on GPU 0, CUDA IPC within the GPU".into(),
        },
        _ if cli.split_visible_devices => Placement {
            decode: on(0, Some("1")),
            prefill: on(0, Some("0")),
            why: "prefill sees only GPU 0, decode only GPU 1 (CUDA_VISIBLE_DEVICES)".into(),
        },
        _ => Placement {
            decode: on(1, None),
            prefill: on(0, None),
            why: format!(
                "prefill on GPU 0, decode on GPU 1, peer access {}",
                match driver.can_access_peer(0, 1) {
                    Ok(true) => "yes".to_owned(),
                    Ok(false) => "no".to_owned(),
                    Err(error) => format!("unknown ({error})"),
                }
            ),
        },
    }
}

fn start(
    role: &str,
    side: &Side,
    mut args: Vec<String>,
) -> Result<(kv::Process, impl Iterator<Item = String>), Box<dyn std::error::Error>> {
    if let Some(gpu) = side.gpu {
        args.extend(["--gpu".to_owned(), gpu.to_string()]);
    }
    kv::spawn_role(role, args, side.visible_devices)
}

fn value<'a>(lines: &'a [String], key: &str) -> Option<&'a str> {
    lines
        .iter()
        .find_map(|line| line.strip_prefix(key).map(str::trim))
}

fn orchestrate(
    shape: &kv::Shape,
    requests: u32,
    entries: bool,
    secret: &kv::SecretFile,
    placement: Placement,
) -> Result<bool, Box<dyn std::error::Error>> {
    shape.validate()?;
    let requests = requests.max(1);
    println!(
        "pd_demo: {} layers x {{K,V}} x {} blocks of {} KiB from pools of {} blocks = {:.2} GiB in {} blocks",
        shape.layers,
        shape.request_blocks,
        shape.block_bytes >> 10,
        shape.pool_blocks,
        shape.request_bytes() as f64 / f64::from(1u32 << 30),
        shape.tensors() * shape.request_blocks
    );
    let mut decode_args = shape_args(shape);
    decode_args.extend(["--requests".to_owned(), requests.to_string()]);
    decode_args.extend(secret.args());
    let (mut decode, mut decode_lines) = start("decode", &placement.decode, decode_args)?;
    let segment = decode_lines
        .next()
        .and_then(|line| line.strip_prefix("segment: ").map(str::to_owned))
        .ok_or("the decode process did not print its engine name")?;
    println!("decode  (pid {}): listening as {segment}", decode.0.id());

    let mut prefill_args = shape_args(shape);
    prefill_args.extend([
        "--peer".to_owned(),
        segment,
        "--requests".to_owned(),
        requests.to_string(),
    ]);
    if entries {
        prefill_args.push("--entries".to_owned());
    }
    prefill_args.extend(secret.args());
    let (mut prefill, mut prefill_lines) = start("prefill", &placement.prefill, prefill_args)?;
    let prefill_pid = prefill.0.id();
    // The decode side answers the engine named here, not whoever a notification claims.
    let prefill_segment = prefill_lines
        .next()
        .and_then(|line| line.strip_prefix("segment: ").map(str::to_owned))
        .ok_or("the prefill process did not print its engine name")?;
    let mut decode_input = decode
        .0
        .stdin
        .take()
        .ok_or("the decode process's input was not captured")?;
    writeln!(decode_input, "reply-to {prefill_segment}")?;
    let prefill_lines: Vec<String> = prefill_lines.collect();
    let prefill_ok = prefill.0.wait()?.success();
    let decode_lines: Vec<String> = decode_lines.collect();
    let decode_ok = decode.0.wait()?.success();
    if !prefill_ok {
        return Err("the prefill process failed (its error is above)".into());
    }

    let transport = value(&prefill_lines, "transport:").unwrap_or("unknown");
    println!(
        "prefill (pid {prefill_pid}): transport {transport} ({})",
        placement.why
    );
    for line in decode_lines
        .iter()
        .filter(|line| line.starts_with("request "))
    {
        println!("decode: {line}");
    }
    let measured: Vec<&String> = prefill_lines
        .iter()
        .filter(|line| line.starts_with("request "))
        .collect();
    for (index, line) in measured.iter().enumerate() {
        let note = match (index, measured.len()) {
            (0, 1) => "",
            (0, _) => " (first touch of the decode pool's pages)",
            _ => " (pool pages already mapped)",
        };
        println!("prefill: {line}{note}");
    }
    if let Some(last) = measured.last() {
        let gbps = last.rsplit(' ').next().unwrap_or("?");
        println!("{gbps} GB/s over {transport}");
    }
    let verified = decode_ok && value(&decode_lines, "verified:") == Some("true");
    println!("verified: {verified}");
    Ok(verified)
}
