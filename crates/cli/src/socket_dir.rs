//! `--socket-dir`: the directory through which engines of other network namespaces (another
//! pod of this node) reach the fd sockets of the engines a command starts, and of its children.

use std::path::PathBuf;

/// Where the engines a command starts also serve their fd sockets, if it was given.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct SocketDirArg {
    /// Directory shared with engines of other network namespaces, such as another pod's (a
    /// hostPath volume mounted at this same path in both): each engine also serves its fd
    /// socket there as ferry-<instance>.sock, so VMM GPU memory and shared-memory
    /// notifications cross between them. Overrides FERRY_SOCKET_DIR. It must exist and be
    /// writable, or the engine does not start; peers of other users are served only with a
    /// shared secret.
    #[arg(long, value_name = "DIR")]
    pub(crate) socket_dir: Option<PathBuf>,
}

impl SocketDirArg {
    /// `config` with the directory, when one was given (else as it is: the engine then takes
    /// FERRY_SOCKET_DIR, if set).
    pub(crate) fn config(&self, config: ferry::NvlinkConfig) -> ferry::NvlinkConfig {
        match &self.socket_dir {
            Some(dir) => config.socket_dir(dir),
            None => config,
        }
    }

    /// The argument again, for a child process whose engine must serve in the same directory.
    pub(crate) fn args(&self) -> Vec<std::ffi::OsString> {
        match &self.socket_dir {
            Some(dir) => vec!["--socket-dir".into(), dir.clone().into_os_string()],
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_goes_into_the_config_and_to_children() {
        let given = SocketDirArg {
            socket_dir: Some("/run/ferry".into()),
        };
        let config = given.config(ferry::NvlinkConfig::default());
        assert_eq!(config.socket_dir, Some(std::path::Path::new("/run/ferry")));
        assert_eq!(given.args(), ["--socket-dir", "/run/ferry"]);
        let absent = SocketDirArg::default();
        assert_eq!(
            absent.config(ferry::NvlinkConfig::default()).socket_dir,
            None
        );
        assert!(absent.args().is_empty());
    }
}
