"""ferry's native API: the engine of the Rust crate in Python terms.

``Engine`` registers tensors and buffers (no raw pointers needed), opens peers by name and
moves bytes in batches that complete as one ``Transfer``; a notification attached to a batch
reaches the peer only after the batch's data is visible there. Errors are ferry's exceptions
(``RangeError``, ``PeerError``, ``TransferTimeout``, ``AuthenticationError`` …, all
``FerryError``) carrying ferry's message, which says what was wrong and what to do.

Waiting never holds the GIL. For ``asyncio``, a ``Transfer`` is awaitable and
``Notifications`` has ``arecv`` and ``async for``: ferry's waiter thread completes the wait
and hands the outcome to the event loop with ``loop.call_soon_threadsafe``, so the loop is
neither blocked nor polling, and no thread is held per pending transfer.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, Iterable, Iterator, NamedTuple, Sequence, Union

from . import _ferry
from ._ferry import Completion, FerryError, Notification, Peer, Region
from ._memory import span_of


def _not_in_a_running_loop(call: str, instead: str) -> None:
    """Raises ``FerryError`` when this thread runs an asyncio event loop: a blocking ``call``
    there would stall every other task of the loop until it returned."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise FerryError(f"{call} blocks, and this thread runs an asyncio event loop that it would "
                     f"stall; {instead}, or call it from another thread")

BlockIds = Union[Sequence[int], Any]
"""Block ids: a list or tuple of ints, or a 1-D integer array (``array.array``, NumPy, torch)."""

Pool = tuple[Region, int, int]
"""One pool of a block copy: ``(local region, offset of the pool in it, the peer's address)``."""

_INTEGER_FORMATS = frozenset("bBhHiIlLqQnN")
_CLOSED = "the engine is closed; no more notifications arrive"


class BlockLayout(NamedTuple):
    """How one side's block pools are laid out; every pool of a block copy has this layout.

    Separate K and V tensors are separate pools; K and V interleaved in one tensor are two pools
    whose offsets differ by the K block's size, each with a stride of both blocks.
    """

    pool_bytes: int
    """Bytes of one pool: a whole number of strides."""
    block_stride: int
    """Bytes from one block's first byte to the next block's."""
    offset: int = 0
    """Where the copied bytes start inside a block (a slice of the heads, for example)."""

    @classmethod
    def packed(cls, pool_bytes: int, block_bytes: int) -> BlockLayout:
        """Pools of ``pool_bytes`` holding blocks of ``block_bytes`` back to back."""
        return cls(pool_bytes, block_bytes, 0)


def _block_ids(ids: BlockIds, name: str) -> list[int]:
    """``ids`` as a list of ints; arrays are converted in C (``tolist``)."""
    if isinstance(ids, list):
        return ids
    if isinstance(ids, (tuple, range)):
        return list(ids)
    dims = getattr(ids, "ndim", None)
    if dims is not None and hasattr(ids, "tolist"):
        dtype = str(getattr(ids, "dtype", ""))
        if dims != 1 or "int" not in dtype:
            raise ValueError(f"{name} must be a 1-D integer array, not {dims}-D {dtype}")
        return ids.tolist()
    try:
        view = memoryview(ids)
    except TypeError:
        raise TypeError(
            f"{name} must be a list of block ids or a 1-D integer array, not {type(ids).__name__}"
        ) from None
    if view.ndim != 1 or view.format.lstrip("@=") not in _INTEGER_FORMATS:
        raise ValueError(f"{name} must be a 1-D integer buffer, not {view.ndim}-D of format {view.format!r}")
    return view.tolist()


def _payload(payload: bytes | bytearray | memoryview | str) -> bytes:
    """A notification payload as bytes; text is encoded as UTF-8."""
    if isinstance(payload, str):
        return payload.encode()
    return bytes(payload)


