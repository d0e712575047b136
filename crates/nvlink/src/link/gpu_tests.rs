//! The launch sequence on a real GPU: a launch that fails part-way through a transfer leaves
//! nothing queued behind the transfer's back. Needs a GPU; fails without one.

use super::launches::{Launches, Work};
use super::{GpuLane, NvlinkLink};
use crate::config::NvlinkConfig;
use crate::plan::{self, CopyPath};
use ferry_core::cuda::{
    download, launch_all, upload, Context, DeviceBuffer, Driver, Event, Launcher, Poller,
};
use ferry_core::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// A real transfer's launches, with launch `fail_at` failing instead of queueing.
struct FailingAt<'a> {
    inner: Launches<'a>,
    fail_at: usize,
}

impl Launcher for FailingAt<'_> {
    type Fence = Arc<Event>;
    type Error = Error;

    fn count(&self) -> usize {
        self.inner.count()
    }

    fn stream(&self, index: usize) -> usize {
        self.inner.stream(index)
    }

    fn launch(&mut self, index: usize) -> Result<()> {
        match index == self.fail_at {
            true => Err(Error::Internal {
                what: format!("launch {index} failed on purpose"),
            }),
            false => self.inner.launch(index),
        }
    }

    fn fence(&mut self, stream: usize) -> Result<Arc<Event>> {
        self.inner.fence(stream)
    }

    fn drain(&mut self, stream: usize) -> Result<()> {
        self.inner.drain(stream)
    }
}

/// Stands for the transfer's region uses and mappings: notes how many fences had fired when
/// it was dropped.
struct Guard {
    fired: Arc<AtomicUsize>,
    fired_at_release: Arc<AtomicUsize>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.fired_at_release
            .store(self.fired.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

#[test]
fn a_failed_launch_waits_for_the_copies_queued_before_it_on_every_stream() {
    let driver = Driver::get();
    assert!(
        driver.is_ready(),
        "this test needs a GPU: {}",
        driver.status()
    );
    const COPY: usize = 64 << 20;
    const COPIES: usize = 8;
    const FAIL_AT: usize = 5;
    let context = Context::get(0).expect("GPU 0 opens");
    let source = DeviceBuffer::new(Arc::clone(&context), COPY * COPIES).expect("source");
    let target = DeviceBuffer::new(Arc::clone(&context), COPY * COPIES).expect("target");
    let bytes: Vec<u8> = (0..COPY * COPIES).map(|i| (i % 251) as u8 + 1).collect();
    // SAFETY: both buffers hold COPY * COPIES bytes on this context's GPU.
    unsafe {
        upload(&context, source.addr(), &bytes).expect("source filled");
        upload(&context, target.addr(), &vec![0u8; COPY * COPIES]).expect("target zeroed");
    }
    let config = NvlinkConfig {
        streams_per_gpu: 4,
        copy_path: CopyPath::CopyEngine,
        ..NvlinkConfig::default()
    };
    let gpus = Arc::new(driver.devices().expect("GPUs listed"));
    let link = NvlinkLink::new(
        crate::NVLINK,
        "launch test".into(),
        ferry_core::InstanceId::from_u128(1),
        None,
        config,
        gpus,
        None,
    );
    let lane: Arc<GpuLane> = link.lane(0).expect("lane of GPU 0");
    let copies: Vec<plan::Copy> = (0..COPIES as u64)
        .map(|index| plan::Copy {
            dst: target.addr() + index * COPY as u64,
            src: source.addr() + index * COPY as u64,
            len: COPY as u64,
            kernel_reaches: false,
        })
        .collect();
    let work: Vec<(usize, Work)> = plan::launches(
        &copies,
        CopyPath::CopyEngine,
        false,
        4,
        plan::Pieces {
            most: 1 << 20,
            full_grid: 1,
        },
    )
    .into_iter()
    .map(|launch| (0, Work::Copies(launch)))
    .collect();
    assert_eq!(work.len(), COPIES, "one launch per copy");
    let launches = FailingAt {
        inner: Launches {
            link: &link,
            streams: 4,
            lanes: vec![Arc::clone(&lane)],
            work,
            last_kernels: Vec::new(),
            published: &AtomicBool::new(false),
        },
        fail_at: FAIL_AT,
    };
    let fired = Arc::new(AtomicUsize::new(0));
    let fired_at_release = Arc::new(AtomicUsize::new(usize::MAX));
    let guard = Guard {
        fired: Arc::clone(&fired),
        fired_at_release: Arc::clone(&fired_at_release),
    };
    let wait = |event: Arc<Event>| {
        let fired = Arc::clone(&fired);
        async move {
            let outcome = Poller::global().wait(event).await;
            fired.fetch_add(1, Ordering::SeqCst);
            outcome
        }
    };
    let outcome = futures::executor::block_on(launch_all(launches, wait, guard));
    match outcome {
        Err(Error::Internal { what }) => assert!(what.contains("launch 5"), "{what}"),
        other => panic!("expected the injected failure, got {other:?}"),
    }
    // Launches 0..=5 went to streams 0, 1, 2, 3, 0, 1: four streams, each fenced and waited
    // for before the guard (the transfer's memory) was released.
    assert_eq!(fired.load(Ordering::SeqCst), 4);
    assert_eq!(fired_at_release.load(Ordering::SeqCst), 4);
    let mut landed = vec![0u8; COPY * COPIES];
    // SAFETY: `target` holds COPY * COPIES bytes on this context's GPU.
    unsafe { download(&context, target.addr(), &mut landed) }.expect("target read");
    let split = COPY * FAIL_AT;
    if let Some(index) = landed[..split]
        .iter()
        .zip(&bytes[..split])
        .position(|(found, wanted)| found != wanted)
    {
        panic!("byte {index} of the copies queued before the failure is wrong");
    }
    assert!(
        landed[split..].iter().all(|&byte| byte == 0),
        "a copy after the failed launch was queued"
    );
}
