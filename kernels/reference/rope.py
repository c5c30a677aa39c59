"""Rotary position embedding, transformers' convention (rotate_half): x * cos + rotate_half(x) *
sin, in float32, two products and a sum as transformers rounds them (addcmul's fused multiply-add
does not)."""
from __future__ import annotations

import torch


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] -> x rotated, in x's dtype (queries and keys go through in
    one call). cos, sin: [num_tokens, 1, head_dim], each half repeated."""
    xf = x if x.dtype == torch.float32 else x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = (xf * cos).add_(torch.cat((x2.neg(), x1), dim=-1).mul_(sin))
    return out if x.dtype == torch.float32 else out.to(x.dtype)
