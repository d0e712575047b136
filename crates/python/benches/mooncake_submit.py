"""The Mooncake-compatible API's cost per entry on the host, for the kv-llama70b-4k id pattern.

Two engines in this process over TCP on 127.0.0.1, host memory (anonymous mmaps). Each side
registers ``2 x layers`` pools of ``pool_blocks`` blocks of ``block_bytes`` (64 B by default, so
the bytes cost nothing next to the bookkeeping); a request picks ``blocks`` distinct random
source and destination ids, shared by every tensor, and lists one entry per run of adjacent ids
(SGLang's merging), tensor after tensor: about 40,960 entries for the defaults.

It prints the median time per call and per entry of:

- ``lists``: the three lists read and refused (lengths differ, so nothing is planned or sent):
  what turning Python ints into addresses costs;
- ``check``: the same, and every entry checked against the registrations, refused at the last
  one (whose local address is outside them), so nothing is planned or sent either;
- ``submit``: ``batch_transfer_async_write`` (checked, planned and submitted; the transfer is
  then waited for outside the timing);
- ``sync``: ``batch_transfer_sync_write``, the call SGLang makes, bytes moved over TCP included.

Usage: python crates/python/benches/mooncake_submit.py [--calls N] [--layers L] ...
Build the module with ``maturin develop --release`` (from crates/python) first.
"""

import argparse
import os
import statistics
import time
from types import SimpleNamespace

os.environ.setdefault("FERRY_LOG", "off")

from ferry_kv._bench_pools import CtypesPools  # noqa: E402
from ferry_kv._bench_workers import ID_PATTERNS, request_block_ids, request_entries  # noqa: E402
from ferry_kv.mooncake import TransferEngine  # noqa: E402


def engine_with(pools):
    """An initialized engine with ``pools`` (a ``CtypesPools``) registered."""
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("initialize failed")
    if engine.batch_register_memory(pools.addresses, pools.lengths) != 0:
        raise RuntimeError("batch_register_memory failed")
    return engine


FIGURES = ("lists", "check", "submit", "sync")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--pool-blocks", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-bytes", type=int, default=64)
    parser.add_argument("--calls", type=int, default=40, help="timed calls per figure")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions of every figure")
    parser.add_argument("--only", choices=list(FIGURES), action="append")
    parser.add_argument("--ids", choices=ID_PATTERNS, default="random",
                        help="block ids drawn at random (SGLang's rows) or in runs (vLLM's)")
    args = parser.parse_args()
    tensors = 2 * args.layers
    # The request shape as ``ferry_kv.bench`` draws and merges it (seed 1).
    config = SimpleNamespace(seed=1, pool_blocks=args.pool_blocks, blocks=args.blocks,
                             block_bytes=args.block_bytes, ids=args.ids)
    prefill_pools = CtypesPools(tensors, args.pool_blocks, args.block_bytes, config.seed)
    decode_pools = CtypesPools(tensors, args.pool_blocks, args.block_bytes, config.seed)
    prefill = engine_with(prefill_pools)
    decode = engine_with(decode_pools)
    session = decode.get_session_id()

    def request(number):
        src_ids, dst_ids = request_block_ids(config, number)
        return request_entries(config, prefill_pools.addresses, decode_pools.addresses,
                               src_ids, dst_ids)

    entries = len(request(0)[0])
    print(f"{tensors} tensors x {args.blocks} blocks of {args.block_bytes} B: {entries} entries")
    if prefill.batch_transfer_sync_write(session, *request(0)) != 0:
        raise RuntimeError("the first transfer failed")

    def lists(sources, destinations, lengths):
        if prefill.batch_transfer_async_write(session, sources, destinations, lengths) != 0:
            raise RuntimeError("lists of different lengths were accepted")
        return None

    def submit(sources, destinations, lengths):
        batch = prefill.batch_transfer_async_write(session, sources, destinations, lengths)
        if batch == 0:
            raise RuntimeError("batch_transfer_async_write failed")
        return batch

    def sync(sources, destinations, lengths):
        if prefill.batch_transfer_sync_write(session, sources, destinations, lengths) != 0:
            raise RuntimeError("batch_transfer_sync_write failed")
        return None

    def check(sources, destinations, lengths):
        if prefill.batch_transfer_async_write(session, sources, destinations, lengths) != 0:
            raise RuntimeError("an unregistered address was accepted")
        return None

    def timed(call, spoil):
        """The median seconds of ``call`` on fresh lists, built just before it as callers do
        (so their ints are in cache); a submitted batch is waited for after the timing."""
        seconds = []
        for number in range(args.calls):
            sources, destinations, lengths = request(number)
            if spoil == "lists":
                lengths.pop()
            elif spoil == "check":
                sources[-1] = 64
            started = time.perf_counter()
            batch = call(sources, destinations, lengths)
            seconds.append(time.perf_counter() - started)
            if batch is not None and prefill.get_batch_transfer_status([batch]) != 0:
                raise RuntimeError("a transfer failed")
        return statistics.median(seconds)

    figures = {"lists": lists, "check": check, "submit": submit, "sync": sync}
    for name in args.only or list(figures):
        medians = [timed(figures[name], name) for _ in range(args.rounds)]
        text = "  ".join(f"{m * 1e3:7.3f} ms {m * 1e9 / entries:6.1f} ns/entry" for m in medians)
        print(f"{name:7} {text}", flush=True)


if __name__ == "__main__":
    main()
