"""ferry: moves the KV cache of LLM requests between prefill and decode processes over the
fastest link they share (NVLink between processes on one host, TCP everywhere).

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

__all__ = [
    "AuthenticationError",
    "FerryError",
    "PeerError",
    "RangeError",
    "TransferTimeout",
    "UnsupportedMemory",
    "__version__",
]