class Transfer:
    """A submitted batch. Its data is visible at the destination once it completes; until then,
    and after a failure, the destination ranges are undefined. ``await transfer`` from
    ``asyncio``, or ``transfer.wait()`` from a thread. Dropping it does not stop it."""

    __slots__ = ("_inner",)

    def __init__(self, inner: _ferry.Transfer) -> None:
        self._inner = inner

    def done(self) -> bool:
        """Whether the transfer has ended, either way."""
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> Completion:
        """Blocks until the transfer ends; returns its ``Completion`` or raises its error.
        Raises ``TransferTimeout`` when it has not ended within ``timeout`` seconds (it keeps
        running and may be waited for again). Inside a running asyncio event loop, ``await``
        the transfer instead: this raises ``FerryError`` there."""
        _not_in_a_running_loop("Transfer.wait()", "await the transfer")
        return self._inner.wait(timeout)

    def __await__(self) -> Any:
        return self._settled().__await__()

    async def _settled(self) -> Completion:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()

        def settle() -> None:
            if future.done():
                return
            try:
                future.set_result(self._inner.wait())
            except FerryError as error:
                future.set_exception(error)

        def wake() -> None:
            # Runs on ferry's waiter thread once the transfer ended.
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                pass  # The loop is closed: nothing awaits the transfer any more.

        self._inner._on_done(wake)
        return await future

    def __repr__(self) -> str:
        return repr(self._inner)


