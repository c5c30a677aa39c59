"""Per-step metadata of paged attention, shared by every implementation of the op.

Request b owns queries q[query_start[b]:query_start[b+1]]; they sit at the last q_len_b positions
of its context of seq_len_b tokens, whose keys/values are in the slots named by its block table.
Index tensors an implementation derives from this depend only on the step, so each implementation
builds them once through `memo` and every layer reuses them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PagedAttentionMetadata:
    query_start: list[int]           # [num_reqs + 1] cumulative query counts (host)
    seq_lens: list[int]              # [num_reqs] context length including this step's tokens
    block_tables: list               # per request, block ids covering seq_len slots
    block_size: int
    device: torch.device | str = "cpu"
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def memo(self, key: str, build: Callable[[], Any]) -> Any:
        """`build()` once per step under `key` (an implementation names its own keys)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


@dataclass(frozen=True)
class StaticBatchMetadata:
    """A batch's metadata as device tensors of fixed shape, so that a CUDA graph can capture
    attention over it (`spec_phases/cuda_graphs.py`): request b has query_lens[b] <= SHORT_QUERY
    rows from row first_rows[b] on, the last of its context of seq_lens[b] tokens, whose blocks are
    block_tables[b, :]. Built once per captured shape, refilled in place each step."""
    requests: torch.Tensor           # [B] int32: 0..B-1 (each request's table row)
    first_rows: torch.Tensor         # [B] int32
    query_lens: torch.Tensor         # [B] int32
    seq_lens: torch.Tensor           # [B] int32
    block_tables: torch.Tensor       # [B, W] int32
    block_size: int

    @property
    def max_context(self) -> int:
        """The longest context the tables can hold: the kernel plans its splits for it."""
        return self.block_tables.shape[1] * self.block_size


@dataclass(frozen=True)
class LayerAttention:
    """What paged attention needs to know of a model, per layer: the score scale, each layer's
    sliding window (0: full attention; () every layer full) and the score soft-cap (0: off)."""
    scale: float
    windows: tuple[int, ...] = ()
    softcap: float = 0.0

    def options(self, layer: int) -> dict:
        """paged_attention's keyword arguments for `layer`."""
        return {"scale": self.scale, "window": self.windows[layer] if self.windows else 0,
                "softcap": self.softcap}
