//! The decode side of a prefill/decode pair: allocates a paged KV pool (one tensor per layer
//! for K and for V), prints its segment name, waits for announcements and verifies every block
//! it was told about. Exits non-zero on any mismatch.
//!
//! ```text
//! cargo run --release --example decode -- --requests 1
//! ```

#[allow(dead_code)] // the shared roles module; each example uses its own part
mod kv;

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(about = "The decode side: receives a KV cache and verifies it")]
struct Cli {
    #[command(flatten)]
    decode: kv::decode::DecodeArgs,
}

fn main() -> ExitCode {
    kv::init_logging();
    match kv::decode::run(Cli::parse().decode) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("decode: {error}");
            ExitCode::FAILURE
        }
    }
}
