"""``python -m ferry_kv``: the operator's tools that come with the module.

- ``python -m ferry_kv probe [--peer NAME] [--metadata URL] [--secret-file PATH]``: what
  ``ferry probe`` prints: the CUDA driver, GPUs, peer access, FABRIC support, transports and
  RDMA devices; with ``--peer``, which transport each of that engine's buffers gets from here
  and why (nothing is written into the peer).
- ``python -m ferry_kv secret``: a new shared secret, as ``ferry secret`` prints it (32 random
  bytes as one line of base64), for ``FERRY_SECRET`` or a secret file.
- ``python -m ferry_kv bench ...``: ``python -m ferry_kv.bench`` (``--help`` lists its options).
"""

from __future__ import annotations

import argparse
import base64
import secrets
import sys

from . import _ferry


def probe(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ferry_kv probe",
        description="What this machine offers ferry, and the path to a peer's buffers.")
    parser.add_argument("--peer", help="a running engine's name (host:port with p2p metadata)")
    parser.add_argument("--metadata", default="p2p",
                        help="where descriptors are published: p2p (default), redis://host:port")
    parser.add_argument("--secret-file",
                        help="a file holding the peers' shared secret (FERRY_SECRET when unset)")
    args = parser.parse_args(argv)
    print(_ferry.probe_machine(), end="")
    if args.peer is not None:
        secret = None
        if args.secret_file is not None:
            # As `ferry --secret-file` reads it: the file's bytes, trailing whitespace removed.
            with open(args.secret_file, "rb") as file:
                secret = file.read().rstrip()
        # Without a secret file, the engine takes FERRY_SECRET when it is set.
        engine = _ferry.Engine("127.0.0.1:0", None, args.metadata, secret, 30.0, True)
        try:
            print(_ferry.probe_routes(engine, args.peer), end="")
        finally:
            engine.close()
    return 0


def secret(argv: list[str]) -> int:
    if argv:
        print("python -m ferry_kv secret takes no arguments", file=sys.stderr)
        return 2
    print(base64.b64encode(secrets.token_bytes(32)).decode())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"probe": probe, "secret": secret}
    if argv[:1] == ["bench"]:
        from . import bench

        return bench.main(argv[1:])
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
