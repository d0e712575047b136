"""``ferry_kv.nixl`` between two processes on 127.0.0.1, in the call sequences vLLM's
``NixlConnector`` makes (pull: decode READs; push: prefill WRITEs after a registration
message), on host memory. This process plays one side; ``nixl_peer.py`` the other. Agent
metadata crosses a pipe, as it crosses vLLM's side channel. Every wait is bounded.
"""

import gc
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from stopping import stop

os.environ.setdefault("FERRY_NIXL_HOST", "127.0.0.1")

from ferry_kv._nixl_api import _index_bytes  # noqa: E402
from ferry_kv.nixl import (  # noqa: E402
    nixl_agent,
    nixl_agent_config,
    nixlBackendError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlRepostActiveError,
    nixlXferDList,
)

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "nixl_peer.py")
REGIONS, BLOCKS, BLOCK = 4, 32, 4096
POISON = 0xAB
REPLY_TIMEOUT_S = 30


def value(region, block, seed):
    return (seed * 31 + region * 7 + block) % 251 + 1


class Peer:
    """The other agent's process and its command pipe."""

    def __init__(self, name="prefill", block=BLOCK):
        self.process = subprocess.Popen(
            [sys.executable, PEER, name, str(REGIONS), str(BLOCKS), str(block)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "FERRY_NIXL_HOST": "127.0.0.1"},
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self._reply()
        self.metadata = bytes.fromhex(hello["metadata"])
        self.addrs = hello["addrs"]
        self.block = block

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)

    def _reply(self):
        try:
            line = self.lines.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"the peer did not answer within {REPLY_TIMEOUT_S} s") from None
        answer = json.loads(line)
        assert "error" not in answer, answer
        return answer

    def ask(self, **command):
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def rows(self):
        return [[addr, self.block, 0, self.block, BLOCKS] for addr in self.addrs]

    def pools(self):
        return [np.frombuffer(bytes.fromhex(pool), dtype=np.uint8) for pool in self.ask(op="dump")["pools"]]

    def close(self):
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


class Side:
    """This process's agent, registered as vLLM registers: 4-tuples per storage, then the
    strided rows of its regions."""

    def __init__(self, name="decode", telemetry=True, block=BLOCK):
        self.agent = nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=telemetry))
        self.pools = [np.full(BLOCKS * block, POISON, dtype=np.uint8) for _ in range(REGIONS)]
        self.block = block
        descs = self.agent.get_reg_descs([(p.ctypes.data, p.nbytes, 0, "") for p in self.pools], "DRAM")
        self.registered = self.agent.register_memory(descs, backends=["UCX"])
        self.rows = np.array(
            [[p.ctypes.data, block, 0, block, BLOCKS] for p in self.pools], dtype=np.uint64
        )
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.rows, mem_type="DRAM")


@pytest.fixture
def peer():
    process = Peer()
    yield process
    process.close()


def ids(blocks):
    """vLLM's descriptor ids: region-major, ``region * BLOCKS + block``."""
    offsets = np.arange(REGIONS, dtype=np.int64)[:, None] * BLOCKS
    return (offsets + np.asarray(blocks, dtype=np.int64)[None, :]).ravel()


def wait(agent, handle, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    state = agent.check_xfer_state(handle)
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.0005)
        state = agent.check_xfer_state(handle)
    return state


def check_blocks(pools, moved, seed, block=BLOCK):
    """Every block of ``moved`` (local block -> source block) holds the source's value; every
    other block still holds the poison."""
    for region, pool in enumerate(pools):
        for b in range(BLOCKS):
            got = pool[b * block : (b + 1) * block]
            want = value(region, moved[b], seed) if b in moved else POISON
            assert (got == want).all(), f"region {region} block {b}: {got[:4]} != {want}"


def pull(side, remote_name, remote, local_blocks, remote_blocks, notif):
    handle = side.agent.make_prepped_xfer(
        "READ", side.local, ids(local_blocks), remote, ids(remote_blocks), notif_msg=notif
    )
    assert side.agent.transfer(handle) in ("PROC", "DONE")
    state = wait(side.agent, handle)
    telemetry = side.agent.get_xfer_telemetry(handle)
    side.agent.release_xfer_handle(handle)
    return state, telemetry


