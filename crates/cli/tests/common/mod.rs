//! Helpers shared by the integration tests of the `ferry` binary.
#![allow(dead_code)]

use ferry::Engine;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The `ferry` binary under test: FERRY_BIN when set (the GPU runner points it at the CLI where
/// it copied it), else the one cargo built for these tests.
pub(crate) fn ferry_bin() -> String {
    std::env::var("FERRY_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_ferry").into())
}

/// An engine on loopback with a short timeout, so a failure cannot stall the suite.
pub(crate) async fn engine() -> Engine {
    ferry::builder()
        .transfer_timeout(Duration::from_secs(10))
        .build()
        .await
        .expect("engine starts on loopback")
}

/// Deterministic bytes that differ for every seed and position.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut bytes);
    bytes
}

/// Fails naming the first differing byte.
pub(crate) fn assert_bytes_eq(found: &[u8], expected: &[u8], what: &str) {
    assert_eq!(found.len(), expected.len(), "{what}: lengths differ");
    if let Some(index) = found.iter().zip(expected).position(|(a, b)| a != b) {
        panic!(
            "{what}: first bad byte at {index}: found {:#04x}, expected {:#04x}",
            found[index], expected[index]
        );
    }
}

/// A `ferry serve` child process with its engine name and buffer.
pub(crate) struct ServeProcess {
    pub(crate) child: Child,
    pub(crate) name: String,
    pub(crate) buffer_addr: u64,
    pub(crate) buffer_len: u64,
    /// The `metrics: URL` line's URL, printed with `--metrics-addr`.
    pub(crate) metrics: Option<String>,
}

impl ServeProcess {
    pub(crate) fn start(bytes: usize) -> ServeProcess {
        Self::start_with(bytes, &[], &[])
    }

    /// `ferry serve` with extra arguments (`--gpu 1`) and environment (`CUDA_VISIBLE_DEVICES`).
    pub(crate) fn start_with(bytes: usize, args: &[&str], env: &[(&str, &str)]) -> ServeProcess {
        Self::start_under(&[], bytes, args, env)
    }

    /// [`ServeProcess::start_with`] run by `launcher` (a command and its arguments, such as
    /// `unshare --pid --fork`), which runs `ferry serve` as its own child; none when empty.
    pub(crate) fn start_under(
        launcher: &[&str],
        bytes: usize,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> ServeProcess {
        let ferry = ferry_bin();
        let mut command = match launcher.split_first() {
            Some((program, launcher_args)) => {
                let mut command = Command::new(program);
                command.args(launcher_args).arg(&ferry);
                command
            }
            None => Command::new(&ferry),
        };
        let mut child = command
            .args(["serve", "--bytes", &bytes.to_string()])
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("ferry serve starts");
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        let mut next = || {
            lines
                .next()
                .expect("ferry serve prints its name")
                .expect("utf-8 line")
        };
        let name = next()
            .strip_prefix("segment: ")
            .expect("segment line")
            .to_owned();
        let buffer = next();
        let mut fields = buffer
            .strip_prefix("buffer: ")
            .expect("buffer line")
            .split(' ');
        let addr = fields.next().expect("address").trim_start_matches("0x");
        let buffer_addr = u64::from_str_radix(addr, 16).expect("hex address");
        let buffer_len = fields
            .next()
            .expect("length")
            .parse()
            .expect("decimal length");
        let metrics = args.contains(&"--metrics-addr").then(|| {
            next()
                .strip_prefix("metrics: ")
                .expect("metrics line")
                .to_owned()
        });
        ServeProcess {
            child,
            name,
            buffer_addr,
            buffer_len,
            metrics,
        }
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
