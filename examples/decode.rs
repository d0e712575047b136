//! The decode side of a prefill/decode pair: allocates a paged KV pool (one tensor per layer
//! for K and for V), prints its engine name, waits for announcements, verifies every block
//! it was told about and answers the prefill engine named by `--reply-to` (never the sender a
//! notification claims to be from). Exits non-zero on any mismatch.
//!
//! ```text
//! cargo run --release --example decode -- --requests 1 --reply-to 127.0.0.1:17001
//! ```
//!
//! With `--secret-file PATH` (or `FERRY_SECRET`) only engines holding the same secret get in.

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
