"""GPU tests of ferry's native Python API: torch CUDA tensors registered as they are (no raw
pointers), a paged block copy with block ids given as a tensor, a flat write, a notification
after the data, and an awaited read back, between two processes; with PyTorch's default
allocator and with expandable segments. Both processes run on GPU 0 (and on GPU 0 -> GPU 1 in
the two-GPU cases). Without a GPU these tests fail; they never skip.
"""

import asyncio
import json
import os
import subprocess
import sys

import torch
from gpu_processes import GPUS, allocator_env, needs_two_gpus, read_line

TENSORS = 3
BLOCK = 16 << 10
BLOCKS = 512
TENSOR_BYTES = BLOCK * BLOCKS
SOURCE_IDS = list(range(7, 7 + 3 * 40, 3))
TARGET_IDS = list(range(BLOCKS - 1, BLOCKS - 1 - 2 * 40, -2))
FLAT = (1000, 5 * BLOCK + 12, 777)  # source offset, target offset, length: tensor 0 only
TIMEOUT = 120


def pattern(tensor, device):
    """Tensor ``tensor``'s source bytes: int64 words unique to their tensor and position."""
    words = torch.arange(TENSOR_BYTES // 8, dtype=torch.int64, device=device)
    return (words + ((tensor + 1) << 40)).view(torch.uint8)


def expected(tensor, device):
    """What the decode side's tensor ``tensor`` must hold after the writes."""
    source = pattern(tensor, device)
    target = torch.zeros(TENSOR_BYTES, dtype=torch.uint8, device=device)
    for src, dst in zip(SOURCE_IDS, TARGET_IDS):
        target[dst * BLOCK : (dst + 1) * BLOCK] = source[src * BLOCK : (src + 1) * BLOCK]
    if tensor == 0:
        src, dst, length = FLAT
        target[dst : dst + length] = source[src : src + length]
    return target


def decode_role(gpu):
    """Registers zeroed tensors, prints its name and their addresses, waits for the
    notification, then prints whether every byte is what the writes put there."""
    import ferry_kv

    device = torch.device(f"cuda:{gpu}")
    torch.cuda.set_device(device)
    tensors = [torch.zeros(TENSOR_BYTES, dtype=torch.uint8, device=device) for _ in range(TENSORS)]
    torch.cuda.synchronize(device)
    with ferry_kv.Engine() as engine:
        regions = [engine.register(tensor) for tensor in tensors]
        inbox = engine.notifications()
        print(json.dumps({"name": engine.name, "addrs": [r.addr for r in regions],
                          "locations": [r.location for r in regions]}), flush=True)
        note = inbox.recv(timeout=TIMEOUT)
        torch.cuda.synchronize(device)
        problems = [f"tensor {t} differs" for t in range(TENSORS)
                    if not torch.equal(tensors[t], expected(t, device))]
        print(json.dumps({"note": note.payload.decode(), "problems": problems}), flush=True)
        # The prefill reads back from these tensors: stay until it says it is done.
        sys.stdin.readline()


def prefill_role(gpu, name, addrs):
    """Registers the pattern tensors, writes the blocks (ids as a tensor) and the flat entry
    with a notification, then awaits a read of block TARGET_IDS[0] back and checks it."""
    import ferry_kv

    device = torch.device(f"cuda:{gpu}")
    torch.cuda.set_device(device)
    tensors = [pattern(t, device) for t in range(TENSORS)]
    back = torch.zeros(BLOCK, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    with ferry_kv.Engine() as engine:
        regions = [engine.register(tensor) for tensor in tensors]
        landing = engine.register(back)
        peer = engine.connect(name)
        pools = [(region, 0, addr) for region, addr in zip(regions, addrs)]
        src, dst, length = FLAT
        done = (
            engine.batch(peer)
            .write_blocks(pools, torch.tensor(SOURCE_IDS, dtype=torch.int32), TARGET_IDS,
                          block_bytes=BLOCK, pool_bytes=TENSOR_BYTES)
            .write(regions[0], src, addrs[0] + dst, length)
            .notify(b"req-1 ready")
            .submit()
            .wait(timeout=TIMEOUT)
        )

        async def read_back():
            return await engine.read(peer, landing, addrs[1] + TARGET_IDS[0] * BLOCK, BLOCK)

        read = asyncio.run(read_back())
        torch.cuda.synchronize(device)
        want = pattern(1, device)[SOURCE_IDS[0] * BLOCK : (SOURCE_IDS[0] + 1) * BLOCK]
        print(json.dumps({"bytes": done.bytes, "transports": done.transports,
                          "read": read.bytes, "read_ok": bool(torch.equal(back, want)),
                          "locations": [r.location for r in regions]}), flush=True)



def run_pair(prefill_gpu, decode_gpu, allocator_conf):
    """Runs decode and prefill processes and asserts what each saw."""
    assert GPUS >= 1, "no CUDA GPU is visible: this GPU test cannot run here"
    env = allocator_env(allocator_conf)
    worker = [sys.executable, os.path.abspath(__file__)]
    decode = subprocess.Popen(worker + ["decode", str(decode_gpu)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        hello = read_line(decode, TIMEOUT)
        assert hello["locations"] == [f"cuda:{decode_gpu}"] * TENSORS, hello
        prefill = subprocess.run(
            worker + ["prefill", str(prefill_gpu), hello["name"], json.dumps(hello["addrs"])],
            env=env, text=True, capture_output=True, timeout=TIMEOUT,
        )
        assert prefill.returncode == 0, prefill.stdout + prefill.stderr
        sent = json.loads(prefill.stdout.strip().splitlines()[-1])
        assert sent["bytes"] == TENSORS * len(SOURCE_IDS) * BLOCK + FLAT[2], sent
        assert "nvlink" in sent["transports"], sent
        assert sent["read"] == BLOCK and sent["read_ok"], sent
        assert read_line(decode, TIMEOUT) == {"note": "req-1 ready", "problems": []}
        decode.stdin.write("done\n")
        decode.stdin.flush()
        assert decode.wait(TIMEOUT) == 0
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()



def test_after_holds_the_block_copy_until_the_stream_has_written_the_source():
    """The source is written on a stream that first sleeps ~0.1 s on the GPU: only a block
    copy that waits for that stream (``Batch.after``) carries the written bytes, not zeros."""
    assert GPUS >= 1, "no CUDA GPU is visible: this GPU test cannot run here"
    import ferry_kv

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    source = torch.zeros(TENSOR_BYTES, dtype=torch.uint8, device=device)
    target = torch.zeros(TENSOR_BYTES, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    with ferry_kv.Engine() as decode, ferry_kv.Engine() as prefill:
        landing = decode.register(target)
        inbox = decode.notifications()
        region = prefill.register(source)
        peer = prefill.connect(decode.name)
        compute = torch.cuda.Stream(device)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)
            source.copy_(pattern(1, device))
        done = (
            prefill.batch(peer)
            .after(compute)
            .write_blocks([(region, 0, landing.addr)], SOURCE_IDS, TARGET_IDS,
                          block_bytes=BLOCK, pool_bytes=TENSOR_BYTES)
            .notify(b"after")
            .submit()
            .wait(timeout=TIMEOUT)
        )
        assert "nvlink" in done.transports, done
        assert inbox.recv(timeout=TIMEOUT).payload == b"after"
        torch.cuda.synchronize(device)
        assert torch.equal(target, expected(1, device))


def test_native_api_same_gpu_default_allocator():
    run_pair(0, 0, None)


def test_native_api_same_gpu_expandable_segments():
    run_pair(0, 0, "expandable_segments:True")


def test_native_api_two_gpus_default_allocator():
    needs_two_gpus()
    run_pair(0, 1, None)


def test_native_api_two_gpus_expandable_segments():
    needs_two_gpus()
    run_pair(0, 1, "expandable_segments:True")


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "decode":
        decode_role(int(sys.argv[2]))
    else:
        prefill_role(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
