//! Data moves and lands intact: every size, packed small blocks, reads, notifications.

mod common;

use common::{assert_bytes_eq, engine, pattern, Pair};
use ferry::metadata::MemoryStore;
use ferry::Error;
use std::time::Duration;

#[tokio::test]
async fn writes_of_every_size_land_intact() {
    let pair = Pair::new(64 << 20, 64 << 20).await;
    let sizes = [1usize, 999, 4096, 32 << 10, 1 << 20, 20 << 20];
    let mut offset = 0u64;
    for (seed, &size) in sizes.iter().enumerate() {
        let bytes = pattern(seed as u64, size);
        pair.source.write_at(offset, &bytes).unwrap();
        let done = pair
            .prefill
            .batch(&pair.peer)
            .write(&pair.source, offset, pair.remote + offset + 3, size as u64)
            .submit()
            .unwrap()
            .await
            .unwrap();
        assert_eq!(done.bytes, size as u64);
        assert_eq!(done.transports, vec!["tcp"]);
        let mut landed = vec![0u8; size];
        pair.pool.read_at(offset + 3, &mut landed).unwrap();
        assert_bytes_eq(&landed, &bytes, &format!("{size}-byte write"));
        offset += size as u64 + 4096;
    }
}

#[tokio::test]
async fn reads_of_every_size_come_back_intact() {
    let pair = Pair::new(32 << 20, 32 << 20).await;
    for (seed, size) in [1usize, 999, 4096, 1 << 20, 9 << 20]
        .into_iter()
        .enumerate()
    {
        let bytes = pattern(100 + seed as u64, size);
        pair.pool.write_at(17, &bytes).unwrap();
        pair.prefill
            .batch(&pair.peer)
            .read(&pair.source, 5, pair.remote + 17, size as u64)
            .submit()
            .unwrap()
            .await
            .unwrap();
        let mut arrived = vec![0u8; size];
        pair.source.read_at(5, &mut arrived).unwrap();
        assert_bytes_eq(&arrived, &bytes, &format!("{size}-byte read"));
    }
}

#[tokio::test]
async fn thousands_of_scattered_blocks_land_in_their_slots() {
    const BLOCK: usize = 4096;
    const BLOCKS: usize = 3000;
    let pair = Pair::new(BLOCK * BLOCKS, BLOCK * BLOCKS).await;
    let bytes = pattern(7, BLOCK * BLOCKS);
    pair.source.write_at(0, &bytes).unwrap();
    // Block i goes to slot (i * 7 + 3) % BLOCKS: a permutation, so nothing is adjacent.
    let slot = |block: usize| (block * 7 + 3) % BLOCKS;
    let mut batch = pair.prefill.batch(&pair.peer);
    for block in 0..BLOCKS {
        let offset = (block * BLOCK) as u64;
        batch = batch.write(
            &pair.source,
            offset,
            pair.remote + (slot(block) * BLOCK) as u64,
            BLOCK as u64,
        );
    }
    assert_eq!(batch.len(), BLOCKS);
    batch.submit().unwrap().await.unwrap();
    let mut landed = vec![0u8; BLOCK * BLOCKS];
    pair.pool.read_at(0, &mut landed).unwrap();
    for block in 0..BLOCKS {
        let at = slot(block) * BLOCK;
        assert_bytes_eq(
            &landed[at..at + BLOCK],
            &bytes[block * BLOCK..(block + 1) * BLOCK],
            &format!("block {block}"),
        );
    }
}

/// Entries of 64 bytes in a permuted order, `count` of them: more than one slice of a
/// batch, which is routed and started a slice at a time.
const SLICED: usize = 20_000;

fn sliced_slot(entry: usize) -> usize {
    (entry * 7_919 + 11) % SLICED
}

