//! Bad input from a caller gets a clear error before anything moves, and nothing is written.

mod common;

use common::{engine, pattern, Pair};
use ferry::{Error, RangeError, Side};
use ferry_core::{Refusal, RegistrationProblem};
use std::io::Write;

fn range_error(outcome: Result<impl std::fmt::Debug, Error>) -> RangeError {
    match outcome {
        Err(Error::Range(error)) => error,
        other => panic!("expected a range error, got {other:?}"),
    }
}

#[tokio::test]
async fn remote_range_outside_the_registration_is_refused_and_nothing_lands() {
    let pair = Pair::new(64 << 10, 64 << 10).await;
    pair.source.write_at(0, &pattern(1, 64 << 10)).unwrap();

    // One good entry, then one that runs 1 byte past the end: the whole batch is refused.
    let outcome = pair
        .prefill
        .batch(&pair.peer)
        .write(&pair.source, 0, pair.remote, 4096)
        .write(&pair.source, 0, pair.remote + (64 << 10) - 4095, 4096)
        .submit()
        .unwrap()
        .await;
    let error = range_error(outcome);
    assert_eq!(
        error,
        RangeError::NotRegistered {
            index: 1,
            side: Side::Remote,
            addr: pair.remote + (64 << 10) - 4095,
            len: 4096
        }
    );
    assert!(error.to_string().contains("entry 1"), "{error}");
    let mut landed = vec![0xffu8; 64 << 10];
    pair.pool.read_at(0, &mut landed).unwrap();
    assert!(
        landed.iter().all(|&byte| byte == 0),
        "nothing may be written"
    );

    // A read from outside is refused the same way.
    let outcome = pair
        .prefill
        .batch(&pair.peer)
        .read(&pair.source, 0, pair.remote - 1, 10)
        .submit()
        .unwrap()
        .await;
    assert!(matches!(
        range_error(outcome),
        RangeError::NotRegistered {
            side: Side::Remote,
            ..
        }
    ));
}

#[tokio::test]
async fn memory_deregistered_by_the_target_is_refused_by_the_target_itself() {
    let decode = engine().await;
    let mut backing = vec![0u8; 8192];
    // SAFETY: `backing` outlives the region, which is dropped below before `backing` is read.
    let region = unsafe { decode.register(backing.as_mut_ptr(), backing.len() as u64) }.unwrap();
    let prefill = engine().await;
    let source = prefill.allocate(8192).unwrap();
    source.write_at(0, &[9u8; 8192]).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let remote = peer.buffers()[0].addr;
    drop(region);

    // The prefill side's cached descriptor still lists the buffer; the target must refuse.
    let outcome = prefill
        .batch(&peer)
        .write(&source, 0, remote, 8192)
        .submit()
        .unwrap()
        .await;
    match outcome {
        Err(Error::Rejected { reason, .. }) => assert_eq!(
            reason,
            Refusal::NotRegistered {
                entry: Some(0),
                addr: remote,
                len: 8192
            }
        ),
        other => panic!("expected the target to refuse, got {other:?}"),
    }
    assert!(
        backing.iter().all(|&byte| byte == 0),
        "nothing may be written"
    );
    // And the write-many path (small entries packed into one frame) refuses the same way.
    let packed = prefill
        .batch(&peer)
        .write(&source, 0, remote, 100)
        .write(&source, 200, remote + 200, 100)
        .submit()
        .unwrap()
        .await;
    assert!(
        matches!(
            &packed,
            Err(Error::Rejected {
                reason: Refusal::NotRegistered { entry: Some(0), .. },
                ..
            })
        ),
        "{packed:?}"
    );
    assert!(
        backing.iter().all(|&byte| byte == 0),
        "nothing may be written"
    );
}

#[tokio::test]
async fn local_range_past_its_region_is_refused_at_submit() {
    let pair = Pair::new(8192, 4096).await;
    let error = range_error(
        pair.prefill
            .batch(&pair.peer)
            .write(&pair.source, 4000, pair.remote, 97)
            .submit(),
    );
    assert_eq!(
        error,
        RangeError::PastRegionEnd {
            index: 0,
            offset: 4000,
            len: 97,
            region_len: 4096
        }
    );
    let error = range_error(
        pair.prefill
            .batch(&pair.peer)
            .read(&pair.source, u64::MAX, pair.remote, 2)
            .submit(),
    );
    assert!(matches!(error, RangeError::PastRegionEnd { .. }));
}

