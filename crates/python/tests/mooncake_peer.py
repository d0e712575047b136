"""The decode-like side of the Mooncake-compatibility tests, run as a process of its own.

Usage: ``python mooncake_peer.py SIZE [HOST]``. It starts a ``TransferEngine`` on HOST
(127.0.0.1 by default), registers SIZE bytes of zeroed host memory followed by an unregistered
guard of ``GUARD`` bytes, and prints one JSON line: its session id, rpc port, the registered
address and size, and the ``register_memory`` code. Then it answers one JSON command per stdin
line with one JSON line on stdout:

- ``{"op": "read", "offset": O, "length": N}`` -> ``{"hex": ...}`` (may reach into the guard)
- ``{"op": "digest", "offset": O, "length": N}`` -> ``{"sha256": ...}``
- ``{"op": "fill", "offset": O, "hex": ...}`` -> ``{"ok": true}``
- ``{"op": "notifies"}`` -> ``{"notifies": [[name, msg], ...]}`` (``get_notifies()``)

It exits when stdin closes, and after ``FERRY_TEST_PEER_LIFETIME_S`` seconds (60 by default)
whatever happens, so a failed test never leaves it behind.
"""

import ctypes
import hashlib
import json
import os
import sys
import threading

from ferry_kv.mooncake import TransferEngine

GUARD = 4096


def reply(message):
    """Writes one JSON line to the test."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main():
    """Runs the peer until stdin closes or its lifetime is over."""
    lifetime = float(os.environ.get("FERRY_TEST_PEER_LIFETIME_S", "60"))
    watchdog = threading.Timer(lifetime, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()

    size = int(sys.argv[1])
    host = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        reply({"error": "initialize failed"})
        return 1
    memory = (ctypes.c_char * (size + GUARD))()
    addr = ctypes.addressof(memory)
    registered = engine.register_memory(addr, size)
    reply(
        {
            "session": engine.get_session_id(),
            "port": engine.get_rpc_port(),
            "addr": addr,
            "size": size,
            "registered": registered,
        }
    )
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "read":
            data = ctypes.string_at(addr + command["offset"], command["length"])
            reply({"hex": data.hex()})
        elif op == "digest":
            data = ctypes.string_at(addr + command["offset"], command["length"])
            reply({"sha256": hashlib.sha256(data).hexdigest()})
        elif op == "fill":
            data = bytes.fromhex(command["hex"])
            ctypes.memmove(addr + command["offset"], data, len(data))
            reply({"ok": True})
        elif op == "notifies":
            reply({"notifies": [[note.name, note.msg] for note in engine.get_notifies()]})
        else:
            reply({"error": f"unknown op {op!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