#[tokio::test]
async fn a_batch_of_many_slices_lands_every_entry_in_its_slot_both_ways() {
    const ENTRY: usize = 64;
    let pair = Pair::new(ENTRY * SLICED, ENTRY * SLICED).await;
    let bytes = pattern(31, ENTRY * SLICED);
    pair.source.write_at(0, &bytes).unwrap();
    let mut batch = pair.prefill.batch(&pair.peer);
    for entry in 0..SLICED {
        batch = batch.write(
            &pair.source,
            (entry * ENTRY) as u64,
            pair.remote + (sliced_slot(entry) * ENTRY) as u64,
            ENTRY as u64,
        );
    }
    let done = batch
        .notify(b"sliced".to_vec())
        .submit()
        .unwrap()
        .await
        .unwrap();
    assert_eq!(done.bytes, (ENTRY * SLICED) as u64);
    let mut landed = vec![0u8; ENTRY * SLICED];
    pair.pool.read_at(0, &mut landed).unwrap();
    for entry in 0..SLICED {
        let at = sliced_slot(entry) * ENTRY;
        assert_bytes_eq(
            &landed[at..at + ENTRY],
            &bytes[entry * ENTRY..(entry + 1) * ENTRY],
            &format!("entry {entry} written"),
        );
    }
    let mut inbox = pair.decode.notifications().unwrap();
    let note = tokio::time::timeout(Duration::from_secs(10), inbox.recv())
        .await
        .expect("the notification of the sliced batch within 10 s")
        .unwrap();
    assert_eq!(note.payload, b"sliced");

    // Back: every slot read into a zeroed source, entry by entry.
    pair.source.write_at(0, &vec![0u8; ENTRY * SLICED]).unwrap();
    let mut batch = pair.prefill.batch(&pair.peer);
    for entry in 0..SLICED {
        batch = batch.read(
            &pair.source,
            (entry * ENTRY) as u64,
            pair.remote + (sliced_slot(entry) * ENTRY) as u64,
            ENTRY as u64,
        );
    }
    batch.submit().unwrap().await.unwrap();
    let mut back = vec![0u8; ENTRY * SLICED];
    pair.source.read_at(0, &mut back).unwrap();
    assert_bytes_eq(&back, &bytes, "the sliced read");
}

#[tokio::test]
async fn an_entry_outside_the_peer_in_a_later_slice_fails_the_transfer_naming_it() {
    const ENTRY: usize = 64;
    let pair = Pair::new(ENTRY * SLICED, ENTRY * SLICED).await;
    let bad = SLICED - 5;
    let mut batch = pair.prefill.batch(&pair.peer);
    for entry in 0..SLICED {
        let remote = match entry == bad {
            // Past the end of every buffer the peer has.
            true => pair.remote + (ENTRY * SLICED) as u64 + (1 << 30),
            false => pair.remote + (entry * ENTRY) as u64,
        };
        batch = batch.write(&pair.source, (entry * ENTRY) as u64, remote, ENTRY as u64);
    }
    let failed = batch
        .submit()
        .unwrap()
        .await
        .expect_err("an entry outside the peer's buffers");
    match failed {
        Error::Range(ferry::RangeError::NotRegistered { index, .. }) => assert_eq!(index, bad),
        other => panic!("expected NotRegistered for entry {bad}, got {other}"),
    }
    // The link still works: the slices that started ended cleanly.
    let bytes = pattern(5, ENTRY);
    pair.source.write_at(0, &bytes).unwrap();
    pair.prefill
        .batch(&pair.peer)
        .write(&pair.source, 0, pair.remote, ENTRY as u64)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; ENTRY];
    pair.pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &bytes, "a write after the failed batch");
}

