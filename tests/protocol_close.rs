//! A peer that breaks the protocol is trusted with nothing further: when any link to it
//! reports a protocol violation, the engine closes every link to that peer, and a fresh
//! `connect` opens it anew.

mod common;

use common::engine;
use ferry::transport::{Endpoint, Link, Reach, TransferOps, Transport};
use ferry::{BufferDescriptor, Error, ProtocolViolation, RegionInfo, SegmentDescriptor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A transport that reaches everything cheaply and whose links report every transfer as a
/// descriptor that does not fit the peer's memory.
struct Hostile {
    closed: Arc<AtomicBool>,
}

struct HostileLink {
    peer: String,
    closed: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl Transport for Hostile {
    fn name(&self) -> &'static str {
        "hostile"
    }

    fn endpoint(&self) -> Option<Endpoint> {
        None
    }

    fn reach(&self, _: &RegionInfo, _: &SegmentDescriptor, _: &BufferDescriptor) -> Reach {
        Reach::Yes { cost: 1 }
    }

    async fn open(&self, peer: &SegmentDescriptor) -> ferry::Result<Arc<dyn Link>> {
        Ok(Arc::new(HostileLink {
            peer: peer.name.clone(),
            closed: Arc::clone(&self.closed),
        }))
    }
}

#[async_trait::async_trait]
impl Link for HostileLink {
    async fn transfer(&self, _ops: TransferOps) -> ferry::Result<()> {
        Err(Error::Protocol {
            peer: self.peer.clone(),
            violation: ProtocolViolation::Descriptor {
                field: "export.offset",
                problem: "lies past the mapping".into(),
            },
        })
    }

    fn is_alive(&self) -> bool {
        !self.closed.load(Ordering::SeqCst)
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_protocol_violation_closes_every_link_to_the_peer() {
    let decode = engine().await;
    let _pool = decode.allocate(1 << 20).unwrap();
    let closed = Arc::new(AtomicBool::new(false));
    let prefill = ferry::builder()
        .transfer_timeout(Duration::from_secs(10))
        .transport(Arc::new(Hostile {
            closed: Arc::clone(&closed),
        }))
        .build()
        .await
        .unwrap();
    let source = prefill.allocate(1 << 20).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let remote = peer.buffers()[0].addr;
    assert!(peer.is_alive());
    let outcome = prefill
        .batch(&peer)
        .write(&source, 0, remote, 4096)
        .submit()
        .unwrap()
        .await;
    match outcome {
        Err(Error::Protocol {
            violation: ProtocolViolation::Descriptor { field, .. },
            ..
        }) => assert_eq!(field, "export.offset"),
        other => panic!("expected the link's protocol violation, got {other:?}"),
    }
    assert!(
        closed.load(Ordering::SeqCst),
        "the reporting link was closed"
    );
    assert!(
        !peer.is_alive(),
        "the control link to the peer was closed too"
    );
    let again = prefill.connect(decode.name()).await.unwrap();
    assert!(again.is_alive(), "a fresh connect opens the peer anew");
}
