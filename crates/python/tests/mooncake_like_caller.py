"""Calls the engine the way SGLang's and vLLM's Mooncake connectors do, through an unmodified
``from mooncake.engine import TransferEngine``; prints ``OK`` when every step worked.

Two engines in this process stand for prefill and decode. Decode registers its KV pool and
publishes ``host:rpc_port``; prefill registers its own, probes decode, then pushes blocks with
``batch_transfer_sync_write`` from a pool of ten threads, treating any non-zero code as failure.
"""

import ctypes
import sys
from concurrent.futures import ThreadPoolExecutor

from mooncake.engine import TransferEngine

HOST = "127.0.0.1"
LAYERS = 4
BLOCKS = 32
BLOCK_BYTES = 4096


class Worker:
    """One side: an engine and one KV pool per layer, registered in one call."""

    def __init__(self, fill):
        self.engine = TransferEngine()
        if self.engine.initialize(HOST, "P2PHANDSHAKE", "rdma", "") != 0:
            raise RuntimeError("Mooncake initialize failed")
        self.session = f"{HOST}:{self.engine.get_rpc_port()}"
        self.pools = [(ctypes.c_char * (BLOCKS * BLOCK_BYTES))() for _ in range(LAYERS)]
        for layer, pool in enumerate(self.pools):
            ctypes.memset(pool, fill(layer), ctypes.sizeof(pool))
        ptrs = [ctypes.addressof(pool) for pool in self.pools]
        lens = [ctypes.sizeof(pool) for pool in self.pools]
        if self.engine.batch_register_memory(ptrs, lens) != 0:
            raise RuntimeError("Mooncake memory registration failed")

    def block_addr(self, layer, block):
        return ctypes.addressof(self.pools[layer]) + block * BLOCK_BYTES


def main():
    decode = Worker(fill=lambda layer: 0)
    prefill = Worker(fill=lambda layer: 65 + layer)
    if prefill.engine.send_probe(decode.session) != 0:
        print(f"probe of {decode.session} failed")
        return 1

    def send(request):
        src_blocks, dst_blocks = request
        src = [prefill.block_addr(layer, b) for layer in range(LAYERS) for b in src_blocks]
        dst = [decode.block_addr(layer, b) for layer in range(LAYERS) for b in dst_blocks]
        lengths = [BLOCK_BYTES] * len(src)
        return prefill.engine.batch_transfer_sync_write(decode.session, src, dst, lengths)

    requests = [([2 * r, 2 * r + 1], [BLOCKS - 1 - 2 * r, BLOCKS - 2 - 2 * r]) for r in range(10)]
    with ThreadPoolExecutor(max_workers=10) as pool:
        codes = list(pool.map(send, requests, timeout=60))
    if any(code != 0 for code in codes):
        print(f"transfer codes {codes}")
        return 1
    for layer in range(LAYERS):
        for _, dst_blocks in requests:
            for block in dst_blocks:
                got = ctypes.string_at(decode.block_addr(layer, block), BLOCK_BYTES)
                if got != bytes([65 + layer]) * BLOCK_BYTES:
                    print(f"layer {layer} block {block} did not arrive")
                    return 1
    untouched = ctypes.string_at(decode.block_addr(0, 0), BLOCK_BYTES)
    if untouched != bytes(BLOCK_BYTES):
        print("block 0, never a destination, was written")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
