"""Attention from Spherical-KV codes (Triton): LUT-gather logits + online softmax over dense V.

Keys are never rebuilt. The wrapper builds, per query head, LUT[j, c] = <q_j, C_j[c]>
([num_q, num_heads, G, K], a tiny einsum); one program per (query, head, split of the context) then
streams its split's codes:
    logit_t = sm_scale / 255 * sum_j radius[t, j] * scale[page(t), j] * LUT[j, theta[t, j]]
and accumulates softmax(logits) @ V flash-decoding style (running max m, sum l, acc). The splits'
partial (m, l, acc) are merged exactly afterwards (`combine_splits`): with one program per (query,
head) a decode step at long context would run 9 programs on a 132-SM GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton.splits import combine_splits, plan_splits


@triton.jit
def _attend_kernel(lut_ptr, theta_ptr, radius_ptr, scale_ptr, v_ptr, out_ptr, lse_ptr,
                   T, NUM_PAGES, NUM_HEADS, GROUP, SPLIT, sm_scale,
                   D: tl.constexpr, G: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
                   BT: tl.constexpr):
    pid = tl.program_id(0)                     # = query * NUM_HEADS + head
    split = tl.program_id(1)                   # tokens [split * SPLIT, min(T, (split + 1) * SPLIT))
    num_splits = tl.num_programs(1)
    end = tl.minimum(T, (split + 1) * SPLIT)
    head = pid % NUM_HEADS
    kvh = head // GROUP
    offs_b = tl.arange(0, BT)
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, D)
    m = tl.zeros([], tl.float32) - float("inf")
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for start in range(split * SPLIT, end, BT):
        t = start + offs_b                                                    # [BT]
        valid = t < end
        code_off = kvh * T * G + t[:, None] * G + offs_g[None, :]             # [BT, G]
        theta = tl.load(theta_ptr + code_off, mask=valid[:, None], other=0).to(tl.int32)
        rad = tl.load(radius_ptr + code_off, mask=valid[:, None], other=0).to(tl.float32)
        sc = tl.load(scale_ptr + (kvh * NUM_PAGES + t[:, None] // P) * G + offs_g[None, :],
                     mask=valid[:, None], other=0.0)
        lut = tl.load(lut_ptr + pid * G * K + offs_g[None, :] * K + theta)   # gather [BT, G]
        logits = tl.sum(rad * sc * lut, axis=1) * (sm_scale / 255.0)          # [BT]
        logits = tl.where(valid, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logits - m_new)
        vb = tl.load(v_ptr + kvh * T * D + t[:, None] * D + offs_d[None, :], mask=valid[:, None],
                     other=0.0).to(tl.float32)                                # [BT, D]
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vb, axis=0)
        m = m_new
    part = pid * num_splits + split
    tl.store(out_ptr + part * D + offs_d, acc / l)
    tl.store(lse_ptr + part, m + tl.log(l))


def spherical_attention(q: torch.Tensor, theta: torch.Tensor, radius: torch.Tensor,
                        scale: torch.Tensor,
                        codebook: torch.Tensor, v: torch.Tensor, sm_scale: float, page_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels/reference/spherical_attention.py."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads, num_tokens, num_groups = theta.shape
    num_codes, group = codebook.shape[2], codebook.shape[3]
    gqa = num_heads // num_kv_heads
    qg = q.float().reshape(num_q, num_heads, num_groups, group)
    cb = codebook.float().repeat_interleave(gqa, dim=0)                       # [num_heads, G, K, g]
    # [num_q, num_heads, G, K]
    lut = torch.einsum("qhgi,hgki->qhgk", qg, cb).contiguous()
    block = 64
    num_splits, split = plan_splits(num_tokens, num_q * num_heads, block)
    out = torch.empty(num_q, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_q, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _attend_kernel[(num_q * num_heads, num_splits)](
        lut, theta.contiguous(), radius.contiguous(), scale.float().contiguous(), v.contiguous(),
        out, lse,
        num_tokens, scale.shape[1], num_heads, gqa, split, sm_scale,
        D=head_dim, G=num_groups, K=num_codes, P=page_size, BT=block)
    return combine_splits(out, lse)
