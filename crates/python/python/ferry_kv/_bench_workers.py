"""The two processes of ``ferry_kv.bench``: decode (receives) and prefill (sends, times).

Both talk to the parent over a ``multiprocessing`` pipe with small dicts whose ``"kind"`` says
what they are; the parent bounds every wait. Either engine is driven through Mooncake's API
exactly as SGLang drives it: ``initialize(host, "P2PHANDSHAKE", protocol, "")``,
``batch_register_memory`` of the pool tensors, and one ``batch_transfer_sync_write`` per request
(or one per thread's share of the request with ``threads > 1``, as vLLM does).
"""

import os
import random
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ._bench_pools import make_pools

HOST = "127.0.0.1"


@dataclass(frozen=True)
class WorkerConfig:
    """What one process of one engine's run needs."""

    engine: str
    memory: str
    device: str
    layers: int
    pool_blocks: int
    blocks: int
    block_bytes: int
    requests: int
    warmup: int
    threads: int
    seed: int
    protocol: str
    # How a request's block ids are drawn (``ID_PATTERNS``).
    ids: str = "random"

    @property
    def tensors(self):
        """Pool tensors: one K and one V per layer."""
        return 2 * self.layers

    @property
    def request_bytes(self):
        """Bytes one request moves."""
        return self.tensors * self.blocks * self.block_bytes


class EngineUnavailable(Exception):
    """The requested engine cannot be loaded in this environment (reported, not a failure)."""


def engine_environment(engine, device_kind):
    """The environment variables ``engine``'s processes need on ``device_kind`` memory.

    Mooncake's own package must win the ``mooncake.engine`` import over ferry's alias, and its
    NVLink path is only taken with ``MC_INTRANODE_NVLINK=1`` (which refuses host memory).
    """
    if engine == "mooncake":
        variables = {"FERRY_MOONCAKE": "0"}
        if device_kind == "cuda":
            variables["MC_INTRANODE_NVLINK"] = "1"
        return variables
    return {}


def load_engine_class(engine):
    """The ``TransferEngine`` class of ``engine`` (``"ferry"`` or ``"mooncake"``).

    Raises EngineUnavailable when Mooncake's package cannot be imported here.
    """
    if engine == "ferry":
        from .mooncake import TransferEngine

        return TransferEngine
    if engine == "mooncake":
        try:
            import mooncake.engine as module
        except (ImportError, OSError) as error:
            raise EngineUnavailable(f"Mooncake's mooncake.engine is not importable: {error}")
        location = getattr(module, "__file__", "") or ""
        if not location.endswith(".so"):
            raise EngineUnavailable(
                f"mooncake.engine resolved to {module.__name__} at {location!r}, not Mooncake's "
                "compiled engine"
            )
        return module.TransferEngine
    raise ValueError(f"unknown engine {engine!r}: use ferry or mooncake")


def start_engine(config, pools):
    """A started engine with ``pools`` registered, and its session id ``host:port``."""
    engine = load_engine_class(config.engine)()
    code = engine.initialize(HOST, "P2PHANDSHAKE", config.protocol, "")
    if code != 0:
        raise RuntimeError(f"{config.engine}: initialize returned {code}")
    code = engine.batch_register_memory(pools.addresses, pools.lengths)
    if code != 0:
        raise RuntimeError(f"{config.engine}: batch_register_memory returned {code}")
    return engine, f"{HOST}:{engine.get_rpc_port()}"


# How a request's block ids are drawn: ``random`` picks each id at random (SGLang's rows),
# ``runs`` lays them out in runs of 1 to ``LONGEST_RUN`` consecutive ids, the same runs on both
# sides, as block allocators may hand them out to vLLM (its MooncakeConnector sends a run as one
# entry): the best case, since prefill's and decode's allocators are independent and vLLM
# splits a run wherever either side's ids break.
ID_PATTERNS = ("random", "runs")

LONGEST_RUN = 64


def request_block_ids(config, request):
    """Request ``request``'s (source ids, destination ids): ``blocks`` distinct ids each from
    the pool, shared by every tensor (one block table per request), drawn as ``config.ids``
    says."""
    rng = random.Random(config.seed * 1_000_003 + request)
    if config.ids == "runs":
        lengths, left = [], config.blocks
        while left:
            lengths.append(min(rng.randint(1, LONGEST_RUN), left))
            left -= lengths[-1]

        def ids(starts):
            return [start + offset for start, length in zip(starts, lengths)
                    for offset in range(length)]

        return (ids(run_starts(rng, lengths, config.pool_blocks)),
                ids(run_starts(rng, lengths, config.pool_blocks)))
    pool = range(config.pool_blocks)
    return rng.sample(pool, config.blocks), rng.sample(pool, config.blocks)


