//! Socket files of stopped engines, removed from the socket directory when an engine starts
//! serving there: an engine that was killed (a pod's container restarted with SIGKILL, say)
//! could not remove its file, and a node whose pods restart often would collect them.
//!
//! A file is removed only when it is a socket of this user named like an engine's, older than
//! [`STALE_AFTER`], and a connection to it is refused: nothing listens there any more. A
//! socket that is being bound right now is younger; one whose engine is alive accepts (or,
//! with a full backlog, would make the connection wait, which counts as alive here too).
//!
//! Only on a file system of this node ([`node_local`]): a socket file that an engine of
//! another host bound on a shared network file system refuses every connection from here
//! however alive its engine is, and must be left to that host.

use super::address::connect_nonblocking;
use super::dir::named_like_a_socket_file;
use rustix::net::SocketAddrUnix;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, SystemTime};

/// Socket files younger than this are left alone: their engine may be between binding and
/// listening, when a connection is refused too.
pub(super) const STALE_AFTER: Duration = Duration::from_secs(60);

/// Removes the socket files in `dir` that engines of this user left behind when they stopped
/// (see the module's doc), those last changed at least `older_than` ago; returns how many it
/// removed. Entries it cannot read or judge are left, silently: this is housekeeping, and the
/// engine's own socket does not depend on it.
pub(super) fn remove_stale(dir: &Path, older_than: Duration) -> usize {
    if !node_local(dir) {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let own = rustix::process::geteuid().as_raw();
    let now = SystemTime::now();
    entries
        .flatten()
        .filter(|entry| {
            if !named_like_a_socket_file(&entry.file_name().to_string_lossy()) {
                return false;
            }
            let Ok(metadata) = entry.metadata() else {
                return false;
            };
            let old = metadata
                .modified()
                .ok()
                .and_then(|modified| now.duration_since(modified).ok())
                .is_some_and(|age| age >= older_than);
            metadata.file_type().is_socket()
                && metadata.uid() == own
                && old
                && nothing_listens(&entry.path())
                && std::fs::remove_file(entry.path()).is_ok()
        })
        .count()
}

/// File systems (`statfs` magic numbers) that live on this node only: a socket file on one
/// of them was bound by an engine of this node. Others (NFS, SMB, FUSE, 9p, Ceph and the
/// like, or any not listed) may be shared with other hosts.
const NODE_LOCAL: [u64; 7] = [
    0x0102_1994, // tmpfs
    0x0000_EF53, // ext2, ext3, ext4
    0x5846_5342, // xfs
    0x9123_683E, // btrfs
    0x794C_7630, // overlayfs (a container's root)
    0x2FC1_2FC1, // zfs
    0x8584_58F6, // ramfs
];

/// Whether `dir` is on a file system of this node only ([`NODE_LOCAL`]).
fn node_local(dir: &Path) -> bool {
    rustix::fs::statfs(dir).is_ok_and(|stat| NODE_LOCAL.contains(&(stat.f_type as u64)))
}

/// Whether a connection to the socket at `path` is refused, without waiting: a listener with
/// a full backlog answers "try again", which is not a refusal.
fn nothing_listens(path: &Path) -> bool {
    SocketAddrUnix::new(path)
        .map_err(std::io::Error::from)
        .and_then(|address| connect_nonblocking(&address))
        .is_err_and(|error| error.kind() == std::io::ErrorKind::ConnectionRefused)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn only_old_sockets_of_this_user_named_like_an_engines_that_refuse_are_removed() {
        let temp = tempfile::tempdir().unwrap();
        let path = |name: &str| temp.path().join(name);
        // An engine that stopped without removing its file: bound, then closed.
        drop(UnixListener::bind(path("ferry-0011.sock")).unwrap());
        // A live engine: its listener is kept open.
        let live = UnixListener::bind(path("ferry-0022.sock")).unwrap();
        // A dead socket under another name, and a plain file under an engine's name.
        drop(UnixListener::bind(path("other.sock")).unwrap());
        std::fs::write(path("ferry-0033.sock"), b"not a socket").unwrap();

        assert_eq!(remove_stale(temp.path(), Duration::from_secs(3600)), 0);
        assert!(
            path("ferry-0011.sock").exists(),
            "removed before it was old"
        );

        assert_eq!(remove_stale(temp.path(), Duration::ZERO), 1);
        assert!(!path("ferry-0011.sock").exists());
        for kept in ["ferry-0022.sock", "other.sock", "ferry-0033.sock"] {
            assert!(path(kept).exists(), "{kept} was removed");
        }
        // The live one still takes connections at its path.
        let client = std::os::unix::net::UnixStream::connect(path("ferry-0022.sock")).unwrap();
        assert!(live.accept().is_ok());
        drop(client);
    }

    #[test]
    #[ignore = "needs root to give a file to another user; .ci/run runs it"]
    fn another_users_socket_is_left_however_old_and_dead() {
        let temp = tempfile::tempdir().unwrap();
        let path = temp.path().join("ferry-0044.sock");
        drop(UnixListener::bind(&path).unwrap());
        std::os::unix::fs::chown(&path, Some(1001), Some(1001)).unwrap();
        assert_eq!(remove_stale(temp.path(), Duration::ZERO), 0);
        assert!(path.exists(), "another user's file was removed");
    }

    #[test]
    fn only_file_systems_of_this_node_are_swept() {
        let temp = tempfile::tempdir().unwrap();
        assert!(node_local(temp.path()), "{}", temp.path().display());
        // procfs is not among them (as NFS, FUSE or 9p are not): nothing there is touched.
        assert!(!node_local(Path::new("/proc")));
    }

    #[test]
    fn a_directory_that_cannot_be_read_removes_nothing() {
        let temp = tempfile::tempdir().unwrap();
        assert_eq!(
            remove_stale(&temp.path().join("missing"), Duration::ZERO),
            0
        );
    }
}
