"""Split-context ("flash-decoding") helpers shared by the compressed-attention kernels.

A decode or verify pass has few (query, head) pairs: one program each would leave most of a GPU idle
at long context. The kernels instead run one program per (query, head, split of the context) and
store each split's softmax-normalised partial output and log-sum-exp; `combine_splits` merges them
exactly: out = sum_s exp(lse_s - lse) * out_s with lse = logsumexp_s(lse_s).
"""
from __future__ import annotations

import torch

TARGET_PROGRAMS = 1024       # enough resident programs for a 132-SM GPU several times over


def plan_splits(num_tokens: int, num_pairs: int, block: int) -> tuple[int, int]:
    """-> (num_splits, tokens per split): every split non-empty and a multiple of `block` tokens."""
    num_blocks = -(-num_tokens // block)
    wanted = max(1, min(num_blocks, -(-TARGET_PROGRAMS // max(num_pairs, 1))))
    split = -(-num_blocks // wanted) * block
    return -(-num_tokens // split), split


def combine_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out [..., S, D], lse [..., S] per split -> (out [..., D], lse [...])."""
    if out.shape[-2] == 1:
        return out[..., 0, :], lse[..., 0]
    total = torch.logsumexp(lse, dim=-1)
    weights = torch.exp(lse - total[..., None])
    return (weights[..., None] * out).sum(-2), total
