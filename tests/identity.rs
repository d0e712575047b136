//! Engines are told apart by random instance ids, never by PID: in containers every service
//! may be PID 1 on the same host, and a restart keeps name, host and often PID.

mod common;

use common::{assert_bytes_eq, pattern};
use ferry::metadata::{MetadataStore, PeerToPeer};
use ferry::transport::InstanceId;
use ferry::SegmentDescriptor;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[tokio::test]
async fn engines_of_one_process_share_its_process_id_and_differ_in_instance() {
    let first = common::engine().await;
    let second = common::engine().await;
    let (a, b) = (first.descriptor(), second.descriptor());
    assert_ne!(a.instance, b.instance);
    assert_eq!(a.process, b.process);
    assert_eq!(a.pid, std::process::id());
    // The ids travel in the descriptor a peer fetches.
    let peer = first.connect(second.name()).await.unwrap();
    assert_eq!(peer.descriptor().instance, b.instance);
    assert_eq!(peer.descriptor().process, b.process);
}

/// Peer-to-peer lookups, except that once `impostor` is set every descriptor carries that
/// instance id: another engine at the same name, PID and host, as a restarted container is.
struct Replacing {
    real: PeerToPeer,
    impostor: Mutex<Option<InstanceId>>,
}

#[async_trait::async_trait]
impl MetadataStore for Replacing {
    async fn publish(&self, descriptor: &SegmentDescriptor) -> ferry::Result<()> {
        self.real.publish(descriptor).await
    }

    async fn fetch(&self, name: &str) -> ferry::Result<SegmentDescriptor> {
        let mut descriptor = self.real.fetch(name).await?;
        if let Some(id) = *self.impostor.lock().unwrap() {
            descriptor.instance = id;
        }
        Ok(descriptor)
    }

    async fn unpublish(&self, name: &str) -> ferry::Result<()> {
        self.real.unpublish(name).await
    }
}

#[test]
fn a_peer_whose_instance_changes_is_closed_though_pid_and_host_are_the_same() {
    let decode = ferry::builder().build_blocking().unwrap();
    let pool = decode.allocate(4096).unwrap();
    let store = Arc::new(Replacing {
        real: PeerToPeer::new(Duration::from_secs(5)),
        impostor: Mutex::new(None),
    });
    let prefill = ferry::builder()
        .metadata(Arc::clone(&store) as Arc<dyn MetadataStore>)
        .liveness_interval(Duration::from_millis(20))
        .build_blocking()
        .unwrap();
    let source = prefill.allocate(4096).unwrap();
    source.write_at(0, &pattern(5, 4096)).unwrap();
    let old = prefill.connect_blocking(decode.name()).unwrap();
    prefill
        .batch(&old)
        .write(&source, 0, pool.addr(), 4096)
        .submit_blocking()
        .unwrap();
    let before = old.descriptor();
    assert_eq!(before.pid, std::process::id());

    let impostor = InstanceId::random().unwrap();
    *store.impostor.lock().unwrap() = Some(impostor);
    // The connection itself stays up: only the instance id says this is another engine.
    let deadline = Instant::now() + Duration::from_secs(5);
    while old.is_alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !old.is_alive(),
        "a peer that came back as another engine (same PID and host) must be closed"
    );
    let fresh = prefill.connect_blocking(decode.name()).unwrap();
    assert_eq!(fresh.descriptor().instance, impostor);
    assert_eq!(fresh.descriptor().pid, before.pid);
    assert_eq!(fresh.descriptor().host, before.host);
    source.write_at(0, &pattern(6, 4096)).unwrap();
    prefill
        .batch(&fresh)
        .write(&source, 0, pool.addr(), 4096)
        .submit_blocking()
        .unwrap();
    let mut landed = vec![0u8; 4096];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(6, 4096), "write to the reopened peer");
}
