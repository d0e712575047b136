"""What both workers set up the same way: their device, their model and KV pools, ferry's engine."""

import argparse

import torch
from ferry_kv.mooncake import TransferEngine

import tiny_llama
from paged_kv import PagedKVPool


def worker_arguments(description: str) -> argparse.Namespace:
    """The options the launcher passes to each worker."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(tiny_llama.DTYPES), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, default=0)
    return parser.parse_args()


def select_device(kind: str, gpu: int) -> torch.device:
    """The device to compute on; on CUDA it also becomes the current device, so kernels and
    allocations without an explicit device stay on this worker's GPU."""
    if kind == "cuda":
        torch.cuda.set_device(gpu)
        return torch.device("cuda", gpu)
    # Every process runs CPU kernels on one thread, so each splits its work identically.
    torch.set_num_threads(1)
    return torch.device("cpu")


def build_worker(args: argparse.Namespace, allocator_seed: int, fill: float = 0.0):
    """The worker's model and KV pools on its device; `allocator_seed` orders the free list,
    `fill` is the pools' first content."""
    device = select_device(args.device, args.gpu)
    dtype = tiny_llama.DTYPES[args.dtype]
    model = tiny_llama.build_model(args.seed, dtype, device)
    pool = PagedKVPool(
        tiny_llama.LAYERS,
        args.num_blocks,
        tiny_llama.KV_HEADS,
        tiny_llama.HEAD_DIM,
        dtype,
        device,
        allocator_seed,
        fill,
    )
    return model, pool


def start_engine(pool: PagedKVPool) -> TransferEngine:
    """A ferry engine on 127.0.0.1 with every pool tensor registered.

    The protocol argument is Mooncake's; ferry picks the link for each pair of buffers itself
    (GPU to GPU within one host, TCP for host memory). Raises when a step fails; ferry logged why.
    """
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("the transfer engine did not start; see ferry's message above")
    for tensor in pool.tensors():
        if engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size()) != 0:
            raise RuntimeError("a KV pool could not be registered; see ferry's message above")
    return engine
