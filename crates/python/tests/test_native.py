"""The native API end to end on host memory over 127.0.0.1: registration of buffers and raw
addresses, writes and reads, paged block copies, notifications, asyncio, and ferry's errors.
Every wait is bounded (WAIT seconds), and every engine fails a transfer after TRANSFER."""

from __future__ import annotations

import _thread
import array
import ast
import base64
import asyncio
import ctypes
import gc
import pathlib
import select
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import weakref
from collections.abc import Iterator

import pytest

import ferry_kv
import ferry_kv._ferry
from ferry_kv import (
    AuthenticationError,
    BlockLayout,
    Engine,
    FerryError,
    PeerError,
    RangeError,
    TransferTimeout,
)

WAIT = 10.0
TRANSFER = 10.0


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    """Two engines of this process: (sender, receiver)."""
    with Engine(transfer_timeout=TRANSFER) as sender, Engine(transfer_timeout=TRANSFER) as receiver:
        yield sender, receiver


def pattern(nbytes: int, seed: int = 1) -> bytes:
    return bytes((index * 7 + seed) % 251 for index in range(nbytes))


def test_bytearray_is_written_to_and_read_from_a_peer(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    pool = receiver.allocate(8192)
    pool.write(4096, pattern(4096, seed=5))
    local = bytearray(pattern(8192, seed=3))
    region = sender.register(local)
    assert (region.addr, region.nbytes, region.location) == (region.addr, 8192, "host")
    peer = sender.connect(receiver.name)
    assert peer.name == receiver.name and peer.alive
    assert (pool.addr, 8192, "host") in peer.buffers

    done = sender.write(peer, region, pool.addr, nbytes=4096).wait(WAIT)
    assert done.bytes == 4096 and done.transports == ["tcp"] and done.elapsed_s >= 0
    assert pool.read(0, 4096) == pattern(8192, seed=3)[:4096]

    sender.read(peer, region, pool.addr + 4096, nbytes=4096, offset=4096).wait(WAIT)
    assert bytes(local[4096:]) == pattern(4096, seed=5)


def test_ctypes_memoryview_and_raw_addresses_register(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    pool = receiver.allocate(3 * 1024)
    peer_name = receiver.name
    c_buffer = (ctypes.c_uint8 * 1024).from_buffer_copy(pattern(1024, seed=11))
    backing = bytearray(pattern(1024, seed=12))
    view = memoryview(backing)
    raw = ctypes.create_string_buffer(pattern(1024, seed=13), 1024)
    regions = [
        sender.register(c_buffer),
        sender.register(view),
        sender.register_address(ctypes.addressof(raw), 1024, owner=raw),
    ]
    assert regions[2].addr == ctypes.addressof(raw) and regions[2].owner is raw
    peer = sender.connect(peer_name)
    batch = sender.batch(peer)
    for index, region in enumerate(regions):
        batch.write(region, 0, pool.addr + index * 1024, 1024)
    assert len(batch) == 3
    batch.submit().wait(WAIT)
    assert pool.read(0, 3 * 1024) == pattern(1024, 11) + pattern(1024, 12) + pattern(1024, 13)


def test_numpy_arrays_register_when_numpy_is_installed(pair: tuple[Engine, Engine]) -> None:
    numpy = pytest.importorskip("numpy")
    sender, receiver = pair
    pool = receiver.allocate(4096)
    pool.write(0, bytes(range(256)) * 16)
    array_2d = numpy.zeros((16, 256), dtype=numpy.uint8)
    region = sender.register(array_2d)
    assert region.nbytes == array_2d.nbytes
    peer = sender.connect(receiver.name)
    sender.read(peer, region, pool.addr).wait(WAIT)
    assert array_2d.tobytes() == bytes(range(256)) * 16

    ids = numpy.array([3], dtype=numpy.int64)
    sender.batch(peer).write_blocks([(region, 0, pool.addr)], ids, ids[::-1], block_bytes=256, pool_bytes=4096).submit().wait(WAIT)
    assert pool.read(3 * 256, 256) == array_2d[3].tobytes()


def test_memory_that_cannot_be_registered_is_refused(pair: tuple[Engine, Engine]) -> None:
    sender, _ = pair
    with pytest.raises(ValueError, match="read-only"):
        sender.register(b"immutable")
    with pytest.raises(ValueError, match="not contiguous"):
        sender.register(memoryview(bytearray(64))[::2])
    with pytest.raises(ValueError, match="no bytes"):
        sender.register(bytearray())
    with pytest.raises(TypeError, match="register_address"):
        sender.register(object())


def test_a_region_keeps_the_object_it_wraps_alive(pair: tuple[Engine, Engine]) -> None:
    class Buffer(bytearray):
        """A bytearray that can be watched with a weak reference."""

    sender, receiver = pair
    buffer = Buffer(4096)
    watch = weakref.ref(buffer)
    region = sender.register(buffer)
    del buffer
    gc.collect()
    assert watch() is not None, "the registered buffer was freed while registered"

    source = receiver.allocate(4096)
    source.write(0, pattern(4096, seed=9))
    sender.read(sender.connect(receiver.name), region, source.addr).wait(WAIT)
    assert region.read(0, 4096) == pattern(4096, seed=9)
    assert bytes(watch() or b"") == pattern(4096, seed=9)

    region.close()
    assert region.closed
    gc.collect()
    assert watch() is None, "closing the region did not release the buffer"
    with pytest.raises(FerryError, match="closed"):
        region.read(0, 1)


def test_paged_blocks_move_with_id_lists_and_id_arrays(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    block, blocks = 256, 8
    pool_bytes = block * blocks
    remote = receiver.allocate(2 * pool_bytes)  # two pools: K and V
    local = bytearray(pattern(2 * pool_bytes, seed=21))
    region = sender.register(local)
    peer = sender.connect(receiver.name)
    pools = [(region, 0, remote.addr), (region, pool_bytes, remote.addr + pool_bytes)]

    sender.batch(peer).write_blocks(pools, [0, 5], [7, 2], block_bytes=block, pool_bytes=pool_bytes).submit().wait(WAIT)
    landed = remote.read(0, 2 * pool_bytes)
    for pool in range(2):
        for local_id, remote_id in ((0, 7), (5, 2)):
            start = pool * pool_bytes
            assert landed[start + remote_id * block : start + (remote_id + 1) * block] == bytes(
                local[start + local_id * block : start + (local_id + 1) * block]
            )

    back = bytearray(2 * pool_bytes)
    back_region = sender.register(back)
    back_pools = [(back_region, 0, remote.addr), (back_region, pool_bytes, remote.addr + pool_bytes)]
    sender.batch(peer).read_blocks(
        back_pools, array.array("q", [1, 3]), array.array("i", [7, 2]), block_bytes=block, pool_bytes=pool_bytes
    ).submit().wait(WAIT)
    for pool in range(2):
        start = pool * pool_bytes
        assert back[start + 1 * block : start + 2 * block] == landed[start + 7 * block : start + 8 * block]
        assert back[start + 3 * block : start + 4 * block] == landed[start + 2 * block : start + 3 * block]


def test_strided_block_layouts_copy_a_slice_of_each_block(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    # Locally K and V interleave in 512-byte strides; the peer keeps 256-byte packed blocks.
    local = bytearray(pattern(4 * 512, seed=31))
    region = sender.register(local)
    remote = receiver.allocate(4 * 256)
    peer = sender.connect(receiver.name)
    local_layout = BlockLayout(pool_bytes=4 * 512, block_stride=512, offset=256)
    sender.batch(peer).write_blocks(
        [(region, 0, remote.addr)],
        (2,),
        range(1, 2),
        local_layout=local_layout,
        remote_layout=BlockLayout.packed(4 * 256, 256),
        nbytes=256,
    ).submit().wait(WAIT)
    assert remote.read(256, 256) == bytes(local[2 * 512 + 256 : 3 * 512])
    assert remote.read(0, 256) == bytes(256)


def test_block_ids_of_the_wrong_shape_are_refused(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    peer = sender.connect(receiver.name)
    region = sender.allocate(1024)
    with pytest.raises(ValueError, match="integer"):
        sender.batch(peer).write_blocks([(region, 0, 0)], array.array("d", [1.0]), [0], block_bytes=256, pool_bytes=1024)
    with pytest.raises(ValueError, match="block_bytes"):
        sender.batch(peer).write_blocks([(region, 0, 0)], [0], [0])


def test_after_refuses_a_stream_of_no_gpu(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    peer = sender.connect(receiver.name)

    class CpuStream:
        cuda_stream = 0
        device = types.SimpleNamespace(type="cpu", index=None)

    with pytest.raises(ValueError, match="names no GPU index"):
        sender.batch(peer).after(CpuStream())


def test_a_block_pool_where_the_peer_has_no_buffer_is_refused_naming_the_pool(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    pool = receiver.allocate(4096)
    peer = sender.connect(receiver.name)
    region = sender.allocate(4096)
    pools = [(region, 0, pool.addr), (region, 0, pool.addr + 4096)]
    with pytest.raises(RangeError, match="pool 1: the peer has no buffer at"):
        sender.batch(peer).write_blocks(pools, [0], [0], block_bytes=1024, pool_bytes=4096)


def test_notifications_arrive_after_their_data_and_time_out(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    inbox = receiver.notifications()
    assert inbox.try_recv() is None
    with pytest.raises(TransferTimeout, match="no notification arrived"):
        inbox.recv(timeout=0.1)

    pool = receiver.allocate(4096)
    source = sender.allocate(4096)
    source.write(0, pattern(4096, seed=41))
    peer = sender.connect(receiver.name)
    sender.write(peer, source, pool.addr, notify=b"req-7").wait(WAIT)
    note = inbox.recv(timeout=WAIT)
    assert note.payload == b"req-7" and note.sender == sender.name
    assert pool.read(0, 4096) == pattern(4096, seed=41)

    sender.notify(peer, "on its own")
    assert inbox.recv(timeout=WAIT).payload == b"on its own"
    with pytest.raises(FerryError):
        receiver.notifications()


def test_ctrl_c_interrupts_a_blocked_recv_and_the_inbox_goes_on(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    inbox = receiver.notifications()
    # As Ctrl-C does: the main thread's SIGINT handler runs at its next check.
    timer = threading.Timer(0.2, _thread.interrupt_main)
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        inbox.recv(timeout=20)
    assert time.monotonic() - started < 2, "Ctrl-C was seen late"
    timer.join()
    sender.notify(sender.connect(receiver.name), "after the interrupt")
    assert inbox.recv(timeout=WAIT).payload == b"after the interrupt"


def test_notifications_are_awaited_and_a_cancelled_wait_loses_none(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    inbox = receiver.notifications()
    peer = sender.connect(receiver.name)

    async def scenario() -> list[bytes]:
        waiting = asyncio.ensure_future(inbox.arecv())
        await asyncio.sleep(0.05)
        sender.notify(peer, b"first")
        first = await asyncio.wait_for(waiting, WAIT)

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(inbox.arecv(), 0.1)
        sender.notify(peer, b"second")
        sender.notify(peer, b"third")
        received = [first.payload]
        async for note in inbox:
            received.append(note.payload)
            if len(received) == 3:
                break
        return received

    assert asyncio.run(asyncio.wait_for(scenario(), 3 * WAIT)) == [b"first", b"second", b"third"]


def test_blocking_calls_refuse_a_running_event_loop_and_connect_has_an_awaitable_form(
        pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    inbox = receiver.notifications()

    async def inside() -> None:
        with pytest.raises(FerryError, match="aconnect"):
            sender.connect(receiver.name)
        peer = await sender.aconnect(receiver.name)
        source = sender.allocate(64)
        pool = receiver.allocate(64)
        transfer = sender.write(peer, source, pool.addr, notify=b"from the loop")
        with pytest.raises(FerryError, match="await the transfer"):
            transfer.wait()
        await transfer
        with pytest.raises(FerryError, match="arecv"):
            inbox.recv(timeout=WAIT)
        assert (await inbox.arecv()).payload == b"from the loop"

    asyncio.run(inside())


def test_regions_are_named_and_peers_find_them_by_name(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    pool = receiver.allocate(4096)
    assert pool.name is None
    pool.set_name("kv-layer-0")
    assert pool.name == "kv-layer-0"
    other = receiver.allocate(64)
    with pytest.raises(FerryError):
        other.set_name("kv-layer-0")
    peer = sender.connect(receiver.name)
    assert peer.buffer("kv-layer-0") == (pool.addr, 4096, "host")
    assert peer.buffer("no-such-name") is None
    source = sender.allocate(4096)
    source.write(0, pattern(4096, seed=9))
    addr, _, _ = peer.buffer("kv-layer-0")
    sender.write(peer, source, addr).wait(WAIT)
    assert pool.read(0, 4096) == pattern(4096, seed=9)


def test_transfers_are_awaited_from_asyncio(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    pool = receiver.allocate(16 * 4096)
    source = sender.allocate(16 * 4096)
    source.write(0, pattern(16 * 4096, seed=51))
    peer = sender.connect(receiver.name)

    async def scenario() -> list[ferry_kv.Completion]:
        transfers = [
            sender.write(peer, source, pool.addr + index * 4096, nbytes=4096, offset=index * 4096)
            for index in range(16)
        ]
        return await asyncio.gather(*transfers)

    completions = asyncio.run(asyncio.wait_for(scenario(), WAIT))
    assert [completion.bytes for completion in completions] == [4096] * 16
    assert pool.read(0, 16 * 4096) == pattern(16 * 4096, seed=51)

    async def failing() -> None:
        await sender.write(peer, source, pool.addr + 16 * 4096, nbytes=4096)

    with pytest.raises(RangeError, match="not inside"):
        asyncio.run(asyncio.wait_for(failing(), WAIT))


def test_errors_carry_ferrys_class_and_message(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    pool = receiver.allocate(4096)
    source = sender.allocate(8192)
    peer = sender.connect(receiver.name)
    with pytest.raises(RangeError, match="not inside one registered region"):
        sender.write(peer, source, pool.addr + 4096, nbytes=4096).wait(WAIT)
    with pytest.raises(RangeError):
        sender.write(peer, source, pool.addr, nbytes=4096, offset=8192).wait(WAIT)

    batch = sender.batch(peer).write(source, 0, pool.addr, 16)
    batch.submit().wait(WAIT)
    with pytest.raises(FerryError, match="submitted already"):
        batch.submit()

    with pytest.raises(PeerError, match="cannot reach peer"):
        sender.connect("127.0.0.1:1")


def test_a_wrong_secret_raises_authentication_error() -> None:
    with Engine(secret=b"one secret of sixteen bytes", transfer_timeout=TRANSFER) as receiver, Engine(
        secret="another secret, also long enough", transfer_timeout=TRANSFER
    ) as sender:
        with pytest.raises(AuthenticationError):
            sender.connect(receiver.name)
    with Engine(secret="a shared secret of 32 bytes.....", transfer_timeout=TRANSFER) as receiver, Engine(
        secret=b"a shared secret of 32 bytes.....", transfer_timeout=TRANSFER
    ) as sender:
        assert sender.connect(receiver.name).name == receiver.name


def test_a_closed_engine_refuses_work() -> None:
    engine = Engine(transfer_timeout=TRANSFER)
    region = engine.allocate(64)
    inbox = engine.notifications()
    engine.close()
    assert engine.closed
    with pytest.raises(FerryError, match="engine is closed"):
        engine.allocate(64)
    with pytest.raises(FerryError, match="engine is closed"):
        inbox.recv(timeout=WAIT)
    assert list(inbox) == []
    region.close()


def test_an_engine_serves_its_fd_socket_in_a_socket_directory_until_it_closes() -> None:
    # Under /tmp: a socket path must stay within the kernel's 107 bytes.
    with tempfile.TemporaryDirectory(prefix="ferry-", dir="/tmp") as folder:
        directory = pathlib.Path(folder)
        with Engine(socket_dir=directory, transfer_timeout=TRANSFER):
            sockets = [path.name for path in directory.iterdir() if path.is_socket()]
            assert len(sockets) == 1, sockets
            assert sockets[0].startswith("ferry-") and sockets[0].endswith(".sock"), sockets
        assert [path for path in directory.iterdir() if path.is_socket()] == []
        with pytest.raises(FerryError, match="socket directory .* cannot be read"):
            Engine(socket_dir=str(directory / "not-mounted"))


CHILD = textwrap.dedent(
    """
    import sys
    from ferry_kv import Engine

    with Engine(transfer_timeout=10.0) as engine:
        pool = engine.allocate(8192)
        pool.write(4096, bytes(range(256)) * 16)
        inbox = engine.notifications()
        print(engine.name, pool.addr, flush=True)
        note = inbox.recv(timeout=20.0)
        print(note.payload.decode(), pool.read(0, 4096).hex(), flush=True)
        inbox.recv(timeout=20.0)
    """
)


def _line(child: subprocess.Popen[str], timeout: float) -> str:
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    assert ready, f"the child printed nothing within {timeout} s"
    return child.stdout.readline().strip()


def test_two_processes_write_notify_and_read() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        name, pool_addr = _line(child, WAIT).split()
        with Engine(transfer_timeout=TRANSFER) as engine:
            local = bytearray(pattern(8192, seed=61))
            region = engine.register(local)
            peer = engine.connect(name)
            engine.write(peer, region, int(pool_addr), nbytes=4096, notify=b"req-2p").wait(WAIT)
            payload, landed = _line(child, WAIT).split()
            assert payload == "req-2p"
            assert bytes.fromhex(landed) == pattern(8192, seed=61)[:4096]

            engine.read(peer, region, int(pool_addr) + 4096, nbytes=4096, offset=4096).wait(WAIT)
            assert bytes(local[4096:]) == bytes(range(256)) * 16
            engine.notify(peer, b"done")
        assert child.wait(timeout=WAIT) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=WAIT)


def test_the_stub_declares_every_name_of_the_compiled_module() -> None:
    stub_path = ferry_kv.__file__.replace("__init__.py", "_ferry.pyi")
    with open(stub_path, encoding="utf-8") as stub_file:
        tree = ast.parse(stub_file.read())
    declared: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            declared[node.name] = {
                item.name if isinstance(item, ast.FunctionDef) else item.target.id  # type: ignore[union-attr]
                for item in node.body
                if isinstance(item, ast.FunctionDef)
                or (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
            }
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared[node.target.id] = set()
        elif isinstance(node, ast.FunctionDef):
            declared[node.name] = set()
    missing = []
    for name, value in vars(ferry_kv._ferry).items():
        if name.startswith("__") and name != "__version__":
            continue
        if name not in declared:
            missing.append(name)
        elif isinstance(value, type) and not issubclass(value, BaseException):
            missing += [f"{name}.{attr}" for attr in vars(value) if not attr.startswith("__") and attr not in declared[name]]
    assert missing == []


def test_python_m_ferry_kv_probe_prints_the_machine_and_a_peers_paths() -> None:
    with Engine() as peer:
        buffer = peer.allocate(1 << 16)
        probed = subprocess.run(
            [sys.executable, "-m", "ferry_kv", "probe", "--peer", peer.name],
            capture_output=True, text=True, timeout=60,
        )
        assert probed.returncode == 0, probed.stderr
        lines = probed.stdout.splitlines()
        assert lines[0].startswith("cuda: "), probed.stdout
        assert "transports:" in lines and "  tcp: available" in "\n".join(lines)
        assert any(line.startswith("RDMA: ") for line in lines), probed.stdout
        assert any(line.startswith(f"peer {peer.name}: engine ") and "another process on this host" in line
                   for line in lines), probed.stdout
        assert "  from host memory:" in lines, probed.stdout
        # The buffer's line names the transport it gets, then what the others answered.
        assert any(line.startswith(f"    buffer {buffer.addr:#x} (65536 bytes, pageable host memory): tcp")
                   for line in lines), probed.stdout
    usage = subprocess.run([sys.executable, "-m", "ferry_kv"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "python -m ferry_kv probe" in usage.stderr
    made = [subprocess.run([sys.executable, "-m", "ferry_kv", "secret"], capture_output=True,
                           text=True, timeout=60).stdout.strip() for _ in range(2)]
    assert made[0] != made[1] and all(len(base64.b64decode(secret)) == 32 for secret in made)
    with Engine(secret=made[0]) as secured:
        assert not secured.closed
    bench_help = subprocess.run([sys.executable, "-m", "ferry_kv", "bench", "--help"],
                                capture_output=True, text=True, timeout=60)
    assert bench_help.returncode == 0 and "--device" in bench_help.stdout


def test_entries_added_as_lists_land_as_single_writes_would(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    count, size = 500, 64
    pool = receiver.allocate(count * size)
    local = bytearray(pattern(count * size, seed=21))
    region = sender.register(local)
    peer = sender.connect(receiver.name)
    slots = [(index * 7 + 3) % count for index in range(count)]
    offsets = [index * size for index in range(count)]
    remote = [pool.addr + slot * size for slot in slots]
    batch = sender.batch(peer).write(region, 0, pool.addr + slots[0] * size, size)
    batch.write_entries(region, offsets[1:], remote[1:], size)
    assert len(batch) == count
    batch.submit().wait(WAIT)
    landed = pool.read(0, count * size)
    for index, slot in enumerate(slots):
        at = slot * size
        assert landed[at : at + size] == local[index * size : (index + 1) * size], f"entry {index}"

    # Back with one length per entry, into the zeroed region.
    local[:] = bytes(count * size)
    sender.batch(peer).read_entries(region, offsets, remote, [size] * count).submit().wait(WAIT)
    assert bytes(local) == pattern(count * size, seed=21)


def test_entry_lists_that_do_not_fit_are_refused(pair: tuple[Engine, Engine]) -> None:
    sender, receiver = pair
    pool = receiver.allocate(4096)
    region = sender.register(bytearray(4096))
    peer = sender.connect(receiver.name)
    with pytest.raises(ValueError, match="2 offsets, 1 remote_addrs and 2 lengths"):
        sender.batch(peer).write_entries(region, [0, 64], [pool.addr], 64)
    with pytest.raises(ValueError, match="2 offsets, 2 remote_addrs and 1 lengths"):
        sender.batch(peer).write_entries(region, [0, 64], [pool.addr, pool.addr + 64], [64])
    with pytest.raises(TypeError, match="remote_addrs: item 1 "):
        sender.batch(peer).write_entries(region, [0, 64], [pool.addr, -1], 64)
    with pytest.raises(TypeError, match="nbytes"):
        sender.batch(peer).read_entries(region, [0], [pool.addr], -1)

    # An entry of a list that runs past the region is refused by submit, named by its index
    # in the batch, and nothing moves.
    pool.write(0, pattern(4096, seed=4))
    batch = sender.batch(peer).write(region, 0, pool.addr, 64)
    batch.write_entries(region, [64, 4090], [pool.addr + 64, pool.addr + 128], 64)
    with pytest.raises(RangeError) as refused:
        batch.submit()
    assert "entry 2" in str(refused.value), refused.value
    assert pool.read(0, 4096) == pattern(4096, seed=4)