def test_pull_mode_reads_every_block_and_notifies_the_prefill_after(peer):
    side = Side()
    peer.ask(op="fill", seed=1)
    name = side.agent.add_remote_agent(peer.metadata)
    assert name == b"prefill"
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    local_blocks, remote_blocks = [0, 5, 6, 7, 31], [9, 2, 3, 4, 0]
    state, telemetry = pull(side, name, remote, local_blocks, remote_blocks, b"req-1:1")
    assert state == "DONE"
    assert telemetry.totalBytes == REGIONS * len(local_blocks) * BLOCK
    assert telemetry.descCount == REGIONS * len(local_blocks)
    assert telemetry.xferDuration > 0 and telemetry.startTime > 0
    check_blocks(side.pools, dict(zip(local_blocks, remote_blocks)), seed=1)
    notifs = peer.ask(op="notifs", count=1, wait_s=10)["notifs"]
    assert notifs == [["decode", b"req-1:1".hex()]]
    side.agent.release_dlist_handle(remote)
    side.agent.remove_remote_agent(name)
    assert side.agent.check_remote_metadata(name) is False


def test_a_read_s_notification_reaches_the_peer_only_after_the_read(peer):
    # The prefill overwrites its blocks the moment a notification arrives; a notification
    # sent before the read had ended would show up as overwritten bytes here.
    side = Side()
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    blocks = list(range(BLOCKS))
    for seed in range(2, 42):
        peer.ask(op="fill", seed=seed, overwrite_on_notif=True)
        state, _ = pull(side, name, remote, blocks, blocks[::-1], f"req-{seed}:1".encode())
        assert state == "DONE"
        check_blocks(side.pools, dict(zip(blocks, blocks[::-1])), seed=seed)
        assert peer.ask(op="notifs", count=1, wait_s=10)["notifs"] == [
            ["decode", f"req-{seed}:1".encode().hex()]
        ]


def test_requests_after_a_deregistration_find_their_pools_again(peer):
    # Requests naming the same pools reuse what the first found; once the memory is
    # deregistered nothing may be reused, and once it is registered again (at the same
    # addresses) the pools are found afresh.
    side = Side()
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    for seed in (50, 51):
        peer.ask(op="fill", seed=seed)
        state, _ = pull(side, name, remote, [1, 2], [3, 4], f"req-{seed}:1".encode())
        assert state == "DONE"
        check_blocks(side.pools, {1: 3, 2: 4}, seed=seed)
    side.agent.deregister_memory(side.registered)
    for pool in side.pools:
        pool.fill(POISON)
    handle = side.agent.make_prepped_xfer("READ", side.local, ids([1, 2]), remote, ids([3, 4]))
    with pytest.raises(nixlBackendError, match="not inside registered memory"):
        side.agent.transfer(handle)
    side.agent.release_xfer_handle(handle)
    check_blocks(side.pools, {}, seed=51)
    descs = side.agent.get_reg_descs([(p.ctypes.data, p.nbytes, 0, "") for p in side.pools], "DRAM")
    side.registered = side.agent.register_memory(descs, backends=["UCX"])
    peer.ask(op="fill", seed=52)
    state, _ = pull(side, name, remote, [5, 6], [7, 8], b"req-52:1")
    assert state == "DONE"
    check_blocks(side.pools, {5: 7, 6: 8}, seed=52)


def test_push_mode_registration_message_of_any_length_then_writes(peer):
    side = Side()
    name = side.agent.add_remote_agent(peer.metadata)
    # The decode sends its registration to a prefill that never added the decode's agent.
    registration = b"PUSH_REG:" + bytes(range(256)) * 1000
    side.agent.send_notif(name, notif_msg=registration)
    notifs = peer.ask(op="notifs", count=1, wait_s=10)["notifs"]
    assert notifs == [["decode", registration.hex()]]
    assert peer.ask(op="add", metadata=side.agent.get_agent_metadata().hex())["name"] == "decode"
    peer.ask(op="fill", seed=3)
    local_blocks, remote_blocks = [1, 2, 3, 20], [4, 5, 6, 7]
    rows = [[int(row[0]), BLOCK, 0, BLOCK, BLOCKS] for row in side.rows]
    answer = peer.ask(
        op="write",
        to="decode",
        rows=rows,
        local_ids=[int(i) for i in ids(remote_blocks)],
        remote_ids=[int(i) for i in ids(local_blocks)],
        notif=b"req-9:1".hex(),
    )
    assert answer == {"state": "DONE", "bytes": REGIONS * 4 * BLOCK}
    deadline = time.monotonic() + 10
    notifs = {}
    while not notifs and time.monotonic() < deadline:
        notifs = side.agent.get_new_notifs()
    assert notifs == {"prefill": [b"req-9:1"]}
    check_blocks(side.pools, dict(zip(local_blocks, remote_blocks)), seed=3)


