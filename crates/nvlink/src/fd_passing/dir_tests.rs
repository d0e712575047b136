//! The fd socket through a socket directory: both ends over a real socket file, with the
//! abstract name out of reach as it is from another network namespace.

use super::dir::SocketDir;
use super::server::*;
use super::tests::{pipe_marks, serve_pipes};
use super::*;
use ferry_core::auth::Secret;
use ferry_core::{InboxHandle, Notifications};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;

fn secret() -> Secret {
    Secret::new(b"socket-dir-tests-0123456789abcdef".to_vec()).unwrap()
}

/// A temporary socket directory every user may enter (for the tests that connect as another
/// user), checked.
fn socket_dir() -> (tempfile::TempDir, SocketDir) {
    let temp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let dir = SocketDir::check(temp.path()).unwrap();
    (temp, dir)
}

/// A socket directory this process counts as served in (as an engine's binding there does),
/// so that peers' socket files in it are connected to.
fn served_dir() -> (tempfile::TempDir, SocketDir) {
    let (temp, dir) = socket_dir();
    dir.record_served();
    (temp, dir)
}

/// A server serving in `dir` too, whose rings deliver into the returned inbox.
fn server_in(dir: &SocketDir, secret: Option<Secret>) -> (FdServer, Notifications) {
    let runtime = tokio::runtime::Handle::current();
    let (inbox, notifications) = InboxHandle::standalone(16, 1 << 20, runtime.clone());
    let mut server = FdServer::start(
        InstanceId::random().unwrap(),
        secret,
        &runtime,
        inbox,
        crate::NvlinkConfig::default(),
    )
    .unwrap();
    server.serve_in(dir).unwrap();
    (server, notifications)
}

/// What a client in another network namespace sees of `server`: an abstract name nothing
/// listens under, and the server's socket file.
fn from_another_namespace(server: &FdServer) -> FdSocket {
    let unbound = fd_socket_name(InstanceId::random().unwrap());
    FdSocket::new(unbound, server.socket_path().map(str::to_owned))
}

