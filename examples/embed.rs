//! Embedding ferry in an async decode server: it registers its paged KV pool, names it for
//! peers, receives one request's blocks from a prefill engine, and learns from the
//! notification (which arrives only after the data) which blocks of the pool now hold the
//! request. The prefill engine runs in the same process here; in a deployment it is another
//! process that opens the decode server by name.
//!
//! Run: `cargo run --example embed`.

use ferry::{BlockCopy, Error};

/// Bytes per KV block and blocks per pool.
const BLOCK: u64 = 16 << 10;
const BLOCKS: u64 = 256;

#[tokio::main]
async fn main() -> Result<(), Error> {
    // The decode server's pool. A server registers the tensor it already has with
    // `unsafe { engine.register(ptr, len) }`; this example lets the engine allocate it.
    let decode = ferry::builder().build().await?;
    let pool = decode.allocate(BLOCK * BLOCKS)?;
    pool.set_name("kv")?;
    let mut inbox = decode.notifications()?;

    // The prefill side computed blocks 5, 6, 7 and 42 of its own pool for request 1; block
    // `id` holds the byte `id` throughout, so the decode side can tell them apart.
    let prefill = ferry::builder().build().await?;
    let computed = prefill.allocate(BLOCK * BLOCKS)?;
    let source: Vec<u32> = vec![5, 6, 7, 42];
    for &id in &source {
        computed.write_at(u64::from(id) * BLOCK, &vec![id as u8; BLOCK as usize])?;
    }

    // The decode server's scheduler gave the request free blocks 0..4; the prefill side
    // writes there and names them in the notification.
    let destination: Vec<u32> = vec![0, 1, 2, 3];
    let peer = prefill.connect(decode.name()).await?;
    let remote = peer
        .buffer("kv")
        .ok_or_else(|| Error::ApiMisuse("the decode server published no pool named kv".into()))?;
    let copy =
        BlockCopy::packed(BLOCK, source.clone(), destination.clone()).pool(&computed, &remote);
    let ids: Vec<String> = destination.iter().map(u32::to_string).collect();
    let completion = prefill
        .batch(&peer)
        .write_blocks(copy)
        .notify(format!("req-1 {}", ids.join(",")))
        .submit()?
        .await?;
    println!(
        "prefill: {} bytes over {:?} in {:?}",
        completion.bytes, completion.transports, completion.elapsed
    );

    // The decode server: the notification says which request and which blocks arrived.
    let note = inbox
        .recv()
        .await
        .ok_or_else(|| Error::ApiMisuse("the decode engine stopped".into()))?;
    let text = String::from_utf8_lossy(&note.payload);
    let (request, blocks) = text.split_once(' ').unwrap_or((&text, ""));
    let arrived: Vec<u32> = blocks.split(',').filter_map(|id| id.parse().ok()).collect();
    let mut block = vec![0u8; BLOCK as usize];
    for (&at, &from) in arrived.iter().zip(&source) {
        pool.read_at(u64::from(at) * BLOCK, &mut block)?;
        if block.iter().any(|&byte| byte != from as u8) {
            return Err(Error::ApiMisuse(format!(
                "block {at} does not hold prefill block {from}"
            )));
        }
    }
    println!("decode: {request} arrived in blocks {arrived:?}, every byte checked");
    Ok(())
}
