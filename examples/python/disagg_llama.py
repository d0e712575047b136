"""Disaggregated prefill and decode of a small Llama, with the paged KV cache moved by ferry.

One command starts two worker processes: the prefill worker computes each prompt's KV cache
and first token, and writes the cache's 16-token blocks into the decode worker's pool through
ferry's Mooncake-compatible TransferEngine; the decode worker rebuilds the cache from its blocks
and generates the remaining tokens greedily. The launcher then runs the same prefill and greedy
decode in one process, with no transfer, and checks that every prompt produced the same tokens.
It exits 1 if any prompt differs.

    python disagg_llama.py                      # cuda if available, else cpu
    python disagg_llama.py --device cpu --dtype fp32 --prompts 5,16,17,40,100 --new-tokens 16
"""

import argparse
import os
import sys
import time

import torch

import tiny_llama
from channel import Worker
from paged_kv import blocks_for

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_arguments() -> argparse.Namespace:
    """The command line, with the device and GPU defaults filled in from what is present."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--prefill-gpu", type=int, default=0)
    parser.add_argument("--decode-gpu", type=int)
    parser.add_argument("--dtype", choices=sorted(tiny_llama.DTYPES), default="bf16")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--prompts", default="5,16,17,40,100", help="prompt lengths, comma-separated"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.device is None:
        args.device = "cuda" if cuda else "cpu"
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda: this machine has no CUDA device PyTorch can use")
    if args.decode_gpu is None:
        args.decode_gpu = 1 if cuda and torch.cuda.device_count() > 1 else 0
    args.prompt_lengths = [int(length) for length in args.prompts.split(",")]
    if args.new_tokens < 1 or min(args.prompt_lengths) < 1:
        parser.error("--new-tokens and every prompt length must be at least 1")
    return args


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random prompts of the given lengths, fixed by `seed`."""
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, tiny_llama.VOCAB, (n,), generator=generator).tolist() for n in lengths]


def start_worker(role: str, args: argparse.Namespace, gpu: int, num_blocks: int) -> Worker:
    """Starts the `role` worker ("prefill" or "decode") with this run's settings."""
    argv = [
        sys.executable,
        os.path.join(HERE, f"{role}_worker.py"),
        f"--device={args.device}",
        f"--gpu={gpu}",
        f"--dtype={args.dtype}",
        f"--seed={args.seed}",
        f"--num-blocks={num_blocks}",
        f"--new-tokens={args.new_tokens}",
    ]
    return Worker(role, argv)


def run_disaggregated(args: argparse.Namespace, prompts: list[list[int]]) -> dict[int, list[int]]:
    """The tokens each prompt gets from the prefill and decode workers, keyed by prompt index."""
    deadline = time.monotonic() + args.timeout
    # Twice what the prompts take, so shuffled ids land far apart.
    num_blocks = 2 * sum(blocks_for(len(prompt)) for prompt in prompts)
    decode = start_worker("decode", args, args.decode_gpu, num_blocks)
    prefill = start_worker("prefill", args, args.prefill_gpu, num_blocks)
    try:
        decode_ready = decode.receive("ready", deadline)
        prefill_ready = prefill.receive("ready", deadline)
        decode.send(
            {
                "prefill_session": prefill_ready["session"],
                "timeout_s": max(1.0, deadline - time.monotonic()),
                "requests": [{"request": i, "prompt_len": len(p)} for i, p in enumerate(prompts)],
            }
        )
        blocks = decode.receive("allocated", deadline)["blocks"]
        prefill.send(
            {
                "decode_session": decode_ready["session"],
                "decode_pools": decode_ready["pools"],
                "block_bytes": decode_ready["block_bytes"],
                "requests": [
                    {"request": i, "prompt": p, "decode_blocks": blocks[str(i)]}
                    for i, p in enumerate(prompts)
                ],
            }
        )
        for _ in prompts:
            sent = prefill.receive("sent", deadline)
            print(
                f"prefill: request {sent['request']}: {sent['bytes']} KV bytes in "
                f"{sent['entries']} entries -> decode blocks {blocks[str(sent['request'])]}"
            )
        generated = {}
        for _ in prompts:
            message = decode.receive("generated", deadline)
            generated[message["request"]] = message["tokens"]
    except BaseException:
        prefill.kill()
        decode.kill()
        raise
    for worker in (prefill, decode):
        if worker.finish(deadline - time.monotonic() + 5.0) != 0:
            raise RuntimeError(f"the {worker.name} worker failed at exit; see its log above")
    return generated


def run_reference(args: argparse.Namespace, prompts: list[list[int]]) -> list[list[int]]:
    """The tokens each prompt gets from prefill and greedy decode in this one process, on the
    prefill worker's device, with the cache handed straight from one to the other."""
    if args.device == "cuda":
        torch.cuda.set_device(args.prefill_gpu)
        device = torch.device("cuda", args.prefill_gpu)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    model = tiny_llama.build_model(args.seed, tiny_llama.DTYPES[args.dtype], device)
    tokens = []
    for prompt in prompts:
        cache, first = tiny_llama.prefill(model, prompt)
        tokens.append(tiny_llama.decode(model, cache, first, args.new_tokens))
    return tokens


def main() -> int:
    """Runs both ways and prints, per prompt, both token lists and whether they are identical."""
    args = parse_arguments()
    gpus = (
        f" (prefill GPU {args.prefill_gpu}, decode GPU {args.decode_gpu})"
        if args.device == "cuda"
        else ""
    )
    print(
        f"device {args.device}{gpus}, dtype {args.dtype}, prompts {args.prompt_lengths}, "
        f"{args.new_tokens} new tokens"
    )
    prompts = make_prompts(args.prompt_lengths, args.seed)
    disaggregated = run_disaggregated(args, prompts)
    reference = run_reference(args, prompts)
    differing = 0
    for index, prompt in enumerate(prompts):
        same = disaggregated[index] == reference[index]
        differing += not same
        print(f"prompt {index} ({len(prompt)} tokens): {'IDENTICAL' if same else 'DIFFERENT'}")
        print(f"  disaggregated: {disaggregated[index]}")
        print(f"  reference:     {reference[index]}")
    print(f"{len(prompts) - differing} of {len(prompts)} prompts identical")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
