"""ferry: moves the KV cache of LLM requests between prefill and decode processes over the
fastest link they share (NVLink between processes on one host, TCP everywhere).

- ``ferry_kv.Engine``: ferry's own API (regions, peers, batches, transfers awaitable from
  ``asyncio``, notifications); see ``docs/python-native.md``.
- ``ferry_kv.mooncake.TransferEngine``: Mooncake's ``TransferEngine``, call for call.
"""

from ._ferry import (
    AuthenticationError,
    FerryError,
    PeerError,
    RangeError,
    TransferTimeout,
    UnsupportedMemory,
    __version__,
)
from ._ferry import Completion, Notification, Peer, Region
from ._native import Batch, BlockLayout, Engine, Notifications, Transfer

__all__ = [
    "AuthenticationError",
    "Batch",
    "BlockLayout",
    "Completion",
    "Engine",
    "FerryError",
    "Notification",
    "Notifications",
    "Peer",
    "PeerError",
    "RangeError",
    "Region",
    "Transfer",
    "TransferTimeout",
    "UnsupportedMemory",
    "__version__",
]
