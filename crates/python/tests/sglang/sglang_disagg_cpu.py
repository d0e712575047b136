#!/usr/bin/env python3
"""Drive SGLang's own, unmodified Mooncake PD-disaggregation code between two
processes on host (CPU) memory, with ``mooncake.engine.TransferEngine`` answered
by whatever is installed (here: ferry's drop-in), and verify every byte.

What is SGLang's and what is the harness's:
  * SGLang (unmodified, imported from the installed package):
      ServerArgs + runtime_context.publish()           (as run_scheduler_process)
      maybe_init_shared_mooncake_transfer_engine()      (as the scheduler does)
      KVArgs, get_kv_transfer_buf_infos, setup_state_kv_args, build_kv_layer_ids,
      MetadataBuffers (the real aux/metadata buffers, device="cpu")
      MooncakeKVManager, MooncakeKVSender, MooncakeKVReceiver,
      MooncakeKVBootstrapServer (CommonKVBootstrapServer), KVPoll
  * Harness: a tiny host-memory MHA pool (numpy) with the same
    get_contiguous_buf_infos() layout as MHATokenToKVPool (K layers, then V
    layers, item_len = bytes of one page), the request plan, the byte patterns,
    and the checks.

Usage:
  python sglang_disagg_cpu.py                 # 3 requests, verify every byte
  python sglang_disagg_cpu.py --kill-decode   # decode SIGKILLed after sending its
                                              # metadata; prefill sender must reach
                                              # KVPoll.Failed within --fail-bound s
  SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=5 \
  python sglang_disagg_cpu.py --kill-decode before-metadata --fail-bound 30
Exit status 0 only when everything verified (or, with --kill-decode, when the
sender reached Failed in time).
"""

import argparse
import ctypes
import hashlib
import multiprocessing as mp
import os
import signal
import socket
import struct
import sys
import time
import traceback

# ---------------------------------------------------------------- geometry
NUM_LAYERS = 4
NUM_PAGES = 64
PAGE_TOKENS = 16            # SGLang page_size (tokens per page)
HEAD_NUM = 2
HEAD_DIM = 64
DTYPE_BYTES = 2             # bf16
PAGE_BYTES = PAGE_TOKENS * HEAD_NUM * HEAD_DIM * DTYPE_BYTES   # 4096
AUX_ROWS = 8                # MetadataBuffers size (req slots)
HIDDEN_SIZE = 64
POISON = 0xA5               # decode fill: must survive on untouched pages/rows
KV_CACHE_DTYPE = "bfloat16"
MAGIC = b"SGLHARN1"

# Requests: (prefill pages, decode pages, prefill aux row, decode aux row, chunks).
# Disjoint page sets per side, so each page's bytes name exactly one
# (layer, K/V, prefill page, request); some runs are contiguous on both sides so
# SGLang's group_concurrent_contiguous merges them into multi-page entries.
def make_plan(seed=1234):
    import numpy as np
    rng = np.random.default_rng(seed)
    sizes = [7, 16, 21]
    run = 8
    # request 2 starts with a contiguous run on both sides (40..47 -> 8..15)
    run_src, run_dst = list(range(40, 40 + run)), list(range(8, 8 + run))
    src_free = [p for p in rng.permutation(NUM_PAGES).tolist() if p not in run_src]
    dst_free = [p for p in rng.permutation(NUM_PAGES).tolist() if p not in run_dst]
    reqs = []
    for r, n in enumerate(sizes):
        src = run_src[:] if r == 2 else []
        dst = run_dst[:] if r == 2 else []
        while len(src) < n:
            src.append(src_free.pop())
            dst.append(dst_free.pop())
        reqs.append({"src": src, "dst": dst})
    aux_src = [1, 6, 2]
    aux_dst = [3, 0, 5]
    rooms = [int(x) for x in rng.integers(1, 2**62, size=len(sizes))]
    for r, q in enumerate(reqs):
        q["room"] = rooms[r]
        q["aux_src"] = aux_src[r]
        q["aux_dst"] = aux_dst[r]
        # request 1 is sent in two chunks (exercises index_slice / is_last_chunk)
        q["chunks"] = [len(q["src"]) // 2, len(q["src"]) - len(q["src"]) // 2] if r == 1 else [len(q["src"])]
    return reqs


def page_pattern(layer, kv, src_page, req):
    """4096 bytes: 32-byte header naming the page, then a keyed pseudo-random body."""
    head = MAGIC + struct.pack("<iiii", layer, kv, src_page, req) + b"\0" * 8
    body = bytearray()
    key = head
    i = 0
    while len(head) + len(body) < PAGE_BYTES:
        body += hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=64).digest()
        i += 1
    return (head + bytes(body))[:PAGE_BYTES]


