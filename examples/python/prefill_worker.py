"""The prefill worker: computes each prompt's KV cache, pages it into its own pool, and writes
the pages into the decode worker's pool through ferry, followed by a notification.

Messages (see channel.py): sends {"event": "ready", "session", "block_bytes"}; receives
{"decode_session", "decode_pools", "block_bytes", "requests": [{"request", "prompt",
"decode_blocks"}]}; sends {"event": "sent", "request", "entries", "bytes"} per request; exits
when the launcher closes its stdin.
"""

import json

import torch
from ferry_kv.mooncake import TransferNotify, TransferOpcode

import tiny_llama
from channel import WorkerChannel
from paged_kv import PagedKVPool, blocks_for, transfer_entries
from worker_setup import build_worker, start_engine, worker_arguments

ALLOCATOR_SEED = 1


def send_request(model, pool: PagedKVPool, engine, session: str, request: dict, decode: dict):
    """Prefills one request, writes its KV blocks into the decode worker's pool (`decode`: its
    session and pool addresses) and notifies that worker; returns what was sent."""
    prompt = request["prompt"]
    blocks = pool.allocator.allocate(blocks_for(len(prompt)))
    cache, first = tiny_llama.prefill(model, prompt)
    for layer in range(tiny_llama.LAYERS):
        keys, values = tiny_llama.layer_kv(cache, layer)
        pool.scatter(layer, keys, values, blocks)
    if pool.keys[0].is_cuda:
        # ferry reads the pools on its own streams: the KV must be in memory first.
        torch.cuda.synchronize()
    entries = transfer_entries(
        pool, blocks, decode["decode_pools"], request["decode_blocks"], len(prompt)
    )
    target = decode["decode_session"]
    sources, destinations, lengths = (list(column) for column in zip(*entries, strict=True))
    if engine.batch_transfer_sync_write(target, sources, destinations, lengths) != 0:
        raise RuntimeError(
            f"request {request['request']}: the KV write failed; see ferry's message above"
        )
    note = TransferNotify(
        session,
        json.dumps(
            {
                "request": request["request"],
                "prompt_len": len(prompt),
                "blocks": request["decode_blocks"],
                "first_token": first,
            }
        ),
    )
    if engine.batch_transfer_sync(target, [], [], [], TransferOpcode.Write, note) != 0:
        raise RuntimeError(
            f"request {request['request']}: the notification failed; see ferry's message above"
        )
    pool.allocator.free(blocks)
    return {
        "event": "sent",
        "request": request["request"],
        "entries": len(entries),
        "bytes": sum(lengths),
    }


def main() -> None:
    """Runs the prefill worker until the launcher closes its stdin."""
    args = worker_arguments("prefill worker of disagg_llama.py")
    channel = WorkerChannel()
    model, pool = build_worker(args, ALLOCATOR_SEED)
    engine = start_engine(pool)
    session = engine.get_session_id()
    channel.send({"event": "ready", "session": session, "block_bytes": pool.block_bytes})
    work = channel.receive()
    if work is None:
        return
    if work["block_bytes"] != pool.block_bytes:
        raise RuntimeError(
            f"decode blocks are {work['block_bytes']} bytes and prefill blocks {pool.block_bytes}; "
            "start both workers with the same dtype"
        )
    for request in work["requests"]:
        channel.send(send_request(model, pool, engine, session, request, work))
    channel.receive()


if __name__ == "__main__":
    main()
