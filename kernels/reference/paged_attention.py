"""Paged attention for a packed, mixed batch (prefill chunks, decodes, verify rows): the reference.

Request b owns queries q[query_start[b]:query_start[b+1]]; they sit at the last q_len_b positions of
its context of seq_len_b tokens, whose keys/values are in the slots named by its block table. Query
i of request b (absolute position seq_len_b - q_len_b + i) attends to keys 0..that position.

The reference gathers each request's blocks (whole blocks, one index_select per cache and step
shape) and runs SDPA:
- short queries (decodes and verify rows, q_len <= SHORT_QUERY) of one shape (query rows, context
  blocks) are batched together, never padded to a neighbour's shape (`short_batch`);
- each longer prefill chunk runs alone, so padding never multiplies a long chunk's cost.
Gather indices and masks depend only on the step, so `PagedAttentionMetadata` builds them once and
every layer reuses them.

Two options of some families (Mistral, Gemma, Phi-3): `window` > 0 lets a query see only the last
`window` keys (its own included: key position > query position - window; transformers'
sliding-window mask), and `softcap` > 0 soft-caps the scores, cap * tanh(scores / cap), before the
mask and softmax (Gemma 2); SDPA has no soft-cap, so those layers spell the same math out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.metadata import PagedAttentionMetadata

SHORT_QUERY = 16


def chunk_groups(meta: PagedAttentionMetadata, window: int = 0,
                 longer_than: int = 0) -> list[tuple]:
    """The long prefill chunks (those whose context has more than `longer_than` tokens), one
    group each: (query slice, block ids [1, n], mask [1, 1, Q, n * block_size] or None: causal
    from the top left), built once per step, window and bound."""
    return meta.memo(f"reference_chunks_{window}_{longer_than}",
                     lambda: _chunk_groups(meta, window, longer_than))


@dataclass(frozen=True)
class ShortGroup:
    """Short queries of one shape: num_reqs requests of q_len rows over num_blocks blocks each.
    `rows` and `blocks` index the step's concatenated short rows and gathered blocks."""
    num_reqs: int
    q_len: int
    num_blocks: int
    rows: slice
    blocks: slice
    mask: torch.Tensor                   # [num_reqs, Q, num_blocks * block_size] bool


@dataclass(frozen=True)
class ShortBatch:
    rows: torch.Tensor                   # query rows of every short request, group by group
    blocks: torch.Tensor                 # their blocks, gathered in one call per layer
    groups: tuple[ShortGroup, ...]
    whole: bool                          # rows are the step's every row, in order (no scatter)


def short_batch(meta: PagedAttentionMetadata, window: int = 0) -> ShortBatch | None:
    """Decodes and verify rows (q_len <= SHORT_QUERY), batched by exact shape (query rows,
    context blocks), never padded to a neighbour's: padding a row's keys or queries changes SDPA's
    rounding, and with it greedy and seeded output (a verify row must compute what the decode it
    replaces would). Built once per step and window."""
    return meta.memo(f"reference_short_{window}", lambda: _short_batch(meta, window))


