//! The fd-passing socket's tests: both ends over real abstract sockets.

use super::client::connect;
use super::server::*;
use super::*;
use ferry_core::auth::Secret;
use ferry_core::InboxHandle;
use ferry_core::Notifications;
use std::io::Read;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn secret(text: &str) -> Secret {
    Secret::new(format!("{text}-0123456789abcdef").into_bytes()).unwrap()
}

fn server(secret: Option<Secret>) -> FdServer {
    server_with_inbox(secret, 16).0
}

/// A server whose message rings deliver into an inbox of `slots` notifications.
fn server_with_inbox(secret: Option<Secret>, slots: usize) -> (FdServer, Notifications) {
    server_with_rings(secret, slots, MAX_RINGS)
}

/// [`server_with_inbox`], reading at most `max_rings` rings at once.
fn server_with_rings(
    secret: Option<Secret>,
    slots: usize,
    max_rings: usize,
) -> (FdServer, Notifications) {
    let owner = InstanceId::random().unwrap();
    let runtime = tokio::runtime::Handle::current();
    let (inbox, notifications) = InboxHandle::standalone(slots, 64 << 20, runtime.clone());
    let server = FdServer::start_with_rings(
        owner,
        secret,
        &runtime,
        inbox,
        crate::NvlinkConfig::default(),
        max_rings,
    )
    .unwrap();
    (server, notifications)
}

