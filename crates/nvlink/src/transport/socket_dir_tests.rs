//! The socket directory as an engine meets it: checked when the transport attaches, published
//! as the `nvlink` endpoint, removed with the transport; a peer's endpoint used only when it
//! names the peer's own socket.

use super::*;
use crate::SocketDirError;
use ferry_core::InboxHandle;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// What an engine tells the transport as it starts.
fn context(runtime: &tokio::runtime::Handle, secret: Option<Secret>) -> EngineContext {
    let (inbox, _) = InboxHandle::standalone(4, 1 << 20, runtime.clone());
    EngineContext {
        instance: InstanceId::random().unwrap(),
        secret,
        runtime: runtime.clone(),
        name: "prefill:1".into(),
        inbox,
    }
}

/// A transport attached (without a secret) with the socket directory `dir`, and where its
/// socket file is to be.
fn attached_in(dir: &Path) -> (NvlinkTransport, String) {
    let transport = NvlinkTransport::new(NvlinkConfig::default().socket_dir(dir));
    let engine = context(&tokio::runtime::Handle::current(), None);
    transport.attach(&engine).unwrap();
    let path = format!("{}/ferry-{}.sock", dir.display(), engine.instance);
    (transport, path)
}

#[tokio::test]
async fn a_transport_with_a_socket_directory_binds_publishes_and_removes_its_file() {
    let temp = tempfile::tempdir().unwrap();
    let (transport, expected) = attached_in(temp.path());
    assert_eq!(
        transport.endpoint(),
        Some(Endpoint {
            transport: NVLINK.into(),
            address: expected.clone(),
        })
    );
    let mode = std::fs::metadata(&expected).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "no secret: this user only");
    drop(transport);
    assert!(!Path::new(&expected).exists(), "{expected} is left");
}

#[tokio::test]
async fn stopping_removes_the_file_at_once_while_the_transport_lives_on() {
    let temp = tempfile::tempdir().unwrap();
    let (transport, path) = attached_in(temp.path());
    assert!(Path::new(&path).exists());
    transport.stop();
    assert!(!Path::new(&path).exists(), "{path} is left after stop");
    drop(transport);
}

#[tokio::test]
async fn a_transport_without_a_socket_directory_publishes_no_endpoint() {
    let transport = NvlinkTransport::new(NvlinkConfig::default());
    transport
        .attach(&context(&tokio::runtime::Handle::current(), None))
        .unwrap();
    // (Unless FERRY_SOCKET_DIR is set where the tests run.)
    if std::env::var_os(SOCKET_DIR_ENV).is_none_or(|dir| dir.is_empty()) {
        assert_eq!(transport.endpoint(), None);
    }
}

/// Whether an error is the one a case expects.
type Expected = fn(&SocketDirError) -> bool;

#[tokio::test]
async fn a_socket_directory_that_cannot_be_used_stops_the_engine_with_the_typed_reason() {
    let temp = tempfile::tempdir().unwrap();
    let file = temp.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let cases: [(std::path::PathBuf, Expected); 3] = [
        (temp.path().join("missing"), |error| {
            matches!(error, SocketDirError::Missing { .. })
        }),
        (file, |error| {
            matches!(error, SocketDirError::NotADirectory { .. })
        }),
        ("relative/dir".into(), |error| {
            matches!(error, SocketDirError::Relative { .. })
        }),
    ];
    for (dir, expected) in cases {
        let transport = NvlinkTransport::new(NvlinkConfig::default().socket_dir(&dir));
        let error = transport
            .attach(&context(&tokio::runtime::Handle::current(), None))
            .unwrap_err();
        let Error::Io { source, .. } = &error else {
            panic!("{dir:?}: expected an I/O error, got {error}");
        };
        let reason = source
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<SocketDirError>())
            .unwrap_or_else(|| panic!("{dir:?}: the source is not a SocketDirError: {error}"));
        assert!(expected(reason), "{dir:?}: {reason}");
        assert!(error.to_string().contains("socket directory"), "{error}");
    }
}

fn descriptor(instance: InstanceId, endpoint: Option<String>) -> SegmentDescriptor {
    SegmentDescriptor {
        version: ferry_core::DESCRIPTOR_VERSION,
        name: "decode".into(),
        host: HostIdentity::current(),
        generation: 1,
        instance,
        process: instance,
        pid: 1,
        endpoints: endpoint
            .map(|address| Endpoint {
                transport: NVLINK.into(),
                address,
            })
            .into_iter()
            .collect(),
        gpus: Vec::new(),
        buffers: Vec::new(),
        signature: None,
    }
}

#[test]
fn a_peers_endpoint_is_its_socket_file_only_when_it_names_its_own() {
    let peer = InstanceId::from_u128(0x5);
    let own = format!("/run/ferry/{}", crate::fd_passing::socket_file_name(peer));
    assert_eq!(
        peer_socket(&descriptor(peer, Some(own.clone()))),
        FdSocket::new(crate::fd_socket_name(peer), Some(own))
    );
    let third = format!(
        "/run/ferry/{}",
        crate::fd_passing::socket_file_name(InstanceId::from_u128(0x6))
    );
    let escaping = format!(
        "/run/ferry/../x/{}",
        crate::fd_passing::socket_file_name(peer)
    );
    for refused in [Some(third), Some(escaping), Some("ferry.sock".into()), None] {
        assert_eq!(
            peer_socket(&descriptor(peer, refused.clone())),
            FdSocket::of(peer),
            "{refused:?}"
        );
    }
}
