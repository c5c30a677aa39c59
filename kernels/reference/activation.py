"""The gated MLP's activation over a [..., 2 * n] tensor holding gate then up: SwiGLU's
silu(gate) * up and GeGLU's gelu_tanh(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * n] -> silu(gate_up[..., :n]) * gate_up[..., n:], in its dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * n] -> gelu(gate_up[..., :n], tanh approximation) * gate_up[..., n:]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
