"""``python -m ferry_kv.bench`` on host memory with a tiny shape, and the pieces it trusts to
judge its own result: the merging of adjacent entries and the block-by-block check."""

import ctypes
import json
import os
import subprocess
import sys

import pytest

from ferry_kv._bench_pools import CtypesPools
from ferry_kv._bench_workers import merged_runs

TINY = ["--device", "cpu", "--layers", "2", "--pool-blocks", "64", "--requests", "2",
        "--engines", "ferry", "--timeout", "60"]


@pytest.mark.parametrize("extra", [["--host-memory", "ctypes"], ["--host-memory", "auto", "--threads", "3"]])
def test_bench_runs_a_tiny_shape_and_verifies_it(tmp_path, extra):
    report = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "ferry_kv.bench", *TINY, *extra, "--json", str(report)],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(report.read_text())["rows"]
    assert [row["engine"] for row in rows] == ["ferry"]
    assert rows[0]["verified"] is True and rows[0]["problems"] == []
    assert rows[0]["gbps_p50"] > 0 and len(rows[0]["seconds"]) == 2
    assert "ferry" in result.stdout and " yes " in result.stdout


def test_bench_rejects_more_blocks_than_the_pool_holds():
    result = subprocess.run(
        [sys.executable, "-m", "ferry_kv.bench", *TINY, "--blocks", "65"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--blocks 65 exceeds --pool-blocks 64" in result.stderr


def test_entries_merge_only_when_adjacent_on_both_sides():
    runs = merged_runs([5, 6, 7, 9, 10, 3], [10, 11, 13, 14, 15, 16])
    assert runs == [(5, 10, 2), (7, 13, 1), (9, 14, 2), (3, 16, 1)]


def copy_blocks(source, destination, src_ids, dst_ids):
    """Copies the given blocks of every tensor the way a transfer would."""
    size = source.block_bytes
    for src_base, dst_base in zip(source.addresses, destination.addresses):
        for src, dst in zip(src_ids, dst_ids):
            ctypes.memmove(dst_base + dst * size, src_base + src * size, size)


def test_check_passes_a_right_copy_and_names_wrong_and_stray_blocks():
    source = CtypesPools(tensors=2, pool_blocks=8, block_bytes=4096, seed=1)
    destination = CtypesPools(tensors=2, pool_blocks=8, block_bytes=4096, seed=1)
    source.fill_pattern()
    destination.poison()
    src_ids, dst_ids = [3, 0, 6], [1, 7, 2]
    copy_blocks(source, destination, src_ids, dst_ids)
    assert destination.check(src_ids, dst_ids) == []

    copy_blocks(source, destination, [4], [7])
    copy_blocks(source, destination, [5], [5])
    assert destination.check(src_ids, dst_ids) == [
        "tensor 0: block 5 is outside the request but was written",
        "tensor 0: block 7 does not hold source block 0",
        "tensor 1: block 5 is outside the request but was written",
        "tensor 1: block 7 does not hold source block 0",
    ]


def test_check_notices_a_block_shifted_inside_itself():
    source = CtypesPools(tensors=1, pool_blocks=2, block_bytes=4096, seed=1)
    destination = CtypesPools(tensors=1, pool_blocks=2, block_bytes=4096, seed=1)
    source.fill_pattern()
    destination.poison()
    copy_blocks(source, destination, [0], [1])
    base = destination.addresses[0] + 4096
    ctypes.memmove(base + 64, source.addresses[0] + 32, 4096 - 64)
    assert destination.check([0], [1]) == ["tensor 0: block 1 does not hold source block 0"]


def test_bench_nixl_rows_pull_and_push_through_nixl_s_api_and_verify(tmp_path):
    report = tmp_path / "bench.json"
    args = [arg for arg in TINY if arg not in ("--engines", "ferry")]
    result = subprocess.run(
        [sys.executable, "-m", "ferry_kv.bench", *args, "--api", "nixl", "--json", str(report)],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "FERRY_NIXL_HOST": "127.0.0.1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(report.read_text())["rows"]
    assert [row["engine"] for row in rows] == ["nixl-pull", "nixl-push", "ferry"]
    for row in rows:
        assert row["verified"] is True and row["problems"] == [], row
        assert row["gbps_p50"] > 0 and len(row["seconds"]) == 2
