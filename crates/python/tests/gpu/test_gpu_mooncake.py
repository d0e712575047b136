"""ferry's Mooncake-compatible engine on torch CUDA tensors, between two processes (prefill
writes, decode checks with torch), with PyTorch's default allocator and with expandable
segments (VMM memory, a 64 MiB tensor spanning several physical allocations).

Runs on GPU 0 -> GPU 0 and, when there are two GPUs, GPU 0 -> GPU 1. Without a GPU (or
without torch) these tests FAIL: they are the GPU suite, and a machine that cannot run them
must not look like one that passed them.

This file is also the worker: ``python test_gpu_mooncake.py decode GPU`` and
``python test_gpu_mooncake.py prefill GPU SESSION ADDRESSES_JSON`` (one JSON line out each).
"""

import json
import os
import random
import subprocess
import sys

import torch
from gpu_processes import GPUS, allocator_env, needs_two_gpus, read_line

HOST = "127.0.0.1"
TENSORS = 2
TENSOR_BYTES = 64 << 20
BLOCK = 32 << 10
BLOCKS = 200
# One large entry crossing the 20 MiB chunks expandable segments hands out.
LARGE = (16 << 20, 38 << 20, 9 << 20)
TIMEOUT = 120


def pattern(tensor, device):
    """Tensor ``tensor``'s source bytes: 8-byte words ``(tensor + 1) << 40 | word index``,
    never zero and different at every position."""
    words = torch.arange(TENSOR_BYTES // 8, dtype=torch.int64, device=device)
    return (words + ((tensor + 1) << 40)).view(torch.uint8)


def entries(seed):
    """(tensor, source offset, destination offset, length) of every write: ``BLOCKS`` random
    32 KiB blocks per tensor (distinct ids each side) and one large entry."""
    rng = random.Random(seed)
    pool = range(TENSOR_BYTES // BLOCK)
    writes = []
    for tensor in range(TENSORS):
        for src, dst in zip(rng.sample(pool, BLOCKS), rng.sample(pool, BLOCKS)):
            if not overlaps(dst * BLOCK, BLOCK, *LARGE[1:]):
                writes.append((tensor, src * BLOCK, dst * BLOCK, BLOCK))
        writes.append((tensor, *LARGE))
    return writes


def overlaps(start, length, other_start, other_length):
    """Whether two byte ranges overlap."""
    return start < other_start + other_length and other_start < start + length


def start_engine(tensors):
    """A ferry Mooncake-compatible engine with ``tensors`` registered, and its session id."""
    from ferry_kv.mooncake import TransferEngine

    engine = TransferEngine()
    assert engine.initialize(HOST, "P2PHANDSHAKE", "rdma", "") == 0
    code = engine.batch_register_memory([t.data_ptr() for t in tensors], [t.numel() for t in tensors])
    assert code == 0, f"batch_register_memory returned {code}"
    return engine, f"{HOST}:{engine.get_rpc_port()}"


def decode_role(gpu):
    """Registers zeroed tensors, prints session and addresses, then checks the writes named
    on stdin against the pattern and prints the problems found."""
    device = torch.device(f"cuda:{gpu}")
    torch.cuda.set_device(device)
    tensors = [torch.zeros(TENSOR_BYTES, dtype=torch.uint8, device=device) for _ in range(TENSORS)]
    torch.cuda.synchronize(device)
    engine, session = start_engine(tensors)
    print(json.dumps({"session": session, "addresses": [t.data_ptr() for t in tensors]}), flush=True)
    writes = json.loads(sys.stdin.readline())
    problems = []
    for tensor, received in enumerate(tensors):
        expected = pattern(tensor, device)
        untouched = received.clone()
        for index, (target, src, dst, length) in enumerate(writes):
            if target != tensor:
                continue
            if not torch.equal(received[dst : dst + length], expected[src : src + length]):
                problems.append(f"tensor {tensor}: write {index} ({length} B at {dst}) is wrong")
            untouched[dst : dst + length] = 0
        if bool(untouched.any()):
            problems.append(f"tensor {tensor}: bytes outside the writes changed")
    print(json.dumps({"problems": problems}), flush=True)
    engine.batch_unregister_memory([t.data_ptr() for t in tensors])


def prefill_role(gpu, session, addresses):
    """Registers the pattern tensors and writes every entry with one batch_transfer_sync_write,
    then the first entry again with transfer_sync_write; prints both return codes."""
    device = torch.device(f"cuda:{gpu}")
    torch.cuda.set_device(device)
    tensors = [pattern(tensor, device) for tensor in range(TENSORS)]
    torch.cuda.synchronize(device)
    engine, _ = start_engine(tensors)
    writes = entries(seed=7)
    sources = [tensors[t].data_ptr() + src for t, src, _, _ in writes]
    destinations = [addresses[t] + dst for t, _, dst, _ in writes]
    lengths = [length for _, _, _, length in writes]
    batch = engine.batch_transfer_sync_write(session, sources, destinations, lengths)
    single = engine.transfer_sync_write(session, sources[0], destinations[0], lengths[0])
    print(json.dumps({"batch": batch, "single": single}), flush=True)



def transfer_and_check(prefill_gpu, decode_gpu, allocator_conf):
    """Runs decode and prefill processes with ``allocator_conf`` and asserts the bytes."""
    assert GPUS >= 1, "no CUDA GPU is visible: this GPU test cannot run here"
    env = allocator_env(allocator_conf)
    worker = [sys.executable, os.path.abspath(__file__)]
    decode = subprocess.Popen(worker + ["decode", str(decode_gpu)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        ready = read_line(decode, TIMEOUT)
        prefill = subprocess.run(
            worker + ["prefill", str(prefill_gpu), ready["session"], json.dumps(ready["addresses"])],
            env=env, text=True, capture_output=True, timeout=TIMEOUT,
        )
        assert prefill.returncode == 0, prefill.stdout + prefill.stderr
        codes = json.loads(prefill.stdout.strip().splitlines()[-1])
        assert codes == {"batch": 0, "single": 0}, prefill.stderr
        decode.stdin.write(json.dumps(entries(seed=7)) + "\n")
        decode.stdin.flush()
        assert read_line(decode, TIMEOUT) == {"problems": []}
        assert decode.wait(TIMEOUT) == 0
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()


def test_a_gpu_is_visible():
    assert GPUS >= 1, "no CUDA GPU is visible: this GPU test cannot run here"


def test_same_gpu_default_allocator():
    transfer_and_check(0, 0, None)


def test_same_gpu_expandable_segments():
    transfer_and_check(0, 0, "expandable_segments:True")



def test_two_gpus_default_allocator():
    needs_two_gpus()
    transfer_and_check(0, 1, None)


def test_two_gpus_expandable_segments():
    needs_two_gpus()
    transfer_and_check(0, 1, "expandable_segments:True")


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "decode":
        decode_role(int(sys.argv[2]))
    elif role == "prefill":
        prefill_role(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
    else:
        sys.exit(f"unknown role {role!r}: use decode or prefill")
