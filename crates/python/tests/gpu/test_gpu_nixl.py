"""ferry through NIXL's API (``ferry_kv.nixl``) on torch CUDA tensors, as vLLM's NixlConnector
drives it: the decode pulling (READ) and the prefill pushing (WRITE) between two processes,
with PyTorch's default allocator and with expandable segments (VMM memory). Each run is the
bench's ferry rows of ``--api nixl`` (``--engines nixl-pull,nixl-push,ferry``) on a small
shape: both processes register their pool tensors as ``VRAM``, prepare NIXL's strided rows,
move every request, and the decode's pools are poisoned before the last request and checked
block by block after it.

Runs on GPU 0 -> GPU 0 and GPU 0 -> GPU 1 (the latter fails, never skips, on one GPU).
"""

import json
import subprocess
import sys

import pytest
from gpu_processes import allocator_env, needs_two_gpus

SHAPE = ["--layers", "4", "--pool-blocks", "1024", "--blocks", "256", "--requests", "3",
         "--warmup", "1", "--timeout", "120"]


def run_nixl_bench(tmp_path, allocator, prefill_gpu, decode_gpu):
    report = tmp_path / "bench.json"
    env = allocator_env(allocator)
    env["FERRY_NIXL_HOST"] = "127.0.0.1"
    result = subprocess.run(
        [sys.executable, "-m", "ferry_kv.bench", "--device", "cuda",
         "--engines", "nixl-pull,nixl-push,ferry",
         "--prefill-gpu", str(prefill_gpu), "--decode-gpu", str(decode_gpu), *SHAPE,
         "--json", str(report)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(report.read_text())["rows"]
    assert [row["engine"] for row in rows] == ["nixl-pull", "nixl-push", "ferry"]
    for row in rows:
        assert row.get("verified") is True and row["problems"] == [], row


@pytest.mark.parametrize("allocator", [None, "expandable_segments:True"])
def test_nixl_pull_and_push_move_vram_on_one_gpu(tmp_path, allocator):
    run_nixl_bench(tmp_path, allocator, 0, 0)


@pytest.mark.parametrize("allocator", [None, "expandable_segments:True"])
def test_nixl_pull_and_push_move_vram_between_two_gpus(tmp_path, allocator):
    needs_two_gpus()
    run_nixl_bench(tmp_path, allocator, 0, 1)
