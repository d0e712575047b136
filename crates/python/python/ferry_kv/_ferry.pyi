"""Type stubs of ``ferry_kv._ferry``, the compiled half of ``ferry_kv``.

The native classes here take integer addresses; use them through ``ferry_kv.Engine``, which
registers objects without raw pointers and wraps transfers and notifications for ``asyncio``.
"""

from typing import Any, Callable, ClassVar, final

__version__: str

# Exceptions -----------------------------------------------------------------------------------

class FerryError(Exception):
    """Base class of the errors ferry raises (host memory it cannot allocate raises
    ``MemoryError``); the message says what was wrong and what to do."""

class RangeError(FerryError):
    """A local or remote range is empty or not inside a registered region (the peer's refusal
    of a range outside its registrations included)."""

class UnsupportedMemory(FerryError):
    """Memory of a kind ferry cannot register (pool or managed memory, for example)."""

class PeerError(FerryError):
    """A peer could not be reached, went away, refused a request or broke the protocol."""

class TransferTimeout(FerryError):
    """A transfer or a wait did not finish within its time limit."""

class AuthenticationError(FerryError):
    """A peer did not prove it holds the shared secret, or refused this engine's proof."""

# Native API -----------------------------------------------------------------------------------

@final
class Engine:
    """A ferry engine; ``ferry_kv.Engine`` wraps it."""

    def __new__(
        cls,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        metadata: str = "p2p",
        secret: bytes | None = None,
        transfer_timeout: float = 30.0,
        gpu_links: bool = True,
    ) -> Engine: ...
    @property
    def name(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def register(self, addr: int, nbytes: int, owner: Any = None) -> Region: ...
    def allocate(self, nbytes: int) -> Region: ...
    def connect(self, name: str) -> Peer: ...
    def batch(self, peer: Peer) -> Batch: ...
    def notify(self, peer: Peer, payload: bytes) -> None: ...
    def notifications(self) -> Notifications: ...
    def close(self) -> None: ...

@final
class Region:
    """Registered memory; peers may read and write it until it is closed."""

    @property
    def addr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def location(self) -> str:
        """``"host"`` or ``"cuda:N"``."""
    @property
    def owner(self) -> Any: ...
    @property
    def closed(self) -> bool: ...
    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None: ...
    def read(self, offset: int, nbytes: int) -> bytes: ...
    def close(self) -> None: ...
    def __enter__(self) -> Region: ...
    def __exit__(self, kind: object = None, value: object = None, traceback: object = None) -> None: ...

@final
class Peer:
    """An open peer and the memory it had registered when it was opened."""

    @property
    def name(self) -> str: ...
    @property
    def buffers(self) -> list[tuple[int, int, str]]:
        """``(addr, nbytes, location)`` of each registered buffer, in the peer's address space."""
    @property
    def alive(self) -> bool: ...

_Layout = tuple[int, int, int]
_Pool = tuple[Region, int, int]

@final
class Batch:
    """Reads and writes with one peer; ``ferry_kv.Batch`` wraps it."""

    def write(self, region: Region, offset: int, remote_addr: int, nbytes: int) -> None: ...
    def read(self, region: Region, offset: int, remote_addr: int, nbytes: int) -> None: ...
    def write_blocks(
        self,
        nbytes: int,
        local_layout: _Layout,
        remote_layout: _Layout,
        local_ids: list[int],
        remote_ids: list[int],
        pools: list[_Pool],
    ) -> None: ...
    def read_blocks(
        self,
        nbytes: int,
        local_layout: _Layout,
        remote_layout: _Layout,
        local_ids: list[int],
        remote_ids: list[int],
        pools: list[_Pool],
    ) -> None: ...
    def signal(self, remote_addr: int, value: int) -> None: ...
    def after_stream(self, handle: int, device: int) -> None: ...
    def notify(self, payload: bytes) -> None: ...
    def submit(self) -> Transfer: ...
    def __len__(self) -> int: ...

@final
class Transfer:
    """A submitted batch; ``ferry_kv.Transfer`` wraps it."""

    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> Completion: ...
    def _on_done(self, callback: Callable[[], object]) -> None: ...

@final
class Completion:
    """What a finished transfer did."""

    @property
    def bytes(self) -> int: ...
    @property
    def transports(self) -> list[str]: ...
    @property
    def elapsed_s(self) -> float: ...

@final
class Notification:
    """A message from a peer, delivered after the data of its batch is visible."""

    @property
    def sender(self) -> str:
        """The name the sender claims: unauthenticated."""
    @property
    def payload(self) -> bytes: ...

@final
class Notifications:
    """The engine's notification stream; ``ferry_kv.Notifications`` wraps it."""

    def try_recv(self) -> Notification | None: ...
    def recv(self, timeout: float | None = None) -> Notification | None: ...
    def _recv_async(self, deliver: Callable[[Notification | None], object]) -> Receiving: ...
    def _push_back(self, note: Notification) -> None: ...

@final
class Receiving:
    """An ``asyncio`` receive in progress."""

    def cancel(self) -> None: ...

# Mooncake-compatible API ----------------------------------------------------------------------

@final
class TransferOpcode:
    """Which way a transfer moves bytes, as Mooncake's ``TransferOpcode``."""

    Read: ClassVar[TransferOpcode]
    Write: ClassVar[TransferOpcode]
    def __int__(self) -> int: ...

class TransferNotify:
    """A message delivered to the target after a transfer's data, as Mooncake's."""

    name: str
    msg: str
    def __init__(self, name: str = "", msg: str = "") -> None: ...

@final
class TransferEngine:
    """Mooncake's ``TransferEngine`` on ferry: ``0``/``-1`` returns, failures logged to stderr."""

    TransferOpcode: ClassVar[type[TransferOpcode]]
    def __init__(self) -> None: ...
    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str = "rdma", device_name: str = ""
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def get_session_id(self) -> str: ...
    def register_memory(
        self, buffer_addr: int, capacity: int, location: str = "*", remote_accessible: bool = True
    ) -> int: ...
    def batch_register_memory(self, buffer_addrs: list[int], capacities: list[int], location: str = "*") -> int: ...
    def unregister_memory(self, buffer_addr: int) -> int: ...
    def batch_unregister_memory(self, buffer_addrs: list[int]) -> int: ...
    def transfer_sync_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int: ...
    def transfer_sync_read(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int: ...
    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: TransferOpcode,
        notify: TransferNotify | None = None,
    ) -> int: ...
    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: TransferOpcode,
        notify: TransferNotify | None = None,
    ) -> int: ...
    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int: ...
    def transfer_check_status(self, batch_id: int) -> int: ...
    def batch_transfer_async_write(
        self, target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int]
    ) -> int: ...
    def batch_transfer_async_read(
        self, target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int]
    ) -> int: ...
    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: TransferOpcode,
    ) -> int: ...
    def get_batch_transfer_status(self, batch_ids: list[int]) -> int: ...
    def send_probe(self, target_hostname: str) -> int: ...
    def get_first_buffer_address(self, target_hostname: str) -> int: ...
    def get_notifies(self) -> list[TransferNotify]: ...
    def allocate_managed_buffer(self, length: int) -> int: ...
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int: ...
    def write_bytes_to_buffer(self, dest_address: int, src_data: bytes, length: int) -> int: ...
    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes: ...
