"""ferry's Mooncake-compatible engine driven as vLLM 0.33's ``MooncakeConnector`` drives it: the
prefill registers one range per pool storage with ``batch_register_memory``, and sends each set
of ready requests with one ``batch_transfer_sync_write`` from a pool of 10 threads, blocks of a
request merged into one entry per run of ids consecutive on both sides (``k x block`` bytes);
under heterogeneous TP each prefill rank writes its slice of every decode block at an offset,
one entry per block. The decode is ``mooncake_peer.py`` in a process of its own; every block is
checked, and blocks no request names must keep their poison."""

from concurrent.futures import ThreadPoolExecutor
import ctypes
import random

from ferry_kv.mooncake import TransferEngine
from test_mooncake import Peer

BLOCK = 4096
BLOCKS = 32
TENSORS = 3
WORKERS = 10
POISON = 0


def value(tensor, block, rank=0):
    return (tensor * 37 + block * 3 + rank * 101) % 250 + 1


def prefill(block_bytes, rank=0):
    """An engine with ``TENSORS`` registered pools of ``BLOCKS`` blocks, block b of tensor t
    filled with ``value(t, b, rank)``, registered in one ``batch_register_memory``; the pools'
    addresses, and the pools themselves (registered memory must outlive its use)."""
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    pools = [(ctypes.c_uint8 * (block_bytes * BLOCKS))() for _ in range(TENSORS)]
    for tensor, pool in enumerate(pools):
        for block in range(BLOCKS):
            ctypes.memset(ctypes.addressof(pool) + block * block_bytes, value(tensor, block, rank), block_bytes)
    addrs = [ctypes.addressof(pool) for pool in pools]
    assert engine.batch_register_memory(addrs, [block_bytes * BLOCKS] * TENSORS) == 0
    return engine, addrs, pools


def runs(src_ids, dst_ids):
    """(first source, first destination, count) of runs consecutive on both sides."""
    out = []
    for src, dst in zip(src_ids, dst_ids):
        if out and src == out[-1][0] + out[-1][2] and dst == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((src, dst, 1))
    return out


def decode_blocks(peer):
    data = bytes.fromhex(peer.ask(op="read", offset=0, length=TENSORS * BLOCKS * BLOCK)["hex"])
    return [[data[(t * BLOCKS + b) * BLOCK : (t * BLOCKS + b + 1) * BLOCK] for b in range(BLOCKS)] for t in range(TENSORS)]


def test_requests_from_ten_threads_with_merged_runs_land_block_by_block():
    peer = Peer(size=TENSORS * BLOCKS * BLOCK)
    try:
        engine, addrs, _pools = prefill(BLOCK)
        rng = random.Random(3)
        free = list(range(BLOCKS))
        rng.shuffle(free)
        requests, landed = [], {}
        for request in range(8):
            # Three destination blocks per request, two of them consecutive on both sides.
            dst = sorted(free[3 * request : 3 * request + 3])
            src = [rng.randrange(BLOCKS - 1) for _ in dst]
            src[1] = src[0] + 1 if dst[1] == dst[0] + 1 else src[1]
            requests.append((src, dst))
            landed.update(zip(dst, src))
        session = f"127.0.0.1:{peer.port}"

        def send(request):
            src, dst = request
            bufs, peers, lens = [], [], []
            for tensor in range(TENSORS):
                remote_base = peer.addr + tensor * BLOCKS * BLOCK
                for first_src, first_dst, count in runs(src, dst):
                    bufs.append(addrs[tensor] + first_src * BLOCK)
                    peers.append(remote_base + first_dst * BLOCK)
                    lens.append(count * BLOCK)
            return engine.batch_transfer_sync_write(session, bufs, peers, lens)

        with ThreadPoolExecutor(WORKERS) as pool:
            assert list(pool.map(send, requests)) == [0] * len(requests)
        blocks = decode_blocks(peer)
        for tensor in range(TENSORS):
            for block in range(BLOCKS):
                want = value(tensor, landed[block]) if block in landed else POISON
                assert blocks[tensor][block] == bytes([want]) * BLOCK, (tensor, block)
    finally:
        peer.close()


def test_heterogeneous_tp_ranks_write_their_slice_of_every_block_at_an_offset():
    # Prefill TP 2 -> decode TP 1: each prefill rank holds half of each block's heads and
    # writes it at its offset inside the decode's block, one entry per block.
    peer = Peer(size=TENSORS * BLOCKS * BLOCK)
    try:
        half = BLOCK // 2
        ranks = [prefill(half, rank) for rank in range(2)]
        src, dst = [4, 5, 9], [1, 2, 30]
        session = f"127.0.0.1:{peer.port}"

        def send(rank):
            engine, addrs, _ = ranks[rank]
            bufs, peers, lens = [], [], []
            for tensor in range(TENSORS):
                remote_base = peer.addr + tensor * BLOCKS * BLOCK
                for s, d in zip(src, dst):
                    bufs.append(addrs[tensor] + s * half)
                    peers.append(remote_base + d * BLOCK + rank * half)
                    lens.append(half)
            return engine.batch_transfer_sync_write(session, bufs, peers, lens)

        with ThreadPoolExecutor(WORKERS) as pool:
            assert list(pool.map(send, range(2))) == [0, 0]
        blocks = decode_blocks(peer)
        for tensor in range(TENSORS):
            for block in range(BLOCKS):
                if block in dst:
                    s = src[dst.index(block)]
                    want = bytes([value(tensor, s, 0)]) * half + bytes([value(tensor, s, 1)]) * half
                else:
                    want = bytes([POISON]) * BLOCK
                assert blocks[tensor][block] == want, (tensor, block)
    finally:
        peer.close()
