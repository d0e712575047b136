//! `ferry secret`: a new shared secret for `--secret-file`, `FERRY_SECRET` or
//! `EngineBuilder::secret`.

use base64::Engine as _;
use std::io::Write;

/// Random bytes in a generated secret: 256 bits, out of reach of offline guessing.
const SECRET_BYTES: usize = 32;

/// Prints 32 bytes from the operating system's random source as one line of base64.
pub(crate) fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut bytes = [0u8; SECRET_BYTES];
    getrandom::fill(&mut bytes)
        .map_err(|error| format!("reading random bytes for a secret failed: {error}"))?;
    let mut stdout = std::io::stdout().lock();
    writeln!(
        stdout,
        "{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )?;
    stdout.flush()?;
    Ok(())
}