/// `write_entries` and `read_entries`: a list of entries added in one call moves exactly what
/// the same entries added one `write` or `read` at a time move, across slices, beside single
/// entries of the same batch; an empty list adds nothing; a bad entry in a list is named by
/// its index in the batch.
#[tokio::test]
async fn entries_added_as_a_list_land_as_if_added_one_by_one() {
    const ENTRY: usize = 64;
    let pair = Pair::new(ENTRY * SLICED, ENTRY * SLICED).await;
    let bytes = pattern(43, ENTRY * SLICED);
    pair.source.write_at(0, &bytes).unwrap();
    let entry = |index: usize| {
        (
            (index * ENTRY) as u64,
            pair.remote + (sliced_slot(index) * ENTRY) as u64,
            ENTRY as u64,
        )
    };
    // Entry 0 alone, then the rest as a list, then an empty list.
    let (offset, remote, len) = entry(0);
    let batch = pair
        .prefill
        .batch(&pair.peer)
        .write(&pair.source, offset, remote, len)
        .write_entries(&pair.source, (1..SLICED).map(entry))
        .write_entries(&pair.source, std::iter::empty());
    assert_eq!(batch.len(), SLICED);
    let done = batch.submit().unwrap().await.unwrap();
    assert_eq!(done.bytes, (ENTRY * SLICED) as u64);
    let mut landed = vec![0u8; ENTRY * SLICED];
    pair.pool.read_at(0, &mut landed).unwrap();
    for index in 0..SLICED {
        let at = sliced_slot(index) * ENTRY;
        assert_bytes_eq(
            &landed[at..at + ENTRY],
            &bytes[index * ENTRY..(index + 1) * ENTRY],
            &format!("entry {index} written from a list"),
        );
    }

    pair.source.write_at(0, &vec![0u8; ENTRY * SLICED]).unwrap();
    let entries: Vec<_> = (0..SLICED).map(entry).collect();
    pair.prefill
        .batch(&pair.peer)
        .read_entries(&pair.source, entries.iter().copied())
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut back = vec![0u8; ENTRY * SLICED];
    pair.source.read_at(0, &mut back).unwrap();
    assert_bytes_eq(&back, &bytes, "the entries read back from a list");

    // A list whose entry 100 (101st of the batch, after one single write) lies past every
    // buffer of the peer: the transfer fails naming index 101.
    let mut bad = entries.clone();
    bad[100].1 = pair.remote + (ENTRY * SLICED) as u64 + (1 << 30);
    let failed = pair
        .prefill
        .batch(&pair.peer)
        .write(&pair.source, offset, remote, len)
        .write_entries(&pair.source, bad)
        .submit()
        .unwrap()
        .await
        .expect_err("an entry of the list outside the peer's buffers");
    match failed {
        Error::Range(ferry::RangeError::NotRegistered { index, .. }) => assert_eq!(index, 101),
        other => panic!("expected NotRegistered for entry 101, got {other}"),
    }

    // A list from a second region after a write from the first: each entry moves from the
    // region its call named.
    let second = pair.prefill.allocate((ENTRY * 100) as u64).unwrap();
    let second_bytes = pattern(47, ENTRY * 100);
    second.write_at(0, &second_bytes).unwrap();
    let slot = |index: usize| pair.remote + (index * ENTRY) as u64;
    pair.prefill
        .batch(&pair.peer)
        .write(&pair.source, 0, slot(0), ENTRY as u64)
        .write_entries(
            &second,
            (0..100).map(|index| ((index * ENTRY) as u64, slot(index + 1), ENTRY as u64)),
        )
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; ENTRY * 101];
    pair.pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(
        &landed[..ENTRY],
        &bytes[..ENTRY],
        "the write from the first region",
    );
    assert_bytes_eq(
        &landed[ENTRY..],
        &second_bytes,
        "the list from the second region",
    );

    // A list whose region belongs to another engine is refused at submit, naming the list's
    // first entry.
    let other = engine().await;
    let foreign = other.allocate(4096).unwrap();
    let refused = pair
        .prefill
        .batch(&pair.peer)
        .write(&pair.source, 0, slot(0), ENTRY as u64)
        .write_entries(
            &foreign,
            (0..3).map(|index| ((index * ENTRY) as u64, slot(index), ENTRY as u64)),
        )
        .submit()
        .map(|_| ());
    match refused {
        Err(Error::Range(ferry::RangeError::ForeignRegion { index })) => assert_eq!(index, 1),
        other => panic!("expected ForeignRegion for entry 1, got {other:?}"),
    }
}

