"""Paged attention (Triton) for decode and verify rows, read in place through the block tables.

The reference gathers each request's keys into a padded tensor per layer (a copy of the whole context
every layer) and runs SDPA. Here short-query requests (decodes and verify rows, q_len <= SHORT_QUERY)
are served by one kernel: one program per (query token, head, split of the context) walks the token's
causal context [0, pos] BN tokens at a time, looks each token's slot up in its request's block table,
and keeps an online softmax; splits are merged exactly by `combine_splits`. Long prefill chunks keep
the reference's SDPA path (one program per query would re-read the context once per query token).
Same contract as kernels/reference/paged_attention.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.reference.paged_attention import SHORT_QUERY, PagedAttentionMetadata, chunk_attention
from specserve.kernels.triton.splits import combine_splits, plan_splits

BN = 64


@triton.jit
def _paged_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, rows_ptr, req_ptr, pos_ptr, tables_ptr,
                  table_width, NUM_HEADS, GROUP, SPLIT, sm_scale, q_stride, kv_stride,
                  D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr):
    i = tl.program_id(0)                        # i-th short query token
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    kvh = head // GROUP
    row = tl.load(rows_ptr + i)
    req = tl.load(req_ptr + i)
    end = tl.minimum(tl.load(pos_ptr + i) + 1, (split + 1) * SPLIT)   # causal: keys 0..pos
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    q = tl.load(q_ptr + row * q_stride + head * D + offs_d).to(tl.float32)
    m = tl.zeros([], tl.float32) - float("inf")
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for start in range(split * SPLIT, end, BN):
        t = start + offs_n
        valid = t < end
        block = tl.load(tables_ptr + req * table_width + t // BS, mask=valid, other=0).to(tl.int64)
        slot = block * BS + t % BS
        kv_off = slot[:, None] * kv_stride + kvh * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(q[None, :] * k, axis=1) * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    part = (i * NUM_HEADS + head) * num_splits + split
    has = l > 0                                 # a split past this token's context holds nothing
    tl.store(out_ptr + part * D + offs_d, tl.where(has, acc / tl.where(has, l, 1.0), 0.0))
    tl.store(lse_ptr + part, tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf")))


def _short_tokens(meta: PagedAttentionMetadata, device) -> tuple | None:
    """(rows, request index, position, block tables [B, W] int32, max context) of the short-query
    tokens; built once per step and shared by every layer."""
    if "triton_short" not in meta._cache:
        rows, reqs, pos = [], [], []
        for b, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start[b], meta.query_start[b + 1]
            if 0 < end - start <= SHORT_QUERY:
                rows.extend(range(start, end))
                reqs.extend([b] * (end - start))
                pos.extend(range(seq_len - (end - start), seq_len))
        if not rows:
            meta._cache["triton_short"] = None
        else:
            width = max(len(t) for t in meta.block_tables) or 1
            tables = torch.zeros(len(meta.block_tables), width, dtype=torch.int32)
            for b, table in enumerate(meta.block_tables):
                tables[b, :len(table)] = torch.tensor(table, dtype=torch.int32)
            as_dev = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
            meta._cache["triton_short"] = (as_dev(rows), as_dev(reqs), as_dev(pos), tables.to(device),
                                           max(pos) + 1)
    return meta._cache["triton_short"]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as kernels/reference/paged_attention.py."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    out = torch.empty_like(q)
    for rows, where, slots, mask in meta.groups():
        if rows is None:                                            # a long prefill chunk
            out[where] = chunk_attention(q[where], k_cache, v_cache, slots, mask, scale)
    short = _short_tokens(meta, q.device)
    if short is not None:
        rows, reqs, pos, tables, max_ctx = short
        assert k_cache.stride(1) == head_dim and k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride()
        qc = q.contiguous()
        n = rows.shape[0]
        num_splits, split = plan_splits(max_ctx, n * num_heads, BN)
        part_out = torch.empty(n, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n, num_heads, num_splits, dtype=torch.float32, device=q.device)
        _paged_kernel[(n, num_heads, num_splits)](
            qc, k_cache, v_cache, part_out, part_lse, rows, reqs, pos, tables, tables.shape[1],
            num_heads, num_heads // num_kv_heads, split, scale, qc.stride(0), k_cache.stride(0),
            D=head_dim, BS=meta.block_size, BN=BN)
        out[rows.long()] = combine_splits(part_out, part_lse)[0].to(q.dtype)
    return out
