"""Paged attention for a packed, mixed batch (prefill chunks, decodes, verify rows): the reference.

Request b owns queries q[query_start[b]:query_start[b+1]]; they sit at the last q_len_b positions of
its context of seq_len_b tokens, whose keys/values are in the slots named by its block table. Query i
of request b (absolute position seq_len_b - q_len_b + i) attends to keys 0..that position.

The reference gathers each request's keys into a padded tensor and runs SDPA:
- short queries (decodes and verify rows, q_len <= SHORT_QUERY) are padded together into one batch;
- each longer prefill chunk runs alone, so padding never multiplies a long chunk's cost.
Gather indices and masks depend only on the step, so `PagedAttentionMetadata` builds them once and
every layer reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

SHORT_QUERY = 16


@dataclass
class PagedAttentionMetadata:
    query_start: list[int]           # [num_reqs + 1] cumulative query counts (host)
    seq_lens: list[int]              # [num_reqs] context length including this step's tokens (host)
    block_tables: list[list[int]]    # per request, block ids covering seq_len slots
    block_size: int
    device: torch.device | str = "cpu"
    _groups: list | None = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)     # per-step tensors other implementations build

    def groups(self) -> list[tuple]:
        """(row_index [B, Q] or None, query slice, key slots [B, L], mask [B, 1, Q, L] or None)."""
        if self._groups is None:
            self._groups = _build_groups(self)
        return self._groups

    def chunk_groups(self) -> list[tuple]:
        """The long prefill chunks' groups only (for kernels that serve short queries themselves)."""
        if "chunks" not in self._cache:
            self._cache["chunks"] = (_build_groups(self, with_short=False) if self._groups is None
                                     else [g for g in self._groups if g[0] is None])
        return self._cache["chunks"]


def _slots(block_table: list[int], seq_len: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_table[:-(-seq_len // block_size)], dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return slots[:seq_len]


def _build_groups(meta: PagedAttentionMetadata, with_short: bool = True) -> list[tuple]:
    dev, bs = meta.device, meta.block_size
    groups, short = [], []
    for b, seq_len in enumerate(meta.seq_lens):
        q_start, q_end = meta.query_start[b], meta.query_start[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len <= SHORT_QUERY:
            short.append(b)
            continue
        slots = _slots(meta.block_tables[b], seq_len, bs).to(dev)
        mask = None
        if seq_len != q_len:         # a chunk after earlier context: causal with an offset
            qpos = torch.arange(seq_len - q_len, seq_len, device=dev)
            mask = (torch.arange(seq_len, device=dev)[None, :] <= qpos[:, None])[None, None]
        groups.append((None, slice(q_start, q_end), slots[None], mask))
    if short and with_short:
        q_max = max(meta.query_start[b + 1] - meta.query_start[b] for b in short)
        l_max = max(meta.seq_lens[b] for b in short)
        rows = torch.zeros(len(short), q_max, dtype=torch.int64)
        slots = torch.zeros(len(short), l_max, dtype=torch.int64)
        mask = torch.zeros(len(short), 1, q_max, l_max, dtype=torch.bool)
        for j, b in enumerate(short):
            q_start, seq_len = meta.query_start[b], meta.seq_lens[b]
            q_len = meta.query_start[b + 1] - q_start
            rows[j, :q_len] = torch.arange(q_start, q_start + q_len)
            rows[j, q_len:] = q_start + q_len - 1               # padding rows repeat the last query
            slots[j, :seq_len] = _slots(meta.block_tables[b], seq_len, bs)
            qpos = torch.arange(seq_len - q_len, seq_len)
            qpos = torch.cat([qpos, qpos[-1:].expand(q_max - q_len)])
            mask[j, 0] = torch.arange(l_max)[None, :] <= qpos[:, None]
        groups.append((rows.to(dev), short, slots.to(dev), mask.to(dev)))
    return groups


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One request's prefill chunk q [Q, num_heads, D] over its context's slots [1, L] (causal; `mask`
    when the chunk follows earlier context). -> [Q, num_heads, D]."""
    k = k_cache[slots].transpose(1, 2)                          # [1, num_kv_heads, L, head_dim]
    v = v_cache[slots].transpose(1, 2)
    qb = q.transpose(0, 1)[None]                                # [1, num_heads, Q, head_dim]
    o = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_slots, num_kv_heads, head_dim] (one
    layer). Returns [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    for rows, where, slots, mask in meta.groups():
        if rows is None:                                        # one prefill chunk
            out[where] = chunk_attention(q[where], k_cache, v_cache, slots, mask, scale)
        else:                                                   # padded short queries
            k = k_cache[slots].transpose(1, 2)                  # [B, num_kv_heads, L, head_dim]
            v = v_cache[slots].transpose(1, 2)
            qb = q[rows].transpose(1, 2)                        # [B, num_heads, Q, head_dim]
            o = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                               scale=scale, enable_gqa=True)
            o = o.transpose(1, 2)                               # [B, Q, num_heads, head_dim]
            out[rows.flatten()] = o.reshape(-1, *o.shape[2:])   # padding rows rewrite their last row
    return out
