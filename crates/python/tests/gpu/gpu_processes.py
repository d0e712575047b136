"""What the GPU tests share: the GPUs visible, the environment of a worker process with a given
PyTorch allocator, reading a worker's JSON answers with a deadline, and the two-GPU guard."""

import json
import os
import select

import torch

GPUS = torch.cuda.device_count()


def allocator_env(allocator_conf):
    """This process's environment with ``PYTORCH_CUDA_ALLOC_CONF`` set to ``allocator_conf``
    (removed when it is ``None``): each worker picks its allocator when torch starts."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if allocator_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = allocator_conf
    return env


def read_line(process, timeout):
    """One JSON line of ``process``'s stdout, or fails the test after ``timeout`` seconds."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no answer from the decode process within {timeout} s"
    line = process.stdout.readline()
    assert line, f"the decode process exited (code {process.poll()}) without answering"
    return json.loads(line)


def needs_two_gpus():
    """Fails (never skips) where GPU 0 -> GPU 1 cannot run, so a one-GPU run shows it owed."""
    assert GPUS >= 2, f"this test needs two GPUs and {GPUS} is visible; run it on a two-GPU machine"