#[tokio::test]
async fn region_write_at_and_read_at_past_the_end_are_refused_in_region_terms() {
    let pair = Pair::new(8192, 4096).await;
    pair.source.write_at(0, &pattern(3, 4096)).unwrap();
    let error = range_error(pair.source.write_at(4000, &[0xaa; 97]));
    assert_eq!(
        error,
        RangeError::OutsideRegion {
            offset: 4000,
            len: 97,
            region_len: 4096
        }
    );
    let message = error.to_string();
    assert!(
        message.contains("offset 4000 + length 97") && message.contains("4096-byte region"),
        "{message}"
    );
    assert!(!message.contains("entry"), "{message}");
    let mut back = vec![0u8; 4096];
    pair.source.read_at(0, &mut back).unwrap();
    assert_eq!(back, pattern(3, 4096), "nothing may be written");

    let mut two = [0u8; 2];
    assert_eq!(
        range_error(pair.source.read_at(u64::MAX, &mut two)),
        RangeError::OutsideRegion {
            offset: u64::MAX,
            len: 2,
            region_len: 4096
        }
    );
}

#[tokio::test]
async fn a_region_dropped_before_submit_is_refused() {
    let pair = Pair::new(8192, 4096).await;
    let batch = pair
        .prefill
        .batch(&pair.peer)
        .write(&pair.source, 0, pair.remote, 10);
    drop(pair.source);
    let error = range_error(batch.submit());
    assert!(
        matches!(
            error,
            RangeError::NotRegistered {
                index: 0,
                side: Side::Local,
                ..
            }
        ),
        "{error}"
    );
}

#[tokio::test]
async fn a_region_of_another_engine_is_refused() {
    let decode = engine().await;
    let _pool = decode.allocate(8192).unwrap();
    let prefill = engine().await;
    let other = engine().await;
    let foreign = other.allocate(4096).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let remote = peer.buffers()[0].addr;
    let error = range_error(prefill.batch(&peer).write(&foreign, 0, remote, 10).submit());
    assert_eq!(error, RangeError::ForeignRegion { index: 0 });
}

#[tokio::test]
async fn zero_lengths_and_empty_batches_are_refused() {
    let pair = Pair::new(8192, 4096).await;
    let error = range_error(
        pair.prefill
            .batch(&pair.peer)
            .write(&pair.source, 0, pair.remote, 8)
            .write(&pair.source, 0, pair.remote, 0)
            .submit(),
    );
    assert_eq!(error, RangeError::ZeroLength { index: 1 });
    assert!(matches!(
        pair.prefill.batch(&pair.peer).submit(),
        Err(Error::ApiMisuse(_))
    ));
}

#[tokio::test]
async fn empty_null_and_wrapping_registrations_are_refused_as_registrations() {
    let engine = engine().await;
    // An allocation of nothing is the caller's slip, named as such (there is no buffer at 0x0).
    let empty = engine.allocate(0).map(|_| ()).unwrap_err();
    assert!(matches!(empty, Error::ApiMisuse(_)), "{empty:?}");
    assert_eq!(
        empty.to_string(),
        "Engine::allocate was asked for 0 bytes; ask for at least one byte"
    );
    let mut byte = 0u8;
    let addr = &mut byte as *mut u8 as u64;
    // SAFETY: zero bytes are registered; the call must refuse before touching anything.
    let outcome = unsafe { engine.register(&mut byte, 0) }.map(|_| ());
    assert!(
        matches!(
            outcome,
            Err(Error::Registration { addr: at, len: 0, problem: RegistrationProblem::Empty }) if at == addr
        ),
        "{outcome:?}"
    );
    // SAFETY: a null pointer; the call must refuse before touching anything.
    let null = unsafe { engine.register(std::ptr::null_mut(), 8) }.map(|_| ());
    assert!(
        matches!(
            null,
            Err(Error::Registration {
                problem: RegistrationProblem::Null,
                ..
            })
        ),
        "{null:?}"
    );
    // SAFETY: the range wraps past the end of the address space; refused before any use.
    let wraps = unsafe { engine.register(&mut byte, u64::MAX) }.map(|_| ());
    assert!(
        matches!(
            wraps,
            Err(Error::Registration {
                problem: RegistrationProblem::Wraps,
                ..
            })
        ),
        "{wraps:?}"
    );
    // SAFETY: page zero is never mapped; the call must refuse before touching it.
    let unmapped = unsafe { engine.register(0x1000 as *mut u8, 8192) }.map(|_| ());
    assert!(
        matches!(
            unmapped,
            Err(Error::Registration {
                problem: RegistrationProblem::NotMapped { first: 0x1000 },
                ..
            })
        ),
        "{unmapped:?}"
    );
    // A real buffer with its length overstated by far runs into unmapped memory.
    let mut heap = vec![0u8; 1 << 16];
    let start = heap.as_mut_ptr();
    // SAFETY: the range past the buffer is refused before anything touches it.
    let overstated = unsafe { engine.register(start, 1 << 46) }.map(|_| ());
    assert!(
        matches!(
            overstated,
            Err(Error::Registration {
                problem: RegistrationProblem::NotMapped { first },
                ..
            }) if first >= start as u64 + (1 << 16)
        ),
        "{overstated:?}"
    );
    // More than the address space holds is refused before any driver call.
    let vmm = engine.allocate_device_vmm(0, u64::MAX, 2).map(|_| ());
    assert!(
        matches!(
            vmm,
            Err(Error::OutOfMemory {
                what: "Engine::allocate_device_vmm",
                ..
            })
        ),
        "{vmm:?}"
    );
}

