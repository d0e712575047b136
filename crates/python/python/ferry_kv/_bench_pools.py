"""The KV pools of ``ferry_kv.bench``: one pool tensor per layer and K/V, filled with a
pattern that names each (tensor, block) and each position inside a block, and checked after a
request block by block.

Two kinds of memory, picked by the parent process so that both sides use the same one:

- ``torch``: a ``torch.uint8`` tensor per pool on ``cuda:N`` or on the host. Each 8-byte word
  ``w`` of block ``b`` of tensor ``t`` holds ``((t << 24 | b) << 20) | w``: never negative, so
  never equal to the poison (all bytes 0xFF), and different for every (tensor, block, word).
- ``ctypes``: an anonymous ``mmap`` per pool (host memory without torch). Block ``b`` of tensor
  ``t`` holds a 16-byte tag ``(t, b)``, a slice of a seeded random stream starting at an offset
  that depends on ``(t, b)``, and the tag again: cheap to build in pure Python, different for
  every block, and different at every position.
"""

import ctypes
import mmap
import random
import struct

POISON = 0xFF
TAG = struct.Struct("<QQ")
WORD_BITS = 20
BLOCK_BITS = 24


class TorchPools:
    """Pool tensors from torch on one device (``"cuda:N"`` or ``"cpu"``)."""

    def __init__(self, tensors, pool_blocks, block_bytes, device):
        import torch

        if block_bytes % 8:
            raise ValueError(f"block size {block_bytes} is not a multiple of 8 bytes")
        if pool_blocks >= 1 << BLOCK_BITS or block_bytes // 8 > 1 << WORD_BITS:
            raise ValueError("pool too large for the verification pattern")
        self._torch = torch
        self._device = torch.device(device)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        self.pool_blocks = pool_blocks
        self.block_bytes = block_bytes
        self._words = block_bytes // 8
        self._pools = [
            torch.empty(pool_blocks * block_bytes, dtype=torch.uint8, device=self._device)
            for _ in range(tensors)
        ]

    @property
    def addresses(self):
        """The base address of every pool, in tensor order."""
        return [pool.data_ptr() for pool in self._pools]

    @property
    def lengths(self):
        """The byte length of every pool."""
        return [pool.numel() for pool in self._pools]

    def _rows(self, tensor):
        """Tensor ``tensor``'s pool as (blocks x words) int64."""
        return self._pools[tensor].view(self._torch.int64).view(self.pool_blocks, self._words)

    def _pattern(self, tensor, block_ids):
        """The expected words of the given blocks of ``tensor`` (blocks x words)."""
        torch = self._torch
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self._device)
        words = torch.arange(self._words, dtype=torch.int64, device=self._device)
        return (((tensor << BLOCK_BITS) + ids[:, None]) << WORD_BITS) + words[None, :]

    def fill_pattern(self):
        """Writes the pattern into every block of every pool."""
        every_block = list(range(self.pool_blocks))
        for tensor in range(len(self._pools)):
            self._rows(tensor).copy_(self._pattern(tensor, every_block))
        self._synchronize()

    def poison(self):
        """Sets every byte of every pool to the poison value."""
        for pool in self._pools:
            pool.fill_(POISON)
        self._synchronize()

    def check(self, src_ids, dst_ids):
        """Problems found (empty when all is well): every destination block ``dst_ids[i]`` of
        every tensor must hold the pattern of source block ``src_ids[i]``, and every other block
        must still hold the poison."""
        torch = self._torch
        problems = []
        dst = torch.as_tensor(dst_ids, dtype=torch.int64, device=self._device)
        untouched = torch.ones(self.pool_blocks, dtype=torch.bool, device=self._device)
        untouched[dst] = False
        for tensor in range(len(self._pools)):
            rows = self._rows(tensor)
            landed = rows.index_select(0, dst)
            wrong = (landed != self._pattern(tensor, src_ids)).any(dim=1)
            for index in wrong.nonzero().flatten().tolist()[:3]:
                problems.append(
                    f"tensor {tensor}: block {dst_ids[index]} does not hold source block "
                    f"{src_ids[index]}"
                )
            if not bool((rows[untouched] == -1).all()):
                problems.append(f"tensor {tensor}: a block outside the request was written")
            if len(problems) >= 10:
                break
        return problems

    def _synchronize(self):
        if self._device.type == "cuda":
            self._torch.cuda.synchronize(self._device)


class CtypesPools:
    """Pools in anonymous host mappings, for machines without torch."""

    def __init__(self, tensors, pool_blocks, block_bytes, seed):
        if block_bytes < 2 * TAG.size:
            raise ValueError(f"block size {block_bytes} is below {2 * TAG.size} bytes")
        self.pool_blocks = pool_blocks
        self.block_bytes = block_bytes
        self._maps = [mmap.mmap(-1, pool_blocks * block_bytes) for _ in range(tensors)]
        self._views = [ctypes.c_char.from_buffer(mapping) for mapping in self._maps]
        self._stream = random.Random(seed).randbytes(2 * block_bytes)

    @property
    def addresses(self):
        """The base address of every pool, in tensor order."""
        return [ctypes.addressof(view) for view in self._views]

    @property
    def lengths(self):
        """The byte length of every pool."""
        return [len(mapping) for mapping in self._maps]

    def _content(self, tensor, block):
        """The expected bytes of block ``block`` of ``tensor``."""
        tag = TAG.pack(tensor, block)
        start = (tensor * 1_000_003 + block * 7_919) % self.block_bytes
        middle = self._stream[start : start + self.block_bytes - 2 * TAG.size]
        return tag + middle + tag

    def fill_pattern(self):
        """Writes the pattern into every block of every pool."""
        for tensor, mapping in enumerate(self._maps):
            for block in range(self.pool_blocks):
                start = block * self.block_bytes
                mapping[start : start + self.block_bytes] = self._content(tensor, block)

    def poison(self):
        """Sets every byte of every pool to the poison value."""
        for address, length in zip(self.addresses, self.lengths):
            ctypes.memset(address, POISON, length)

    def check(self, src_ids, dst_ids):
        """Problems found (empty when all is well): every destination block ``dst_ids[i]`` of
        every tensor must hold the pattern of source block ``src_ids[i]``, and every other block
        must still hold the poison."""
        problems = []
        poison = bytes([POISON]) * self.block_bytes
        source_of = dict(zip(dst_ids, src_ids))
        for tensor, mapping in enumerate(self._maps):
            for block in range(self.pool_blocks):
                start = block * self.block_bytes
                landed = mapping[start : start + self.block_bytes]
                source = source_of.get(block)
                if source is None:
                    if landed != poison:
                        problems.append(
                            f"tensor {tensor}: block {block} is outside the request but was written"
                        )
                elif landed != self._content(tensor, source):
                    problems.append(
                        f"tensor {tensor}: block {block} does not hold source block {source}"
                    )
                if len(problems) >= 10:
                    return problems
        return problems


def make_pools(memory, tensors, pool_blocks, block_bytes, device, seed):
    """The pools for ``memory`` ``"torch"`` (on ``device``) or ``"ctypes"`` (host)."""
    if memory == "torch":
        return TorchPools(tensors, pool_blocks, block_bytes, device)
    if memory == "ctypes":
        return CtypesPools(tensors, pool_blocks, block_bytes, seed)
    raise ValueError(f"unknown memory kind {memory!r}: use torch or ctypes")
