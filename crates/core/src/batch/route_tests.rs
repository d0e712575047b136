//! Routing against fake transports and an in-memory peer view: no engine, no sockets.

use super::route;
use crate::batch::Entry;
use crate::descriptor::{
    BufferDescriptor, Endpoint, HostIdentity, SegmentDescriptor, DESCRIPTOR_VERSION,
};
use crate::error::{Error, RangeError, Result, Side};
use crate::memory::{Location, RegionEntry, RegionInfo, RegionUse};
use crate::peer::PeerView;
use crate::transport::{Direction, Link, Reach, TransferOps, Transport};
use std::sync::Arc;

/// The one local region every entry uses (batch index 0).
const LOCAL: u64 = 0x1000_0000;
/// The peer's two buffers, `B` right after `A`, so a range can continue from one into the other.
const REMOTE_A: u64 = 0x2000_0000;
const REMOTE_B: u64 = REMOTE_A + LEN;
/// Length of the local region and of each remote buffer.
const LEN: u64 = 0x1000;
const PEER: &str = "decode:7000";

/// A transport whose answer to `reach` depends only on the remote buffer; it moves nothing.
struct Fake {
    name: &'static str,
    answer: fn(&BufferDescriptor) -> Reach,
}

#[async_trait::async_trait]
impl Transport for Fake {
    fn name(&self) -> &'static str {
        self.name
    }

    fn endpoint(&self) -> Option<Endpoint> {
        None
    }

    fn reach(&self, _: &RegionInfo, _: &SegmentDescriptor, remote: &BufferDescriptor) -> Reach {
        (self.answer)(remote)
    }

    async fn open(&self, _: &SegmentDescriptor) -> Result<Arc<dyn Link>> {
        unreachable!("routing opens no links")
    }
}

fn fake(name: &'static str, answer: fn(&BufferDescriptor) -> Reach) -> Arc<dyn Transport> {
    Arc::new(Fake { name, answer })
}

fn refuse(reason: &str) -> Reach {
    Reach::No {
        reason: reason.into(),
    }
}

fn host(addr: u64) -> RegionInfo {
    RegionInfo {
        addr,
        len: LEN,
        location: Location::Host { pinned: false },
    }
}

fn local_use() -> Arc<[Arc<RegionUse>]> {
    let entry = Arc::new(RegionEntry::new(
        host(LOCAL),
        0,
        1,
        Vec::new(),
        Vec::new(),
        None,
    ));
    vec![Arc::new(entry.acquire().expect("a fresh region is open"))].into()
}

fn peer_view() -> PeerView {
    let buffer = |addr| BufferDescriptor {
        addr,
        len: LEN,
        location: Location::Host { pinned: false },
        name: None,
        exports: Vec::new(),
    };
    PeerView::new(SegmentDescriptor {
        version: DESCRIPTOR_VERSION,
        name: PEER.into(),
        host: HostIdentity::current(),
        generation: 1,
        instance: crate::InstanceId::from_u128(7),
        process: crate::InstanceId::from_u128(7),
        pid: 7,
        endpoints: Vec::new(),
        gpus: Vec::new(),
        buffers: vec![buffer(REMOTE_A), buffer(REMOTE_B)],
        signature: None,
    })
}

fn entry(direction: Direction, offset: u64, remote_addr: u64, len: u64) -> Entry {
    Entry {
        direction,
        region: 0,
        offset,
        remote_addr,
        len,
    }
}

fn write(offset: u64, remote_addr: u64, len: u64) -> Entry {
    entry(Direction::Write, offset, remote_addr, len)
}

fn read(offset: u64, remote_addr: u64, len: u64) -> Entry {
    entry(Direction::Read, offset, remote_addr, len)
}

fn route_entries(
    transports: &[Arc<dyn Transport>],
    entries: &[Entry],
) -> Result<Vec<(usize, TransferOps)>> {
    let (ops, blocks) = route(transports, &peer_view(), &local_use(), (entries, 0), PEER)?;
    assert!(blocks.is_empty(), "no fake transport prefers block copies");
    Ok(ops)
}