def run_starts(rng, lengths, pool_blocks):
    """The first id of each run of ``lengths`` ids in a pool of ``pool_blocks``: the runs lie
    in a random order with random gaps between them, none overlapping another."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    free = pool_blocks - sum(lengths)
    # Sorted cut points in [0, free]: the gap before each run, in pool order, adds up to at
    # most ``free``, so the last run ends inside the pool.
    cuts = sorted(rng.randint(0, free) for _ in lengths)
    starts = [0] * len(lengths)
    position, previous = 0, 0
    for index, cut in zip(order, cuts):
        position += cut - previous
        previous = cut
        starts[index] = position
        position += lengths[index]
    return starts


def merged_runs(src_ids, dst_ids):
    """(first source id, first destination id, length in blocks) of each run of consecutive
    entries that are adjacent on both sides, in request order (SGLang's merging)."""
    runs = []
    for src, dst in zip(src_ids, dst_ids):
        if runs:
            first_src, first_dst, count = runs[-1]
            if src == first_src + count and dst == first_dst + count:
                runs[-1] = (first_src, first_dst, count + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def request_entries(config, src_bases, dst_bases, src_ids, dst_ids):
    """The (source addresses, destination addresses, lengths) of one request, layer by layer."""
    block = config.block_bytes
    runs = merged_runs(src_ids, dst_ids)
    sources, destinations, lengths = [], [], []
    for src_base, dst_base in zip(src_bases, dst_bases):
        for src, dst, count in runs:
            sources.append(src_base + src * block)
            destinations.append(dst_base + dst * block)
            lengths.append(count * block)
    return sources, destinations, lengths


def split(entries, parts):
    """``entries`` (three parallel lists) cut into at most ``parts`` contiguous shares."""
    sources, destinations, lengths = entries
    size = -(-len(lengths) // parts)
    return [
        (sources[i : i + size], destinations[i : i + size], lengths[i : i + size])
        for i in range(0, len(lengths), size)
    ]


def _run_worker(conn, config, body):
    """Runs ``body(conn)`` with the engine's environment, reporting failures on ``conn``."""
    os.environ.update(engine_environment(config.engine, config.device.split(":")[0]))
    try:
        body(conn)
    except EngineUnavailable as error:
        conn.send({"kind": "unavailable", "reason": str(error)})
    except Exception as error:
        conn.send(
            {
                "kind": "error",
                "reason": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
        )
    finally:
        conn.close()


def decode_main(conn, config):
    """The decode process: registers its pools (poisoned), reports its session id and pool
    addresses, then answers ``poison`` and ``verify`` until ``exit``."""

    def body(conn):
        pools = make_pools(
            config.memory, config.tensors, config.pool_blocks, config.block_bytes,
            config.device, config.seed,
        )
        pools.poison()
        engine, session = start_engine(config, pools)
        conn.send({"kind": "ready", "session": session, "addresses": pools.addresses})
        serve_checks(conn, pools)
        engine.batch_unregister_memory(pools.addresses)

    _run_worker(conn, config, body)


def serve_checks(conn, pools):
    """Answers the parent's ``poison`` and ``verify`` on the decode's ``pools`` until ``exit``."""
    while True:
        message = conn.recv()
        if message["kind"] == "poison":
            pools.poison()
            conn.send({"kind": "poisoned"})
        elif message["kind"] == "verify":
            problems = pools.check(message["src_ids"], message["dst_ids"])
            conn.send({"kind": "verified", "problems": problems})
        elif message["kind"] == "exit":
            return


def prefill_main(conn, config, session, remote_addresses):
    """The prefill process: registers its pools (filled with the pattern), runs the warm-up and
    timed requests against ``session``, asking the parent to poison the decode pools before the
    last one, and reports the seconds of each timed request and the last one's block ids."""

    def body(conn):
        pools = make_pools(
            config.memory, config.tensors, config.pool_blocks, config.block_bytes,
            config.device, config.seed,
        )
        pools.fill_pattern()
        engine, _ = start_engine(config, pools)
        executor = ThreadPoolExecutor(config.threads) if config.threads > 1 else None

        def transfer(entries):
            if executor is None:
                codes = [engine.batch_transfer_sync_write(session, *entries)]
            else:
                shares = split(entries, config.threads)
                codes = list(
                    executor.map(lambda share: engine.batch_transfer_sync_write(session, *share), shares)
                )
            failed = [code for code in codes if code != 0]
            if failed:
                raise RuntimeError(f"{config.engine}: batch_transfer_sync_write returned {failed[0]}")

        seconds = []
        total = config.warmup + config.requests
        entry_count = 0
        for request in range(total):
            src_ids, dst_ids = request_block_ids(config, request)
            entries = request_entries(config, pools.addresses, remote_addresses, src_ids, dst_ids)
            entry_count = len(entries[2])
            if request == total - 1:
                conn.send({"kind": "poison-decode"})
                if conn.recv()["kind"] != "go":
                    raise RuntimeError("the parent did not confirm the decode pools were poisoned")
            started = time.perf_counter()
            transfer(entries)
            elapsed = time.perf_counter() - started
            if request >= config.warmup:
                seconds.append(elapsed)
        if executor is not None:
            executor.shutdown()
        conn.send(
            {
                "kind": "done",
                "seconds": seconds,
                "entries": entry_count,
                "src_ids": src_ids,
                "dst_ids": dst_ids,
            }
        )
        conn.recv()
        engine.batch_unregister_memory(pools.addresses)

    _run_worker(conn, config, body)
