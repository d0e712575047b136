//! A `ferry serve` child process: the other side of `ferry bench`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running `ferry serve --gpu N`, killed on drop.
pub(crate) struct ServeChild {
    child: Child,
    pub(crate) name: String,
    pub(crate) buffer_addr: u64,
}

impl ServeChild {
    /// Starts `ferry serve` with a `bytes`-byte buffer on GPU `gpu` and reads its address;
    /// with `echo`, it answers every notification with one carrying the time it held it.
    pub(crate) fn start(
        bytes: u64,
        gpu: u32,
        echo: bool,
        metadata: &str,
    ) -> Result<ServeChild, Box<dyn std::error::Error>> {
        let mut command = Command::new(std::env::current_exe()?);
        command.args([
            "serve",
            "--bytes",
            &bytes.to_string(),
            "--gpu",
            &gpu.to_string(),
            "--metadata",
            metadata,
        ]);
        if echo {
            command.arg("--echo");
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or("the serve process's output was not captured")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut next = || -> Result<String, Box<dyn std::error::Error>> {
            Ok(lines
                .next()
                .ok_or("the serve process exited before printing its address")??)
        };
        let name = next()?
            .strip_prefix("segment: ")
            .ok_or("unexpected serve output")?
            .to_owned();
        let buffer = next()?;
        let addr = buffer
            .strip_prefix("buffer: 0x")
            .and_then(|rest| rest.split(' ').next())
            .ok_or("unexpected serve output")?;
        let buffer_addr = u64::from_str_radix(addr, 16)?;
        Ok(ServeChild {
            child,
            name,
            buffer_addr,
        })
    }
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