/// Each op as (direction, offset into the local region, remote address, its buffer, length).
fn shape(ops: &TransferOps) -> Vec<(Direction, u64, u64, u64, u64)> {
    ops.iter()
        .map(|op| {
            let offset = op.local_addr - LOCAL;
            (
                op.direction,
                offset,
                op.remote_addr,
                ops.remote(op).addr,
                op.len,
            )
        })
        .collect()
}

#[test]
fn the_cheapest_transport_that_reaches_a_buffer_carries_its_entries() {
    // `far` reaches everything and answers before `near`, which is cheaper but reaches only A.
    let transports = [
        fake("none", |_| refuse("no fabric")),
        fake("far", |_| Reach::Yes { cost: 100 }),
        fake("near", |remote| match remote.addr {
            REMOTE_A => Reach::Yes { cost: 10 },
            _ => refuse("only buffer A"),
        }),
    ];
    let entries = [
        write(0, REMOTE_A, 16),
        write(0x100, REMOTE_B, 16),
        write(0x200, REMOTE_A + 0x200, 16),
    ];
    let groups = route_entries(&transports, &entries).unwrap();
    let chosen: Vec<(usize, Vec<u64>)> = groups
        .iter()
        .map(|(transport, ops)| (*transport, ops.iter().map(|op| op.remote_addr).collect()))
        .collect();
    assert_eq!(
        chosen,
        [(1, vec![REMOTE_B]), (2, vec![REMOTE_A, REMOTE_A + 0x200])]
    );
}

#[test]
fn a_remote_range_outside_every_buffer_is_not_registered_naming_the_entry() {
    let transports = [fake("far", |_| Reach::Yes { cost: 100 })];
    // Past the end of the last buffer, and across the seam of two buffers: neither lies inside
    // one buffer.
    for (addr, len) in [(REMOTE_B + LEN - 8, 16), (REMOTE_B - 8, 16)] {
        let entries = [write(0, REMOTE_A, 16), write(0x100, addr, len)];
        let error = route_entries(&transports, &entries).expect_err("the range is outside");
        let Error::Range(error) = error else {
            panic!("expected a range error, got {error:?}");
        };
        assert_eq!(
            error,
            RangeError::NotRegistered {
                index: 1,
                side: Side::Remote,
                addr,
                len,
            }
        );
    }
}

#[test]
fn entries_that_continue_each_other_on_both_sides_merge_into_one_op() {
    let transports = [fake("far", |_| Reach::Yes { cost: 100 })];
    let entries = [
        write(0x000, REMOTE_A, 0x100),
        // Continues the write on both sides: merged.
        write(0x100, REMOTE_A + 0x100, 0x100),
        // Continues it remotely only.
        write(0x300, REMOTE_A + 0x200, 0x100),
        // Continues it on both sides, but reads.
        read(0x400, REMOTE_A + 0x300, 0x100),
        // Continues the read on both sides: merged.
        read(0x500, REMOTE_A + 0x400, 0x100),
        // Continues it locally only.
        read(0x600, REMOTE_A + 0x600, 0x100),
        // Locally only again, up to the end of A.
        read(0x700, REMOTE_A + 0xf00, 0x100),
        // Continues it on both sides by address, but in the next buffer.
        read(0x800, REMOTE_B, 0x100),
    ];
    let groups = route_entries(&transports, &entries).unwrap();
    assert_eq!(groups.len(), 1);
    let (write, read) = (Direction::Write, Direction::Read);
    assert_eq!(
        shape(&groups[0].1),
        [
            (write, 0x000, REMOTE_A, REMOTE_A, 0x200),
            (write, 0x300, REMOTE_A + 0x200, REMOTE_A, 0x100),
            (read, 0x400, REMOTE_A + 0x300, REMOTE_A, 0x200),
            (read, 0x600, REMOTE_A + 0x600, REMOTE_A, 0x100),
            (read, 0x700, REMOTE_A + 0xf00, REMOTE_A, 0x100),
            (read, 0x800, REMOTE_B, REMOTE_B, 0x100),
        ]
    );
}