class Batch:
    """Reads and writes with one peer, completed together. Each method adds to the batch and
    returns it, for chaining; ``submit`` checks everything before anything moves."""

    __slots__ = ("_inner",)

    def __init__(self, inner: _ferry.Batch) -> None:
        self._inner = inner

    def write(self, region: Region, offset: int, remote_addr: int, nbytes: int) -> Batch:
        """Adds a write of ``nbytes`` from ``region`` at ``offset`` to the peer's ``remote_addr``."""
        self._inner.write(region, offset, remote_addr, nbytes)
        return self

    def read(self, region: Region, offset: int, remote_addr: int, nbytes: int) -> Batch:
        """Adds a read of ``nbytes`` from the peer's ``remote_addr`` into ``region`` at ``offset``."""
        self._inner.read(region, offset, remote_addr, nbytes)
        return self

    def write_entries(
        self,
        region: Region,
        offsets: Sequence[int],
        remote_addrs: Sequence[int],
        nbytes: int | Sequence[int],
    ) -> Batch:
        """Adds a write for each entry: ``nbytes`` (or ``nbytes[i]``) bytes from ``region`` at
        ``offsets[i]`` to the peer's ``remote_addrs[i]``. The same as ``write`` once per entry,
        built in one call: lists of ints are read without a Python call per entry."""
        self._inner.write_entries(region, offsets, remote_addrs, nbytes)
        return self

    def read_entries(
        self,
        region: Region,
        offsets: Sequence[int],
        remote_addrs: Sequence[int],
        nbytes: int | Sequence[int],
    ) -> Batch:
        """Adds a read for each entry: ``nbytes`` (or ``nbytes[i]``) bytes from the peer's
        ``remote_addrs[i]`` into ``region`` at ``offsets[i]``; arguments as ``write_entries``."""
        self._inner.read_entries(region, offsets, remote_addrs, nbytes)
        return self

    def write_blocks(
        self,
        pools: Iterable[Pool],
        local_ids: BlockIds,
        remote_ids: BlockIds,
        block_bytes: int | None = None,
        pool_bytes: int | None = None,
        *,
        local_layout: BlockLayout | None = None,
        remote_layout: BlockLayout | None = None,
        nbytes: int | None = None,
    ) -> Batch:
        """Adds a paged copy to the peer: block ``local_ids[i]`` of every local pool to block
        ``remote_ids[i]`` of the matching remote pool. Pools are ``(region, offset,
        remote_addr)``. Packed pools take ``block_bytes`` and ``pool_bytes``; strided ones take
        ``local_layout`` (and ``remote_layout`` when the peer's differs). ``nbytes`` per block
        defaults to ``block_bytes``, else to the layout's stride less its offset."""
        self._inner.write_blocks(
            *self._blocks(pools, local_ids, remote_ids, block_bytes, pool_bytes, local_layout, remote_layout, nbytes)
        )
        return self

    def read_blocks(
        self,
        pools: Iterable[Pool],
        local_ids: BlockIds,
        remote_ids: BlockIds,
        block_bytes: int | None = None,
        pool_bytes: int | None = None,
        *,
        local_layout: BlockLayout | None = None,
        remote_layout: BlockLayout | None = None,
        nbytes: int | None = None,
    ) -> Batch:
        """Adds a paged copy from the peer's pools into local ones; arguments as ``write_blocks``."""
        self._inner.read_blocks(
            *self._blocks(pools, local_ids, remote_ids, block_bytes, pool_bytes, local_layout, remote_layout, nbytes)
        )
        return self

    @staticmethod
    def _blocks(
        pools: Iterable[Pool],
        local_ids: BlockIds,
        remote_ids: BlockIds,
        block_bytes: int | None,
        pool_bytes: int | None,
        local_layout: BlockLayout | None,
        remote_layout: BlockLayout | None,
        nbytes: int | None,
    ) -> tuple[int, BlockLayout, BlockLayout, list[int], list[int], list[Pool]]:
        if local_layout is None:
            if block_bytes is None or pool_bytes is None:
                raise ValueError("pass block_bytes and pool_bytes for packed pools, or local_layout=BlockLayout(...)")
            local_layout = BlockLayout.packed(pool_bytes, block_bytes)
        remote_layout = local_layout if remote_layout is None else remote_layout
        if nbytes is None:
            nbytes = block_bytes if block_bytes is not None else local_layout.block_stride - local_layout.offset
        return (
            nbytes,
            local_layout,
            remote_layout,
            _block_ids(local_ids, "local_ids"),
            _block_ids(remote_ids, "remote_ids"),
            [tuple(pool) for pool in pools],  # type: ignore[misc]
        )

    def signal(self, remote_addr: int, value: int) -> Batch:
        """Writes the 32-bit ``value`` into the peer's GPU memory at ``remote_addr`` once the
        batch's data is visible there, for a peer stream waiting on that word (nvlink only)."""
        self._inner.signal(remote_addr, value)
        return self

    def after(self, stream: Any) -> Batch:
        """Lets the batch's data move only once the work queued on ``stream`` so far has
        finished, without blocking the host: prefill queues a layer's compute, calls this with
        its stream, submits, and goes on computing. ``stream`` is a ``torch.cuda.Stream`` or
        any object with ``cuda_stream`` (the driver's handle) and ``device``. Block copies
        that nvlink's copy kernel carries wait for it on the GPU and start the moment the
        data is written; everything else waits for it on the host. If the stream's work never
        finishes, neither does the transfer."""
        device = stream.device
        index = device if isinstance(device, int) else device.index
        if index is None:
            raise ValueError(f"the stream's device {device!r} names no GPU index; pass a stream of a CUDA device")
        self._inner.after_stream(int(stream.cuda_stream), int(index))
        return self

    def notify(self, payload: bytes | bytearray | memoryview | str) -> Batch:
        """Sends ``payload`` (at most 64 KiB; text as UTF-8) once the batch's data is visible."""
        self._inner.notify(_payload(payload))
        return self

    def submit(self) -> Transfer:
        """Checks every entry and starts the transfer; the batch cannot be used again."""
        return Transfer(self._inner.submit())

    def __len__(self) -> int:
        return len(self._inner)