def test_heterogeneous_tp_reads_half_blocks_at_an_offset(peer):
    # Decode TP 2 reads its half of every head from a prefill of TP 1: the remote rows start
    # half a block in and keep the whole-block stride.
    half = BLOCK // 2
    side = Side(block=half)
    peer.ask(op="fill", seed=4)
    name = side.agent.add_remote_agent(peer.metadata)
    rows = np.array([[addr + half, half, 0, BLOCK, BLOCKS] for addr in peer.addrs], dtype=np.uint64)
    remote = side.agent.prep_xfer_dlist(name, rows, mem_type="DRAM")
    state, _ = pull(side, name, remote, [0, 1], [10, 11], b"req-4:2")
    assert state == "DONE"
    for region, pool in enumerate(side.pools):
        assert (pool[:half] == value(region, 10, 4)).all()
        assert (pool[half : 2 * half] == value(region, 11, 4)).all()
        assert (pool[2 * half :] == POISON).all()


def test_flat_descriptor_lists_move_too(peer):
    side = Side()
    peer.ask(op="fill", seed=5)
    name = side.agent.add_remote_agent(peer.metadata)
    local = nixlXferDList("DRAM", [(side.pools[0].ctypes.data + 3 * BLOCK, BLOCK, 0)])
    remote = nixlXferDList("DRAM", [(peer.addrs[1] + 8 * BLOCK, BLOCK, 0)])
    handle = side.agent.initialize_xfer("READ", local, remote, name, b"flat")
    assert side.agent.transfer(handle) in ("PROC", "DONE")
    assert wait(side.agent, handle) == "DONE"
    assert (side.pools[0][3 * BLOCK : 4 * BLOCK] == value(1, 8, 5)).all()
    assert (side.pools[0][: 3 * BLOCK] == POISON).all()


class IdsView(np.ndarray):
    """A numpy subclass: not read in place, converted like any other sequence."""


@pytest.mark.parametrize(
    "form",
    [
        "int64",
        "int32",
        "big-endian",
        "read-only",
        "every-other",
        "fortran-2d",
        "subclass",
        "list",
        "tuple",
    ],
)
def test_every_index_form_moves_the_same_blocks(peer, form):
    # Arrays are read where they lie (numpy's int64 C-order copy of those that are not such
    # arrays already); lists, tuples and subclasses go through the scratch bytearray. Each
    # must name exactly the blocks its values say, on both sides.
    side = Side()
    peer.ask(op="fill", seed=11)
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    local_blocks, remote_blocks = [1, 4, 5, 30], [7, 0, 12, 31]

    def shaped(blocks):
        values = ids(blocks)
        if form == "int32":
            return values.astype(np.int32)
        if form == "big-endian":
            return values.astype(">i8")
        if form == "read-only":
            values.setflags(write=False)
            return values
        if form == "every-other":
            spread = np.full(2 * len(values), -1, dtype=np.int64)
            spread[::2] = values
            return spread[::2]
        if form == "fortran-2d":
            # Read in C order, as NIXL flattens: the array's rows are the regions.
            return np.asfortranarray(values.reshape(REGIONS, len(blocks)))
        if form == "subclass":
            return values.view(IdsView)
        if form == "list":
            return [int(v) for v in values]
        if form == "tuple":
            return tuple(int(v) for v in values)
        return values

    handle = side.agent.make_prepped_xfer(
        "READ", side.local, shaped(local_blocks), remote, shaped(remote_blocks), notif_msg=b"forms"
    )
    assert side.agent.transfer(handle) in ("PROC", "DONE")
    assert wait(side.agent, handle) == "DONE"
    assert side.agent.get_xfer_telemetry(handle).descCount == REGIONS * len(local_blocks)
    side.agent.release_xfer_handle(handle)
    check_blocks(side.pools, dict(zip(local_blocks, remote_blocks)), seed=11)