/// The next notification, waiting up to five seconds.
async fn next(notifications: &mut Notifications) -> ferry_core::Notification {
    tokio::time::timeout(Duration::from_secs(5), notifications.recv())
        .await
        .expect("no notification within 5 s")
        .expect("the inbox closed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_through_a_ring_arrive_in_order_also_after_the_reader_slept() {
    let (server, mut inbox) = server_with_inbox(Some(secret("a")), 64);
    let sender = open_messages(&server.address(), "decode", "prefill:1", Some(&secret("a")))
        .await
        .unwrap();
    for round in 0..3u8 {
        for index in 0..20u8 {
            let payload = vec![round ^ index; usize::from(index) * 700];
            sender.send(&payload).await.unwrap();
            let note = next(&mut inbox).await;
            assert_eq!(note.from, "prefill:1");
            assert_eq!(note.payload, payload);
        }
        // Long enough for the reader to stop polling and sleep on its futex word.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // The largest notification, many at once: more than the ring holds, so senders
    // wait for room as the reader takes them.
    let big: Vec<Vec<u8>> = (0..40u8)
        .map(|index| vec![index; ferry_core::MAX_NOTIFICATION_BYTES])
        .collect();
    let sends = futures::future::join_all(big.iter().map(|payload| sender.send(payload)));
    let (sent, received) = tokio::join!(sends, async {
        let mut received = Vec::new();
        for _ in 0..big.len() {
            received.push(next(&mut inbox).await.payload);
        }
        received
    });
    assert!(sent.iter().all(Result::is_ok), "{sent:?}");
    assert_eq!(received, big);
    assert_eq!(sender.closed(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_inbox_refuses_a_message_and_the_sender_hears_why() {
    let (server, mut inbox) = server_with_inbox(None, 2);
    let sender = open_messages(&server.address(), "decode", "prefill:1", None)
        .await
        .unwrap();
    sender.send(b"one").await.unwrap();
    sender.send(b"two").await.unwrap();
    let error = sender.send(b"three").await.unwrap_err();
    assert!(
        matches!(&error, ferry_core::Error::Rejected { reason, .. } if reason.to_string().contains("inbox is full")),
        "{error}"
    );
    assert_eq!(next(&mut inbox).await.payload, b"one");
    sender.send(b"four").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"two");
    assert_eq!(next(&mut inbox).await.payload, b"four");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_without_the_secret_or_from_a_stopped_server_is_refused() {
    let (server, _inbox) = server_with_inbox(Some(secret("a")), 4);
    let error = open_messages(&server.address(), "decode", "prefill:1", None)
        .await
        .unwrap_err();
    assert!(matches!(error, ImportError::Refused { .. }), "{error}");
    let sender = open_messages(&server.address(), "decode", "prefill:1", Some(&secret("a")))
        .await
        .unwrap();
    let address = server.address();
    drop(server);
    // The reader notices the engine stopped at its next look and closes the ring.
    let error = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match sender.send(b"late").await {
                Ok(()) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(error) => break error,
            }
        }
    })
    .await
    .expect("the ring stayed open after its engine stopped");
    assert!(
        matches!(error, ferry_core::Error::PeerGone { .. }),
        "{error}"
    );
    assert!(sender.closed().is_some());
    // The listener closes at the next connection it takes, which it then drops.
    let error = open_messages(&address, "decode", "prefill:1", Some(&secret("a"))).await;
    assert!(error.is_err(), "a stopped server took a ring");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_ring_says_so_and_takes_nothing_more() {
    let (server, mut inbox) = server_with_inbox(None, 16);
    let sender = open_messages(&server.address(), "decode", "prefill:1", None)
        .await
        .unwrap();
    sender.send(b"before").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"before");
    sender.close();
    assert!(sender.closed().is_some());
    let error = sender.send(b"after").await.unwrap_err();
    assert!(
        matches!(error, ferry_core::Error::PeerGone { .. }),
        "{error}"
    );
    let nothing = tokio::time::timeout(Duration::from_millis(200), inbox.recv()).await;
    assert!(nothing.is_err(), "a closed ring delivered {nothing:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_left_for_the_gpu_arrives_once_its_position_is_stored_and_keeps_its_place() {
    let (server, mut inbox) = server_with_inbox(None, 16);
    let sender = open_messages(&server.address(), "decode", "prefill:1", None)
        .await
        .unwrap();
    sender.send(b"first").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"first");
    let unpublished = sender.write_unpublished(b"data landed").unwrap();
    assert!(
        sender.write_unpublished(b"another").is_none(),
        "a second record was written while the first waits for its GPU"
    );
    let (later, held) = tokio::join!(sender.send(b"later"), async {
        let early = tokio::time::timeout(Duration::from_millis(150), inbox.recv()).await;
        assert!(
            early.is_err(),
            "delivered before its position was stored: {early:?}"
        );
        sender.store_position(unpublished.position());
        let held = next(&mut inbox).await.payload;
        unpublished.published().await.unwrap();
        held
    });
    later.unwrap();
    assert_eq!(held, b"data landed");
    assert_eq!(next(&mut inbox).await.payload, b"later");
    assert_eq!(sender.closed(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawn_record_is_never_delivered_and_an_abandoned_one_closes_the_ring() {
    let (server, mut inbox) = server_with_inbox(None, 16);
    let sender = open_messages(&server.address(), "decode", "prefill:1", None)
        .await
        .unwrap();
    let withdrawn = sender.write_unpublished(b"never queued").unwrap();
    let position = withdrawn.position();
    withdrawn.withdraw();
    sender.send(b"next").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"next");
    let abandoned = sender.write_unpublished(b"copies failed").unwrap();
    assert!(abandoned.position() > position);
    let stored = abandoned.position();
    abandoned.abandon("an injected failure");
    let reason = sender
        .closed()
        .expect("an abandoned record leaves the ring open");
    assert!(reason.contains("an injected failure"), "{reason}");
    // A GPU store that still ran publishes nothing the reader delivers.
    sender.store_position(stored);
    let nothing = tokio::time::timeout(Duration::from_millis(200), inbox.recv()).await;
    assert!(nothing.is_err(), "a closed ring delivered {nothing:?}");
    assert!(matches!(
        sender.send(b"after").await,
        Err(ferry_core::Error::PeerGone { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_left_for_the_gpu_and_dropped_unsettled_closes_the_ring() {
    let (server, mut inbox) = server_with_inbox(None, 16);
    let sender = open_messages(&server.address(), "decode", "prefill:1", None)
        .await
        .unwrap();
    let dropped = sender.write_unpublished(b"given up").unwrap();
    let position = dropped.position();
    drop(dropped);
    let reason = sender.closed().expect("the ring stayed open");
    assert!(reason.contains("dropped before its copies"), "{reason}");
    sender.store_position(position);
    let nothing = tokio::time::timeout(Duration::from_millis(200), inbox.recv()).await;
    assert!(nothing.is_err(), "a closed ring delivered {nothing:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_that_could_still_shrink_is_refused() {
    let (server, _inbox) = server_with_inbox(None, 4);
    let mut stream = connect(&server.address(), None, OPEN_MESSAGES)
        .await
        .unwrap();
    stream.write_u16_le(4).await.unwrap();
    stream.write_all(b"evil").await.unwrap();
    let fd = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 1 << 21).unwrap();
    send_fds(&stream, &[fd]).await.unwrap();
    assert_eq!(stream.read_u8().await.unwrap(), 1);
    let mut reason = String::new();
    stream.read_to_string(&mut reason).await.unwrap();
    assert!(reason.contains("not sealed"), "{reason}");
}

#[tokio::test]
async fn a_server_with_a_secret_refuses_a_client_without_one_and_says_so() {
    let server = server(Some(secret("a")));
    let error = fetch_fds(&server.address(), 0x1000, 1, None)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ImportError::Refused { reason } if reason.contains("requires a shared secret")),
        "{error}"
    );
}

#[tokio::test]
async fn secrets_that_differ_or_are_missing_on_the_server_fail_the_handshake() {
    let server_a = server(Some(secret("a")));
    let error = fetch_fds(&server_a.address(), 0x1000, 1, Some(&secret("b")))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            ImportError::Auth {
                reason: AuthFailure::PeerProofMismatch,
                ..
            }
        ),
        "{error}"
    );
    let open = server(None);
    let error = fetch_fds(&open.address(), 0x1000, 1, Some(&secret("a")))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            ImportError::Auth {
                reason: AuthFailure::PeerHasNoSecret,
                ..
            }
        ),
        "{error}"
    );
}

#[tokio::test]
async fn a_share_is_served_until_its_guard_drops() {
    let server = server(Some(secret("a")));
    let guard = server.share(
        0x1000,
        Share {
            ordinal: 0,
            handles: Vec::new(),
        },
    );
    let key = secret("a");
    let address = server.address();
    let asked = || fetch_fds(&address, 0x1000, 1, Some(&key));
    // Registered: the server tries to export it (and, on a machine without a GPU, says
    // why it could not), instead of not knowing the address.
    let error = asked().await.unwrap_err();
    assert!(!error.to_string().contains("no VMM region"), "{error}");
    drop(guard);
    let error = asked().await.unwrap_err();
    assert!(
        matches!(&error, ImportError::Refused { reason } if reason.starts_with("no VMM region is registered at 0x1000;")),
        "{error}"
    );
}

/// A stand-in fd server on `listener`: takes one unauthenticated [`FETCH_FDS`] request for
/// `region` and answers with `count` pipes whose write ends tell them apart (descriptor `i`
/// carries the byte `i % 251`).
pub(super) fn serve_pipes(
    listener: std::os::unix::net::UnixListener,
    region: u64,
    count: usize,
) -> tokio::task::JoinHandle<()> {
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::UnixListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        assert_eq!(
            stream.read_u8().await.unwrap(),
            0,
            "no secret, no handshake"
        );
        assert_eq!(stream.read_u8().await.unwrap(), FETCH_FDS);
        assert_eq!(stream.read_u64_le().await.unwrap(), region);
        let mut readers = Vec::new();
        for index in 0..count {
            let (reader, mut writer) = std::io::pipe().unwrap();
            std::io::Write::write_all(&mut writer, &[(index % 251) as u8]).unwrap();
            readers.push(OwnedFd::from(reader));
        }
        send_fds(&stream, &readers).await.unwrap();
    })
}

/// The byte each of [`serve_pipes`]'s descriptors carries, in the order they arrived.
pub(super) fn pipe_marks(fds: Vec<OwnedFd>) -> Vec<u8> {
    fds.into_iter()
        .map(|fd| {
            let mut byte = [0u8; 1];
            std::fs::File::from(fd).read_exact(&mut byte).unwrap();
            byte[0]
        })
        .collect()
}

#[tokio::test]
async fn more_descriptors_than_one_message_carries_arrive_in_order() {
    let name = fd_socket_name(InstanceId::random().unwrap());
    let listener = std::os::unix::net::UnixListener::bind_addr(
        &SocketAddr::from_abstract_name(name.as_bytes()).unwrap(),
    )
    .unwrap();
    let count = FDS_PER_MESSAGE + 47;
    let serving = serve_pipes(listener, 0x1000, count);
    let fds = fetch_fds(&FdSocket::new(name, None), 0x1000, count, None)
        .await
        .unwrap();
    serving.await.unwrap();
    assert_eq!(fds.len(), count);
    for (index, mark) in pipe_marks(fds).into_iter().enumerate() {
        assert_eq!(mark, (index % 251) as u8, "descriptor {index} out of order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_silent_connections_is_closed_past_the_cap_and_a_real_request_goes_on() {
    const FLOOD: usize = 3 * MAX_SERVING;
    let (server, mut inbox) = server_with_inbox(None, 4);
    let address = SocketAddr::from_abstract_name(server.name().as_bytes()).unwrap();
    let mut flood: Vec<std::os::unix::net::UnixStream> = (0..FLOOD)
        .map(|_| std::os::unix::net::UnixStream::connect_addr(&address).unwrap())
        .collect();
    // Those past the cap are closed as they arrive: their reads end at once.
    let closed = tokio::task::spawn_blocking(move || {
        let mut closed = 0;
        for stream in &mut flood {
            stream
                .set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            if matches!(stream.read(&mut [0u8; 1]), Ok(0)) {
                closed += 1;
            }
        }
        (closed, flood)
    });
    let (closed, flood) = closed.await.unwrap();
    assert!(
        closed >= FLOOD - MAX_SERVING,
        "only {closed} of {FLOOD} connections were closed"
    );
    // Once the flood goes away, a real client is served.
    drop(flood);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sender = open_messages(&server.address(), "decode", "prefill:1", None)
        .await
        .unwrap();
    sender.send(b"after the flood").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"after the flood");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rings_past_the_limit_are_refused_and_one_that_ends_makes_room() {
    let (server, mut inbox) = server_with_rings(None, 16, 3);
    let mut senders = Vec::new();
    for index in 0..3 {
        let name = format!("prefill:{index}");
        senders.push(
            open_messages(&server.address(), "decode", &name, None)
                .await
                .unwrap(),
        );
    }
    let refused = open_messages(&server.address(), "decode", "prefill:3", None).await;
    assert!(
        matches!(&refused, Err(ImportError::Refused { reason }) if reason.contains("maximum of 3 message rings")),
        "{refused:?}"
    );
    for sender in &senders {
        sender.send(b"still read").await.unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"still read");
    }
    // A ring whose sender goes away ends, and its place is free again.
    senders.pop().unwrap().close();
    let mut reopened = None;
    for _ in 0..50 {
        match open_messages(&server.address(), "decode", "prefill:4", None).await {
            Ok(sender) => {
                reopened = Some(sender);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let reopened = reopened.expect("a ring that ended makes room for another");
    reopened.send(b"in its place").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"in its place");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_rings_are_read_by_two_threads_also_after_they_slept() {
    let rings = 200;
    let (server, mut inbox) = server_with_rings(None, 2 * rings, 256);
    let mut senders = Vec::new();
    for index in 0..rings {
        let name = format!("prefill:{index}");
        senders.push(
            open_messages(&server.address(), "decode", &name, None)
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        server.readers.threads(),
        rings.div_ceil(crate::messages::RINGS_PER_THREAD)
    );
    for round in 0..2 {
        let sends = senders
            .iter()
            .enumerate()
            .map(|(index, sender)| async move {
                sender.send(format!("{round}:{index}").as_bytes()).await
            });
        let sent = futures::future::join_all(sends).await;
        assert!(sent.iter().all(Result::is_ok), "{sent:?}");
        let mut received = std::collections::HashSet::new();
        for _ in 0..rings {
            let note = next(&mut inbox).await;
            let index = note.from.strip_prefix("prefill:").unwrap().to_owned();
            assert_eq!(note.payload, format!("{round}:{index}").into_bytes());
            received.insert(index);
        }
        assert_eq!(received.len(), rings);
        // Long enough for both threads to stop polling and sleep on their rings' words.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // Woken by the sender, not found at the end of a nap (100 ms): five wakes in a row
    // each well under a nap.
    for wake in 0..5 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let started = std::time::Instant::now();
        senders[rings - 1 - wake]
            .send(b"wakes a sleeping thread")
            .await
            .unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"wakes a sleeping thread");
        assert!(
            started.elapsed() < Duration::from_millis(40),
            "a sleeping thread took {:?} to wake",
            started.elapsed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_whose_sender_left_makes_room_while_another_keeps_its_thread_busy() {
    let (server, mut inbox) = server_with_rings(None, 1 << 16, 2);
    let busy = open_messages(&server.address(), "decode", "prefill:busy", None)
        .await
        .unwrap();
    let leaving = open_messages(&server.address(), "decode", "prefill:leaving", None)
        .await
        .unwrap();
    leaving.close();
    drop(leaving);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sending = {
        let stop = std::sync::Arc::clone(&stop);
        tokio::spawn(async move {
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                busy.send(b"busy").await.unwrap();
                sent += 1;
            }
            sent
        })
    };
    let draining = tokio::spawn(async move {
        let mut taken = 0u64;
        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(500), inbox.recv()).await
        {
            taken += 1;
        }
        taken
    });
    let mut reopened = None;
    for _ in 0..40 {
        match open_messages(&server.address(), "decode", "prefill:next", None).await {
            Ok(sender) => {
                reopened = Some(sender);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = sending.await.unwrap();
    assert!(
        reopened.is_some(),
        "the ring that ended still held its place while the other kept the thread busy"
    );
    assert!(sent > 10, "only {sent} messages kept the thread busy");
    drop(reopened);
    assert!(draining.await.unwrap() >= sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_handed_to_a_sleeping_thread_is_read_at_once() {
    let (server, mut inbox) = server_with_inbox(None, 64);
    let first = open_messages(&server.address(), "decode", "prefill:first", None)
        .await
        .unwrap();
    first.send(b"first").await.unwrap();
    assert_eq!(next(&mut inbox).await.payload, b"first");
    // Each time the thread has gone to sleep on its rings' words: the new ring wakes it, not
    // the end of its nap (100 ms).
    let mut later = Vec::new();
    for index in 0..4 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let sender = open_messages(
            &server.address(),
            "decode",
            &format!("prefill:{index}"),
            None,
        )
        .await
        .unwrap();
        let started = std::time::Instant::now();
        sender.send(b"to a new ring").await.unwrap();
        assert_eq!(next(&mut inbox).await.payload, b"to a new ring");
        assert!(
            started.elapsed() < Duration::from_millis(40),
            "a new ring was read {:?} after its first message",
            started.elapsed()
        );
        later.push(sender);
    }
    assert_eq!(server.readers.threads(), 1);
}

/// The refusal `open_staging` met, or a panic naming what it got instead.
async fn staging_refusal(server: &FdServer, buffer: u64, secret: Option<&Secret>) -> String {
    match open_staging(&server.address(), buffer, 256 << 20, secret).await {
        Err(ImportError::Refused { reason }) => reason,
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("a staging session opened for the buffer at {buffer:#x}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_is_refused_for_a_buffer_that_is_not_registered_or_without_the_secret() {
    let server = server(Some(secret("a")));
    let reason = staging_refusal(&server, 0x1000, Some(&secret("a"))).await;
    assert!(
        reason.contains("no cudaMalloc buffer is registered at 0x1000"),
        "{reason}"
    );
    // A deregistered buffer is refused the same way.
    let vouched = server.vouch(
        0x1000,
        Vouch::new(ferry_core::cuda::IpcHandle([1; 64]), 0, 4096),
    );
    drop(vouched);
    let reason = staging_refusal(&server, 0x1000, Some(&secret("a"))).await;
    assert!(reason.contains("no cudaMalloc buffer"), "{reason}");
    // Without the secret nothing is allocated: the request is refused before it is read.
    let refused = open_staging(&server.address(), 0x1000, 256 << 20, None).await;
    assert!(
        refused.is_err(),
        "a staging session opened without the secret"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_for_a_registered_buffer_on_a_gpu_that_cannot_give_it_is_refused_with_the_cause() {
    // Without a GPU (the build machine) the staging allocation fails; with one, GPU 7 is not
    // there. Either way the peer hears why, and the slot is given back for the next request.
    let server = server(None);
    let _vouched = server.vouch(
        0x2000,
        Vouch::new(ferry_core::cuda::IpcHandle([2; 64]), 7, 4096),
    );
    for _ in 0..MAX_STAGING_SESSIONS + 1 {
        let reason = staging_refusal(&server, 0x2000, None).await;
        assert!(reason.contains("staging on GPU 7 failed"), "{reason}");
    }
}