class Notifications:
    """The messages peers send this engine, in the order each peer sent them. Iterate it (or
    ``async for``) to receive until the engine closes.

    ``Notification.sender`` is the name the sender claims, unauthenticated: show it to people,
    but name the peer to answer in your own configuration and ``connect`` to that."""

    __slots__ = ("_inner",)

    def __init__(self, inner: _ferry.Notifications) -> None:
        self._inner = inner

    def recv(self, timeout: float | None = None) -> Notification:
        """The next notification, waiting for it. Raises ``TransferTimeout`` when none arrived
        within ``timeout`` seconds, ``FerryError`` once the engine is closed, or inside a running
        asyncio event loop (``await notes.arecv()`` there)."""
        _not_in_a_running_loop("Notifications.recv()", "await notes.arecv()")
        note = self._inner.recv(timeout)
        if note is None:
            raise FerryError(_CLOSED)
        return note

    def try_recv(self) -> Notification | None:
        """The next notification if one is waiting, else ``None``."""
        return self._inner.try_recv()

    async def arecv(self) -> Notification:
        """The next notification, awaited without blocking the event loop. Cancelling the wait
        loses nothing: a notification that arrived meanwhile is kept for the next receive.
        Raises ``FerryError`` once the engine is closed."""
        note = await self._next()
        if note is None:
            raise FerryError(_CLOSED)
        return note

    async def _next(self) -> Notification | None:
        note = self._inner.try_recv()
        if note is not None:
            return note
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Notification | None] = loop.create_future()

        def settle(note: Notification | None) -> None:
            if not future.done():
                future.set_result(note)
            elif note is not None:
                self._inner._push_back(note)

        def deliver(note: Notification | None) -> None:
            # Runs on ferry's waiter thread; raising (the loop is closed) keeps the note.
            loop.call_soon_threadsafe(settle, note)

        receiving = self._inner._recv_async(deliver)
        try:
            return await future
        finally:
            receiving.cancel()

    def __iter__(self) -> Iterator[Notification]:
        _not_in_a_running_loop("iterating Notifications", "use async for")
        while (note := self._inner.recv(None)) is not None:
            yield note

    def __aiter__(self) -> AsyncIterator[Notification]:
        return self

    async def __anext__(self) -> Notification:
        note = await self._next()
        if note is None:
            raise StopAsyncIteration
        return note


