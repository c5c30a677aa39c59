"""Attention over a Mustafar bitmap-sparse KV cache (reference: scatter back to dense, then attend).

Layout for one layer, T = 64 * num_blocks tokens, H kv heads, head_dim D (a multiple of 64):
- keys, column tiles (one channel × 64 consecutive tokens):
      k_bitmaps, k_offsets [H, num_blocks, D]      tile (h, b, c) = K[h, 64b : 64b + 64, c]
- values, row tiles (one token × 64 consecutive channels):
      v_bitmaps, v_offsets [H, T, D // 64]         tile (h, t, j) = V[h, t, 64j : 64j + 64]
Offsets index the flat fp16 arrays k_values / v_values (see mustafar_encode.py).
"""
from __future__ import annotations

import torch

from specserve.kernels.reference.mustafar_encode import mustafar_decode


def mustafar_keys(k_bitmaps: torch.Tensor, k_offsets: torch.Tensor,
                  k_values: torch.Tensor) -> torch.Tensor:
    """-> K [H, T, D] float32."""
    tiles = mustafar_decode(k_bitmaps, k_offsets, k_values)                    # [H, NB, D, 64]
    h, nb, d, _ = tiles.shape
    return tiles.permute(0, 1, 3, 2).reshape(h, nb * 64, d)


def mustafar_values(v_bitmaps: torch.Tensor, v_offsets: torch.Tensor,
                    v_values: torch.Tensor) -> torch.Tensor:
    """-> V [H, T, D] float32."""
    tiles = mustafar_decode(v_bitmaps, v_offsets, v_values)                    # [H, T, D / 64, 64]
    return tiles.reshape(*tiles.shape[:2], -1)


def mustafar_attention(q: torch.Tensor,
                     k_bitmaps: torch.Tensor, k_offsets: torch.Tensor, k_values: torch.Tensor,
                     v_bitmaps: torch.Tensor, v_offsets: torch.Tensor, v_values: torch.Tensor,
                     sm_scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [num_q, num_heads, D] -> (out [num_q, num_heads, D] f32, lse [num_q, num_heads] f32)."""
    group = q.shape[1] // k_bitmaps.shape[0]
    # [num_heads, T, D]
    k = mustafar_keys(k_bitmaps, k_offsets, k_values).repeat_interleave(group, dim=0)
    v = mustafar_values(v_bitmaps, v_offsets, v_values).repeat_interleave(group, dim=0)
    logits = torch.einsum("qhd,htd->hqt", q.float(), k) * sm_scale
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("hqt,htd->qhd", torch.softmax(logits, dim=-1), v)
    return out, lse.transpose(0, 1).contiguous()
