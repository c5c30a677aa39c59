"""Attention over a Mustafar bitmap-sparse KV cache (Triton): expand tiles in registers, online
softmax.

One program per (query, head, split of the context; see splits.py); per 64-token block it loads the
D key-tile bitmaps, expands them to a [D, 64] K^T tile (a non-zero's slot = its tile offset + the
set bits before it), and the 64 tokens' value tiles to a [64, D] V tile (row tiles of one token are
contiguous in the value array, so a slot = the token's first offset + set bits before it in the
row). Layout: kernels/reference/mustafar_attention.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton.splits import combine_splits, plan_splits


@triton.jit
def _attend_kernel(q_ptr, kb_ptr, ko_ptr, kv_ptr, vb_ptr, vo_ptr, vv_ptr, out_ptr, lse_ptr,
                   NUM_BLOCKS, NUM_HEADS, GROUP, SPLIT, sm_scale, D: tl.constexpr):
    pid = tl.program_id(0)                     # = query * NUM_HEADS + head
    # 64-token blocks [split * SPLIT, (split + 1) * SPLIT)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    head = pid % NUM_HEADS
    kvh = head // GROUP
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, 64)
    q = tl.load(q_ptr + pid * D + offs_d).to(tl.float32)
    m = tl.zeros([], tl.float32) - float("inf")
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    CHUNKS: tl.constexpr = D // 64
    for b in range(split * SPLIT, tl.minimum(NUM_BLOCKS, (split + 1) * SPLIT)):
        tile = (kvh * NUM_BLOCKS + b) * D + offs_d                                   # [D] key tiles
        kbits = (tl.load(kb_ptr + tile)[:, None] >> (63 - offs_t[None, :]).to(tl.int64)) & 1
        krank = tl.cumsum(kbits, axis=1) - kbits
        kslot = tl.load(ko_ptr + tile)[:, None] + krank
        kt = tl.load(kv_ptr + kslot, mask=kbits != 0, other=0.0).to(tl.float32)     # [D, 64] = K^T
        logits = tl.sum(q[:, None] * kt, axis=0) * sm_scale                          # [64]
        t = b * 64 + offs_t
        vtile = (kvh * NUM_BLOCKS * 64 + t[:, None]) * CHUNKS + offs_d[None, :] // 64  # [64, D]
        vbits = (tl.load(vb_ptr + vtile) >> (63 - offs_d[None, :] % 64).to(tl.int64)) & 1
        vrank = tl.cumsum(vbits, axis=1) - vbits
        first = tl.load(vo_ptr + (kvh * NUM_BLOCKS * 64 + t) * CHUNKS)               # [64]
        vt = tl.load(vv_ptr + first[:, None] + vrank, mask=vbits != 0, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(logits, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logits - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        m = m_new
    part = pid * num_splits + split
    tl.store(out_ptr + part * D + offs_d, acc / l)
    tl.store(lse_ptr + part, m + tl.log(l))


def mustafar_attention(q: torch.Tensor,
                     k_bitmaps: torch.Tensor, k_offsets: torch.Tensor, k_values: torch.Tensor,
                     v_bitmaps: torch.Tensor, v_offsets: torch.Tensor, v_values: torch.Tensor,
                     sm_scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels/reference/mustafar_attention.py."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, _ = k_bitmaps.shape
    assert head_dim % 64 == 0 and num_blocks >= 1
    num_splits, split_tokens = plan_splits(num_blocks * 64, num_q * num_heads, 64)
    split = split_tokens // 64
    out = torch.empty(num_q, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_q, num_heads, num_splits, dtype=torch.float32, device=q.device)
    # one element of padding so that masked-off gathers past the last non-zero stay in bounds
    kv = torch.cat([k_values, k_values.new_zeros(1)])
    vv = torch.cat([v_values, v_values.new_zeros(1)])
    _attend_kernel[(num_q * num_heads, num_splits)](
        q.float().contiguous(), k_bitmaps.contiguous(), k_offsets.contiguous(), kv,
        v_bitmaps.contiguous(),
        v_offsets.contiguous(), vv, out, lse, num_blocks, num_heads, num_heads // num_kv_heads,
        split,
        sm_scale, D=head_dim)
    return combine_splits(out, lse)
