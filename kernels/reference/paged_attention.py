"""Paged attention for a packed, mixed batch (prefill chunks, decodes, verify rows): the reference.

Request b owns queries q[query_start[b]:query_start[b+1]]; they sit at the last q_len_b positions of
its context of seq_len_b tokens, whose keys/values are in the slots named by its block table. Query
i of request b (absolute position seq_len_b - q_len_b + i) attends to keys 0..that position.

The reference gathers each request's blocks into a padded tensor (whole blocks, `gather_blocks`) and
runs SDPA:
- short queries (decodes and verify rows, q_len <= SHORT_QUERY) of one shape (query rows, context
  blocks) are batched together, never padded to a neighbour's shape;
- each longer prefill chunk runs alone, so padding never multiplies a long chunk's cost.
Gather indices and masks depend only on the step, so `PagedAttentionMetadata` builds them once and
every layer reuses them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.metadata import PagedAttentionMetadata

SHORT_QUERY = 16


def groups(meta: PagedAttentionMetadata) -> list[tuple]:
    """(row_index [B, Q] or None, query slice, block ids [B, n], mask [B, 1, Q, n * block_size] or
    None), built once per step."""
    return meta.memo("reference_groups", lambda: _build_groups(meta))


def chunk_groups(meta: PagedAttentionMetadata) -> list[tuple]:
    """The long prefill chunks' groups only (for kernels that serve short queries themselves)."""
    return meta.memo("reference_chunks", lambda: _build_groups(meta, with_short=False))


def _blocks(block_table: list[int], seq_len: int, block_size: int) -> list[int]:
    return block_table[:-(-seq_len // block_size)]


def _build_groups(meta: PagedAttentionMetadata, with_short: bool = True) -> list[tuple]:
    dev, bs = meta.device, meta.block_size
    groups = []
    short: dict[tuple[int, int], list[int]] = {}          # (q_len, blocks) -> requests
    for b, seq_len in enumerate(meta.seq_lens):
        q_start, q_end = meta.query_start[b], meta.query_start[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len <= SHORT_QUERY:
            short.setdefault((q_len, -(-seq_len // bs)), []).append(b)
            continue
        blocks = torch.tensor(_blocks(meta.block_tables[b], seq_len, bs), dtype=torch.int64,
                              device=dev)
        # causal from the top left: right for a whole prompt, padding included
        mask = None
        if seq_len != q_len:         # a chunk after earlier context: causal with an offset
            qpos = torch.arange(seq_len - q_len, seq_len, device=dev)
            mask = (torch.arange(blocks.numel() * bs, device=dev)[None, :] <= qpos[:, None])[None,
                                                                                             None]
        groups.append((None, slice(q_start, q_end), blocks[None], mask))
    if with_short:
        groups += [_short_group(meta, members, q_len, num_blocks)
                   for (q_len, num_blocks), members in short.items()]
    return groups


def _short_group(meta: PagedAttentionMetadata, members: list[int], q_len: int,
                 num_blocks: int) -> tuple:
    """Short queries of one shape (q_len rows over num_blocks blocks) as one batch. Batching only
    equal shapes keeps each row's result independent of the rest of the batch: padding a row's
    keys or queries to a longer neighbour's changes SDPA's rounding, and with it greedy and
    seeded output (a verify row must compute what the decode it replaces would)."""
    bs = meta.block_size
    rows = torch.tensor([[meta.query_start[b] + i for i in range(q_len)] for b in members],
                        dtype=torch.int64)
    blocks = torch.tensor([meta.block_tables[b][:num_blocks] for b in members], dtype=torch.int64)
    seq_lens = torch.tensor([meta.seq_lens[b] for b in members])
    qpos = seq_lens[:, None] - q_len + torch.arange(q_len)[None, :]           # [B, Q]
    mask = torch.arange(num_blocks * bs)[None, None, :] <= qpos[:, :, None]    # [B, Q, L]
    dev = meta.device
    return rows.to(dev), members, blocks.to(dev), mask[:, None].to(dev)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [num_slots, num_kv_heads, D], blocks [B, n] -> [B, num_kv_heads, n * block_size, D] (a
    strided view of one copy). Whole blocks are copied with index_select: several times faster on
    CPU than indexing slot by slot."""
    num_slots, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_slots // block_size, block_size * num_kv_heads * head_dim)
    out = flat.index_select(0, blocks.flatten())
    return out.view(blocks.shape[0], blocks.shape[1] * block_size, num_kv_heads,
                    head_dim).transpose(1, 2)


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    blocks: torch.Tensor,
                    mask: torch.Tensor | None, scale: float, block_size: int) -> torch.Tensor:
    """One request's prefill chunk q [Q, num_heads, D] over its context's blocks [1, n] (causal;
    `mask` when the chunk follows earlier context). -> [Q, num_heads, D]."""
    # [1, num_kv_heads, n * block_size, D]
    k = gather_blocks(k_cache, blocks, block_size)
    v = gather_blocks(v_cache, blocks, block_size)
    qb = q.transpose(0, 1)[None]                                # [1, num_heads, Q, head_dim]
    o = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_slots, num_kv_heads, head_dim]
    (one layer). Returns [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    bs = meta.block_size
    for i, (rows, where, blocks, mask) in enumerate(groups(meta)):
        if rows is None:                                        # one prefill chunk
            out[where] = chunk_attention(q[where], k_cache, v_cache, blocks, mask, scale, bs)
            continue
        # short queries of one shape; query head h reads kv head h // group, so a kv head's
        # group x Q query rows go in as one [group * Q] block (no K/V repeat for GQA)
        num_reqs, q_max = rows.shape
        k = gather_blocks(k_cache, blocks, bs).to(q.dtype)     # [B, num_kv_heads, L, head_dim]
        v = gather_blocks(v_cache, blocks, bs).to(q.dtype)
        qg = q[rows].view(num_reqs, q_max, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(num_reqs, num_kv_heads, group * q_max, head_dim)
        grouped = meta.memo(f"reference_grouped_mask_{group}_{i}", lambda: mask[:, :, None].expand(
            -1, -1, group, -1, -1).reshape(num_reqs, 1, group * q_max, mask.shape[-1]))
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=grouped, scale=scale)
        o = o.view(num_reqs, num_kv_heads, group, q_max, head_dim).permute(0, 3, 1, 2, 4)
        out[rows.flatten()] = o.reshape(num_reqs * q_max, num_heads, head_dim)
    return out
