//! The socket directory: a folder that engines in different network namespaces mount, such
//! as two Kubernetes pods of one node with the same hostPath volume mounted at the same path.
//! The abstract fd socket lives in the network namespace, so a process of another one cannot
//! reach it; a socket FILE in a shared folder can be reached from any namespace that sees the
//! folder. Each engine binds `<dir>/ferry-<instance>.sock` there besides its abstract socket.
//!
//! The folder comes from [`crate::NvlinkConfig::socket_dir`], else from [`SOCKET_DIR_ENV`]; it
//! is checked here when the engine starts ([`SocketDir::check`]).

use super::fd_socket_name;
use ferry_core::InstanceId;
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

/// The environment variable naming the socket directory when [`crate::NvlinkConfig`] does
/// not set one (`FERRY_SOCKET_DIR`). Empty counts as unset.
pub const SOCKET_DIR_ENV: &str = "FERRY_SOCKET_DIR";

/// The longest path a Unix socket can be bound at: `sun_path` holds 108 bytes, the last a NUL.
pub(crate) const MAX_SOCKET_PATH: usize = 107;

/// The file name of engine `owner`'s fd socket in a socket directory: its abstract name
/// ([`fd_socket_name`]) with `.sock`. A peer's export must name a file of exactly this name:
/// one naming another engine's file is refused.
pub(crate) fn socket_file_name(owner: InstanceId) -> String {
    format!("{}{SOCKET_FILE_SUFFIX}", fd_socket_name(owner))
}

/// What [`socket_file_name`] adds to the socket's abstract name.
const SOCKET_FILE_SUFFIX: &str = ".sock";

/// Whether the file `name` has the shape of an engine's socket file ([`socket_file_name`]).
pub(crate) fn named_like_a_socket_file(name: &str) -> bool {
    name.starts_with(super::FD_SOCKET_PREFIX) && name.ends_with(SOCKET_FILE_SUFFIX)
}

/// The socket directory to use: the one the config names, else `env` (the value of
/// [`SOCKET_DIR_ENV`]) when it is set and not empty, else none.
pub(crate) fn configured(config: Option<&Path>, env: Option<OsString>) -> Option<PathBuf> {
    config
        .map(Path::to_path_buf)
        .or_else(|| env.filter(|value| !value.is_empty()).map(PathBuf::from))
}

/// Whether a directory of permission bits `mode` lets users other than its owner (its group,
/// or everyone) create and remove files without the sticky bit, which would let them remove
/// (and so replace) an engine's socket file.
pub(crate) fn writable_by_others_without_sticky(mode: u32) -> bool {
    const GROUP_OR_OTHERS_WRITE: u32 = 0o022;
    const STICKY: u32 = 0o1000;
    mode & GROUP_OR_OTHERS_WRITE != 0 && mode & STICKY == 0
}

/// A socket directory checked usable: absolute, plain (no `..`), UTF-8 (descriptors carry the
/// path as text), short enough for a socket path, an existing directory in which this process
/// can create files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SocketDir {
    /// The directory, normalized (no trailing `/`, no `.` parts).
    path: String,
}

impl SocketDir {
    /// Checks `dir` and keeps it. Logs a warning when every user may write to it and its
    /// sticky bit is not set.
    ///
    /// A directory that fails these checks is refused, and the engine is not built, rather
    /// than started without it: an operator who sets a socket directory asked for GPU memory
    /// to cross between pods, and an engine that quietly served only its abstract socket
    /// would move every byte over TCP at a fraction of the speed with one log line to say
    /// why, the silent fallback this directory exists to end.
    ///
    /// # Errors
    /// The [`SocketDirError`] naming what is wrong and what to do.
    pub(crate) fn check(dir: &Path) -> Result<SocketDir, SocketDirError> {
        let owned = || dir.to_path_buf();
        if !dir.is_absolute() {
            return Err(SocketDirError::Relative { dir: owned() });
        }
        if dir
            .components()
            .any(|component| component == Component::ParentDir)
        {
            return Err(SocketDirError::ClimbsOut { dir: owned() });
        }
        let normal: PathBuf = dir.components().collect();
        let Some(text) = normal.to_str() else {
            return Err(SocketDirError::NotUtf8 { dir: owned() });
        };
        let longest = text.len() + 1 + socket_file_name(InstanceId::from_u128(0)).len();
        if longest > MAX_SOCKET_PATH {
            return Err(SocketDirError::TooLong {
                dir: owned(),
                len: text.len(),
            });
        }
        let metadata = std::fs::metadata(&normal).map_err(|source| SocketDirError::Missing {
            dir: owned(),
            source,
        })?;
        if !metadata.is_dir() {
            return Err(SocketDirError::NotADirectory { dir: owned() });
        }
        // The real user's access: a pod's processes are not set-uid, so it is the effective
        // one. (`AT_EACCESS` needs faccessat2, which some container seccomp profiles refuse
        // with EPERM rather than ENOSYS.)
        rustix::fs::access(
            &normal,
            rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK,
        )
        .map_err(|errno| SocketDirError::NotWritable {
            dir: owned(),
            uid: rustix::process::getuid().as_raw(),
            source: errno.into(),
        })?;
        let mode = metadata.permissions().mode();
        if writable_by_others_without_sticky(mode) {
            tracing::warn!(
                dir = %normal.display(),
                mode = format_args!("{:o}", mode & 0o7777),
                "the socket directory is writable by other users and its sticky bit is not set: they can remove an engine's fd socket and bind another in its place; set the sticky bit (chmod 1777) or give the directory to one user only",
            );
        }
        Ok(SocketDir {
            path: text.to_owned(),
        })
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        Path::new(&self.path)
    }