def _blocks(block_table: list[int], seq_len: int, block_size: int) -> list[int]:
    return block_table[:-(-seq_len // block_size)]


def _visible(kpos: torch.Tensor, qpos: torch.Tensor, window: int) -> torch.Tensor:
    """[..., Q, L] bool: key at kpos visible to the query at qpos (causal, within the window)."""
    visible = kpos <= qpos
    return visible & (kpos > qpos - window) if window else visible


def _chunk_groups(meta: PagedAttentionMetadata, window: int, longer_than: int) -> list[tuple]:
    dev, bs = meta.device, meta.block_size
    groups = []
    for b, seq_len in enumerate(meta.seq_lens):
        q_start, q_end = meta.query_start[b], meta.query_start[b + 1]
        q_len = q_end - q_start
        if q_len <= SHORT_QUERY or seq_len <= longer_than:
            continue
        blocks = torch.tensor(_blocks(meta.block_tables[b], seq_len, bs), dtype=torch.int64,
                              device=dev)
        # causal from the top left: right for a whole prompt, padding included
        mask = None
        if seq_len != q_len or window:   # after earlier context (causal with an offset), a window
            qpos = torch.arange(seq_len - q_len, seq_len, device=dev)
            kpos = torch.arange(blocks.numel() * bs, device=dev)
            mask = _visible(kpos[None, :], qpos[:, None], window)[None, None]
        groups.append((slice(q_start, q_end), blocks[None], mask))
    return groups


def _short_batch(meta: PagedAttentionMetadata, window: int) -> ShortBatch | None:
    bs = meta.block_size
    shapes: dict[tuple[int, int], list[int]] = {}          # (q_len, blocks) -> requests
    for b, seq_len in enumerate(meta.seq_lens):
        q_len = meta.query_start[b + 1] - meta.query_start[b]
        if 0 < q_len <= SHORT_QUERY:
            shapes.setdefault((q_len, -(-seq_len // bs)), []).append(b)
    if not shapes:
        return None
    rows: list[int] = []
    blocks: list[int] = []
    groups = []
    for (q_len, num_blocks), members in shapes.items():
        row0, block0 = len(rows), len(blocks)
        for b in members:
            rows.extend(range(meta.query_start[b], meta.query_start[b] + q_len))
            blocks.extend(meta.block_tables[b][:num_blocks])
        seq_lens = torch.tensor([meta.seq_lens[b] for b in members])
        qpos = seq_lens[:, None] - q_len + torch.arange(q_len)[None, :]           # [B, Q]
        mask = _visible(torch.arange(num_blocks * bs)[None, None, :], qpos[:, :, None],
                        window)                                                   # [B, Q, L]
        groups.append(ShortGroup(len(members), q_len, num_blocks, slice(row0, len(rows)),
                                 slice(block0, len(blocks)), mask.to(meta.device)))
    as_tensor = lambda ids: torch.tensor(ids, dtype=torch.int64, device=meta.device)  # noqa: E731
    whole = len(groups) == 1 and rows == list(range(meta.query_start[-1]))
    return ShortBatch(as_tensor(rows), as_tensor(blocks), tuple(groups), whole)


def gather_flat(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [num_slots, num_kv_heads, D], blocks [n] -> [n, block_size, num_kv_heads, D]: whole
    blocks copied in one index_select."""
    num_slots, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_slots // block_size, block_size * num_kv_heads * head_dim)
    return flat.index_select(0, blocks).view(-1, block_size, num_kv_heads, head_dim)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [num_slots, num_kv_heads, D], blocks [B, n] -> [B, num_kv_heads, n * block_size, D] (a
    strided view of one copy). Whole blocks are copied with index_select: several times faster on
    CPU than indexing slot by slot."""
    num_slots, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_slots // block_size, block_size * num_kv_heads * head_dim)
    out = flat.index_select(0, blocks.flatten())
    return out.view(blocks.shape[0], blocks.shape[1] * block_size, num_kv_heads,
                    head_dim).transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float, softcap: float = 0.0, gqa: bool = False) -> torch.Tensor:
    """SDPA (mask None: causal from the top left); with `softcap` the same math spelled out, the
    scores soft-capped before the mask (SDPA has no soft-cap). q [B, H, Q, D]; k, v [B, H_kv, L,
    D] (H_kv < H only with `gqa`)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=gqa)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    blocks: torch.Tensor,
                    mask: torch.Tensor | None, scale: float, block_size: int,
                    softcap: float = 0.0) -> torch.Tensor:
    """One request's prefill chunk q [Q, num_heads, D] over its context's blocks [1, n] (causal;
    `mask` when the chunk follows earlier context or has a window). -> [Q, num_heads, D]."""
    # [1, num_kv_heads, n * block_size, D]
    k = gather_blocks(k_cache, blocks, block_size)
    v = gather_blocks(v_cache, blocks, block_size)
    qb = q.transpose(0, 1)[None]                                # [1, num_heads, Q, head_dim]
    o = attend(qb, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap, gqa=True)
    return o[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_slots, num_kv_heads, head_dim]
    (one layer). `window`, `softcap`: 0 = off (module docstring). Returns [num_tokens, num_heads,
    head_dim]."""
    batch = short_batch(meta, window)
    if batch is not None and batch.whole:           # all decodes/verify rows of one shape
        return short_attention(q, k_cache, v_cache, batch, meta, scale, window, softcap)
    out = torch.empty_like(q)
    for where, blocks, mask in chunk_groups(meta, window):      # prefill chunks, one by one
        out[where] = chunk_attention(q[where], k_cache, v_cache, blocks, mask, scale,
                                     meta.block_size, softcap)
    if batch is not None:
        out[batch.rows] = short_attention(q[batch.rows], k_cache, v_cache, batch, meta, scale,
                                          window, softcap)
    return out


def short_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ShortBatch, meta: PagedAttentionMetadata, scale: float,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: the short rows [R, num_heads, D], group by group. Every group's blocks come from one
    gather per cache; query head h reads kv head h // group, so a kv head's group x Q query rows go
    in as one [group * Q] block (no K/V repeat for GQA)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group, bs = num_heads // num_kv_heads, meta.block_size
    k_all = gather_flat(k_cache, batch.blocks, bs)                   # [n_all, bs, kvh, D]
    v_all = gather_flat(v_cache, batch.blocks, bs)
    if k_all.dtype != q.dtype:
        k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)
    out = None if len(batch.groups) == 1 else torch.empty_like(q)
    for i, g in enumerate(batch.groups):
        shape = (g.num_reqs, g.num_blocks * bs, num_kv_heads, head_dim)
        k = k_all[g.blocks].view(shape).transpose(1, 2)             # [B, kvh, L, D]
        v = v_all[g.blocks].view(shape).transpose(1, 2)
        qg = q[g.rows].view(g.num_reqs, g.q_len, num_kv_heads, group, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(g.num_reqs, num_kv_heads, group * g.q_len, head_dim)
        mask = meta.memo(f"reference_short_mask_{window}_{group}_{i}_{softcap > 0}",
                         lambda: _group_mask(g, group, q.dtype, additive=not softcap))
        o = attend(qg, k, v, mask, scale, softcap)
        o = o.view(g.num_reqs, num_kv_heads, group, g.q_len, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(g.num_reqs * g.q_len, num_heads, head_dim)
        if out is None:
            return o
        out[g.rows] = o
    return out


def _group_mask(g: ShortGroup, group: int, dtype: torch.dtype, additive: bool) -> torch.Tensor:
    """The group's mask repeated for the `group` query heads of each kv head: [B, 1, group * Q,
    L]; `additive`: as SDPA turns a boolean mask into one (0 visible, -inf hidden), built once per
    step instead of once per layer."""
    mask = g.mask[:, None, None].expand(-1, -1, group, -1, -1).reshape(
        g.num_reqs, 1, group * g.q_len, g.mask.shape[-1])
    if not additive:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask,
                                                                                float("-inf"))