#[tokio::test]
async fn notification_arrives_only_after_its_data() {
    let pair = Pair::new(16 << 20, 16 << 20).await;
    let mut inbox = pair.decode.notifications().unwrap();
    for round in 0..4u64 {
        let bytes = pattern(round, 16 << 20);
        pair.source.write_at(0, &bytes).unwrap();
        let transfer = pair
            .prefill
            .batch(&pair.peer)
            .write(&pair.source, 0, pair.remote, 16 << 20)
            .notify(format!("req-{round}"))
            .submit()
            .unwrap();
        let note = inbox.recv().await.unwrap();
        // The data must already be there when the notification is in hand.
        let mut landed = vec![0u8; 16 << 20];
        pair.pool.read_at(0, &mut landed).unwrap();
        assert_bytes_eq(&landed, &bytes, &format!("round {round}"));
        assert_eq!(note.payload, format!("req-{round}").into_bytes());
        assert_eq!(note.from, pair.prefill.name());
        transfer.await.unwrap();
    }
}

#[tokio::test]
async fn standalone_notifications_keep_their_order() {
    let decode = engine().await;
    let mut inbox = decode.notifications().unwrap();
    let prefill = engine().await;
    let peer = prefill.connect(decode.name()).await.unwrap();
    for index in 0..200u32 {
        prefill.notify(&peer, index.to_le_bytes()).await.unwrap();
    }
    for index in 0..200u32 {
        let note = inbox.recv().await.unwrap();
        assert_eq!(note.payload, index.to_le_bytes());
    }
    assert!(
        decode.notifications().is_err(),
        "the stream can be taken once"
    );
}

#[tokio::test]
async fn a_polling_receiver_sees_nothing_then_the_notification_then_the_end() {
    let decode = engine().await;
    let mut inbox = decode.notifications().unwrap();
    assert!(matches!(inbox.try_recv(), Ok(None)));
    let prefill = engine().await;
    let peer = prefill.connect(decode.name()).await.unwrap();
    prefill.notify(&peer, "polled").await.unwrap();
    // The receiver acknowledges before it hands the notification over (so that a receiver
    // acting on it at once cannot cut the sender off): it arrives right after the ack.
    let mut note = None;
    for _ in 0..100 {
        note = inbox.try_recv().unwrap();
        if note.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let note = note.expect("delivered within a second of the ack");
    assert_eq!(note.payload, b"polled");
    drop(decode);
    let mut ended = false;
    for _ in 0..200 {
        match inbox.try_recv() {
            Err(Error::Shutdown { .. }) => {
                ended = true;
                break;
            }
            Ok(None) => tokio::time::sleep(Duration::from_millis(10)).await,
            Ok(Some(note)) => panic!("no more notifications were sent, got {note:?}"),
            Err(other) => panic!("expected the end of the stream, got {other}"),
        }
    }
    assert!(
        ended,
        "the stream did not end within 2 s of dropping the engine"
    );
}

#[tokio::test]
async fn memory_registered_after_connect_is_found_by_refetching() {
    let pair = Pair::new(4096, 4096).await;
    pair.source.write_at(0, &pattern(9, 4096)).unwrap();
    assert_eq!(pair.peer.buffers().len(), 1);
    let second = pair.decode.allocate(4096).unwrap();
    pair.prefill
        .batch(&pair.peer)
        .write(&pair.source, 0, second.addr(), 4096)
        .submit()
        .unwrap()
        .await
        .unwrap();
    assert_eq!(
        pair.peer.buffers().len(),
        2,
        "the cached descriptor was refreshed"
    );
    let mut landed = vec![0u8; 4096];
    second.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(9, 4096), "write into the new region");
}