async fn next(notifications: &mut Notifications) -> ferry_core::Notification {
    tokio::time::timeout(Duration::from_secs(5), notifications.recv())
        .await
        .expect("no notification within 5 s")
        .expect("the inbox closed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_and_a_fetch_reach_the_server_through_its_file_when_the_name_is_unreachable() {
    let (_temp, dir) = socket_dir();
    for key in [None, Some(secret())] {
        let (server, mut inbox) = server_in(&dir, key.clone());
        let target = from_another_namespace(&server);
        let sender = open_messages(&target, "decode", "prefill:1", key.as_ref())
            .await
            .unwrap();
        sender.send(b"through the directory").await.unwrap();
        let note = next(&mut inbox).await;
        assert_eq!(
            (note.from.as_str(), note.payload.as_slice()),
            ("prefill:1", &b"through the directory"[..])
        );
        // A fetch is answered by the server itself: it knows no buffer at that address.
        let error = fetch_fds(&target, 0x1000, 1, key.as_ref())
            .await
            .unwrap_err();
        assert!(
            matches!(&error, ImportError::Refused { reason } if reason.starts_with("no VMM region is registered at 0x1000;")),
            "{error}"
        );
    }
}

#[tokio::test]
async fn descriptors_arrive_in_order_through_a_socket_file() {
    let (temp, _dir) = served_dir();
    let path = temp.path().join("ferry-serving.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let serving = serve_pipes(listener, 0x2000, 5);
    let unbound = fd_socket_name(InstanceId::random().unwrap());
    let target = FdSocket::new(unbound, Some(path.to_str().unwrap().to_owned()));
    let fds = fetch_fds(&target, 0x2000, 5, None).await.unwrap();
    serving.await.unwrap();
    assert_eq!(pipe_marks(fds), [0, 1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_abstract_name_is_used_first_and_a_missing_file_is_never_tried() {
    let (_temp, dir) = socket_dir();
    let (server, mut inbox) = server_in(&dir, None);
    // One network namespace: the name answers, and a file that is not there does not matter.
    let target = FdSocket::new(
        server.name().to_owned(),
        Some(format!(
            "/nonexistent/{}",
            socket_file_name(InstanceId::random().unwrap())
        )),
    );
    let sender = open_messages(&target, "decode", "prefill:1", None)
        .await
        .unwrap();
    sender.send(b"by name").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"by name");
}

#[tokio::test]
async fn a_socket_reachable_neither_by_name_nor_by_file_says_both_and_what_to_do() {
    let (_temp, dir) = served_dir();
    let id = InstanceId::random().unwrap();
    let target = FdSocket::new(fd_socket_name(id), Some(dir.socket_path(id)));
    let error = fetch_fds(&target, 0x1000, 1, None).await.unwrap_err();
    match &error {
        ImportError::Unreachable {
            by_name, by_path, ..
        } => {
            assert_eq!(by_name.kind(), std::io::ErrorKind::ConnectionRefused);
            assert_eq!(by_path.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Unreachable, got {other}"),
    }
    assert!(error.to_string().contains("FERRY_SOCKET_DIR"), "{error}");
    assert!(!error.is_passing());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_file_outside_every_directory_this_process_serves_in_is_not_tried() {
    let (_temp, dir) = socket_dir();
    // Served by a real server, but in a directory no engine of this process serves in (as if
    // a peer named a path of its own choosing): the file is not connected to.
    let listener =
        std::os::unix::net::UnixListener::bind(dir.socket_path(InstanceId::from_u128(7))).unwrap();
    let id = InstanceId::from_u128(7);
    let target = FdSocket::new(fd_socket_name(id), Some(dir.socket_path(id)));
    let error = fetch_fds(&target, 0x1000, 1, None).await.unwrap_err();
    match &error {
        ImportError::Unreachable { by_path, .. } => {
            assert!(by_path.to_string().starts_with("not tried"), "{by_path}");
        }
        other => panic!("expected Unreachable, got {other}"),
    }
    listener.set_nonblocking(true).unwrap();
    assert!(listener.accept().is_err(), "nothing connected to the file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_named_after_the_peer_but_leading_to_another_engines_socket_is_refused() {
    let (_temp, dir) = socket_dir();
    // The third engine, whose memory the peer would have this engine map.
    let (third, _inbox) = server_in(&dir, None);
    let third_path = third.socket_path().unwrap().to_owned();
    let (elsewhere, _served) = served_dir();
    let peer = InstanceId::random().unwrap();
    let link = elsewhere.path().join(socket_file_name(peer));
    let links: [fn(&Path, &Path) -> std::io::Result<()>; 2] = [
        |from, to| std::os::unix::fs::symlink(from, to),
        |from, to| std::fs::hard_link(from, to),
    ];
    for make in links {
        make(Path::new(&third_path), &link).unwrap();
        let target = FdSocket::new(
            fd_socket_name(peer),
            Some(link.to_str().unwrap().to_owned()),
        );
        let error = fetch_fds(&target, 0x1000, 1, None).await.unwrap_err();
        match &error {
            ImportError::BoundElsewhere { asked, bound } => {
                assert_eq!(asked, link.to_str().unwrap());
                assert_eq!(bound, &third_path);
            }
            other => panic!("expected BoundElsewhere, got {other}"),
        }
        std::fs::remove_file(&link).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_file_has_the_secrets_mode_and_both_sockets_go_when_the_server_drops() {
    let (_temp, dir) = socket_dir();
    for (key, mode) in [(Some(secret()), 0o666), (None, 0o600)] {
        let (server, _inbox) = server_in(&dir, key.clone());
        let path = server.socket_path().unwrap().to_owned();
        let metadata = std::fs::metadata(&path).unwrap();
        assert!(metadata.file_type().is_socket());
        assert_eq!(metadata.permissions().mode() & 0o7777, mode, "{path}");
        let by_name = FdSocket::new(server.name().to_owned(), None);
        drop(server);
        assert!(!Path::new(&path).exists(), "{path} is left after drop");
        // The listeners stop with the server: the abstract name refuses connections at once.
        let mut refused = None;
        for _ in 0..50 {
            match open_messages(&by_name, "decode", "prefill:1", key.as_ref()).await {
                Err(ImportError::Socket { source, .. })
                    if source.kind() == std::io::ErrorKind::ConnectionRefused =>
                {
                    refused = Some(source);
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        assert!(
            refused.is_some(),
            "the abstract socket still took connections"
        );
    }
}

/// Runs `ask` on a thread of its own whose user is `uid` (the process's other threads keep
/// theirs), with a runtime of its own; the kernel reports the user of a connection's
/// creator to the server. Needs root.
fn as_user<T: Send + 'static>(
    uid: u32,
    ask: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>> + Send + 'static,
) -> T {
    std::thread::spawn(move || {
        let gid = rustix::process::Gid::from_raw(uid);
        rustix::thread::set_thread_groups(&[]).unwrap();
        rustix::thread::set_thread_res_gid(gid, gid, gid).unwrap();
        let uid = rustix::process::Uid::from_raw(uid);
        rustix::thread::set_thread_res_uid(uid, uid, uid).unwrap();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(ask())
    })
    .join()
    .unwrap()
}

const NOBODY: u32 = 65534;

// Switching a thread to another user needs root: `.ci/run` runs this test as root with
// `--ignored`; a developer's plain `cargo test` leaves it out (the rule itself is
// `credentials::admits`, tested everywhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root to switch a thread to another user; .ci/run runs it"]
async fn another_user_is_served_through_the_directory_with_the_secret_and_refused_without() {
    assert!(
        rustix::process::geteuid().is_root(),
        "switching a thread to uid {NOBODY} needs root: run this test as root"
    );
    let (_temp, dir) = socket_dir();
    // With the secret: the other user reaches the file (mode 0o666) and is served.
    let (server, mut inbox) = server_in(&dir, Some(secret()));
    let target = from_another_namespace(&server);
    let sent = as_user(NOBODY, move || {
        Box::pin(async move {
            let sender = open_messages(&target, "decode", "prefill:nobody", Some(&secret()))
                .await
                .map_err(|error| error.to_string())?;
            sender
                .send(b"from another user")
                .await
                .map_err(|error| error.to_string())?;
            // Held until the message is taken, so the ring is still open when it is read.
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok::<_, String>(())
        })
    });
    sent.unwrap();
    let note = next(&mut inbox).await;
    assert_eq!(
        (note.from.as_str(), note.payload.as_slice()),
        ("prefill:nobody", &b"from another user"[..])
    );
    drop(server);
    // Without a secret: the file (mode 0o600) does not let the other user connect; by the
    // abstract name (which has no permissions) the client refuses a server of another user,
    // and the server a client of another user, before either sends anything.
    let (server, _inbox) = server_in(&dir, None);
    let (by_file, by_name) = (from_another_namespace(&server), server.address());
    let name = server.name().to_owned();
    let (file, client, server_said) = as_user(NOBODY, move || {
        Box::pin(async move {
            let file = fetch_fds(&by_file, 0x1000, 1, None).await;
            let client = fetch_fds(&by_name, 0x1000, 1, None).await;
            // A client that does not check: the server's refusal, read raw.
            let address = rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap();
            let socket = rustix::net::socket(
                rustix::net::AddressFamily::UNIX,
                rustix::net::SocketType::STREAM,
                None,
            )
            .unwrap();
            rustix::net::connect(&socket, &address).unwrap();
            let mut answer = Vec::new();
            std::os::unix::net::UnixStream::from(socket)
                .read_to_end(&mut answer)
                .unwrap();
            (
                file.map(drop).map_err(|error| error.to_string()),
                client.map(drop).map_err(|error| error.to_string()),
                answer,
            )
        })
    });
    let file = file.unwrap_err();
    assert!(file.contains("Permission denied"), "{file}");
    let client = client.unwrap_err();
    assert!(client.contains("served by uid 0"), "{client}");
    assert_eq!(server_said.first(), Some(&1), "not a refusal");
    let reason = String::from_utf8_lossy(&server_said[1..]);
    assert!(
        reason.contains(&format!("runs as uid {NOBODY}")) && reason.contains("same secret"),
        "{reason}"
    );
}

/// Sets the modification time of the file at `path` (a socket too) to `ago` before now.
fn age(path: &Path, ago: Duration) {
    let then = std::time::SystemTime::now() - ago;
    let since = then.duration_since(std::time::UNIX_EPOCH).unwrap();
    let stamp = rustix::fs::Timespec {
        tv_sec: since.as_secs() as i64,
        tv_nsec: since.subsec_nanos().into(),
    };
    let times = rustix::fs::Timestamps {
        last_access: stamp,
        last_modification: stamp,
    };
    rustix::fs::utimensat(rustix::fs::CWD, path, &times, rustix::fs::AtFlags::empty()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_starting_in_the_directory_removes_files_of_stopped_engines_and_keeps_live_ones()
{
    let (_temp, dir) = socket_dir();
    // An engine killed an hour ago left its file; another one's is as old and still served.
    let stopped = dir.socket_path(InstanceId::random().unwrap());
    drop(std::os::unix::net::UnixListener::bind(&stopped).unwrap());
    let (alive, mut inbox) = server_in(&dir, Some(secret()));
    let alive_path = alive.socket_path().unwrap().to_owned();
    // One bound a moment ago, whose engine may not be listening yet.
    let young = dir.socket_path(InstanceId::random().unwrap());
    drop(std::os::unix::net::UnixListener::bind(&young).unwrap());
    for path in [&stopped, &alive_path] {
        age(Path::new(path), Duration::from_secs(3600));
    }

    let (_starting, _its_inbox) = server_in(&dir, Some(secret()));
    assert!(
        !Path::new(&stopped).exists(),
        "the stopped engine's file is left"
    );
    assert!(
        Path::new(&young).exists(),
        "a file younger than a minute was removed"
    );
    assert!(Path::new(&alive_path).exists(), "a served file was removed");
    // The live engine still serves through its file after the check connected to it.
    let sender = open_messages(
        &from_another_namespace(&alive),
        "decode",
        "prefill:1",
        Some(&secret()),
    )
    .await
    .unwrap();
    sender.send(b"still served").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"still served");
}
