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
    /// With a secret, which TCP connections tag every frame against changes on the path:
    /// between-hosts (all but loopback ones), always, or never
    #[arg(long, value_name = "WHICH", default_value = "between-hosts")]
    pub(crate) frame_tags: FrameTagsArg,
}

/// `--frame-tags`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum FrameTagsArg {
    #[default]
    BetweenHosts,
    Always,
    Never,
}

impl FrameTagsArg {
    fn tags(self) -> ferry::FrameTags {
        match self {
            FrameTagsArg::BetweenHosts => ferry::FrameTags::BetweenHosts,
            FrameTagsArg::Always => ferry::FrameTags::Always,
            FrameTagsArg::Never => ferry::FrameTags::Never,
        }
    }

    fn name(self) -> &'static str {
        match self {
            FrameTagsArg::BetweenHosts => "between-hosts",
            FrameTagsArg::Always => "always",
            FrameTagsArg::Never => "never",
        }
    }
}

impl SecretFile {
    /// `builder` with the file's secret, when a file was named.
    pub(crate) fn apply(
        &self,
        builder: ferry::EngineBuilder,
    ) -> Result<ferry::EngineBuilder, ferry::Error> {
        let builder = builder.frame_tags(self.frame_tags.tags());
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
        if self.frame_tags != FrameTagsArg::default() {
            args.push("--frame-tags".into());
            args.push(self.frame_tags.name().into());
        }
        args
    }
}