def test_index_arrays_read_in_place_are_checked_like_any_other(peer):
    side = Side()
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    good = ids([0, 1])
    for bad, needle in [
        (np.array([0, -3, 1, 2, 3, 4, 5, 6], dtype=np.int64), "local index -3 (position 1) is negative"),
        (np.array([0, 1, 2, 3, 4, 5, 6, REGIONS * BLOCKS], dtype=np.int64), "is past the"),
        (np.array([], dtype=np.int64), "0 local indices against 8 remote ones"),
    ]:
        with pytest.raises(nixlInvalidParamError, match=re.escape(needle)):
            side.agent.make_prepped_xfer("READ", side.local, bad, remote, good)
    # vLLM's arrays are handed over as they are; other sequences go through the scratch.
    assert _index_bytes(good, 0)[0] is good
    assert isinstance(_index_bytes(good.view(IdsView), 0)[0], bytearray)
    # The scratch path and the in-place path give one error for one mistake.
    with pytest.raises(nixlInvalidParamError, match="local index -3 \\(position 1\\) is negative"):
        side.agent.make_prepped_xfer("READ", side.local, [0, -3, 1, 2, 3, 4, 5, 6], remote, good)


def test_the_agent_reads_only_int64_arrays_in_c_order_or_bytearrays(peer):
    # What reaches the compiled agent is converted by the Python layer first; handed anything
    # else directly, the agent refuses it rather than reading memory it cannot vouch for.
    side = Side()
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    good = ids([0, 1])
    native = np.dtype(np.int64).str
    swapped = good.astype(np.dtype(np.int64).newbyteorder())
    grid = good.reshape(REGIONS, 2)
    for bad, needle in [
        (swapped, f"are {swapped.dtype.str}, not {native}"),
        (good.astype(np.int32), f"are {np.dtype(np.int32).str}, not {native}"),
        (np.array(good, dtype="datetime64[s]"), f"are {np.dtype('datetime64[s]').str}"),
        (good[::2], "are not in C order"),
        (np.asfortranarray(grid), "are not in C order"),
        (list(good), "are neither a bytearray nor a numpy.ndarray"),
        (good.view(IdsView), "are neither a bytearray nor a numpy.ndarray"),
    ]:
        for side_name in ("local", "remote"):
            local_ids, remote_ids = (bad, good) if side_name == "local" else (good, bad)
            with pytest.raises(nixlInvalidParamError, match=re.escape(f"the {side_name} indices {needle}")):
                side.agent._agent.make_xfer(
                    "READ", int(side.local), local_ids, good.nbytes, int(remote), remote_ids, good.nbytes, b""
                )
    # C-order 2-D arrays and bytearrays are read as they are.
    handle = side.agent._agent.make_xfer(
        "READ", int(side.local), np.ascontiguousarray(grid), good.nbytes, int(remote),
        bytearray(good.tobytes()), good.nbytes, b"",
    )
    side.agent._agent.release_xfer(handle)


def test_python_code_run_while_the_arrays_are_located_is_seen_whole(peer):
    # A garbage collection can run Python code (its callbacks, other threads) while the agent
    # reads the remote array's interface. Here a callback grows the local bytearray then,
    # which moves its buffer and rewrites its ids: the agent must plan from the new bytes, not
    # read the freed ones. CPython 3.12 and later collect only between bytecodes, so there the
    # callback never runs inside the call and the test has nothing to show.
    side = Side()
    peer.ask(op="fill", seed=13)
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    before, after, remote_ids = ids([0, 1]), ids([2, 3]), ids([4, 5])
    local_ids = bytearray(before.tobytes())
    fired = []

    def grow(phase, info):
        if phase == "start" and not fired:
            fired.append(True)
            local_ids[:] = after.tobytes() + bytes(1 << 20)

    threshold = gc.get_threshold()
    gc.callbacks.append(grow)
    gc.set_threshold(1)
    try:
        handle = side.agent._agent.make_xfer(
            "READ", int(side.local), local_ids, before.nbytes, int(remote), remote_ids, remote_ids.nbytes, b""
        )
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(grow)
    if not fired:
        side.agent._agent.release_xfer(handle)
        pytest.skip(f"no collection ran inside the call on Python {sys.version_info[:2]}")
    assert side.agent.transfer(handle) in ("PROC", "DONE")
    assert wait(side.agent, handle) == "DONE"
    side.agent._agent.release_xfer(handle)
    check_blocks(side.pools, {2: 4, 3: 5}, seed=13)


