//! A `ferry serve` child process: the other side of `ferry bench`.

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// A running `ferry serve --gpu N`, killed on drop.
pub(crate) struct ServeChild {
    child: Child,
    input: ChildStdin,
    output: Lines<BufReader<ChildStdout>>,
    pub(crate) name: String,
    pub(crate) buffer_addr: u64,
}

impl ServeChild {
    /// Starts `ferry serve` with a `bytes`-byte buffer on GPU `gpu` and reads its address;
    /// with `echo`, it answers every notification with one carrying the time it held it, to
    /// the engine named with [`Self::reply_to`]; without `gpu_links`, its engine leaves out
    /// the GPU-to-GPU transports. Its engine takes `secret` and `socket_dir` as this one's.
    pub(crate) fn start(
        bytes: u64,
        gpu: Option<u32>,
        echo: bool,
        gpu_links: bool,
        metadata: &str,
        secret: &crate::secret_file::SecretFile,
        socket_dir: &crate::socket_dir::SocketDirArg,
    ) -> Result<ServeChild, Box<dyn std::error::Error>> {
        let mut command = Command::new(std::env::current_exe()?);
        command.args([
            "serve",
            "--bytes",
            &bytes.to_string(),
            "--metadata",
            metadata,
        ]);
        if let Some(gpu) = gpu {
            command.args(["--gpu", &gpu.to_string()]);
        }
        if echo {
            command.arg("--echo");
        }
        if !gpu_links {
            command.arg("--no-gpu-links");
        }
        command.args(secret.args());
        command.args(socket_dir.args());
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let (Some(input), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("the serve process's input and output were not captured".into());
        };
        let mut output = BufReader::new(stdout).lines();
        let mut next = || -> Result<String, Box<dyn std::error::Error>> {
            Ok(output
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
            input,
            output,
            name,
            buffer_addr,
        })
    }

    /// Makes the echoing process answer the engine named `name` from now on, and waits until
    /// it confirmed.
    pub(crate) fn reply_to(&mut self, name: &str) -> Result<(), Box<dyn std::error::Error>> {
        writeln!(self.input, "reply-to {name}")?;
        self.input.flush()?;
        let expected = format!("reply-to: {name}");
        for line in self.output.by_ref() {
            if line? == expected {
                return Ok(());
            }
        }
        Err("the serve process exited before it confirmed whom to answer".into())
    }
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
