//! The prefill side of a prefill/decode pair: fills the blocks of one request, writes them
//! into the decode engine's pool in one batch and notifies it.
//!
//! ```text
//! cargo run --release --example prefill -- --peer 127.0.0.1:PORT
//! ```

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