#[tokio::test]
async fn engines_sharing_a_memory_store_find_each_other() {
    let store = MemoryStore::new();
    let decode = ferry::builder()
        .metadata(store.clone())
        .build()
        .await
        .unwrap();
    let pool = decode.allocate(8192).unwrap();
    decode.publish().await.unwrap();
    let prefill = ferry::builder().metadata(store).build().await.unwrap();
    let source = prefill.allocate(8192).unwrap();
    source.write_at(0, &pattern(3, 8192)).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    prefill
        .batch(&peer)
        .write(&source, 0, pool.addr(), 8192)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; 8192];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(
        &landed,
        &pattern(3, 8192),
        "write found through the memory store",
    );
}

#[test]
fn blocking_callers_need_no_runtime() {
    let decode = ferry::builder().build_blocking().unwrap();
    let pool = decode.allocate(1 << 20).unwrap();
    let mut inbox = decode.notifications().unwrap();
    let prefill = ferry::builder()
        .transfer_timeout(Duration::from_secs(10))
        .build_blocking()
        .unwrap();
    let source = prefill.allocate(1 << 20).unwrap();
    source.write_at(0, &pattern(11, 1 << 20)).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    let done = prefill
        .batch(&peer)
        .write(&source, 0, pool.addr(), 1 << 20)
        .notify("blocking")
        .submit_blocking()
        .unwrap();
    assert_eq!(done.bytes, 1 << 20);
    assert_eq!(inbox.recv_blocking().unwrap().unwrap().payload, b"blocking");
    prefill
        .batch(&peer)
        .notify("second")
        .submit_blocking()
        .unwrap();
    let note = inbox
        .recv_timeout_blocking(Duration::from_secs(10))
        .unwrap();
    assert_eq!(note.unwrap().payload, b"second");
    let nothing = inbox.recv_timeout_blocking(Duration::from_millis(50));
    assert!(matches!(nothing, Err(Error::Timeout { .. })), "{nothing:?}");
    prefill.notify_blocking(&peer, "alone").unwrap();
    let note = inbox
        .recv_timeout_blocking(Duration::from_secs(10))
        .unwrap();
    assert_eq!(note.unwrap().payload, b"alone");
    let mut landed = vec![0u8; 1 << 20];
    pool.read_at(0, &mut landed).unwrap();
    assert_bytes_eq(&landed, &pattern(11, 1 << 20), "blocking write");
}

/// Asserts that `outcome` is the blocking-call refusal naming `call` and the async `instead`.
fn assert_refused<T: std::fmt::Debug>(outcome: ferry::Result<T>, call: &str, instead: &str) {
    match outcome {
        Err(Error::ApiMisuse(message)) => assert!(
            message.contains(call) && message.contains(&format!("await {instead}")),
            "{message}"
        ),
        other => panic!("{call} on a runtime thread answered {other:?}"),
    }
}

