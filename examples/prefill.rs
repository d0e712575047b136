//! The prefill side of a prefill/decode pair: fills the blocks of one request, writes them
//! into the decode engine's pool in one batch and notifies it.
//!
//! ```text
//! cargo run --release --example prefill -- --listen 127.0.0.1:17001 --peer 127.0.0.1:PORT
//! ```
//!
//! It waits for the decode side's answer after each request, and stops waiting as soon as the
//! decode engine is gone.

#[allow(dead_code)] // the shared roles module; each example uses its own part
mod kv;

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(about = "The prefill side: writes a request's KV cache to a decode engine")]
struct Cli {
    #[command(flatten)]
    prefill: kv::prefill::PrefillArgs,
}

fn main() -> ExitCode {
    kv::init_logging();
    match kv::prefill::run(Cli::parse().prefill) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("prefill: {error}");
            ExitCode::FAILURE
        }
    }
}
