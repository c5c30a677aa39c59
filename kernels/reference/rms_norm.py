"""RMSNorm, and the residual add before it, in float32 as transformers computes it (x * rsqrt(
mean(x^2) + eps) * w, then the input's dtype): torch's fused op is bitwise that formula and one
call instead of eight. `weight` is the float32 scale (Gemma's 1 + w already added)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x + delta, norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)
