"""KV tensors of one pool, sized from a memory budget.

Layout per layer: k[layer] and v[layer] are [num_blocks * block_size, num_kv_heads, head_dim]; slot
s belongs to block s // block_size. Writes go through a slot mapping, so rejected drafts simply
leave stale values in slots that later writes overwrite.
"""
from __future__ import annotations

import numpy as np
import torch


def num_blocks_for_budget(budget_bytes: float, num_layers: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * elem
    return int(budget_bytes // per_block)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero-filled tensor. On CPU it comes from calloc (numpy's zeros), whose large blocks are
    fresh zero pages the OS maps on first write: a KV cache then costs resident memory only for
    the blocks requests have used, not its whole budget at start-up."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x rounded to the cache's dtype (torch's rounding; an fp8 e4m3 cache
    saturates at +-448). torch has no index_copy_ for fp8: its bytes are copied instead."""
    x = x.to(cache.device, cache.dtype)
    if cache.dtype == torch.float8_e4m3fn:
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.index_copy_(0, slots, x)


class KVStorage:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu",
                 padding_block: bool = False):
        """padding_block: one block more than num_blocks, block id num_blocks, which no block
        pool hands out: the padding rows of a CUDA graph's batch write and read it
        (`spec_phases/cuda_graphs.py`)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.padding_block = num_blocks if padding_block else None
        total = num_blocks + int(padding_block)
        shape = (num_layers, total * block_size, num_kv_heads, head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """slot_mapping: [num_tokens] int64; k, v: [num_tokens, num_kv_heads, head_dim]."""
        write_slots(self.k[layer], slot_mapping, k)
        write_slots(self.v[layer], slot_mapping, v)