    /// Where engine `owner`'s fd socket is in this directory.
    pub(crate) fn socket_path(&self, owner: InstanceId) -> String {
        format!("{}/{}", self.path, socket_file_name(owner))
    }

    /// Records that an engine of this process serves its socket here: peers' socket files are
    /// connected to only in such directories ([`in_served_dir`]).
    pub(crate) fn record_served(&self) {
        let mut served = SERVED.lock();
        if !served.contains(&self.path) {
            served.push(self.path.clone());
        }
    }
}

/// The socket directories engines of this process have served in (a handful at most; never
/// shrinks, since a directory once mounted stays the pods' meeting place).
static SERVED: parking_lot::Mutex<Vec<String>> = parking_lot::Mutex::new(Vec::new());

/// Whether the socket file `path` a peer's descriptor names lies in a socket directory an
/// engine of this process serves in. Both pods mount the shared directory at one path, so a
/// peer's file anywhere else is not the meeting place, and connecting to a path of the peer's
/// choosing elsewhere could block on whatever file system it names (a hung network mount).
pub(crate) fn in_served_dir(path: &str) -> bool {
    let Some(parent) = Path::new(path).parent() else {
        return false;
    };
    SERVED.lock().iter().any(|dir| Path::new(dir) == parent)
}

/// Why the socket directory cannot be used; the engine is not built (see [`crate::NvlinkConfig::socket_dir`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SocketDirError {
    /// The directory is given as a relative path.
    #[error("the socket directory {dir:?} is a relative path: give the absolute path both pods mount the shared volume at")]
    Relative {
        /// The directory as given.
        dir: PathBuf,
    },
    /// The path has a `..` part.
    #[error("the socket directory {dir:?} has a `..` part, and peers refuse socket paths with one: give its plain absolute path")]
    ClimbsOut {
        /// The directory as given.
        dir: PathBuf,
    },
    /// The path is not UTF-8.
    #[error("the socket directory {dir:?} is not UTF-8, and descriptors carry socket paths as text: pick a directory whose path is UTF-8")]
    NotUtf8 {
        /// The directory as given.
        dir: PathBuf,
    },
    /// A socket path in the directory would be longer than the kernel binds.
    #[error("the socket directory {dir:?} is {len} bytes long, so a socket in it would pass the kernel's limit of {MAX_SOCKET_PATH} bytes: use a directory of at most 63 bytes, such as /run/ferry")]
    TooLong {
        /// The directory as given.
        dir: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The directory cannot be found (or its path not searched).
    #[error("the socket directory {dir:?} cannot be read ({source}): create it, or mount the shared volume there (a hostPath volume of type DirectoryOrCreate), in every pod at the same path")]
    Missing {
        /// The directory as given.
        dir: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The path names something other than a directory.
    #[error("the socket directory {dir:?} is not a directory: point the socket directory at a directory")]
    NotADirectory {
        /// The directory as given.
        dir: PathBuf,
    },
    /// This process may not create files in the directory.
    #[error("this process (uid {uid}) cannot create files in the socket directory {dir:?} ({source}): make it writable for the pods' users with mode 1777 (the sticky bit keeps users from removing each other's sockets), set by an init container running as root since a hostPath volume ignores fsGroup")]
    NotWritable {
        /// The directory as given.
        dir: PathBuf,
        /// This process's user.
        uid: u32,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Binding the socket file failed.
    #[error("binding the fd socket {path:?} failed ({source}): check that the socket directory is writable and on a file system that holds Unix sockets (not a network file system)")]
    Bind {
        /// The socket's path.
        path: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Setting the socket file's permissions failed.
    #[error("setting the permissions of the fd socket {path:?} failed ({source}): check that the socket directory's file system supports Unix permissions")]
    Mode {
        /// The socket's path.
        path: String,
        /// The operating system's error.
        source: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn the_config_wins_over_the_environment_and_an_empty_variable_is_unset() {
        let from_env = Some(OsString::from("/run/env"));
        assert_eq!(
            configured(Some(Path::new("/run/config")), from_env.clone()),
            Some(PathBuf::from("/run/config"))
        );
        assert_eq!(configured(None, from_env), Some(PathBuf::from("/run/env")));
        assert_eq!(configured(None, Some(OsString::new())), None);
        assert_eq!(configured(None, None), None);
    }

    #[test]
    fn only_a_directory_others_may_write_without_the_sticky_bit_is_warned_about() {
        assert!(writable_by_others_without_sticky(0o777));
        assert!(writable_by_others_without_sticky(0o733));
        assert!(!writable_by_others_without_sticky(0o1777));
        assert!(!writable_by_others_without_sticky(0o755));
        assert!(writable_by_others_without_sticky(0o775));
        assert!(writable_by_others_without_sticky(0o770));
        assert!(!writable_by_others_without_sticky(0o1775));
        assert!(!writable_by_others_without_sticky(0o700));
    }

    #[test]
    fn a_usable_directory_is_kept_normalized_and_names_each_engines_socket() {
        let temp = tempfile::tempdir().unwrap();
        let given = format!("{}/./", temp.path().display());
        let dir = SocketDir::check(Path::new(&given)).unwrap();
        let owner = InstanceId::from_u128(0xab);
        assert_eq!(
            dir.socket_path(owner),
            format!(
                "{}/ferry-000000000000000000000000000000ab.sock",
                temp.path().display()
            )
        );
    }

    /// Whether an error is the one a case expects.
    type Expected = fn(&SocketDirError) -> bool;

    #[test]
    fn unusable_directories_are_refused_with_the_reason() {
        let temp = tempfile::tempdir().unwrap();
        let file = temp.path().join("plain-file");
        std::fs::write(&file, b"not a directory").unwrap();
        let inside = temp.path().to_str().unwrap();
        let long = format!("/{}", "d".repeat(63));
        let cases: [(String, Expected); 6] = [
            ("run/ferry".into(), |error| {
                matches!(error, SocketDirError::Relative { .. })
            }),
            (format!("{inside}/../escape"), |error| {
                matches!(error, SocketDirError::ClimbsOut { .. })
            }),
            (format!("{inside}/missing"), |error| {
                matches!(error, SocketDirError::Missing { .. })
            }),
            (file.to_str().unwrap().to_owned(), |error| {
                matches!(error, SocketDirError::NotADirectory { .. })
            }),
            (long, |error| {
                matches!(error, SocketDirError::TooLong { len: 64, .. })
            }),
            (format!("/{}", "d".repeat(62)), |error| {
                // Short enough: refused only because it does not exist.
                matches!(error, SocketDirError::Missing { .. })
            }),
        ];
        for (dir, expected) in cases {
            let error = SocketDir::check(Path::new(&dir)).unwrap_err();
            assert!(expected(&error), "{dir}: {error}");
        }
        let not_utf8 = std::ffi::OsStr::from_bytes(b"/run/\xff");
        assert!(matches!(
            SocketDir::check(Path::new(not_utf8)),
            Err(SocketDirError::NotUtf8 { .. })
        ));
    }

    #[test]
    fn a_directory_this_process_cannot_write_is_refused_unless_it_is_root() {
        let temp = tempfile::tempdir().unwrap();
        let locked = temp.path().join("locked");
        std::fs::create_dir(&locked).unwrap();
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
        let checked = SocketDir::check(&locked);
        if rustix::process::getuid().is_root() {
            // Root may create files anywhere that is not read-only.
            assert!(checked.is_ok(), "{checked:?}");
        } else {
            let error = checked.unwrap_err();
            assert!(
                matches!(error, SocketDirError::NotWritable { .. }),
                "{error}"
            );
            assert!(error.to_string().contains("mode 1777"), "{error}");
        }
    }
}
