"""The decode worker: allocates pool blocks for each request, waits for the prefill worker's
notification that their KV arrived, rebuilds the model's cache from those blocks and continues
greedy generation.

Messages (see channel.py): sends {"event": "ready", "session", "pools", "block_bytes"};
receives {"prefill_session", "timeout_s", "requests": [{"request", "prompt_len"}]}; sends
{"event": "allocated", "blocks": {request: [block ids]}} and then {"event": "generated",
"request", "tokens"} per request; exits after the last one.
"""

import json
import time

import tiny_llama
from channel import WorkerChannel
from paged_kv import PagedKVPool, blocks_for
from worker_setup import build_worker, start_engine, worker_arguments

ALLOCATOR_SEED = 2
POLL_SECONDS = 0.001


def generate(model, pool: PagedKVPool, note: dict, expected_blocks: list[int], new_tokens: int):
    """The tokens of one request, generated from the KV cache in its received blocks."""
    if note["blocks"] != expected_blocks:
        raise RuntimeError(
            f"request {note['request']}: the prefill wrote blocks {note['blocks']}, "
            f"but this worker allocated {expected_blocks}"
        )
    layers = [
        pool.gather(layer, expected_blocks, note["prompt_len"])
        for layer in range(tiny_llama.LAYERS)
    ]
    cache = tiny_llama.cache_from_layers(layers)
    return tiny_llama.decode(model, cache, note["first_token"], new_tokens)


def main() -> None:
    """Runs the decode worker until every request it was given has been generated."""
    args = worker_arguments("decode worker of disagg_llama.py")
    channel = WorkerChannel()
    # NaN until written: a KV byte the transfer missed poisons the tokens instead of reading as 0.
    model, pool = build_worker(args, ALLOCATOR_SEED, fill=float("nan"))
    engine = start_engine(pool)
    channel.send(
        {
            "event": "ready",
            "session": engine.get_session_id(),
            "pools": pool.addresses(),
            "block_bytes": pool.block_bytes,
        }
    )
    work = channel.receive()
    if work is None:
        return
    allocated = {
        str(request["request"]): pool.allocator.allocate(blocks_for(request["prompt_len"]))
        for request in work["requests"]
    }
    channel.send({"event": "allocated", "blocks": allocated})
    deadline = time.monotonic() + work["timeout_s"]
    while allocated:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no KV arrived in time for requests {sorted(allocated)}")
        notes = engine.get_notifies()
        if not notes:
            time.sleep(POLL_SECONDS)
        for note in notes:
            if note.name != work["prefill_session"]:
                print(f"decode: ignoring a notification from {note.name!r}", flush=True)
                continue
            message = json.loads(note.msg)
            blocks = allocated.pop(str(message["request"]), None)
            if blocks is None:
                raise RuntimeError(
                    f"a notification for request {message['request']}, which is not pending"
                )
            tokens = generate(model, pool, message, blocks, args.new_tokens)
            pool.allocator.free(blocks)
            channel.send({"event": "generated", "request": message["request"], "tokens": tokens})


if __name__ == "__main__":
    main()