#[test]
fn when_no_transport_reaches_every_reason_is_in_the_error() {
    let transports = [
        fake("alpha", |_| refuse("no shared fabric")),
        fake("beta", |_| refuse("another host")),
    ];
    let error = route_entries(&transports, &[write(0, REMOTE_A, 16)]).expect_err("unreachable");
    let Error::Unavailable {
        local,
        peer,
        reason,
    } = error
    else {
        panic!("expected Unavailable, got {error:?}");
    };
    assert_eq!(reason, "alpha: no shared fabric; beta: another host");
    assert_eq!(peer, PEER);
    assert_eq!(local, "pageable host memory");
}

/// Reaches every buffer and counts how often it was asked.
#[derive(Default)]
struct Counting {
    asked: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl Transport for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }

    fn endpoint(&self) -> Option<Endpoint> {
        None
    }

    fn reach(&self, _: &RegionInfo, _: &SegmentDescriptor, _: &BufferDescriptor) -> Reach {
        self.asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Reach::Yes { cost: 1 }
    }

    async fn open(&self, _: &SegmentDescriptor) -> Result<Arc<dyn Link>> {
        unreachable!("routing opens no links")
    }
}

#[test]
fn transports_are_asked_once_per_region_and_buffer_for_as_long_as_the_view_lasts() {
    let counting = Arc::new(Counting::default());
    let transports: [Arc<dyn Transport>; 1] = [counting.clone()];
    let asked = || counting.asked.load(std::sync::atomic::Ordering::Relaxed);
    let (view, uses) = (peer_view(), local_use());
    let entries = [
        write(0, REMOTE_A, 16),
        write(0x100, REMOTE_B, 16),
        write(0x200, REMOTE_A + 0x200, 16),
    ];
    for _ in 0..3 {
        let (groups, _) = route(&transports, &view, &uses, (&entries, 0), PEER).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].1.len(), 3);
    }
    assert_eq!(asked(), 2, "asked again for a pair it had answered");
    route(&transports, &peer_view(), &uses, (&entries, 0), PEER).unwrap();
    assert_eq!(asked(), 4, "a new view of the peer asks again");
}

#[test]
fn a_view_remembers_a_bounded_number_of_routes() {
    let view = peer_view();
    let remote = Arc::clone(&view.buffers()[0]);
    let asked = std::cell::Cell::new(0);
    let route = |sequence: u64| {
        let local = RegionEntry::new(host(LOCAL), sequence, 1, Vec::new(), Vec::new(), None);
        view.route(&local, &remote, || {
            asked.set(asked.get() + 1);
            Ok(0)
        })
        .unwrap();
    };
    for sequence in 0..4096 {
        route(sequence);
    }
    route(0);
    assert_eq!(asked.get(), 4096, "a remembered route was asked again");
    route(4096);
    route(0);
    assert_eq!(asked.get(), 4098, "past the bound the view started over");
}

/// Reaches every buffer and prefers paged block copies, as nvlink does.
struct Paging;

#[async_trait::async_trait]
impl Transport for Paging {
    fn name(&self) -> &'static str {
        "paging"
    }

    fn endpoint(&self) -> Option<Endpoint> {
        None
    }

    fn prefers_blocks(&self) -> bool {
        true
    }

    fn reach(&self, _: &RegionInfo, _: &SegmentDescriptor, _: &BufferDescriptor) -> Reach {
        Reach::Yes { cost: 1 }
    }

    async fn open(&self, _: &SegmentDescriptor) -> Result<Arc<dyn Link>> {
        unreachable!("routing opens no links")
    }
}

