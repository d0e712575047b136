"""A paged KV cache: per layer one K pool and one V pool of 16-token blocks, and their allocator.

Pool tensors are [num_blocks, BLOCK_TOKENS, kv_heads, head_dim], so the tokens of one block are
one contiguous run of bytes and the first `n` tokens of a block are its first `n` rows: a block
(or the used part of the last one) moves as a single transfer entry.
"""

import math
import random

import torch

BLOCK_TOKENS = 16


def blocks_for(tokens: int) -> int:
    """How many blocks `tokens` tokens take."""
    return math.ceil(tokens / BLOCK_TOKENS)


class BlockAllocator:
    """Hands out block ids from a shuffled free list, so a request's blocks are scattered."""

    def __init__(self, num_blocks: int, seed: int):
        """A free list of `num_blocks` ids in an order fixed by `seed`."""
        self._free = list(range(num_blocks))
        random.Random(seed).shuffle(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free block ids; raises when the pool has fewer left."""
        if count > len(self._free):
            raise RuntimeError(
                f"{count} KV blocks asked for and {len(self._free)} are free; "
                "start the example with fewer or shorter prompts"
            )
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def free(self, blocks: list[int]) -> None:
        """Returns `blocks` to the free list."""
        self._free.extend(blocks)


class PagedKVPool:
    """The K and V pools of every layer on one device, with their allocator."""

    def __init__(self, layers, num_blocks, kv_heads, head_dim, dtype, device, seed, fill=0.0):
        """Pools of `num_blocks` blocks per layer, every element `fill`; `seed` orders the free
        list."""
        shape = (num_blocks, BLOCK_TOKENS, kv_heads, head_dim)
        self.keys = [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(layers)]
        self.allocator = BlockAllocator(num_blocks, seed)
        self.block_bytes = self.keys[0][0].numel() * self.keys[0].element_size()
        self.token_bytes = self.block_bytes // BLOCK_TOKENS

    def tensors(self) -> list[torch.Tensor]:
        """Every pool tensor, in the order layer 0 K, layer 0 V, layer 1 K, ..."""
        return [t for pair in zip(self.keys, self.values, strict=True) for t in pair]

    def addresses(self) -> list[int]:
        """The device address of every pool tensor, in the order of :meth:`tensors`."""
        return [t.data_ptr() for t in self.tensors()]

    def pool_bytes(self) -> int:
        """The size in bytes of one pool tensor."""
        return self.keys[0].numel() * self.keys[0].element_size()

    def scatter(self, layer: int, keys: torch.Tensor, values: torch.Tensor, blocks: list[int]):
        """Writes one layer's cache ([1, kv_heads, tokens, head_dim] each) into `blocks`."""
        for pool, states in ((self.keys[layer], keys), (self.values[layer], values)):
            rows = states[0].transpose(0, 1)
            padded = torch.zeros(
                (len(blocks) * BLOCK_TOKENS, *rows.shape[1:]), dtype=rows.dtype, device=rows.device
            )
            padded[: rows.shape[0]] = rows
            ids = torch.tensor(blocks, device=pool.device)
            pool.index_copy_(0, ids, padded.view(len(blocks), BLOCK_TOKENS, *rows.shape[1:]))

    def gather(self, layer: int, blocks: list[int], tokens: int):
        """One layer's cache for `tokens` tokens held in `blocks`, as (keys, values) each
        [1, kv_heads, tokens, head_dim] and contiguous, as the model's attention made them."""
        ids = torch.tensor(blocks, device=self.keys[layer].device)
        out = []
        for pool in (self.keys[layer], self.values[layer]):
            rows = pool.index_select(0, ids).flatten(0, 1)[:tokens]
            out.append(rows.transpose(0, 1).unsqueeze(0).contiguous())
        return out[0], out[1]


def transfer_entries(local: PagedKVPool, local_blocks, remote_addresses, remote_blocks, tokens):
    """The (local address, remote address, length) entries that copy a request's blocks.

    One entry per (layer, K/V, block), holding only the used tokens of the last block; runs of
    blocks consecutive on both sides are merged into one entry. `remote_addresses` are the
    peer's pool addresses in :meth:`PagedKVPool.tensors` order, with the same block size.
    """
    used = [
        min(BLOCK_TOKENS, tokens - index * BLOCK_TOKENS) * local.token_bytes
        for index in range(len(local_blocks))
    ]
    entries = []
    for local_base, remote_base in zip(local.addresses(), remote_addresses, strict=True):
        for src, dst, length in zip(local_blocks, remote_blocks, used, strict=True):
            src_addr = local_base + src * local.block_bytes
            dst_addr = remote_base + dst * local.block_bytes
            if entries:
                last_src, last_dst, last_len = entries[-1]
                if last_src + last_len == src_addr and last_dst + last_len == dst_addr:
                    entries[-1] = (last_src, last_dst, last_len + length)
                    continue
            entries.append((src_addr, dst_addr, length))
    return entries
