"""Attention over Spherical-KV key codes (reference): rebuild the keys, then plain attention.

The Triton kernel computes the same logits without rebuilding keys: per query head a table
LUT[j, c] = <q_j, C_j[c]>, then
    logit_t = sm_scale * sum_j radius[t, j] / 255 * scale[j] * LUT[j, theta[t, j]].
"""
from __future__ import annotations

import torch

from specserve.kernels.reference.spherical_encode import spherical_decode


def spherical_attention(q: torch.Tensor, theta: torch.Tensor, radius: torch.Tensor,
                        scale: torch.Tensor,
                        codebook: torch.Tensor, v: torch.Tensor, sm_scale: float, page_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [num_q, num_heads, D]; theta, radius [H, T, G] uint8; scale [H, T // page_size, G] f32;
    codebook [H, G, K, g]; v [H, T, D] (dense values). num_heads % H == 0, T >= 1.

    Returns out [num_q, num_heads, D] float32 and lse [num_q, num_heads] float32 (natural log).
    """
    num_heads = q.shape[1]
    group = num_heads // theta.shape[0]
    k = spherical_decode(theta, radius, scale, codebook, page_size)           # [H, T, D]
    k = k.repeat_interleave(group, dim=0)                                     # [num_heads, T, D]
    vf = v.float().repeat_interleave(group, dim=0)
    # [num_heads, num_q, T]
    logits = torch.einsum("qhd,htd->hqt", q.float(), k) * sm_scale
    lse = torch.logsumexp(logits, dim=-1)                                     # [num_heads, num_q]
    out = torch.einsum("hqt,htd->qhd", torch.softmax(logits, dim=-1), vf)
    return out, lse.transpose(0, 1).contiguous()
