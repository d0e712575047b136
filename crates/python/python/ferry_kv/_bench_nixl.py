"""The processes of ``ferry_kv.bench``'s NIXL rows: NIXL's API called as vLLM's ``NixlConnector``
calls it, on ferry's agent (``nixl-pull``, ``nixl-push``) or on NIXL's own (``nixl-own-pull``,
``nixl-own-push``), through the same code. One region per pool tensor, prepared as NIXL's
strided rows ``(base, block, devID, block, pool_blocks)``, and vLLM's descriptor ids ``tensor *
pool_blocks + block``; one ``make_prepped_xfer`` per request with a ``"req:1"`` notification,
posted with ``transfer`` and polled with ``check_xfer_state`` until ``"DONE"``.

- ``nixl-push``, ``nixl-own-push``: the prefill WRITEs (vLLM's ``NixlPushConnector``). Same
  messages as the Mooncake rows (``_bench_workers``): the decode is ready first, the prefill
  times.
- ``nixl-pull``, ``nixl-own-pull``: the decode READs (vLLM's default ``NixlConnector``). The
  prefill is ready first; the decode times, poisons its own pools before the last request and
  checks them.

NIXL's own agent comes from ``nixl_cu13._api``, imported by that name: ferry's import hook
answers for ``nixl``, ``nixl._api`` and ``nixl._bindings`` only, so this import cannot pick up
ferry's agent whatever ``FERRY_NIXL`` says, and NIXL's ``nixl`` meta package (which picks
``nixl_cu12`` or ``nixl_cu13`` by the CUDA version torch was built for) is not needed. Its agent
uses the UCX backend, as vLLM's default; UCX picks the transport (cuda_ipc between GPUs of one
host; cma, shared memory or TCP for host memory) and reads its usual ``UCX_*`` variables.
"""

import importlib
import os
import time

import numpy as np

from ._bench_pools import make_pools
from ._bench_workers import EngineUnavailable, _run_worker, request_block_ids, serve_checks

OWN_PACKAGE = "nixl_cu13"
BACKEND = "UCX"


def _api(config):
    """``(nixl_agent, nixl_agent_config)`` of ``config.engine``: ferry's (``nixl-pull``,
    ``nixl-push``) or NIXL's own (``nixl-own-*``). Raises EngineUnavailable when NIXL's own
    package cannot be imported here."""
    if not config.engine.startswith("nixl-own-"):
        os.environ.setdefault("FERRY_NIXL_HOST", "127.0.0.1")
        from .nixl import nixl_agent, nixl_agent_config

        return nixl_agent, nixl_agent_config
    try:
        module = importlib.import_module(f"{OWN_PACKAGE}._api")
    except (ImportError, OSError) as error:
        raise EngineUnavailable(
            f"NIXL's own {OWN_PACKAGE}._api (wheel nixl-cu13) is not importable: {error}"
        )
    return module.nixl_agent, module.nixl_agent_config


def _agent(config, api, name, pools):
    """A NIXL agent of ``api`` (see ``_api``) with ``pools`` registered as vLLM registers them,
    and the strided rows of its regions. Raises EngineUnavailable when NIXL's own agent has no
    UCX plugin."""
    nixl_agent, nixl_agent_config = api
    agent = nixl_agent(
        name, nixl_agent_config(num_threads=4, capture_telemetry=True, backends=[BACKEND])
    )
    if BACKEND not in agent.backends:
        raise EngineUnavailable(
            f"the NIXL agent has no {BACKEND} backend (plugins found: {agent.get_plugin_list()})"
        )
    mem = "VRAM" if config.device.startswith("cuda") else "DRAM"
    device = _device(config)
    descs = agent.get_reg_descs(
        [(addr, length, device, "") for addr, length in zip(pools.addresses, pools.lengths)], mem
    )
    agent.register_memory(descs, backends=[BACKEND])
    return agent, mem, _rows(pools.addresses, config, device)


def _rows(addresses, config, device):
    return np.array(
        [[addr, config.block_bytes, device, config.block_bytes, config.pool_blocks] for addr in addresses],
        dtype=np.uint64,
    )


def _side(config, role):
    """``role``'s pools (the prefill's hold the pattern, the decode's the poison) and its agent,
    lists' memory type and rows (see ``_agent``). The agent's package is imported first, so that
    an engine that cannot run here says so before any pool is made."""
    api = _api(config)
    pools = make_pools(config.memory, config.tensors, config.pool_blocks, config.block_bytes,
                       config.device, config.seed)
    if role == "prefill":
        pools.fill_pattern()
    else:
        pools.poison()
    return pools, _agent(config, api, role, pools)


def _ready(conn, side):
    """Reports ``side``'s agent metadata and pool addresses to the parent; ``side``."""
    pools, (agent, _, _) = side
    conn.send({"kind": "ready", "session": agent.get_agent_metadata().hex(),
               "addresses": pools.addresses})
    return side