class Engine:
    """A ferry engine: registers memory, opens peers and moves bytes between them.

    ``listen`` is the control listener's address (port 0: the system picks); ``advertise`` the
    host peers reach it at (needed when listening on ``0.0.0.0``); ``metadata`` where
    descriptors are published: ``"p2p"`` (peers ask each other, by ``host:port``),
    ``"memory"`` (one process), ``"etcd://host:port"`` or ``"redis://host:port"``. Peers must
    prove they hold ``secret`` (bytes or text; the ``FERRY_SECRET`` environment variable when
    ``None``). A transfer fails after ``transfer_timeout`` seconds. ``gpu_links=False`` moves
    GPU memory over TCP only. ``socket_dir`` (the ``FERRY_SOCKET_DIR`` environment variable
    when ``None``) is a directory shared with engines in other network namespaces, such as
    another Kubernetes pod's (a hostPath volume mounted at the same path in both): the engine
    also serves its fd socket there, so VMM GPU memory and notifications cross between them;
    it must exist and be writable, or the engine does not start. Use it as a context manager,
    or ``close()`` it.
    """

    __slots__ = ("_inner",)

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        metadata: str = "p2p",
        secret: bytes | str | None = None,
        transfer_timeout: float = 30.0,
        gpu_links: bool = True,
        socket_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        directory = None if socket_dir is None else os.fspath(socket_dir)
        self._inner = _ferry.Engine(listen, advertise, metadata, secret, transfer_timeout, gpu_links, directory)

    @property
    def name(self) -> str:
        """This engine's name, ``host:port``: what peers pass to ``connect``."""
        return self._inner.name

    @property
    def port(self) -> int:
        """The port the engine listens on."""
        return self._inner.port

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._inner.closed

    def register(self, obj: Any) -> Region:
        """Registers the memory of ``obj`` (host or GPU) for peers and local batches, keeping
        ``obj`` alive while the region is open: a torch tensor or storage, an object with
        ``__cuda_array_interface__``, or a writable buffer (``bytearray``, NumPy array,
        ``memoryview``, ctypes array). Peers may write it at any time while it is registered."""
        span = span_of(obj)
        return self._inner.register(span.addr, span.nbytes, span.owner)

    def register_address(self, addr: int, nbytes: int, owner: Any = None) -> Region:
        """Registers ``nbytes`` at the raw address ``addr``. The memory must stay valid until
        the region is closed; ``owner``, if given, is kept alive that long."""
        return self._inner.register(addr, nbytes, owner)

    def allocate(self, nbytes: int) -> Region:
        """A fresh, zeroed host buffer of ``nbytes``, owned and registered by the engine; reach
        it with ``Region.write`` and ``Region.read``."""
        return self._inner.allocate(nbytes)

    def connect(self, name: str) -> Peer:
        """Opens the peer named ``name`` (its ``host:port`` with ``p2p`` metadata). Connect
        again to see memory the peer registered since. Raises ``PeerError`` when it cannot
        be reached, ``AuthenticationError`` when the secrets differ; ``FerryError`` inside a
        running asyncio event loop, where ``await engine.aconnect(name)`` does the same."""
        _not_in_a_running_loop("Engine.connect()", "await engine.aconnect(name)")
        return self._inner.connect(name)

    async def aconnect(self, name: str) -> Peer:
        """``connect`` for asyncio: connects on a worker thread, so the event loop goes on."""
        return await asyncio.get_running_loop().run_in_executor(None, self._inner.connect, name)

    def batch(self, peer: Peer) -> Batch:
        """An empty batch of transfers with ``peer``."""
        return Batch(self._inner.batch(peer))

    def write(
        self,
        peer: Peer,
        region: Region,
        remote_addr: int,
        nbytes: int | None = None,
        offset: int = 0,
        notify: bytes | str | None = None,
    ) -> Transfer:
        """Writes ``nbytes`` (the rest of the region by default) of ``region`` from ``offset``
        to the peer's ``remote_addr``, then delivers ``notify`` if given."""
        batch = self.batch(peer).write(region, offset, remote_addr, _rest(region, offset, nbytes))
        if notify is not None:
            batch.notify(notify)
        return batch.submit()

    def read(
        self,
        peer: Peer,
        region: Region,
        remote_addr: int,
        nbytes: int | None = None,
        offset: int = 0,
        notify: bytes | str | None = None,
    ) -> Transfer:
        """Reads ``nbytes`` (the rest of the region by default) from the peer's ``remote_addr``
        into ``region`` at ``offset``, then delivers ``notify`` to the peer if given."""
        batch = self.batch(peer).read(region, offset, remote_addr, _rest(region, offset, nbytes))
        if notify is not None:
            batch.notify(notify)
        return batch.submit()

    def notify(self, peer: Peer, payload: bytes | bytearray | memoryview | str) -> None:
        """Sends ``payload`` (at most 64 KiB) to ``peer`` on its own; to announce data, attach
        the notification to its batch instead, which delivers it after the data."""
        self._inner.notify(peer, _payload(payload))

    def notifications(self) -> Notifications:
        """The stream of notifications peers send this engine; there is one per engine."""
        return Notifications(self._inner.notifications())

    def close(self) -> None:
        """Stops the engine: transfers in flight fail and peers can no longer reach its memory."""
        self._inner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        inner = getattr(self, "_inner", None)
        return "Engine(not started)" if inner is None else repr(inner)


def _rest(region: Region, offset: int, nbytes: int | None) -> int:
    return region.nbytes - offset if nbytes is None else nbytes
