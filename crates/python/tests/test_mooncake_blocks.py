"""Per-block entries, as SGLang and vLLM pass them, through the Mooncake-compatible engine.

The engine turns entries of one length at whole-block offsets into paged block copies and moves
the rest as they are; these tests check that every byte lands where its entry says, and only
there, for writes and reads, with block entries and odd entries mixed in one call.
"""

import ctypes
import random
import time

from ferry_kv.mooncake import TransferEngine

BLOCK = 4096
BLOCKS = 16
TENSORS = 3
POISON = 0xEE


def pools(engine, fill):
    """``TENSORS`` registered pools of ``BLOCKS`` blocks; block b of tensor t filled by ``fill``."""
    made = []
    for tensor in range(TENSORS):
        pool = (ctypes.c_uint8 * (BLOCK * BLOCKS))()
        for block in range(BLOCKS):
            ctypes.memset(ctypes.addressof(pool) + block * BLOCK, fill(tensor, block), BLOCK)
        assert engine.register_memory(ctypes.addressof(pool), BLOCK * BLOCKS) == 0
        made.append(pool)
    return made


def block(pool, index):
    return bytes(pool[index * BLOCK : (index + 1) * BLOCK])


def engines():
    prefill, decode = TransferEngine(), TransferEngine()
    assert prefill.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    assert decode.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    return prefill, decode


def test_block_entries_and_odd_entries_land_exactly_where_they_say():
    prefill, decode = engines()
    sources = pools(prefill, lambda tensor, b: 16 * tensor + b)
    targets = pools(decode, lambda tensor, b: POISON)
    rng = random.Random(7)
    src_ids = rng.sample(range(BLOCKS), 6)
    dst_ids = rng.sample(range(BLOCKS), 6)
    bufs, peers, lens = [], [], []
    for tensor in range(TENSORS):
        for s, d in zip(src_ids, dst_ids):
            bufs.append(ctypes.addressof(sources[tensor]) + s * BLOCK)
            peers.append(ctypes.addressof(targets[tensor]) + d * BLOCK)
            lens.append(BLOCK)
    free = sorted(set(range(BLOCKS)) - set(dst_ids))[0]
    # An entry that is not a whole block at a block offset: moved as it is.
    bufs.append(ctypes.addressof(sources[0]) + 3)
    peers.append(ctypes.addressof(targets[1]) + free * BLOCK + 5)
    lens.append(100)
    assert prefill.batch_transfer_sync_write(decode.get_session_id(), bufs, peers, lens) == 0

    for tensor in range(TENSORS):
        for b in range(BLOCKS):
            got = block(targets[tensor], b)
            if b in dst_ids:
                expected = bytes([16 * tensor + src_ids[dst_ids.index(b)]]) * BLOCK
            elif tensor == 1 and b == free:
                expected = bytes([POISON]) * 5 + bytes(sources[0][3:103]) + bytes([POISON]) * (BLOCK - 105)
            else:
                expected = bytes([POISON]) * BLOCK
            assert got == expected, f"tensor {tensor} block {b}"


def test_block_entries_read_back_into_other_blocks():
    prefill, decode = engines()
    remote = pools(decode, lambda tensor, b: 100 + 10 * tensor + b)
    local = pools(prefill, lambda tensor, b: POISON)
    pairs = [(2, 9), (5, 0), (15, 15)]
    bufs, peers, lens = [], [], []
    for tensor in range(TENSORS):
        for into, source in pairs:
            bufs.append(ctypes.addressof(local[tensor]) + into * BLOCK)
            peers.append(ctypes.addressof(remote[tensor]) + source * BLOCK)
            lens.append(BLOCK)
    assert prefill.batch_transfer_sync_read(decode.get_session_id(), bufs, peers, lens) == 0
    for tensor in range(TENSORS):
        for b in range(BLOCKS):
            sources = [source for into, source in pairs if into == b]
            fill = 100 + 10 * tensor + sources[0] if sources else POISON
            assert block(local[tensor], b) == bytes([fill]) * BLOCK, f"tensor {tensor} block {b}"


def test_reading_two_blocks_into_one_is_refused_and_nothing_lands():
    prefill, decode = engines()
    remote = pools(decode, lambda tensor, b: 1 + b)
    local = pools(prefill, lambda tensor, b: POISON)
    base, peer = ctypes.addressof(local[0]), ctypes.addressof(remote[0])
    code = prefill.batch_transfer_sync_read(
        decode.get_session_id(), [base, base], [peer, peer + BLOCK], [BLOCK, BLOCK]
    )
    assert code == -1
    assert bytes(local[0]) == bytes([POISON]) * (BLOCK * BLOCKS)


ENTRY = 64
MANY = 20_000


def many_entries(prefill, decode):
    """A source of ``MANY`` distinct 64-byte entries and a poisoned target, registered."""
    source = (ctypes.c_uint8 * (ENTRY * MANY))()
    for index in range(MANY):
        ctypes.memset(ctypes.addressof(source) + index * ENTRY, index % 251, ENTRY)
    target = (ctypes.c_uint8 * (ENTRY * MANY))()
    ctypes.memset(target, POISON, ENTRY * MANY)
    assert prefill.register_memory(ctypes.addressof(source), ENTRY * MANY) == 0
    assert decode.register_memory(ctypes.addressof(target), ENTRY * MANY) == 0
    order = list(range(MANY))
    random.Random(3).shuffle(order)
    bufs = [ctypes.addressof(source) + index * ENTRY for index in range(MANY)]
    peers = [ctypes.addressof(target) + slot * ENTRY for slot in order]
    return source, target, order, bufs, peers


def test_twenty_thousand_entries_move_and_the_notify_follows_them():
    from ferry_kv.mooncake import TransferNotify, Write

    prefill, decode = engines()
    source, target, order, bufs, peers = many_entries(prefill, decode)
    note = TransferNotify("prefill-0", "req-7 ready")
    code = prefill.batch_transfer_sync(
        decode.get_session_id(), bufs, peers, [ENTRY] * MANY, Write, note
    )
    assert code == 0
    for index, slot in enumerate(order):
        assert bytes(target[slot * ENTRY : (slot + 1) * ENTRY]) == bytes([index % 251]) * ENTRY
    notes = []
    for _ in range(100):
        notes += [(n.name, n.msg) for n in decode.get_notifies()]
        if notes:
            break
        time.sleep(0.02)
    assert notes == [("prefill-0", "req-7 ready")]


def test_one_bad_entry_among_thousands_fails_the_call():
    prefill, decode = engines()
    _, _, _, bufs, peers = many_entries(prefill, decode)
    peers[17_000] += ENTRY * MANY  # past the peer's registration
    code = prefill.batch_transfer_sync_write(decode.get_session_id(), bufs, peers, [ENTRY] * MANY)
    assert code == -1


def test_a_non_int_among_thousands_fails_the_call_and_the_log_names_it(capfd):
    prefill, decode = engines()
    _, _, _, bufs, peers = many_entries(prefill, decode)
    lens = [ENTRY] * MANY
    lens[16_500] = "64"
    code = prefill.batch_transfer_sync_write(decode.get_session_id(), bufs, peers, lens)
    assert code == -1, "a str length was accepted"
    assert "item 16500" in capfd.readouterr().err