def test_transfers_from_many_threads_at_once(peer):
    side = Side()
    peer.ask(op="fill", seed=6)
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    errors = []

    def one(block):
        try:
            state, _ = pull(side, name, remote, [block], [BLOCKS - 1 - block], f"req-{block}:1")
            assert state == "DONE"
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(block,)) for block in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    check_blocks(side.pools, {b: BLOCKS - 1 - b for b in range(16)}, seed=6)
    got = peer.ask(op="notifs", count=16, wait_s=10)["notifs"]
    assert sorted(bytes.fromhex(msg) for _, msg in got) == sorted(f"req-{b}:1".encode() for b in range(16))


def test_handles_are_reposted_and_errors_are_nixl_s(peer):
    side = Side()
    peer.ask(op="fill", seed=7)
    name = side.agent.add_remote_agent(peer.metadata)
    rows = np.array(peer.rows(), dtype=np.uint64)
    with pytest.raises(nixlNotFoundError):
        side.agent.prep_xfer_dlist(b"nobody", rows, mem_type="DRAM")
    outside = rows.copy()
    outside[0, 0] += BLOCK
    with pytest.raises(nixlNotFoundError):
        side.agent.prep_xfer_dlist(name, outside, mem_type="DRAM")
    with pytest.raises(ValueError):
        side.agent.prep_xfer_dlist(name, rows)
    remote = side.agent.prep_xfer_dlist(name, rows, mem_type="DRAM")
    agent = side.agent
    with pytest.raises(nixlInvalidParamError):
        agent.make_prepped_xfer("READ", side.local, ids([0]), remote, ids([0, 1]))
    with pytest.raises(nixlInvalidParamError):
        agent.make_prepped_xfer("READ", side.local, [], remote, [])
    with pytest.raises(nixlInvalidParamError):
        agent.make_prepped_xfer("READ", side.local, [REGIONS * BLOCKS], remote, [0])
    with pytest.raises(nixlInvalidParamError):
        agent.make_prepped_xfer("READ", side.local, [-1], remote, [0])
    with pytest.raises(KeyError):
        agent.make_prepped_xfer("COPY", side.local, [0], remote, [0])
    with pytest.raises(nixlInvalidParamError, match="send_notif"):
        agent.make_prepped_xfer("READ", side.local, [0], remote, [0], notif_msg=b"x" * 70_000)
    half = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", np.array([[side.pools[0].ctypes.data, BLOCK // 2, 0, BLOCK, BLOCKS]], dtype=np.uint64), "DRAM"
    )
    with pytest.raises(nixlMismatchError):
        agent.make_prepped_xfer("READ", half, [0], remote, [0])
    handle = agent.make_prepped_xfer("READ", side.local, np.array([0, 1], dtype=np.int32), remote, [2, 3])
    with pytest.raises(nixlNotPostedError):
        agent.check_xfer_state(handle)
    for _ in range(3):
        agent.transfer(handle)
        assert wait(agent, handle) == "DONE"
    assert (side.pools[0][:BLOCK] == value(0, 2, 7)).all()
    agent.release_xfer_handle(handle)
    agent.release_xfer_handle(handle)
    agent.remove_remote_agent(name)
    with pytest.raises(nixlNotFoundError):
        agent.make_prepped_xfer("READ", side.local, [0], remote, [0])
    with pytest.raises(nixlNotFoundError):
        agent.send_notif(name, notif_msg=b"x")
    agent.remove_remote_agent(b"never-added")
    with pytest.raises(nixlNotFoundError):
        agent.deregister_memory([(12345, 1, 0, b"")])
    agent.deregister_memory(side.registered)
    with pytest.raises(nixlNotFoundError):
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", side.rows, mem_type="DRAM")


def test_telemetry_needs_capture_telemetry(peer):
    side = Side(telemetry=False)
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    handle = side.agent.make_prepped_xfer("READ", side.local, ids([0]), remote, ids([1]))
    side.agent.transfer(handle)
    assert wait(side.agent, handle) == "DONE"
    with pytest.raises(nixlNoTelemetryError):
        side.agent.get_xfer_telemetry(handle)


