"""The Mooncake-compatible ``TransferEngine`` between two processes on 127.0.0.1.

This process plays prefill: it owns a ``TransferEngine`` and host buffers (ctypes). The peer,
``mooncake_peer.py``, plays decode: it registers memory, reports its session id and addresses,
and answers commands (read back bytes, drain notifies). Every wait is bounded: subprocess reads
and thread joins have timeouts, and the peer exits on its own after a minute.
"""

import _thread
import ctypes
import hashlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from stopping import stop

from ferry_kv.mooncake import Read, TransferEngine, TransferNotify, TransferOpcode, Write

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mooncake_peer.py")
PEER_SIZE = 4 << 20
GUARD = 4096
REPLY_TIMEOUT_S = 20


class Peer:
    """The decode-like process: its session id, registered address and a command channel."""

    def __init__(self, size=PEER_SIZE, host="127.0.0.1"):
        self.process = subprocess.Popen(
            [sys.executable, PEER_SCRIPT, str(size), host],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines = queue.Queue()
        reader = threading.Thread(target=self._read_lines, daemon=True)
        reader.start()
        hello = self._reply()
        assert "error" not in hello, hello
        assert hello["registered"] == 0, hello
        self.session = hello["session"]
        self.port = hello["port"]
        self.addr = hello["addr"]
        self.size = hello["size"]

    def _read_lines(self):
        for line in self.process.stdout:
            self.lines.put(line)

    def _reply(self):
        try:
            line = self.lines.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"the peer did not answer within {REPLY_TIMEOUT_S} s") from None
        return json.loads(line)

    def ask(self, **command):
        """Sends one command and returns the peer's answer."""
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self._reply()
        assert "error" not in answer, answer
        return answer

    def read(self, offset, length):
        """The bytes at ``offset`` of the peer's memory (the guard after it included)."""
        return bytes.fromhex(self.ask(op="read", offset=offset, length=length)["hex"])

    def digest(self, offset, length):
        return self.ask(op="digest", offset=offset, length=length)["sha256"]

    def fill(self, offset, data):
        self.ask(op="fill", offset=offset, hex=data.hex())

    def notifies(self, count, timeout_s=10):
        """Drains the peer's notifies until ``count`` arrived or the time is up."""
        found = []
        deadline = time.monotonic() + timeout_s
        while len(found) < count and time.monotonic() < deadline:
            found += [tuple(note) for note in self.ask(op="notifies")["notifies"]]
            if len(found) < count:
                time.sleep(0.02)
        return found

    def close(self):
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


class Local:
    """This process's engine with ``size`` bytes of registered host memory."""

    def __init__(self, size=PEER_SIZE):
        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        self.memory = (ctypes.c_char * size)()
        self.addr = ctypes.addressof(self.memory)
        assert self.engine.register_memory(self.addr, size) == 0

    def put(self, offset, data):
        ctypes.memmove(self.addr + offset, data, len(data))

    def get(self, offset, length):
        return ctypes.string_at(self.addr + offset, length)


@pytest.fixture
def peer():
    started = Peer()
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def local():
    return Local()