def aux_pattern(buf_index, req, length):
    out = bytearray()
    i = 0
    while len(out) < length:
        out += hashlib.blake2b(b"AUX" + struct.pack("<iii", buf_index, req, i), digest_size=64).digest()
        i += 1
    return bytes(out[:length])


def describe_page(data):
    if data[:8] == MAGIC:
        layer, kv, page, req = struct.unpack("<iiii", data[8:24])
        return f"holds layer {layer} {'KV'[kv]} prefill page {page} of request {req}"
    if data == bytes([POISON]) * len(data):
        return "still poison (never written)"
    if data == bytes(len(data)):
        return "all zero"
    nz = sum(1 for b in data if b != POISON)
    return f"unrecognised bytes ({nz} of {len(data)} not poison)"


# ------------------------------------------------------------ host KV pool
class HostMHAPool:
    """Host-memory stand-in for MHATokenToKVPool: what the disaggregation code
    reads from a pool (get_contiguous_buf_infos, page_size, head_num,
    start_layer/end_layer). Buffers are numpy (NUM_PAGES, PAGE_BYTES) uint8."""

    def __init__(self, fill):
        import numpy as np
        self.page_size = PAGE_TOKENS
        self.head_num = HEAD_NUM
        self.head_dim = HEAD_DIM
        self.layer_num = NUM_LAYERS
        self.start_layer = 0
        self.end_layer = NUM_LAYERS
        self.k_buffers = [np.full((NUM_PAGES, PAGE_BYTES), fill, dtype=np.uint8) for _ in range(NUM_LAYERS)]
        self.v_buffers = [np.full((NUM_PAGES, PAGE_BYTES), fill, dtype=np.uint8) for _ in range(NUM_LAYERS)]

    def buffers(self):
        return self.k_buffers + self.v_buffers

    def get_contiguous_buf_infos(self):
        bufs = self.buffers()
        return ([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [b[0].nbytes for b in bufs])


# --------------------------------------------------------------- SGLang setup
def publish_config(role, bootstrap_port):
    """What run_scheduler_process does before the scheduler exists: publish a
    real ServerArgs for this process. Returns the ServerArgs."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.runtime_context import SpawnRanks, publish

    server_args = ServerArgs(
        model_path="dummy",   # SGLang's own no-model short-circuit in resolve_once(); nothing is loaded
        device="cpu",
        host="127.0.0.1",
        page_size=PAGE_TOKENS,
        disaggregation_mode=role,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
    )
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    # The scheduler builds torch.distributed process groups (initialize_model_parallel)
    # before the KV manager; CommonKVManager only stores pp_group (it is used
    # when pp_size > 1). Building the real groups pulls in the sampler/OpenAI
    # protocol stack, so state the one handle it reads instead, as the
    # ParallelContext error message suggests.
    from sglang.srt.runtime_context import get_parallel
    get_parallel().override_permanently(pp_group=None)
    return server_args


def build_manager(role, bootstrap_port, pool_fill):
    """Mirror of PrefillBootstrapQueue._init_kv_manager / DecodePreallocQueue._init_kv_manager
    for a plain MHA pool, TP1/PP1/DP1."""
    import torch
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode, MetadataBuffers, build_kv_layer_ids,
        get_kv_transfer_buf_infos, get_pd_kv_layout, setup_state_kv_args)
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine)
    from sglang.srt.runtime_context import get_device, get_disagg, get_parallel

    server_args = publish_config(role, bootstrap_port)
    # The scheduler process initialises the shared engine during model-parallel setup.
    maybe_init_shared_mooncake_transfer_engine(gpu_id=get_device().gpu_id)

    pool = HostMHAPool(pool_fill)
    meta = MetadataBuffers(AUX_ROWS, hidden_size=HIDDEN_SIZE, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=server_args.sampling_mask_max_tokens)

    kv_args = KVArgs()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = get_parallel().dp_rank
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = KV_CACHE_DTYPE
    kv_args.kv_layout = get_pd_kv_layout(pool)
    kv_args.prefill_start_layer = pool.start_layer
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.prefill_end_layer = pool.end_layer
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                                              num_draft_entries=0, num_hidden_layers=NUM_LAYERS)
    kv_args.kv_head_num = HEAD_NUM
    kv_args.total_kv_head_num = HEAD_NUM
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = get_disagg().disaggregation_ib_device
    kv_args.gpu_id = get_device().gpu_id
    setup_state_kv_args(kv_args, pool, None, NUM_LAYERS, req_to_token_pool=None)

    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    mgr = MooncakeKVManager(kv_args, mode, server_args, False)
    return mgr, pool, meta, kv_args


def engine_info(mgr):
    eng = mgr.engine.engine
    return f"{type(eng).__module__}.{type(eng).__name__} session={mgr.get_session_id()}"


def poll_name(v):
    from sglang.srt.disaggregation.base.conn import KVPoll
    return {KVPoll.Failed: "Failed", KVPoll.Bootstrapping: "Bootstrapping",
            KVPoll.WaitingForInput: "WaitingForInput", KVPoll.Transferring: "Transferring",
            KVPoll.Success: "Success"}.get(v, str(v))


# ------------------------------------------------------------------ prefill
def prefill_main(cfg, conn):
    try:
        import numpy as np
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

        reqs = cfg["reqs"]
        mgr, pool, meta, kv_args = build_manager("prefill", cfg["bootstrap_port"], pool_fill=0x3C)
        # Fill the prefill pool: request pages with their pattern; others with a
        # pattern of "request -1", so a misaddressed read is recognisable.
        owner = {p: (r, p) for r, q in enumerate(reqs) for p in q["src"]}
        for layer in range(NUM_LAYERS):
            for kv, bufs in ((0, pool.k_buffers), (1, pool.v_buffers)):
                for p in range(NUM_PAGES):
                    r = owner.get(p, (-1, p))[0]
                    bufs[layer][p] = np.frombuffer(page_pattern(layer, kv, p, r), dtype=np.uint8)
        for r, q in enumerate(reqs):
            for b, (ptr, item) in enumerate(zip(kv_args.aux_data_ptrs, kv_args.aux_item_lens)):
                ctypes.memmove(ptr + item * q["aux_src"], aux_pattern(b, r, item), item)
        conn.send(("ready", engine_info(mgr)))

        bootstrap_addr = f"127.0.0.1:{cfg['bootstrap_port']}"
        if cfg["kill_phase"] == "before-metadata":
            msg = conn.recv()          # parent: decode is dead, it never sent metadata
            assert msg == "go", msg
            t0 = time.monotonic()
            senders = [MooncakeKVSender(mgr, bootstrap_addr, q["room"]) for q in reqs]
            results = [None] * len(reqs)
            while any(x is None for x in results) and time.monotonic() < t0 + cfg["fail_bound"]:
                for i, s in enumerate(senders):
                    if results[i] is None and s.poll() == KVPoll.Failed:
                        results[i] = ("Failed", time.monotonic() - t0, mgr.failure_records.get(reqs[i]["room"]))
                time.sleep(0.05)
            conn.send(("sender_results", [x if x is not None else (poll_name(senders[i].poll()) + " (not concluded)", time.monotonic() - t0, None) for i, x in enumerate(results)]))
            conn.recv()
            return 0
        senders = [MooncakeKVSender(mgr, bootstrap_addr, q["room"]) for q in reqs]
        # Like the prefill bootstrap queue: wait until decode's metadata arrived.
        deadline = time.monotonic() + cfg["timeout"]
        while True:
            states = [s.poll() for s in senders]
            if all(st == KVPoll.WaitingForInput for st in states):
                break
            if any(st == KVPoll.Failed for st in states) or time.monotonic() > deadline:
                conn.send(("error", f"prefill bootstrap did not reach WaitingForInput: {[poll_name(s) for s in states]}"))
                return 3
            time.sleep(0.005)
        conn.send(("bootstrapped", None))

        if cfg["kill_phase"] == "after-metadata":
            msg = conn.recv()          # parent: decode is dead now
            assert msg == "go", msg

        t_send = time.monotonic()
        for s, q in zip(senders, reqs):
            s.init(len(q["src"]), q["aux_src"])
            start = 0
            for n in q["chunks"]:
                s.send(np.asarray(q["src"][start:start + n], dtype=np.int32))
                start += n
        results = [None] * len(reqs)
        deadline = time.monotonic() + (cfg["fail_bound"] if cfg["kill_phase"] else cfg["timeout"])
        while any(x is None for x in results) and time.monotonic() < deadline:
            for i, s in enumerate(senders):
                if results[i] is None:
                    st = s.poll()
                    if st in (KVPoll.Success, KVPoll.Failed):
                        reason = mgr.failure_records.get(reqs[i]["room"]) if st == KVPoll.Failed else None
                        results[i] = (poll_name(st), time.monotonic() - t_send, reason)
            time.sleep(0.002)
        final = []
        for i, s in enumerate(senders):
            if results[i] is None:
                final.append((poll_name(s.poll()) + " (not concluded)", time.monotonic() - t_send, None))
            else:
                final.append(results[i])
        conn.send(("sender_results", final))
        conn.recv()   # wait for parent's "exit"
        return 0
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return 2


# ------------------------------------------------------------------- decode
def decode_main(cfg, conn):
    try:
        import numpy as np
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

        reqs = cfg["reqs"]
        mgr, pool, meta, kv_args = build_manager("decode", cfg["bootstrap_port"], pool_fill=POISON)
        for ptr, ln in zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens):
            ctypes.memset(ptr, POISON, ln)
        conn.send(("ready", engine_info(mgr)))
        if cfg["kill_phase"] == "before-metadata":
            time.sleep(3600)      # parent SIGKILLs us before any receiver exists

        bootstrap_addr = f"127.0.0.1:{cfg['bootstrap_port']}"
        # DecodePreallocQueue: receiver, prefill parallel info, init(dp_rank),
        # then (after allocating pages and a metadata slot) send_metadata.
        receivers = [MooncakeKVReceiver(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=q["room"]) for q in reqs]
        deadline = time.monotonic() + cfg["timeout"]
        while not mgr.try_ensure_parallel_info(bootstrap_addr):
            if time.monotonic() > deadline:
                conn.send(("error", "decode could not fetch prefill parallel info"))
                return 3
            time.sleep(0.1)
        for rcv, q in zip(receivers, reqs):
            rcv.init(0)
            rcv.send_metadata(np.asarray(q["dst"], dtype=np.int32), q["aux_dst"])
        conn.send(("metadata_sent", None))
        if cfg["kill_phase"] == "after-metadata":
            time.sleep(3600)      # parent SIGKILLs us here

        t0 = time.monotonic()
        status = [None] * len(reqs)
        while any(s is None for s in status) and time.monotonic() < t0 + cfg["timeout"]:
            for i, rcv in enumerate(receivers):
                if status[i] is None:
                    st = rcv.poll()
                    if st in (KVPoll.Success, KVPoll.Failed):
                        status[i] = (poll_name(st), time.monotonic() - t0)
            time.sleep(0.002)
        status = [s if s is not None else (poll_name(receivers[i].poll()) + " (timeout)", time.monotonic() - t0)
                  for i, s in enumerate(status)]

        # ---- byte-for-byte verification
        lines, ok_all = [], True
        written = set()
        for r, q in enumerate(reqs):
            bad = []
            npages = 0
            for layer in range(NUM_LAYERS):
                for kv, bufs in ((0, pool.k_buffers), (1, pool.v_buffers)):
                    for sp, dp in zip(q["src"], q["dst"]):
                        written.add(dp)
                        npages += 1
                        got = bufs[layer][dp].tobytes()
                        if got != page_pattern(layer, kv, sp, r):
                            bad.append(f"layer {layer} {'KV'[kv]} decode page {dp} (want prefill page {sp}): {describe_page(got)}")
            aux_bad = []
            for b, (ptr, item) in enumerate(zip(kv_args.aux_data_ptrs, kv_args.aux_item_lens)):
                got = ctypes.string_at(ptr + item * q["aux_dst"], item)
                if got != aux_pattern(b, r, item):
                    nbad = sum(1 for x, y in zip(got, aux_pattern(b, r, item)) if x != y)
                    aux_bad.append(f"aux buffer {b} row {q['aux_dst']}: {nbad}/{item} bytes differ")
            ok = status[r][0] == "Success" and not bad and not aux_bad
            ok_all &= ok
            lines.append(
                f"{'PASS' if ok else 'FAIL'} request {r} room={q['room']:#x} receiver={status[r][0]} "
                f"after {status[r][1]*1000:.1f} ms; {len(q['src'])} pages x {NUM_LAYERS} layers x K,V = "
                f"{npages} pages of {PAGE_BYTES} B: {npages-len(bad)} match; "
                f"{len(kv_args.aux_data_ptrs)} aux rows (slot {q['aux_src']}->{q['aux_dst']}): "
                f"{len(kv_args.aux_data_ptrs)-len(aux_bad)} match")
            for m in (bad[:8] + aux_bad[:8]):
                lines.append(f"    MISMATCH {m}")
            if len(bad) > 8:
                lines.append(f"    ... {len(bad)-8} more page mismatches")
        # untouched pages and rows must still be poison
        poison_page = bytes([POISON]) * PAGE_BYTES
        clobbered = []
        for layer in range(NUM_LAYERS):
            for kv, bufs in ((0, pool.k_buffers), (1, pool.v_buffers)):
                for p in range(NUM_PAGES):
                    if p not in written and bufs[layer][p].tobytes() != poison_page:
                        clobbered.append(f"layer {layer} {'KV'[kv]} page {p}: {describe_page(bufs[layer][p].tobytes())}")
        used_rows = {q["aux_dst"] for q in reqs}
        for b, (ptr, item) in enumerate(zip(kv_args.aux_data_ptrs, kv_args.aux_item_lens)):
            for row in range(AUX_ROWS):
                if row not in used_rows and ctypes.string_at(ptr + item * row, item) != bytes([POISON]) * item:
                    clobbered.append(f"aux buffer {b} row {row} overwritten")
        n_untouched = NUM_LAYERS * 2 * (NUM_PAGES - len(written))
        lines.append(f"{'PASS' if not clobbered else 'FAIL'} untouched: {n_untouched} pages outside every request "
                     f"and {(AUX_ROWS-len(used_rows))*len(kv_args.aux_data_ptrs)} unused aux rows still poison"
                     + (f"; {len(clobbered)} overwritten" if clobbered else ""))
        for m in clobbered[:8]:
            lines.append(f"    CLOBBERED {m}")
        ok_all &= not clobbered
        conn.send(("verified", (ok_all, lines)))
        conn.recv()
        return 0
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return 2


def _child(role, cfg, conn):
    import logging
    logging.basicConfig(level=os.environ.get("HARNESS_LOG", "WARNING"),
                        format=f"[{role} %(levelname)s %(name)s] %(message)s")
    import warnings
    warnings.filterwarnings("ignore")
    rc = (prefill_main if role == "prefill" else decode_main)(cfg, conn)
    sys.stdout.flush()
    os._exit(rc)


# ------------------------------------------------------------------- parent
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expect(conn, proc, kinds, timeout, who):
    if not conn.poll(timeout):
        raise RuntimeError(f"{who}: no message within {timeout}s (alive={proc.is_alive()}, exitcode={proc.exitcode})")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"{who} failed:\n{payload}")
    if kind not in kinds:
        raise RuntimeError(f"{who}: unexpected message {kind}")
    return kind, payload


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=60.0, help="bound on each wait (s)")
    ap.add_argument("--kill-decode", nargs="?", const="after-metadata", default=None,
                    choices=["after-metadata", "before-metadata"],
                    help="SIGKILL decode after it sent its metadata for all requests (default), or "
                         "before it created any receiver; prefill senders must reach KVPoll.Failed "
                         "within --fail-bound (before-metadata relies on SGLang's bootstrap timeout, "
                         "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, default 300 s)")
    ap.add_argument("--fail-bound", type=float, default=60.0,
                    help="with --kill-decode: seconds the sender may take to reach Failed")
    args = ap.parse_args()
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=os.environ.get("HARNESS_LOG", "WARNING"))

    t_start = time.monotonic()
    import sglang
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer
    import mooncake.engine
    print(f"sglang {sglang.__version__}; mooncake.engine = {mooncake.engine.__name__} "
          f"from {mooncake.engine.__file__}; TransferEngine = {mooncake.engine.TransferEngine.__module__}."
          f"{mooncake.engine.TransferEngine.__qualname__}", flush=True)

    port = free_port()
    server = MooncakeKVBootstrapServer(host="127.0.0.1", port=port)
    reqs = make_plan()
    cfg = {"bootstrap_port": port, "reqs": reqs, "timeout": args.timeout,
           "kill_phase": args.kill_decode, "fail_bound": args.fail_bound}
    ctx = mp.get_context("spawn")
    p_parent, p_child = ctx.Pipe()
    d_parent, d_child = ctx.Pipe()
    prefill = ctx.Process(target=_child, args=("prefill", cfg, p_child), name="prefill")
    decode = ctx.Process(target=_child, args=("decode", cfg, d_child), name="decode")
    rc = 1
    try:
        prefill.start()
        _, info = expect(p_parent, prefill, {"ready"}, 120, "prefill")
        print(f"prefill ready: {info}", flush=True)
        decode.start()
        _, info = expect(d_parent, decode, {"ready"}, 120, "decode")
        print(f"decode ready:  {info}", flush=True)
        if args.kill_decode != "before-metadata":
            expect(d_parent, decode, {"metadata_sent"}, args.timeout, "decode")
            expect(p_parent, prefill, {"bootstrapped"}, args.timeout, "prefill")
        if args.kill_decode:
            os.kill(decode.pid, signal.SIGKILL)
            decode.join(10)
            if args.kill_decode == "after-metadata":
                print(f"decode pid {decode.pid} SIGKILLed after sending metadata for {len(reqs)} requests "
                      f"(exitcode {decode.exitcode}); prefill now sends", flush=True)
            else:
                print(f"decode pid {decode.pid} SIGKILLed before creating any receiver "
                      f"(exitcode {decode.exitcode}); prefill now creates its senders and polls", flush=True)
            p_parent.send("go")
            _, res = expect(p_parent, prefill, {"sender_results"}, args.fail_bound + 30, "prefill")
            ok = True
            for r, (st, dt, reason) in enumerate(res):
                good = st == "Failed" and dt <= args.fail_bound
                ok &= good
                print(f"{'PASS' if good else 'FAIL'} request {r} room={reqs[r]['room']:#x} sender={st} "
                      f"{dt:.3f} s after {'send()' if args.kill_decode == 'after-metadata' else 'sender creation'}; "
                      f"reason: {reason}", flush=True)
            rc = 0 if ok else 1
            p_parent.send("exit")
        else:
            _, res = expect(p_parent, prefill, {"sender_results"}, args.timeout + 30, "prefill")
            _, (ok, lines) = expect(d_parent, decode, {"verified"}, args.timeout + 30, "decode")
            for r, (st, dt, reason) in enumerate(res):
                print(f"prefill sender request {r}: {st} after {dt*1000:.1f} ms"
                      + (f" ({reason})" if reason else ""), flush=True)
                ok &= st == "Success"
            for line in lines:
                print(line, flush=True)
            rc = 0 if ok else 1
            p_parent.send("exit")
            d_parent.send("exit")
    except Exception as e:
        print(f"FAIL harness: {e}", flush=True)
        rc = 1
    finally:
        for p in (prefill, decode):
            if p.is_alive():
                p.join(15)
            if p.is_alive():
                p.kill()
                p.join(5)
        server.close()
    print(f"{'OK' if rc == 0 else 'FAILED'}: {'kill-decode ' + args.kill_decode if args.kill_decode else 'transfer'} mode, "
          f"{time.monotonic() - t_start:.1f} s total", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
