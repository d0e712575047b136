"""``python -m ferry_kv.bench``: the ``kv-llama70b-4k`` workload through the Mooncake-compatible
API, the way SGLang calls it and the way vLLM's MooncakeConnector does (the ``-vllm`` rows), for
ferry and (when importable) Mooncake itself, in the same run;
with ``--api nixl``, through NIXL's API the way vLLM's NixlConnector calls it (decode pulling,
prefill pushing; see ``_bench_nixl``), on ferry's agent and (when its ``nixl_cu13`` package is
importable) NIXL's own, beside ferry through Mooncake's.

Per request: ``2 x layers`` pool tensors (K and V per layer), ``blocks`` blocks of 32 KiB each
picked at random from a pool of ``pool_blocks`` (source and destination ids distinct random
draws, one block table shared by every tensor), merged where adjacent on both sides, and sent
with one ``batch_transfer_sync_write`` (or one per thread with ``--threads``). The ``-vllm``
rows draw the ids in runs of 1-64 consecutive ids, the same runs on both sides, instead, as
block allocators may hand them out to vLLM, whose MooncakeConnector sends each run as one entry
(the best case: where the two sides' runs break at different ids, vLLM sends more, shorter
entries). A decode process registers its pools and reports its session id and pool addresses;
the prefill process runs the warm-up and timed requests. The decode pools are poisoned before the last timed request, and
every block of every tensor is checked after it: the destination blocks must hold their source
blocks' pattern, all others the poison.

Prints one row per engine (GB/s decimal: median of the timed requests, and total bytes over
total seconds), whether the bytes verified, and the ratios of ferry to the other project's
engine on the same API and pattern (ferry / Mooncake, ferry-vllm / mooncake-vllm, nixl-pull /
nixl-own-pull, nixl-push / nixl-own-push). Exits non-zero when an engine that ran failed or did
not verify (and, with ``--require-all``, when one was skipped).
"""

import argparse
import dataclasses
import importlib.util
import json
import multiprocessing
import statistics
import sys

from . import _bench_nixl as nixl_workers
from . import _bench_workers as workers

BLOCK_BYTES = 32 * 1024
ENGINES = ("ferry", "mooncake", "ferry-vllm", "mooncake-vllm", "nixl-pull", "nixl-push",
           "nixl-own-pull", "nixl-own-push")
APIS = {
    "mooncake": "ferry,mooncake,ferry-vllm,mooncake-vllm",
    "nixl": "nixl-pull,nixl-own-pull,nixl-push,nixl-own-push,ferry",
}
# (ferry's row, the other project's engine's row on the same API and pattern).
RATIOS = (("ferry", "mooncake"), ("ferry-vllm", "mooncake-vllm"),
          ("nixl-pull", "nixl-own-pull"), ("nixl-push", "nixl-own-push"))
# Rows with vLLM's MooncakeConnector pattern: the engine of the same name without the suffix,
# the block ids in runs of consecutive ids (one entry per run).
VLLM = "-vllm"
# Each engine's two processes (a ``-vllm`` row's are its engine's): the one started first (it
# reports "ready"), and the one given its session and addresses.
PROCESSES = {
    "ferry": (workers.decode_main, workers.prefill_main),
    "mooncake": (workers.decode_main, workers.prefill_main),
    "nixl-push": (nixl_workers.sink_main, nixl_workers.writer_main),
    "nixl-pull": (nixl_workers.source_main, nixl_workers.reader_main),
    "nixl-own-push": (nixl_workers.sink_main, nixl_workers.writer_main),
    "nixl-own-pull": (nixl_workers.source_main, nixl_workers.reader_main),
}
# Engines whose decode reads: the prefill is the process started first.
PULL = ("nixl-pull", "nixl-own-pull")