#[tokio::test]
async fn a_peer_refusing_one_entry_names_its_place_in_the_batch() {
    let decode = engine().await;
    let kept = decode.allocate(1 << 20).unwrap();
    let dropped = decode.allocate(1 << 20).unwrap();
    let prefill = engine().await;
    let source = prefill.allocate(1 << 20).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let gone = dropped.addr();
    drop(dropped);

    // Entry 0 is a frame of its own; entries 1 and 2 are packed into one write-many frame, in
    // which the refused entry 2 is the second: the error names its place in the batch.
    let outcome = prefill
        .batch(&peer)
        .write(&source, 0, kept.addr(), 512 << 10)
        .write(&source, 0, kept.addr() + (600 << 10), 100)
        .write(&source, 0, gone, 100)
        .submit()
        .unwrap()
        .await;
    match outcome {
        Err(error @ Error::Rejected { .. }) => {
            let Error::Rejected { reason, .. } = &error else {
                unreachable!()
            };
            assert_eq!(
                *reason,
                Refusal::NotRegistered {
                    entry: Some(2),
                    addr: gone,
                    len: 100
                }
            );
            let message = error.to_string();
            assert!(
                message.contains(&format!(
                    "batch entry 2: its range {gone:#x}..+100 is not inside one of its registered regions"
                )),
                "{message}"
            );
        }
        other => panic!("expected the peer to refuse entry 2, got {other:?}"),
    }
}

#[tokio::test]
async fn overlapping_registrations_are_refused_and_adjacent_ones_accepted() {
    let engine = engine().await;
    let mut backing = vec![0u8; 3 * 4096];
    let base = backing.as_mut_ptr();
    // SAFETY: every range lies inside `backing`, which outlives all regions (dropped first).
    unsafe {
        let middle = engine.register(base.add(4096), 4096).unwrap();
        let error = engine.register(base.add(4095), 2).unwrap_err();
        assert!(
            matches!(error, Error::Range(RangeError::Overlap { .. })),
            "{error}"
        );
        assert!(error.to_string().contains("overlaps"), "{error}");
        assert!(engine.register(base.add(8191), 4096).is_err());
        assert!(
            engine.register(base.add(4096), 4096).is_err(),
            "the same range twice"
        );
        let before = engine.register(base, 4096).unwrap();
        let after = engine.register(base.add(8192), 4096).unwrap();
        assert_eq!(engine.descriptor().buffers.len(), 3);
        drop((before, middle, after));
    }
    assert!(
        engine.descriptor().buffers.is_empty(),
        "dropping a region deregisters it"
    );
}

#[tokio::test]
async fn oversized_notifications_are_refused() {
    let decode = engine().await;
    let prefill = engine().await;
    let peer = prefill.connect(decode.name()).await.unwrap();
    let payload = vec![0u8; ferry::MAX_NOTIFICATION_BYTES + 1];
    assert!(matches!(
        prefill.notify(&peer, payload.clone()).await,
        Err(Error::ApiMisuse(_))
    ));
    assert!(matches!(
        prefill.batch(&peer).notify(payload).submit(),
        Err(Error::ApiMisuse(_))
    ));
}

