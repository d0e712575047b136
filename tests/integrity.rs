//! Between engines that share a secret, every frame carries an integrity tag: a byte altered
//! on the path fails the transfer, in either direction, instead of landing unnoticed.

mod common;

use common::pattern;
use ferry::{Engine, Error};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SECRET: &[u8] = b"integrity-0123456789abcdef";
const LEN: u64 = 64 << 10;
/// Past the handshake, hello and write header of a connection: inside a write's data, or a
/// read answer's.
const FLIP_AT: usize = 4096;

/// Which direction of every relayed connection gets one byte flipped at [`FLIP_AT`].
#[derive(Clone, Copy, PartialEq)]
enum Flip {
    Nothing,
    TowardListener,
    TowardCaller,
}

/// A decode engine reached only through a relay: it advertises 127.0.0.2, where the relay
/// forwards each connection to the engine's port on 127.0.0.1.
async fn decode_behind_relay(flip: Flip) -> Engine {
    let decode = ferry::builder()
        .secret(SECRET)
        .listen("127.0.0.1:0")
        .advertise("127.0.0.2")
        .transfer_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("engine starts on loopback");
    let port = decode.name().rsplit(':').next().unwrap().to_owned();
    let relay = TcpListener::bind(format!("127.0.0.2:{port}"))
        .await
        .unwrap();
    let upstream = format!("127.0.0.1:{port}");
    tokio::spawn(async move {
        while let Ok((caller, _)) = relay.accept().await {
            let listener = TcpStream::connect(&upstream).await.unwrap();
            let (caller_read, caller_write) = caller.into_split();
            let (listener_read, listener_write) = listener.into_split();
            tokio::spawn(pump(
                caller_read,
                listener_write,
                flip == Flip::TowardListener,
            ));
            tokio::spawn(pump(
                listener_read,
                caller_write,
                flip == Flip::TowardCaller,
            ));
        }
    });
    decode
}

/// Copies one direction until either side closes, flipping the byte at [`FLIP_AT`] if asked.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    flip: bool,
) {
    let mut buffer = vec![0u8; 16 << 10];
    let mut offset = 0usize;
    while let Ok(read) = from.read(&mut buffer).await {
        if read == 0 {
            break;
        }
        if flip && (offset..offset + read).contains(&FLIP_AT) {
            buffer[FLIP_AT - offset] ^= 0x20;
        }
        offset += read;
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
}

/// The caller: over loopback, frames are tagged only when asked.
async fn prefill() -> Engine {
    ferry::builder()
        .secret(SECRET)
        .frame_tags(ferry::FrameTags::Always)
        .transfer_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("engine starts on loopback")
}

#[tokio::test]
async fn frames_through_an_honest_relay_move_every_byte() {
    let decode = decode_behind_relay(Flip::Nothing).await;
    let pool = decode.allocate(2 * LEN).unwrap();
    let mut inbox = decode.notifications().unwrap();
    let prefill = prefill().await;
    let source = prefill.allocate(2 * LEN).unwrap();
    let data = pattern(3, 2 * LEN as usize);
    source.write_at(0, &data[..LEN as usize]).unwrap();
    pool.write_at(LEN, &data[LEN as usize..]).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let remote = peer.buffers()[0].addr;
    prefill
        .batch(&peer)
        .write(&source, 0, remote, LEN)
        .read(&source, LEN, remote + LEN, LEN)
        .notify(b"req-1".to_vec())
        .submit()
        .unwrap()
        .await
        .unwrap();
    assert_eq!(inbox.recv().await.unwrap().payload, b"req-1");
    let mut landed = vec![0u8; LEN as usize];
    pool.read_at(0, &mut landed).unwrap();
    common::assert_bytes_eq(&landed, &data[..LEN as usize], "written through the relay");
    source.read_at(LEN, &mut landed).unwrap();
    common::assert_bytes_eq(&landed, &data[LEN as usize..], "read through the relay");
}

#[tokio::test]
async fn a_write_altered_on_the_path_fails_and_its_notification_never_arrives() {
    let decode = decode_behind_relay(Flip::TowardListener).await;
    let _pool = decode.allocate(LEN).unwrap();
    let mut inbox = decode.notifications().unwrap();
    let prefill = prefill().await;
    let source = prefill.allocate(LEN).unwrap();
    source.write_at(0, &pattern(5, LEN as usize)).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let remote = peer.buffers()[0].addr;
    let outcome = prefill
        .batch(&peer)
        .write(&source, 0, remote, LEN)
        .notify(b"req-1".to_vec())
        .submit()
        .unwrap()
        .await;
    match outcome {
        Err(Error::Rejected { reason, .. }) => {
            assert!(reason.to_string().contains("integrity tag"), "{reason}")
        }
        other => panic!("expected the write refused for its tag, got {other:?}"),
    }
    let arrived = tokio::time::timeout(Duration::from_millis(300), inbox.recv()).await;
    assert!(
        arrived.is_err(),
        "no notification may follow a failed write: {arrived:?}"
    );
}

#[tokio::test]
async fn a_read_answer_altered_on_the_path_fails_the_read() {
    let decode = decode_behind_relay(Flip::TowardCaller).await;
    let pool = decode.allocate(LEN).unwrap();
    pool.write_at(0, &pattern(6, LEN as usize)).unwrap();
    let prefill = prefill().await;
    let destination = prefill.allocate(LEN).unwrap();
    let peer = prefill.connect(decode.name()).await.unwrap();
    let remote = peer.buffers()[0].addr;
    let outcome = prefill
        .batch(&peer)
        .read(&destination, 0, remote, LEN)
        .submit()
        .unwrap()
        .await;
    match outcome {
        Err(error @ Error::Protocol { .. }) => {
            assert!(error.to_string().contains("integrity tag"), "{error}")
        }
        other => panic!("expected the read answer refused for its tag, got {other:?}"),
    }
}