def test_a_dead_peer_ends_in_err_or_an_exception_within_the_timeout():
    process = Peer()
    side = Side()
    name = side.agent.add_remote_agent(process.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(process.rows(), dtype=np.uint64), mem_type="DRAM")
    process.process.kill()
    process.process.wait(timeout=10)
    started = time.monotonic()
    handle = side.agent.make_prepped_xfer("READ", side.local, ids([0]), remote, ids([1]), notif_msg=b"r:1")
    try:
        state = side.agent.transfer(handle)
        if state == "PROC":
            state = wait(side.agent, handle, timeout_s=60)
    except Exception as error:  # noqa: BLE001 - NIXL raises as well as reporting ERR
        state = f"raised {type(error).__name__}"
    assert state == "ERR" or state == "raised nixlBackendError", state
    assert time.monotonic() - started < 45
    assert (side.pools[0][:BLOCK] == POISON).all(), "a failed read wrote nothing it reported"


def test_a_moving_transfer_cannot_be_posted_again_or_released(peer):
    # The peer is stopped, so the transfer stays in flight until the peer runs again.
    side = Side()
    peer.ask(op="fill", seed=8)
    name = side.agent.add_remote_agent(peer.metadata)
    remote = side.agent.prep_xfer_dlist(name, np.array(peer.rows(), dtype=np.uint64), mem_type="DRAM")
    handle = side.agent.make_prepped_xfer("READ", side.local, ids([0]), remote, ids([1]))
    side.agent.transfer(handle)
    assert wait(side.agent, handle) == "DONE", "the connection is up before the peer stops"
    stop(peer.process.pid)
    try:
        side.agent.transfer(handle)
        assert side.agent.check_xfer_state(handle) == "PROC"
        with pytest.raises(nixlRepostActiveError):
            side.agent.transfer(handle)
        with pytest.raises(nixlRepostActiveError):
            side.agent.release_xfer_handle(handle)
    finally:
        os.kill(peer.process.pid, signal.SIGCONT)
    assert wait(side.agent, handle) == "DONE"
    side.agent.release_xfer_handle(handle)
    check_blocks(side.pools, {0: 1}, seed=8)


def test_lmcache_and_dynamo_helpers(peer):
    side = Side()
    agent = side.agent
    base = side.pools[0].ctypes.data
    from_tuples = agent.get_xfer_descs([(base, BLOCK, 0), (base + BLOCK, BLOCK, 0)], "DRAM")
    from_array = agent.get_xfer_descs(np.array([[base, BLOCK, 0], [base + BLOCK, BLOCK, 0]]), "DRAM")
    assert from_tuples == from_array and from_tuples.descCount() == 2
    assert agent.get_xfer_descs([(base, BLOCK, 0)]) is None, "tuples need a memory type"
    copied = agent.deserialize_descs(agent.get_serialized_descs(from_tuples))
    assert copied == from_tuples and copied[1] == (base + BLOCK, BLOCK, 0)
    registered = agent.get_reg_descs([(base, BLOCK, 0, "meta")], "DRAM")
    assert registered[0] == (base, BLOCK, 0, b"meta") and registered.trim()[0] == (base, BLOCK, 0)
    name = agent.add_remote_agent(peer.metadata)
    assert agent.check_remote_metadata(name)
    assert agent.check_remote_metadata(name, nixlXferDList("DRAM", [(peer.addrs[0], BLOCK, 0)]))
    assert not agent.check_remote_metadata(name, nixlXferDList("DRAM", [(base, BLOCK, 0)]))
    assert peer.ask(op="add", metadata=agent.get_agent_metadata().hex())["name"] == "decode"
    for msg in ("tag-1:a", "tag-2:b"):
        peer.ask(op="send_notif", to="decode", msg=msg.encode().hex())
    deadline = time.monotonic() + 10
    while len(agent.update_notifs().get("prefill", [])) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert agent.notifs["prefill"] == [b"tag-1:a", b"tag-2:b"]
    assert agent.check_remote_xfer_done(name, b"tag-2")
    assert not agent.check_remote_xfer_done(name, b"tag-2")
    assert agent.check_remote_xfer_done(name, b"tag-1:a", tag_is_prefix=False)
