"""``python -m ferry_kv.bench`` on host memory with a tiny shape, and the pieces it trusts to
judge its own result: the merging of adjacent entries, the block-by-block check and the
ratios; NIXL's own rows where its package cannot be loaded (CI has none)."""

import ctypes
import importlib.util
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ferry_kv import bench
from ferry_kv._bench_pools import CtypesPools
from ferry_kv._bench_workers import merged_runs, request_block_ids, run_starts

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


def test_bench_vllm_rows_send_one_entry_per_run_and_verify(tmp_path):
    report = tmp_path / "bench.json"
    args = [arg for arg in TINY if arg not in ("--engines", "ferry")]
    result = subprocess.run(
        [sys.executable, "-m", "ferry_kv.bench", *args, "--pool-blocks", "512", "--blocks", "256",
         "--engines", "ferry,ferry-vllm", "--json", str(report)],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["engine"]: row for row in json.loads(report.read_text())["rows"]}
    assert rows["ferry-vllm"]["verified"] is True and rows["ferry-vllm"]["problems"] == []
    # 256 ids in runs of 1-64: a handful of entries a tensor, where random ids give about one
    # an id.
    assert rows["ferry-vllm"]["entries_per_request"] <= 4 * 256 // 8
    assert rows["ferry"]["entries_per_request"] > 4 * 200


@pytest.mark.parametrize("seed", range(20))
def test_run_ids_are_distinct_ids_of_the_pool_in_a_few_runs(seed):
    config = SimpleNamespace(seed=seed, pool_blocks=300, blocks=256, ids="runs")
    src_ids, dst_ids = request_block_ids(config, 3)
    for ids in (src_ids, dst_ids):
        assert len(ids) == 256 and len(set(ids)) == 256
        assert all(0 <= block < 300 for block in ids)
    # Runs of 1-64 ids, about 8 for 256 ids; random ids would be about 256.
    assert len(merged_runs(src_ids, dst_ids)) < 64


@pytest.mark.parametrize("seed", range(20))
def test_runs_lie_inside_the_pool_without_overlapping(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 12))]
    for pool_blocks in (sum(lengths), sum(lengths) + 1, sum(lengths) + 500):
        starts = run_starts(rng, lengths, pool_blocks)
        taken = [start + offset for start, length in zip(starts, lengths) for offset in range(length)]
        assert len(set(taken)) == sum(lengths)
        assert all(0 <= block < pool_blocks for block in taken)


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
    assert [row["engine"] for row in rows] == [
        "nixl-pull", "nixl-own-pull", "nixl-push", "nixl-own-push", "ferry"]
    # NIXL's own rows run where its package is installed, and are skipped (saying why) elsewhere.
    own_installed = importlib.util.find_spec("nixl_cu13") is not None
    for row in rows:
        if row["engine"].startswith("nixl-own-") and not own_installed:
            assert "nixl_cu13" in row["skipped"], row
            continue
        assert row["verified"] is True and row["problems"] == [], row
        assert row["gbps_p50"] > 0 and len(row["seconds"]) == 2


# Stand-ins for NIXL's own package on PYTHONPATH: one that cannot load, one whose agent found
# no UCX plugin.
BROKEN_NIXL = {
    "__init__.py": 'raise ImportError("libnixl.so: cannot open shared object file")\n',
}
NIXL_WITHOUT_UCX = {
    "__init__.py": "",
    "_api.py": (
        "class nixl_agent_config:\n"
        "    def __init__(self, **options):\n"
        "        pass\n"
        "class nixl_agent:\n"
        "    backends = {}\n"
        "    def __init__(self, name, config):\n"
        "        pass\n"
        "    def get_plugin_list(self):\n"
        "        return ['POSIX']\n"
    ),
}


@pytest.mark.parametrize(
    "package, reason",
    [
        (BROKEN_NIXL, "NIXL's own nixl_cu13._api (wheel nixl-cu13) is not importable: "
                      "libnixl.so: cannot open shared object file"),
        (NIXL_WITHOUT_UCX, "the NIXL agent has no UCX backend (plugins found: ['POSIX'])"),
    ],
    ids=["cannot-load", "no-ucx-plugin"],
)
def test_bench_nixl_own_rows_say_why_they_cannot_run_and_fail_require_all(tmp_path, package, reason):
    folder = tmp_path / "site" / "nixl_cu13"
    folder.mkdir(parents=True)
    for name, text in package.items():
        (folder / name).write_text(text)
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    args = [arg for arg in TINY if arg not in ("--engines", "ferry")]
    report = tmp_path / "bench.json"
    command = [sys.executable, "-m", "ferry_kv.bench", *args,
               "--engines", "nixl-own-pull,nixl-own-push", "--json", str(report)]
    env = {**os.environ, "PYTHONPATH": path}

    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(report.read_text())["rows"]
    assert rows == [{"engine": "nixl-own-pull", "skipped": reason},
                    {"engine": "nixl-own-push", "skipped": reason}]
    assert f"nixl-own-pull skipped: {reason}" in result.stdout

    result = subprocess.run([*command, "--require-all"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 1, result.stdout + result.stderr


def test_bench_api_nixl_takes_nixl_s_own_rows_and_engines_are_checked():
    args = bench.parse_args(["--device", "cpu", "--api", "nixl"])
    assert args.engines == ["nixl-pull", "nixl-own-pull", "nixl-push", "nixl-own-push", "ferry"]
    args = bench.parse_args(["--device", "cpu", "--engines", "nixl-own-push, nixl-own-pull"])
    assert args.engines == ["nixl-own-push", "nixl-own-pull"]
    with pytest.raises(SystemExit) as exit:
        bench.parse_args(["--device", "cpu", "--engines", "nixl-own"])
    assert exit.value.code == 2


def test_ratios_pair_ferry_with_the_other_engine_of_the_same_api_and_pattern():
    def row(engine, p50, verified=True):
        return {"engine": engine, "gbps_p50": p50, "gbps_mean": p50 / 2, "verified": verified}

    rows = [row("nixl-pull", 100.0), row("nixl-own-pull", 4.0), row("nixl-push", 90.0),
            row("nixl-own-push", 3.0, verified=False), row("ferry", 80.0),
            {"engine": "mooncake", "skipped": "not installed"}]
    assert bench.ratios(rows) == {"nixl-pull/nixl-own-pull": {"gbps_p50": 25.0, "gbps_mean": 25.0}}