def parse_args(argv):
    """The command-line options, with device-dependent defaults filled in."""
    parser = argparse.ArgumentParser(
        prog="python -m ferry_kv.bench",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--api", choices=sorted(APIS), default="mooncake",
                        help="which API's rows to run when --engines is not given: mooncake "
                             "(ferry and Mooncake through it, with SGLang's and vLLM's "
                             "patterns), nixl (ferry's and NIXL's own "
                             "agent through NIXL's API, decode pulling and prefill pushing, "
                             "beside ferry through Mooncake's; NIXL's own rows need its "
                             "nixl_cu13 package, from the nixl-cu13 wheel, importable)")
    parser.add_argument("--engines",
                        help="comma-separated engines to run: ferry (through Mooncake's API), "
                             "mooncake, ferry-vllm, mooncake-vllm (the same with vLLM's "
                             "MooncakeConnector pattern: block ids in runs of 1-64 consecutive "
                             "ids, one entry per run), nixl-pull, nixl-push (ferry through "
                             "NIXL's API), nixl-own-pull, nixl-own-push (NIXL's own agent, UCX "
                             "backend, through the same calls)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="pool memory: torch CUDA tensors, or host memory (ferry moves it over "
                             "TCP, NIXL's own agent as UCX picks)")
    parser.add_argument("--prefill-gpu", type=int, default=0, help="GPU of the prefill process")
    parser.add_argument("--decode-gpu", type=int, default=1, help="GPU of the decode process")
    parser.add_argument("--host-memory", choices=("auto", "torch", "ctypes"), default="auto",
                        help="with --device cpu: torch host tensors or plain mappings "
                             "(auto: torch when importable)")
    parser.add_argument("--layers", type=int, default=80, help="model layers (2 pool tensors each)")
    parser.add_argument("--pool-blocks", type=int,
                        help="blocks per pool tensor (default 4096 on cuda, 512 on cpu)")
    parser.add_argument("--blocks", type=int,
                        help="blocks per request (default 256, at most --pool-blocks)")
    parser.add_argument("--requests", type=int, default=10, help="timed requests")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests first")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads sharing each request's entries (vLLM uses several)")
    parser.add_argument("--protocol",
                        help="protocol passed to initialize (default tcp on cpu, rdma on cuda "
                             "as SGLang does)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the block ids and data")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any one step may take before the run is failed")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--require-all", action="store_true",
                        help="fail when an engine asked for cannot run here")
    args = parser.parse_args(argv)
    engines = APIS[args.api] if args.engines is None else args.engines
    args.engines = [name.strip() for name in engines.split(",") if name.strip()]
    unknown = [name for name in args.engines if name not in ENGINES]
    if unknown or not args.engines:
        parser.error(f"--engines {','.join(unknown) or '(none)'}: use {', '.join(ENGINES)}")
    if args.pool_blocks is None:
        args.pool_blocks = 4096 if args.device == "cuda" else 512
    if args.blocks is None:
        args.blocks = min(256, args.pool_blocks)
    for name in ("layers", "pool_blocks", "blocks", "requests", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    if args.blocks > args.pool_blocks:
        parser.error(f"--blocks {args.blocks} exceeds --pool-blocks {args.pool_blocks}")
    if args.protocol is None:
        args.protocol = "rdma" if args.device == "cuda" else "tcp"
    return args


def pick_memory(args):
    """``"torch"`` or ``"ctypes"``: the memory both processes allocate their pools in."""
    has_torch = importlib.util.find_spec("torch") is not None
    if args.device == "cuda" or args.host_memory == "torch":
        if not has_torch:
            raise SystemExit(f"--device {args.device} needs torch, which is not importable here"
                             + ("; --device cpu measures host memory over TCP without it"
                                if args.device == "cuda" else ""))
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("--device cuda (the default) needs a CUDA GPU, and torch sees "
                                 "none here; --device cpu measures host memory over TCP")
        return "torch"
    if args.host_memory == "ctypes":
        return "ctypes"
    return "torch" if has_torch else "ctypes"


class StepFailed(Exception):
    """A process failed, went silent past the timeout, or answered out of turn."""


def receive(conn, process, timeout, expected):
    """The next message from ``process``; raises StepFailed when it is an error, arrives after
    ``timeout`` seconds, or is not of kind ``expected`` (``unavailable`` passes through)."""
    if not conn.poll(timeout):
        raise StepFailed(f"{process.name}: no answer within {timeout:.0f} s while waiting for "
                         f"{expected!r} (raise --timeout, or see its stderr)")
    try:
        message = conn.recv()
    except EOFError:
        process.join(5)
        raise StepFailed(f"{process.name} exited (code {process.exitcode}) before sending "
                         f"{expected!r}; see its stderr")
    if message["kind"] == "error":
        sys.stderr.write(message.get("traceback", ""))
        raise StepFailed(f"{process.name}: {message['reason']}")
    if message["kind"] not in (expected, "unavailable"):
        raise StepFailed(f"{process.name}: sent {message['kind']!r} while {expected!r} was due")
    return message


def run_engine(context, engine, args, memory):
    """One engine's row: runs decode and prefill, returns a dict for the table and the JSON."""
    base = workers.WorkerConfig(
        engine=engine.removesuffix(VLLM), memory=memory, device="cpu", layers=args.layers,
        pool_blocks=args.pool_blocks, blocks=args.blocks, block_bytes=BLOCK_BYTES,
        requests=args.requests, warmup=args.warmup, threads=args.threads, seed=args.seed,
        protocol=args.protocol, ids="runs" if engine.endswith(VLLM) else "random",
    )
    on_gpu = args.device == "cuda"
    decode_config = dataclasses.replace(
        base, device=f"cuda:{args.decode_gpu}" if on_gpu else "cpu")
    prefill_config = dataclasses.replace(
        base, device=f"cuda:{args.prefill_gpu}" if on_gpu else "cpu")
    row = {"engine": engine}
    finished = False
    first, second = PROCESSES[base.engine]
    pull = engine in PULL
    first_config, second_config = (
        (prefill_config, decode_config) if pull else (decode_config, prefill_config))
    decode_conn, decode_end = context.Pipe()
    decode = context.Process(target=first, args=(decode_end, first_config),
                             name=f"{engine} {'prefill' if pull else 'decode'}", daemon=True)
    processes = [decode]
    try:
        decode.start()
        decode_end.close()
        ready = receive(decode_conn, decode, args.timeout, "ready")
        if ready["kind"] == "unavailable":
            row["skipped"] = ready["reason"]
            return row
        prefill_conn, prefill_end = context.Pipe()
        prefill = context.Process(
            target=second,
            args=(prefill_end, second_config, ready["session"], ready["addresses"]),
            name=f"{engine} {'decode' if pull else 'prefill'}", daemon=True)
        processes.append(prefill)
        prefill.start()
        prefill_end.close()
        step_timeout = args.timeout * (1 + args.warmup + args.requests)
        if pull:
            # The decode reads, poisons its own pools before the last request and checks them.
            done = receive(prefill_conn, prefill, step_timeout, "done")
            verified = done
        else:
            done, verified = push(decode_conn, decode, prefill_conn, prefill, args, step_timeout)
        if done["kind"] == "unavailable":
            decode_conn.send({"kind": "exit"})
            row["skipped"] = done["reason"]
            return row
        for conn in (prefill_conn, decode_conn):
            conn.send({"kind": "exit"})
        finished = True
        rates = [base.request_bytes / seconds / 1e9 for seconds in done["seconds"]]
        row.update(
            gbps_p50=statistics.median(rates),
            gbps_mean=base.request_bytes * len(rates) / sum(done["seconds"]) / 1e9,
            verified=not verified["problems"],
            problems=verified["problems"],
            entries_per_request=done["entries"],
            seconds=done["seconds"],
        )
        if "phases" in done:
            row["phases"] = done["phases"]
    except StepFailed as error:
        row["error"] = str(error)
    finally:
        for process in processes:
            process.join(args.timeout if finished else 5)
            if process.is_alive():
                process.terminate()
                process.join(5)
    return row


def push(decode_conn, decode, prefill_conn, prefill, args, step_timeout):
    """The prefill's requests, the decode pools poisoned before its last one and checked
    after it: the prefill's ``done`` and the decode's ``verified`` (or the ``unavailable``
    message twice)."""
    asked = receive(prefill_conn, prefill, step_timeout, "poison-decode")
    if asked["kind"] == "unavailable":
        return asked, asked
    decode_conn.send({"kind": "poison"})
    receive(decode_conn, decode, args.timeout, "poisoned")
    prefill_conn.send({"kind": "go"})
    done = receive(prefill_conn, prefill, args.timeout, "done")
    decode_conn.send({"kind": "verify", "src_ids": done["src_ids"], "dst_ids": done["dst_ids"]})
    return done, receive(decode_conn, decode, args.timeout, "verified")


def describe(args, memory):
    """One line naming the shape and the placement."""
    request_bytes = 2 * args.layers * args.blocks * BLOCK_BYTES
    where = (f"cuda: prefill GPU {args.prefill_gpu} -> decode GPU {args.decode_gpu}"
             if args.device == "cuda" else f"host memory ({memory}), ferry over TCP")
    return (f"kv-llama70b-4k: {args.layers} layers x {{K,V}}, {args.blocks} blocks of 32 KiB per "
            f"request from a pool of {args.pool_blocks} per tensor, "
            f"{request_bytes / 2**30:.3g} GiB per request; {where}; {args.warmup} warm-up + "
            f"{args.requests} timed requests; {args.threads} thread(s); protocol {args.protocol}")


def ratios(rows):
    """``{"ferry/mooncake": {"gbps_p50": ..., "gbps_mean": ...}, ...}``: each pair of
    ``RATIOS`` where both rows ran and verified."""
    by_engine = {row["engine"]: row for row in rows if row.get("verified")}
    return {
        f"{ferry}/{other}": {
            key: by_engine[ferry][key] / by_engine[other][key] for key in ("gbps_p50", "gbps_mean")
        }
        for ferry, other in RATIOS
        if ferry in by_engine and other in by_engine
    }


def print_table(args, memory, rows, pairs):
    """The human-readable report; ``pairs`` from ``ratios``."""
    print(describe(args, memory))
    print(f"{'engine':<13} {'GB/s p50':>9} {'GB/s mean':>10}  {'verified':<8} entries/request")
    for row in rows:
        if "skipped" in row:
            print(f"{row['engine']:<13} skipped: {row['skipped']}")
        elif "error" in row:
            print(f"{row['engine']:<13} FAILED: {row['error']}")
        else:
            print(f"{row['engine']:<13} {row['gbps_p50']:>9.2f} {row['gbps_mean']:>10.2f}  "
                  f"{'yes' if row['verified'] else 'NO':<8} {row['entries_per_request']}")
            for problem in row["problems"]:
                print(f"              {problem}")
    for pair, ratio in pairs.items():
        print(f"ratio {pair}: p50 {ratio['gbps_p50']:.2f}, mean {ratio['gbps_mean']:.2f}")


def main(argv=None):
    """Runs the bench; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    memory = pick_memory(args)
    context = multiprocessing.get_context("spawn")
    rows = []
    for engine in args.engines:
        # Each engine's run starts two processes and takes seconds: say what is running.
        print(f"running {engine}...", file=sys.stderr, flush=True)
        rows.append(run_engine(context, engine, args, memory))
    pairs = ratios(rows)
    print_table(args, memory, rows, pairs)
    if args.json:
        report = {
            "workload": "kv-llama70b-4k",
            "description": describe(args, memory),
            "options": {key: value for key, value in vars(args).items() if key != "json"},
            "memory": memory,
            "rows": rows,
            "ratios": pairs,
        }
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
    failed = any("error" in row or ("verified" in row and not row["verified"]) for row in rows)
    skipped = any("skipped" in row for row in rows)
    return 1 if failed or (skipped and args.require_all) else 0


if __name__ == "__main__":
    sys.exit(main())