def _device(config):
    return int(config.device.split(":")[1]) if ":" in config.device else 0


def _ids(config, blocks):
    offsets = np.arange(config.tensors, dtype=np.int64)[:, None] * config.pool_blocks
    return (offsets + np.asarray(blocks, dtype=np.int64)[None, :]).ravel()


def _requests(agent, config, op, local, remote, before_last):
    """Runs every request; the seconds of the timed ones, the last one's block ids and, per
    timed request, where its time went (microseconds: making the transfer, posting it, the
    transfer as the agent timed it, and from the post to seeing ``"DONE"``). ``before_last()``
    runs untimed before the last request."""
    seconds, phases = [], []
    total = config.warmup + config.requests
    for request in range(total):
        src_ids, dst_ids = request_block_ids(config, request)
        local_blocks, remote_blocks = (dst_ids, src_ids) if op == "READ" else (src_ids, dst_ids)
        # vLLM computes its descriptor ids for any engine; the engine's time starts after.
        local_descs, remote_descs = _ids(config, local_blocks), _ids(config, remote_blocks)
        if request == total - 1:
            before_last()
        started = time.perf_counter()
        handle = agent.make_prepped_xfer(
            op, local, local_descs, remote, remote_descs, notif_msg=f"req-{request}:1".encode()
        )
        made = time.perf_counter()
        agent.transfer(handle)
        # Polled without sleeping, as the native bench waits: a sleep's timer slack (50 us on
        # Linux) would count against the engine.
        state = agent.check_xfer_state(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        ended = time.perf_counter()
        if state != "DONE":
            raise RuntimeError(f"request {request}: the transfer ended {state}")
        telemetry = agent.get_xfer_telemetry(handle)
        agent.release_xfer_handle(handle)
        if request >= config.warmup:
            seconds.append(ended - started)
            phases.append({"make_us": round((made - started) * 1e6), "post_us": telemetry.postDuration,
                           "xfer_us": telemetry.xferDuration, "done_us": round((ended - made) * 1e6)})
    return seconds, phases, src_ids, dst_ids


def source_main(conn, config):
    """The pull row's prefill: pools holding the pattern; reports its metadata and pool
    addresses, then waits to be read until ``exit``."""

    def body(conn):
        # The agent must outlive the reads: its engine serves them.
        side = _ready(conn, _side(config, "prefill"))
        conn.recv()
        del side

    _run_worker(conn, config, body)


def writer_main(conn, config, metadata, remote_addresses):
    """The push row's prefill: writes every request into the decode, asking the parent to
    poison the decode pools before the last, and reports the seconds and the last block ids."""

    def body(conn):
        pools, (agent, mem, rows) = _side(config, "prefill")
        name = agent.add_remote_agent(bytes.fromhex(metadata))
        local, remote = _lists(agent, config, mem, rows, name, remote_addresses)

        def poison_decode():
            conn.send({"kind": "poison-decode"})
            if conn.recv()["kind"] != "go":
                raise RuntimeError("the parent did not confirm the decode pools were poisoned")

        seconds, phases, src_ids, dst_ids = _requests(agent, config, "WRITE", local, remote,
                                                      poison_decode)
        conn.send({"kind": "done", "seconds": seconds, "phases": phases,
                   "entries": len(_ids(config, src_ids)), "src_ids": src_ids, "dst_ids": dst_ids})
        conn.recv()

    _run_worker(conn, config, body)


def _lists(agent, config, mem, rows, name, remote_addresses):
    """The local list and the peer's, prepared as vLLM prepares them."""
    device = _device(config)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type=mem)
    remote = agent.prep_xfer_dlist(name, _rows(remote_addresses, config, device), mem_type=mem)
    return local, remote


def reader_main(conn, config, metadata, remote_addresses):
    """The pull row's decode: reads every request from the source, poisoning its pools before
    the last, and checks them."""

    def body(conn):
        pools, (agent, mem, rows) = _side(config, "decode")
        name = agent.add_remote_agent(bytes.fromhex(metadata))
        local, remote = _lists(agent, config, mem, rows, name, remote_addresses)
        seconds, phases, src_ids, dst_ids = _requests(agent, config, "READ", local, remote,
                                                      pools.poison)
        conn.send({"kind": "done", "seconds": seconds, "phases": phases,
                   "entries": len(_ids(config, src_ids)), "problems": pools.check(src_ids, dst_ids)})
        conn.recv()

    _run_worker(conn, config, body)


def sink_main(conn, config):
    """The push row's decode: poisoned pools; reports its metadata, answers ``poison`` and
    ``verify`` until ``exit``."""

    def body(conn):
        pools, _ = _ready(conn, _side(config, "decode"))
        serve_checks(conn, pools)

    _run_worker(conn, config, body)