#[tokio::test]
async fn blocking_calls_on_a_runtime_thread_refuse_instead_of_panicking() {
    let pair = Pair::new(4096, 4096).await;
    let mut inbox = pair.decode.notifications().unwrap();
    assert_refused(
        ferry::builder().build_blocking(),
        "EngineBuilder::build_blocking",
        "EngineBuilder::build",
    );
    assert_refused(
        pair.prefill.connect_blocking(pair.decode.name()),
        "Engine::connect_blocking",
        "Engine::connect",
    );
    assert_refused(
        pair.prefill.notify_blocking(&pair.peer, "refused"),
        "Engine::notify_blocking",
        "Engine::notify",
    );
    assert_refused(
        pair.prefill
            .batch(&pair.peer)
            .notify("refused")
            .submit_blocking(),
        "Batch::submit_blocking",
        "Batch::submit()",
    );
    assert_refused(
        inbox.recv_blocking(),
        "Notifications::recv_blocking",
        "Notifications::recv",
    );
    assert_refused(
        inbox.recv_timeout_blocking(Duration::from_millis(1)),
        "Notifications::recv_timeout_blocking",
        "Notifications::recv",
    );
    let transfer = pair
        .prefill
        .batch(&pair.peer)
        .notify("waited")
        .submit()
        .unwrap();
    assert_refused(transfer.wait(), "Transfer::wait", "the Transfer");
    let spinning = pair
        .prefill
        .batch(&pair.peer)
        .notify("spun")
        .submit()
        .unwrap();
    assert_refused(
        spinning.wait_spinning(Duration::from_millis(1)),
        "Transfer::wait_spinning",
        "the Transfer",
    );
    // Only the refused waits submitted anything, and their transfers went on without a waiter.
    let note = tokio::time::timeout(Duration::from_secs(10), inbox.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(note.payload, b"waited");
    let note = tokio::time::timeout(Duration::from_secs(10), inbox.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(note.payload, b"spun");
}

#[test]
fn a_spinning_wait_returns_the_completion_whether_or_not_the_spin_outlasts_the_transfer() {
    let decode = ferry::builder().build_blocking().unwrap();
    let pool = decode.allocate(1 << 20).unwrap();
    let prefill = ferry::builder().build_blocking().unwrap();
    let source = prefill.allocate(1 << 20).unwrap();
    let peer = prefill.connect_blocking(decode.name()).unwrap();
    for (round, spin) in [Duration::ZERO, Duration::from_millis(50)]
        .into_iter()
        .enumerate()
    {
        let bytes = vec![round as u8 + 1; 1 << 20];
        source.write_at(0, &bytes).unwrap();
        let done = prefill
            .batch(&peer)
            .write(&source, 0, pool.addr(), 1 << 20)
            .submit()
            .unwrap()
            .wait_spinning(spin)
            .unwrap();
        assert_eq!(done.bytes, 1 << 20);
        let mut landed = vec![0u8; 1 << 20];
        pool.read_at(0, &mut landed).unwrap();
        assert!(landed == bytes, "round {round}: the bytes did not land");
    }
}

#[tokio::test]
async fn notifications_on_one_host_take_shared_memory_and_tcp_where_the_peer_has_no_ring() {
    let pair = Pair::new(4096, 4096).await;
    let mut inbox = pair.decode.notifications().unwrap();
    assert_eq!(pair.peer.notifications_through(), None);
    // Sent at once while the first one still opens the ring: they keep their order.
    let sent: Vec<_> = (0..100u32)
        .map(|index| {
            pair.prefill
                .batch(&pair.peer)
                .notify(format!("burst {index}"))
                .submit()
                .unwrap()
        })
        .collect();
    for transfer in sent {
        transfer.await.unwrap();
    }
    for index in 0..100u32 {
        assert_eq!(
            inbox.recv().await.unwrap().payload,
            format!("burst {index}").into_bytes()
        );
    }
    for round in 0..50u32 {
        let bytes = pattern(u64::from(round), 4096);
        pair.source.write_at(0, &bytes).unwrap();
        pair.prefill
            .batch(&pair.peer)
            .write(&pair.source, 0, pair.remote, 4096)
            .notify(round.to_le_bytes())
            .submit()
            .unwrap()
            .await
            .unwrap();
        let note = inbox.recv().await.unwrap();
        assert_eq!(note.payload, round.to_le_bytes());
        assert_eq!(note.from, pair.prefill.name());
        let mut landed = vec![0u8; 4096];
        pair.pool.read_at(0, &mut landed).unwrap();
        assert_bytes_eq(&landed, &bytes, &format!("round {round}"));
    }
    assert_eq!(pair.peer.notifications_through(), Some("nvlink"));

    // An engine without the GPU links serves no fd socket, so nothing takes a ring there.
    let plain = ferry::Links::default()
        .gpu_links(false)
        .builder()
        .transfer_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let mut plain_inbox = plain.notifications().unwrap();
    let peer = pair.prefill.connect(plain.name()).await.unwrap();
    for index in 0..3u32 {
        pair.prefill
            .notify(&peer, index.to_le_bytes())
            .await
            .unwrap();
        assert_eq!(
            plain_inbox.recv().await.unwrap().payload,
            index.to_le_bytes()
        );
    }
    assert_eq!(peer.notifications_through(), Some("tcp"));
}
