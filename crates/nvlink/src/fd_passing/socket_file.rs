//! The fd socket's file in the socket directory: bound with the permissions the credentials
//! rule calls for, and removed when the server stops.

use super::dir::{SocketDir, SocketDirError};
use super::stale;
use ferry_core::InstanceId;
use std::os::unix::net::UnixListener;

/// Permissions of the socket file with a shared secret: every user may connect (connecting
/// to a Unix socket needs write permission on its file), since the secret, not the user, is
/// what the server checks.
pub(super) const MODE_WITH_SECRET: u32 = 0o666;

/// Permissions of the socket file without a secret: only this engine's user may connect, as
/// only that user is served.
pub(super) const MODE_WITHOUT_SECRET: u32 = 0o600;

/// The socket file's permissions for a server with or without a secret: open to the users
/// the credentials rule ([`super::credentials::admits`]) lets through (any user with a
/// secret, this one without), and to no others.
pub(super) fn mode(with_secret: bool) -> u32 {
    match with_secret {
        true => MODE_WITH_SECRET,
        false => MODE_WITHOUT_SECRET,
    }
}

/// Engine `owner`'s socket file in a socket directory; removed from the directory on drop,
/// so a stopped engine leaves no file for peers to try (or for the directory to collect).
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: String,
}

impl SocketFile {
    /// Binds engine `owner`'s socket in `dir`, non-blocking, with the permissions of
    /// [`mode`], after removing the files stopped engines left there ([`stale`]). Between the
    /// bind and setting the permissions the file has the mode the process's umask leaves; a
    /// client of another user that connects meanwhile is still refused by the server's
    /// credentials check.
    ///
    /// # Errors
    /// [`SocketDirError::Bind`] or [`SocketDirError::Mode`]; the file is removed again when
    /// the permissions could not be set.
    pub(super) fn bind(
        dir: &SocketDir,
        owner: InstanceId,
        with_secret: bool,
    ) -> Result<(UnixListener, SocketFile), SocketDirError> {
        let removed = stale::remove_stale(dir.path(), stale::STALE_AFTER);
        if removed > 0 {
            tracing::info!(
                dir = %dir.path().display(),
                removed,
                "removed the socket files of stopped engines from the socket directory"
            );
        }
        let path = dir.socket_path(owner);
        let listener = UnixListener::bind(&path).map_err(|source| SocketDirError::Bind {
            path: path.clone(),
            source,
        })?;
        dir.record_served();
        let file = SocketFile { path };
        set_mode(&file.path, mode(with_secret)).map_err(|source| SocketDirError::Mode {
            path: file.path.clone(),
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| SocketDirError::Bind {
                path: file.path.clone(),
                source,
            })?;
        Ok((listener, file))
    }

    /// The socket's path, as exports carry it.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }
}

/// Sets the permissions of the socket just bound at `path` to `mode`, on the very file the
/// name leads to now, and only when that is a socket of this user: another user who may
/// remove files in the directory could otherwise swap a symbolic link to a file of this
/// user's in between the bind and the change, and have that file's permissions changed
/// (`chmod` follows links). The name is opened without following a link, checked, and the
/// permissions are changed through the opened file (its `/proc/self/fd` entry), not the name.
fn set_mode(path: &str, mode: u32) -> std::io::Result<()> {
    use rustix::fs::{FileType, Mode, OFlags};
    use std::os::fd::AsRawFd;
    let opened = rustix::fs::open(
        path,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let stat = rustix::fs::fstat(&opened)?;
    let own = rustix::process::geteuid().as_raw();
    if FileType::from_raw_mode(stat.st_mode) != FileType::Socket || stat.st_uid != own {
        return Err(std::io::Error::other(format!(
            "{path} is no longer the socket this engine bound (another file, or another user's, took its name): the directory lets other users replace files; set its sticky bit (chmod 1777) or give it to the pods' user only"
        )));
    }
    let through = format!("/proc/self/fd/{}", opened.as_raw_fd());
    rustix::fs::chmod(through.as_str(), Mode::from_raw_mode(mode))?;
    Ok(())
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                tracing::warn!(path = %self.path, %error, "removing this engine's fd socket from the socket directory failed; remove the file by hand")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::path::Path;

    #[test]
    fn the_file_is_a_socket_with_the_secrets_mode_and_is_gone_after_drop() {
        let temp = tempfile::tempdir().unwrap();
        let dir = SocketDir::check(temp.path()).unwrap();
        for (with_secret, expected) in [(true, 0o666), (false, 0o600)] {
            let owner = InstanceId::random().unwrap();
            let (listener, file) = SocketFile::bind(&dir, owner, with_secret).unwrap();
            let metadata = std::fs::metadata(file.path()).unwrap();
            assert!(metadata.file_type().is_socket());
            assert_eq!(metadata.permissions().mode() & 0o7777, expected);
            assert_eq!(file.path(), dir.socket_path(owner));
            // The listener really takes connections at that path.
            let client = std::os::unix::net::UnixStream::connect(file.path()).unwrap();
            assert!(listener.accept().is_ok());
            drop(client);
            let path = file.path().to_owned();
            drop(file);
            assert!(!Path::new(&path).exists(), "{path} is left after drop");
        }
    }

    #[test]
    fn a_file_already_there_is_a_bind_error_naming_its_path() {
        let temp = tempfile::tempdir().unwrap();
        let dir = SocketDir::check(temp.path()).unwrap();
        let owner = InstanceId::random().unwrap();
        std::fs::write(dir.socket_path(owner), b"in the way").unwrap();
        let error = SocketFile::bind(&dir, owner, false).unwrap_err();
        assert!(
            matches!(&error, SocketDirError::Bind { path, .. } if *path == dir.socket_path(owner)),
            "{error}"
        );
    }
}
