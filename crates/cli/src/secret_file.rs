//! `--secret-file`: the shared secret of the engines a command starts, and of its children.

use std::path::PathBuf;

/// Where the shared secret is, if the command was given one.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct SecretFile {
    /// File holding the shared secret peers must prove they hold (trailing whitespace is
    /// ignored; at least 16 bytes). Overrides FERRY_SECRET; without either, any process that
    /// reaches the listener can read and write its registered memory.
    #[arg(long, value_name = "PATH")]
    pub(crate) secret_file: Option<PathBuf>,
    /// With a secret, tag the frames of TCP connections to loopback addresses too (connections
    /// to other addresses always carry integrity tags; loopback ones skip them by default)
    #[arg(long)]
    pub(crate) tag_loopback_frames: bool,
}

impl SecretFile {
    /// `builder` with the file's secret, when a file was named.
    pub(crate) fn apply(
        &self,
        builder: ferry::EngineBuilder,
    ) -> Result<ferry::EngineBuilder, ferry::Error> {
        let builder = builder.tag_loopback_frames(self.tag_loopback_frames);
        Ok(match &self.secret_file {
            Some(path) => builder.secret(ferry::auth::read_secret_file(path)?),
            None => builder,
        })
    }

    /// The argument again, for a child process that must use the same secret.
    pub(crate) fn args(&self) -> Vec<std::ffi::OsString> {
        let mut args = match &self.secret_file {
            Some(path) => vec!["--secret-file".into(), path.clone().into_os_string()],
            None => Vec::new(),
        };
        if self.tag_loopback_frames {
            args.push("--tag-loopback-frames".into());
        }
        args
    }
}