#[test]
fn block_shaped_entries_become_one_block_copy_per_id_list_and_the_rest_stay_ops() {
    const BLOCK: u64 = 0x80;
    let transports: [Arc<dyn Transport>; 1] = [Arc::new(Paging)];
    let pairs = [
        (3, 9),
        (0, 1),
        (7, 2),
        (12, 30),
        (5, 4),
        (9, 0),
        (30, 6),
        (1, 31),
    ];
    let mut entries: Vec<Entry> = Vec::new();
    for remote in [REMOTE_A, REMOTE_B] {
        entries.extend(
            pairs
                .iter()
                .map(|&(local, far)| read(local * BLOCK, remote + far * BLOCK, BLOCK)),
        );
    }
    // Too few for a copy of their own: ops.
    entries.push(write(0x10, REMOTE_A + 0x10, 0x20));
    let (ops, blocks) =
        route(&transports, &peer_view(), &local_use(), (&entries, 0), PEER).unwrap();
    assert_eq!(ops.len(), 1);
    assert_eq!(
        shape(&ops[0].1),
        [(Direction::Write, 0x10, REMOTE_A + 0x10, REMOTE_A, 0x20)]
    );
    assert_eq!(blocks.len(), 1, "both buffers move the same ids: one copy");
    let (transport, copy) = &blocks[0];
    assert_eq!(*transport, 0);
    assert_eq!(copy.direction(), Direction::Read);
    assert_eq!(copy.block_len(), BLOCK);
    let bases: Vec<(u64, u64)> = copy
        .pools()
        .iter()
        .map(|pool| (pool.local_base, pool.remote_base))
        .collect();
    assert_eq!(bases, [(LOCAL, REMOTE_A), (LOCAL, REMOTE_B)]);
    let at = |ids: &[u32], stride: u64, offset: u64| -> Vec<u64> {
        ids.iter()
            .map(|&id| u64::from(id) * stride + offset)
            .collect()
    };
    assert_eq!(
        at(copy.local_ids(), copy.local_stride(), copy.local_offset()),
        pairs
            .iter()
            .map(|&(local, _)| local * BLOCK)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        at(
            copy.remote_ids(),
            copy.remote_stride(),
            copy.remote_offset()
        ),
        pairs
            .iter()
            .map(|&(_, far)| far * BLOCK)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        u64::from(copy.remote_highest()) * copy.remote_stride() + copy.remote_offset(),
        31 * BLOCK
    );
    assert_eq!(copy.bytes(), 16 * BLOCK);
}

#[test]
fn a_pair_of_odd_entries_stays_ops_on_a_transport_that_prefers_blocks() {
    let transports: [Arc<dyn Transport>; 1] = [Arc::new(Paging)];
    // Eight entries, but of lengths with no common block: flat.
    let entries: Vec<Entry> = (0..8)
        .map(|index| write(index * 0x100, REMOTE_A + index * 0x100, 0x61 + index))
        .collect();
    let (ops, blocks) =
        route(&transports, &peer_view(), &local_use(), (&entries, 0), PEER).unwrap();
    assert!(blocks.is_empty());
    assert_eq!(ops[0].1.len(), 8);
    let bytes: u64 = ops[0].1.iter().map(|op| op.len).sum();
    assert_eq!(bytes, (0..8).map(|index| 0x61 + index).sum::<u64>());
}

#[test]
fn token_entries_in_runs_merge_into_one_op_a_run_on_a_transport_that_prefers_blocks() {
    const TOKEN: u64 = 0x48;
    let transports: [Arc<dyn Transport>; 1] = [Arc::new(Paging)];
    // Three runs of 5, 9 and 6 tokens, one entry a token, scattered differently on each side.
    let runs = [(0, 20, 5), (30, 0, 9), (10, 40, 6)];
    let entries: Vec<Entry> = runs
        .iter()
        .flat_map(|&(local, far, tokens)| {
            (0..tokens).map(move |token| {
                write(
                    (local + token) * TOKEN,
                    REMOTE_A + (far + token) * TOKEN,
                    TOKEN,
                )
            })
        })
        .collect();
    let (ops, blocks) =
        route(&transports, &peer_view(), &local_use(), (&entries, 0), PEER).unwrap();
    assert!(blocks.is_empty(), "tokens in runs stay flat");
    assert_eq!(
        shape(&ops[0].1),
        runs.map(|(local, far, tokens)| (
            Direction::Write,
            local * TOKEN,
            REMOTE_A + far * TOKEN,
            REMOTE_A,
            tokens * TOKEN
        ))
    );
}