#[tokio::test]
async fn unknown_names_and_silent_ports_are_unreachable() {
    let prefill = engine().await;
    for name in ["no-such-host.invalid:1", "not a name", "127.0.0.1:1"] {
        match prefill.connect(name).await {
            Err(Error::Unreachable { peer, reason }) => {
                assert_eq!(peer, name);
                assert!(!reason.is_empty());
            }
            other => panic!("{name}: expected unreachable, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_listener_that_is_not_ferry_is_named_as_such() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
    });
    let prefill = engine().await;
    let error = prefill.connect(&address).await.unwrap_err();
    assert!(matches!(error, Error::Unreachable { .. }), "{error}");
    assert!(
        error.to_string().contains(
            "it answered like an HTTP server (\"HTTP\"), not a ferry engine; check the port"
        ),
        "{error}"
    );
    server.join().unwrap();
}

#[tokio::test]
async fn a_read_into_bytes_another_entry_uses_is_refused_at_submit() {
    let pair = Pair::new(3 * 4096, 8192).await;
    let (prefill, peer, source, remote) = (&pair.prefill, &pair.peer, &pair.source, pair.remote);
    let racing = prefill
        .batch(peer)
        .write(source, 0, remote, 4096)
        .read(source, 4000, remote + 4096, 100)
        .submit();
    match racing {
        Err(Error::ApiMisuse(reason)) => assert!(reason.contains("entry 1"), "{reason}"),
        other => panic!("expected the overlapping read to be refused, got {other:?}"),
    }
    // Writes may share source bytes, and reads into disjoint bytes are fine.
    prefill
        .batch(peer)
        .write(source, 0, remote, 4096)
        .write(source, 0, remote + 4096, 4096)
        .read(source, 4096, remote + 8192, 4096)
        .submit()
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_large_read_that_races_is_checked_while_it_moves_and_fails_its_transfer() {
    large_read_race(5000).await;
}

#[tokio::test]
async fn a_read_large_enough_to_be_checked_on_its_own_thread_that_races_fails_its_transfer() {
    large_read_race(20_000).await;
}

/// A batch of `entries` reads of 64 bytes (checked while it moves, on the submitting thread
/// or on one of its own), once with entry 4321 racing entry 17 and once a block copy reading
/// into local block 3 twice: both fail their transfer naming the entry; then the same without
/// a race moves every byte.
async fn large_read_race(entries: u64) {
    let pair = Pair::new(entries as usize * 64, entries as usize * 64).await;
    let (prefill, peer, source, remote) = (&pair.prefill, &pair.peer, &pair.source, pair.remote);
    // Entry 4321 reads into the bytes entry 17 reads into.
    let mut racing = prefill.batch(peer);
    for index in 0..entries {
        let local = if index == 4321 { 17 } else { index };
        racing = racing.read(source, local * 64, remote + index * 64, 64);
    }
    let transfer = racing
        .submit()
        .expect("a large batch is checked while it moves");
    match transfer.await {
        Err(Error::ApiMisuse(reason)) => assert!(reason.contains("entry 4321"), "{reason}"),
        other => panic!("expected the racing read to fail its transfer, got {other:?}"),
    }
    let ids: Vec<u32> = (0..entries as u32).collect();
    let mut twice = ids.clone();
    twice[4999] = 3;
    let copy = ferry::BlockCopy::packed(64, twice, ids.clone()).pool(source, &peer.buffers()[0]);
    let transfer = prefill
        .batch(peer)
        .read_blocks(copy)
        .submit()
        .expect("a large block copy is checked while it moves");
    match transfer.await {
        Err(Error::Range(error)) => assert!(
            error
                .to_string()
                .contains("local block id 3 at index 4999 is read into twice"),
            "{error}"
        ),
        other => panic!("expected the repeated block to fail its transfer, got {other:?}"),
    }
    // Without a race both move every byte.
    pair.pool
        .write_at(0, &pattern(5, entries as usize * 64))
        .unwrap();
    let copy = ferry::BlockCopy::packed(64, ids.clone(), ids).pool(source, &peer.buffers()[0]);
    prefill
        .batch(peer)
        .read_blocks(copy)
        .submit()
        .unwrap()
        .await
        .unwrap();
    let mut landed = vec![0u8; entries as usize * 64];
    source.read_at(0, &mut landed).unwrap();
    common::assert_bytes_eq(&landed, &pattern(5, entries as usize * 64), "the read");
}

#[tokio::test]
async fn signals_that_cannot_be_honoured_are_refused() {
    let pair = Pair::new(1 << 16, 1 << 16).await;
    let misaligned = pair
        .prefill
        .batch(&pair.peer)
        .write(&pair.source, 0, pair.remote, 64)
        .signal(pair.remote + 4098, 1)
        .submit();
    assert!(
        matches!(&misaligned, Err(Error::ApiMisuse(text)) if text.contains("4-byte aligned")),
        "{misaligned:?}"
    );
    let alone = pair
        .prefill
        .batch(&pair.peer)
        .signal(pair.remote + 4096, 1)
        .notify(b"ready".to_vec())
        .submit();
    assert!(
        matches!(&alone, Err(Error::ApiMisuse(text)) if text.contains("needs data")),
        "{alone:?}"
    );
    // Host memory has no GPU to write the word: the data lands, the signal is refused.
    let host = pair
        .prefill
        .batch(&pair.peer)
        .write(&pair.source, 0, pair.remote, 64)
        .signal(pair.remote + 4096, 1)
        .submit()
        .unwrap()
        .await;
    assert!(
        matches!(&host, Err(Error::ApiMisuse(text)) if text.contains("rely on the notification")),
        "{host:?}"
    );
}