def pattern(seed, length):
    """``length`` bytes that differ for each seed; the period (251) is not a power of two."""
    period = bytes((seed * 31 + index * 7) % 256 for index in range(251))
    return (period * (length // 251 + 1))[:length]


def unused_port():
    """A port on 127.0.0.1 nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ipv6_loopback_works():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def run_bounded(function, timeout_s):
    """Runs ``function`` in a thread; its result, or a failure when it takes over ``timeout_s``."""
    result = {}

    def target():
        result["value"] = function()

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert not worker.is_alive(), f"the call did not return within {timeout_s} s"
    return result["value"]


# --- types -------------------------------------------------------------------------------


def test_opcode_and_notify_types_match_mooncake():
    assert TransferEngine.TransferOpcode is TransferOpcode
    assert int(TransferOpcode.Read) == 0 and int(TransferOpcode.Write) == 1
    assert Read == TransferOpcode.Read and Write == TransferOpcode.Write
    note = TransferNotify(name="decode-0", msg="req-7")
    assert (note.name, note.msg) == ("decode-0", "req-7")
    note.msg = "req-8"
    assert note.msg == "req-8"
    empty = TransferNotify()
    assert (empty.name, empty.msg) == ("", "")


def test_opcode_must_be_the_enum_not_an_int(local, peer):
    with pytest.raises(TypeError):
        local.engine.transfer_sync(peer.session, local.addr, peer.addr, 1, 1)


# --- initialize, session ids ------------------------------------------------------------------


def test_before_initialize_every_call_reports_failure():
    engine = TransferEngine()
    buffer = ctypes.create_string_buffer(64)
    addr = ctypes.addressof(buffer)
    assert engine.get_rpc_port() == 0
    assert engine.get_session_id() == ""
    assert engine.register_memory(addr, 64) == -1
    assert engine.transfer_sync_write("127.0.0.1:1", addr, addr, 8) == -1
    assert engine.transfer_submit_write("127.0.0.1:1", addr, addr, 8) == 0
    assert engine.allocate_managed_buffer(64) == 0
    assert engine.get_notifies() == []
    assert engine.send_probe("127.0.0.1:1") == -102


def test_initialize_ignores_the_port_in_local_hostname():
    engine = TransferEngine()
    taken = unused_port()
    assert engine.initialize(f"127.0.0.1:{taken}", "P2PHANDSHAKE", "tcp", None) == 0
    port = engine.get_rpc_port()
    assert port > 0
    assert engine.get_session_id() == f"127.0.0.1:{port}"
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


def test_second_initialize_fails_and_keeps_the_first(peer):
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    session = engine.get_session_id()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == -1
    assert engine.get_session_id() == session
    assert engine.send_probe(peer.session) == 0


@pytest.mark.parametrize(
    "metadata_server", ["bogus://x", "10.0.0.1:2379", "redis://127.0.0.1:1"]
)
def test_bad_metadata_server_fails_initialize(metadata_server):
    engine = TransferEngine()
    code = run_bounded(
        lambda: engine.initialize("127.0.0.1", metadata_server, "tcp", ""), timeout_s=30
    )
    assert code == -1
    assert engine.get_rpc_port() == 0


def test_bad_mc_transfer_timeout_fails_initialize(monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "soon")
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1


@pytest.mark.skipif(not ipv6_loopback_works(), reason="this machine has no IPv6 loopback")
def test_ipv6_sessions_are_bracketed_and_reachable_either_way():
    ipv6_peer = Peer(host="::1")
    try:
        assert ipv6_peer.session == f"[::1]:{ipv6_peer.port}"
        engine = TransferEngine()
        assert engine.initialize("[::1]:17000", "P2PHANDSHAKE", "tcp", "") == 0
        assert engine.get_session_id() == f"[::1]:{engine.get_rpc_port()}"
        buffer = ctypes.create_string_buffer(b"over ipv6", 9)
        assert engine.register_memory(ctypes.addressof(buffer), 9) == 0
        addr = ctypes.addressof(buffer)
        assert engine.transfer_sync_write(ipv6_peer.session, addr, ipv6_peer.addr, 9) == 0
        unbracketed = f"::1:{ipv6_peer.port}"
        assert engine.transfer_sync_write(unbracketed, addr, ipv6_peer.addr + 100, 9) == 0
        assert ipv6_peer.read(0, 9) == b"over ipv6"
        assert ipv6_peer.read(100, 9) == b"over ipv6"
    finally:
        ipv6_peer.close()


# --- registration ---------------------------------------------------------------------------


def test_batch_register_with_lists_of_different_lengths_registers_nothing():
    engine = Local(64).engine
    buffers = [ctypes.create_string_buffer(256) for _ in range(2)]
    addrs = [ctypes.addressof(buffer) for buffer in buffers]
    assert engine.batch_register_memory(addrs, [256]) == -1
    assert engine.unregister_memory(addrs[0]) == -1
    assert engine.batch_register_memory([], []) == 0
    assert engine.batch_register_memory(addrs, [256, 256]) == 0
    assert engine.batch_unregister_memory(addrs) == 0
    assert engine.batch_unregister_memory(addrs) == -1


def test_overlapping_registration_fails_and_a_failed_batch_leaves_nothing_new():
    local = Local(4096)
    engine = local.engine
    other = ctypes.create_string_buffer(512)
    other_addr = ctypes.addressof(other)
    assert engine.register_memory(local.addr + 100, 16) == -1
    assert engine.register_memory(local.addr - 8, 16) == -1
    assert engine.batch_register_memory([other_addr, local.addr + 8], [512, 8]) == -1
    assert engine.unregister_memory(other_addr) == -1, "the batch's first range stayed"


def test_registering_the_same_range_again_is_accepted_and_kept_by_failed_batches():
    local = Local(4096)
    engine = local.engine
    assert engine.register_memory(local.addr, 4096) == 0
    assert engine.batch_register_memory([local.addr, local.addr + 8], [4096, 8]) == -1
    assert engine.unregister_memory(local.addr) == 0, "the earlier registration went away"
    assert engine.unregister_memory(local.addr) == -1


def test_unmapped_host_memory_is_refused_at_registration():
    engine = Local(64).engine
    # Page zero is never mapped; a real buffer's length overstated runs into unmapped memory.
    assert engine.register_memory(0x1000, 4096) == -1
    buffer = ctypes.create_string_buffer(4096)
    assert engine.register_memory(ctypes.addressof(buffer), 1 << 46) == -1
    assert engine.register_memory(ctypes.addressof(buffer), 4096) == 0


def test_negative_or_non_int_arguments_return_the_failure_code(local, peer):
    engine = local.engine
    session = peer.session
    assert engine.register_memory(-1, 4096) == -1
    assert engine.register_memory(local.addr, "4096") == -1
    assert engine.batch_register_memory([local.addr, -8], [16, 16]) == -1
    assert engine.unregister_memory(None) == -1
    assert engine.batch_unregister_memory("abc") == -1
    assert engine.transfer_sync_write(session, -1, peer.addr, 16) == -1
    assert engine.transfer_sync_read(session, local.addr, peer.addr, 1.5) == -1
    assert engine.transfer_sync(session, local.addr, -peer.addr, 16, Write) == -1
    assert engine.batch_transfer_sync_write(session, [local.addr], [peer.addr], [-16]) == -1
    assert engine.batch_transfer_sync_read(session, [local.addr], None, [16]) == -1
    assert engine.batch_transfer_sync(session, [local.addr], [peer.addr], ["x"], Read) == -1
    assert engine.transfer_submit_write(session, local.addr, peer.addr, -16) == 0
    assert engine.batch_transfer_async_write(session, [-1], [peer.addr], [16]) == 0
    assert engine.batch_transfer_async_read(session, [local.addr], [peer.addr], [2**64]) == 0
    assert engine.batch_transfer_async(session, [local.addr], [-1], [16], Write) == 0
    assert engine.transfer_check_status(-3) == -1
    assert engine.get_batch_transfer_status([-3]) == -1
    assert engine.allocate_managed_buffer(-1) == 0
    assert engine.free_managed_buffer(-1, 16) == -1
    assert engine.write_bytes_to_buffer(-1, b"abc", 3) == -1
    assert engine.write_bytes_to_buffer(local.addr, 12345, 3) == -1
    assert engine.read_bytes_from_buffer(local.addr, -3) == b""
    # The engine is unharmed: a good transfer still moves its bytes.
    local.put(0, b"still works")
    assert engine.transfer_sync_write(session, local.addr, peer.addr, 11) == 0
    assert peer.read(0, 11) == b"still works"


def test_unregister_unknown_address_fails(local):
    assert local.engine.unregister_memory(local.addr + 1) == -1
    assert local.engine.batch_unregister_memory([local.addr, local.addr + 1]) == -1


# --- synchronous transfers ---------------------------------------------------------------------


def test_write_and_read_at_offsets_inside_regions(local, peer):
    data = pattern(1, 5000)
    local.put(1234, data)
    code = local.engine.transfer_sync_write(peer.session, local.addr + 1234, peer.addr + 777, 5000)
    assert code == 0
    assert peer.read(777, 5000) == data

    back = pattern(2, 3000)
    peer.fill(40000, back)
    code = local.engine.transfer_sync_read(peer.session, local.addr + 9000, peer.addr + 40000, 3000)
    assert code == 0
    assert local.get(9000, 3000) == back


def test_batch_write_and_read(local, peer):
    pieces = [(0, 100_000, 4000), (8192, 200_000, 1), (70_000, 300_000, 65536)]
    for seed, (offset, _, length) in enumerate(pieces):
        local.put(offset, pattern(seed, length))
    code = local.engine.batch_transfer_sync_write(
        target_hostname=peer.session,
        buffers=[local.addr + offset for offset, _, _ in pieces],
        peer_buffer_addresses=[peer.addr + remote for _, remote, _ in pieces],
        lengths=[length for _, _, length in pieces],
    )
    assert code == 0
    for seed, (_, remote, length) in enumerate(pieces):
        assert peer.read(remote, length) == pattern(seed, length)

    code = local.engine.batch_transfer_sync_read(
        peer.session,
        (local.addr + 1_000_000, local.addr + 2_000_000),
        (peer.addr + 100_000, peer.addr + 300_000),
        (4000, 65536),
    )
    assert code == 0
    assert local.get(1_000_000, 4000) == pattern(0, 4000)
    assert local.get(2_000_000, 65536) == pattern(2, 65536)
    assert local.engine.batch_transfer_sync_write(peer.session, [], [], []) == 0
    assert local.engine.batch_transfer_sync_write(peer.session, [local.addr], [peer.addr], []) == -1


def test_unregistered_local_buffer_fails_and_writes_nothing(local, peer):
    stray = ctypes.create_string_buffer(b"x" * 64, 64)
    stray_addr = ctypes.addressof(stray)
    assert local.engine.transfer_sync_write(peer.session, stray_addr, peer.addr, 64) == -1
    tail = local.addr + PEER_SIZE - 10
    assert local.engine.transfer_sync_write(peer.session, tail, peer.addr, 64) == -1
    assert peer.read(0, 64) == bytes(64)


def test_remote_range_outside_the_peer_registration_fails_and_writes_nothing(local, peer):
    local.put(0, b"\xff" * 64)
    edge = peer.addr + peer.size - 16
    assert local.engine.transfer_sync_write(peer.session, local.addr, edge, 64) == -1
    assert local.engine.batch_transfer_sync_write(
        peer.session, [local.addr, local.addr], [peer.addr, edge], [16, 64]
    ) == -1
    assert peer.read(peer.size - 16, 16 + GUARD) == bytes(16 + GUARD)
    assert local.engine.transfer_sync_read(peer.session, local.addr, peer.addr - 64, 64) == -1
    assert local.get(0, 64) == b"\xff" * 64


def test_a_long_list_moves_in_parts_and_a_bad_entry_anywhere_moves_nothing(local, peer):
    # 20,000 entries of 128 bytes, scattered: more than one part of the engine's submission.
    count, size = 20_000, 128
    sources = [(index * 7919) % count for index in range(count)]
    data = pattern(5, count * size)
    local.put(0, data)
    code = local.engine.batch_transfer_sync_write(
        peer.session,
        [local.addr + source * size for source in sources],
        [peer.addr + index * size for index in range(count)],
        [size] * count,
    )
    assert code == 0
    expected = b"".join(data[source * size : (source + 1) * size] for source in sources)
    assert peer.digest(0, count * size) == hashlib.sha256(expected).hexdigest()

    batch = local.engine.batch_transfer_async_read(
        peer.session,
        [local.addr + 3_000_000 - (index + 1) * size for index in range(count)],
        [peer.addr + index * size for index in range(count)],
        [size] * count,
    )
    assert batch != 0
    assert local.engine.get_batch_transfer_status([batch]) == 0
    landed = local.get(3_000_000 - count * size, count * size)
    chunks = [expected[index * size : (index + 1) * size] for index in range(count)]
    assert landed == b"".join(reversed(chunks))

    # The last entry lies past the peer's registration: the call fails and no part moved.
    peer.fill(0, bytes(count * size))
    remote = [peer.addr + index * size for index in range(count)]
    remote[-1] = peer.addr + peer.size - 16
    code = local.engine.batch_transfer_sync_write(
        peer.session, [local.addr + index * size for index in range(count)], remote, [size] * count
    )
    assert code == -1
    assert peer.digest(0, count * size) == hashlib.sha256(bytes(count * size)).hexdigest()


def test_unreachable_target_fails(local):
    target = f"127.0.0.1:{unused_port()}"
    assert local.engine.transfer_sync_write(target, local.addr, local.addr, 8) == -1
    assert local.engine.batch_transfer_sync_read(target, [local.addr], [local.addr], [8]) == -1
    assert local.engine.send_probe(target) == -102
    assert local.engine.get_first_buffer_address(target) == 0


def test_get_engine_raises_and_names_what_to_use_instead(local):
    with pytest.raises(NotImplementedError, match="Mooncake Store"):
        local.engine.get_engine()


# --- asynchronous transfers -----------------------------------------------------------------


def test_submit_write_and_check_status(local, peer):
    data = pattern(3, 100_000)
    local.put(0, data)
    batch = local.engine.transfer_submit_write(peer.session, local.addr, peer.addr + 50, len(data))
    assert batch != 0
    deadline = time.monotonic() + 20
    status = local.engine.transfer_check_status(batch)
    while status == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
        status = local.engine.transfer_check_status(batch)
    assert status == 1
    assert peer.read(50, len(data)) == data
    assert local.engine.transfer_check_status(batch) == -1, "a reported batch is forgotten"
    assert local.engine.transfer_check_status(123_456_789) == -1
    unreachable = f"127.0.0.1:{unused_port()}"
    assert local.engine.transfer_submit_write(unreachable, local.addr, peer.addr, 8) == 0


def test_batch_async_write_read_and_wait(local, peer):
    local.put(0, pattern(4, 8192))
    local.put(8192, pattern(5, 8192))
    writes = local.engine.batch_transfer_async_write(
        peer.session, [local.addr, local.addr + 8192], [peer.addr, peer.addr + 16384], [8192, 8192]
    )
    assert writes != 0
    assert local.engine.get_batch_transfer_status([writes]) == 0
    assert peer.read(0, 8192) == pattern(4, 8192)
    assert peer.read(16384, 8192) == pattern(5, 8192)

    reads = local.engine.batch_transfer_async_read(
        peer.session, [local.addr + 100_000], [peer.addr + 16384], [8192]
    )
    both = local.engine.batch_transfer_async(
        peer.session, [local.addr + 200_000], [peer.addr], [8192], TransferOpcode.Read
    )
    assert reads != 0 and both != 0 and reads != both
    assert local.engine.get_batch_transfer_status([reads, both]) == 0
    assert local.get(100_000, 8192) == pattern(5, 8192)
    assert local.get(200_000, 8192) == pattern(4, 8192)

    assert local.engine.get_batch_transfer_status([]) == 0
    assert local.engine.get_batch_transfer_status([reads]) == -1, "waited ids are forgotten"
    assert local.engine.batch_transfer_async_write(peer.session, [local.addr], [], [8]) == 0
    outside = local.engine.batch_transfer_async_write(
        peer.session, [local.addr], [peer.addr + peer.size], [8]
    )
    assert outside == 0, "ferry checks the peer's registration when the batch is submitted"
    assert peer.read(peer.size, 8) == bytes(8)


# --- notifies -----------------------------------------------------------------------------------


def test_transfer_sync_with_notify_reaches_get_notifies(local, peer):
    local.put(0, b"first block")
    code = local.engine.transfer_sync(
        peer.session,
        local.addr,
        peer.addr + 10,
        11,
        TransferOpcode.Write,
        TransferNotify("prefill-0", "req-1 done"),
    )
    assert code == 0
    assert peer.read(10, 11) == b"first block"
    assert peer.notifies(1) == [("prefill-0", "req-1 done")]

    peer.fill(500, b"read me")
    code = local.engine.batch_transfer_sync(
        peer.session,
        [local.addr + 100],
        [peer.addr + 500],
        [7],
        TransferEngine.TransferOpcode.Read,
        TransferNotify(name="prefill-0", msg="req-2 read"),
    )
    assert code == 0
    assert local.get(100, 7) == b"read me"
    assert peer.notifies(1) == [("prefill-0", "req-2 read")]
    assert local.engine.transfer_sync(peer.session, local.addr, peer.addr, 4, Write) == 0
    assert peer.ask(op="notifies")["notifies"] == []


# --- probes, descriptors, managed buffers ------------------------------------------------------


def test_send_probe_and_first_buffer_address(local, peer):
    assert local.engine.send_probe(peer.session) == 0
    assert local.engine.get_first_buffer_address(peer.session) == peer.addr


def test_bytes_are_copied_to_and_from_the_callers_own_unregistered_memory(local):
    engine = local.engine
    own = (ctypes.c_char * 4096)()
    addr = ctypes.addressof(own)
    # As Mooncake: memory the engine never registered is the caller's, copied as it is.
    assert engine.write_bytes_to_buffer(addr + 10, b"unregistered", 12) == 0
    assert own.raw[10:22] == b"unregistered"
    assert engine.read_bytes_from_buffer(addr + 10, 12) == b"unregistered"
    # Nothing mapped there: refused, never a crash.
    assert engine.write_bytes_to_buffer(8, b"x", 1) == -1
    assert engine.read_bytes_from_buffer(8, 1) == b""
    # A range that runs out of registered memory is a mistake, not the caller's memory.
    assert engine.write_bytes_to_buffer(local.addr + len(local.memory) - 1, b"ab", 2) == -1


def test_managed_buffers(local, peer):
    engine = local.engine
    managed = engine.allocate_managed_buffer(1 << 16)
    assert managed != 0
    assert engine.write_bytes_to_buffer(managed, b"managed bytes", 13) == 0
    assert engine.read_bytes_from_buffer(managed, 13) == b"managed bytes"
    assert engine.write_bytes_to_buffer(managed + 100, "text", 4) == 0
    assert engine.read_bytes_from_buffer(managed + 100, 4) == b"text"
    assert engine.write_bytes_to_buffer(managed, b"ab", 3) == -1
    assert engine.write_bytes_to_buffer(managed + (1 << 16) - 1, b"ab", 2) == -1
    assert engine.transfer_sync_write(peer.session, managed, peer.addr + 64, 13) == 0
    assert peer.read(64, 13) == b"managed bytes"
    assert engine.free_managed_buffer(managed, 1 << 16) == 0
    assert engine.read_bytes_from_buffer(managed, 13) == b""
    assert engine.transfer_sync_write(peer.session, managed, peer.addr, 13) == -1


# --- timeouts, threads, the GIL ----------------------------------------------------------------


def stopped_peer_transfer(monkeypatch, timeout_setting):
    """A large write to a peer stopped with SIGSTOP: (code, seconds, ticks of another thread)."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", timeout_setting)
    local = Local(32 << 20)
    stopped = Peer(size=32 << 20)
    ticks = []
    running = threading.Event()
    running.set()

    def ticker():
        while running.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    try:
        assert local.engine.send_probe(stopped.session) == 0
        stop(stopped.process.pid)
        ticking = threading.Thread(target=ticker, daemon=True)
        ticking.start()
        start = time.monotonic()
        code = run_bounded(
            lambda: local.engine.batch_transfer_sync_write(
                stopped.session, [local.addr], [stopped.addr], [32 << 20]
            ),
            timeout_s=40,
        )
        end = time.monotonic()
        running.clear()
        ticking.join(5)
    finally:
        running.clear()
        stopped.close()
    return code, end - start, [tick for tick in ticks if start + 0.1 < tick < end - 0.1]


def test_mc_transfer_timeout_is_honoured_with_mooncakes_minimum(monkeypatch):
    code, seconds, _ = stopped_peer_transfer(monkeypatch, "1")
    assert code == -1
    assert 4.5 <= seconds <= 12, f"took {seconds:.1f} s; MC_TRANSFER_TIMEOUT=1 means 5 s"


def test_gil_is_released_while_a_transfer_waits(monkeypatch):
    code, seconds, ticks = stopped_peer_transfer(monkeypatch, "5")
    assert code == -1
    assert len(ticks) >= (seconds - 0.2) / 0.01 * 0.3, f"{len(ticks)} ticks in {seconds:.1f} s"


def test_ctrl_c_interrupts_a_blocked_transfer_call(monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "30")
    local = Local(32 << 20)
    stopped = Peer(size=32 << 20)
    try:
        assert local.engine.send_probe(stopped.session) == 0
        stop(stopped.process.pid)
        # As Ctrl-C does: the main thread's SIGINT handler runs at its next check.
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            local.engine.batch_transfer_sync_write(
                stopped.session, [local.addr], [stopped.addr], [32 << 20]
            )
        seconds = time.monotonic() - start
        timer.join()
        assert seconds < 3, f"Ctrl-C was seen after {seconds:.1f} s"
    finally:
        stopped.close()


def test_ten_threads_write_their_own_ranges_at_once(local, peer):
    threads = 10
    chunk = PEER_SIZE // threads // 4096 * 4096
    pieces = 4
    piece = chunk // pieces
    for index in range(threads):
        local.put(index * chunk, pattern(index + 10, chunk))
    barrier = threading.Barrier(threads)
    codes = [None] * threads

    def write(index):
        base = index * chunk
        barrier.wait(timeout=20)
        codes[index] = local.engine.batch_transfer_sync_write(
            peer.session,
            [local.addr + base + part * piece for part in range(pieces)],
            [peer.addr + base + part * piece for part in range(pieces)],
            [piece] * pieces,
        )

    workers = [
        threading.Thread(target=write, args=(index,), daemon=True) for index in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert not worker.is_alive(), "a writer did not finish within 60 s"
    assert codes == [0] * threads
    for index in range(threads):
        expected = hashlib.sha256(pattern(index + 10, chunk)).hexdigest()
        assert peer.digest(index * chunk, chunk) == expected, f"range of thread {index}"
