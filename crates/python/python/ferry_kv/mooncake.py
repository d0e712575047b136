"""Mooncake's ``TransferEngine`` on ferry, with Mooncake's call conventions exactly.

Use it as ``from ferry_kv.mooncake import TransferEngine``, or let unmodified code that does
``from mooncake.engine import TransferEngine`` get it (see ``ferry_kv._mooncake_alias`` and the
README's Python section). Every method returns Mooncake's codes (``0`` success, ``-1`` failure,
batch id ``0`` failure) and logs the reason of a failure to stderr (``FERRY_LOG``).
"""

from ._ferry import TransferEngine, TransferNotify, TransferOpcode

Read = TransferOpcode.Read
Write = TransferOpcode.Write

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode", "Read", "Write"]
