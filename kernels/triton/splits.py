"""Split-context ("flash-decoding") helpers shared by the compressed-attention kernels.

A decode or verify pass has few (query, head) pairs: one program each would leave most of a GPU idle
at long context. The kernels instead run one program per (query, head, split of the context) and
store each split's softmax-normalised partial output and log-sum-exp; `combine_splits` merges them
exactly: out = sum_s exp(lse_s - lse) * out_s with lse = logsumexp_s(lse_s) (in PyTorch, a
handful of launches), or `merge_splits` (one Triton launch, the output alone: what CUDA graphs of
decode steps replay, `kernels/triton/paged_attention.paged_attention_static`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 1024       # enough resident programs for a 132-SM GPU several times over
MIN_SPLIT_TOKENS = 1024      # below this a split costs more (the merge's launches) than it saves:
                             # measured on an H100, 16 splits at 1K tokens took 0.21 ms vs 0.044 ms


def plan_splits(num_tokens: int, num_pairs: int, block: int) -> tuple[int, int]:
    """-> (num_splits, tokens per split): every split non-empty, a multiple of `block` tokens, and
    at least MIN_SPLIT_TOKENS long unless there is only one."""
    num_blocks = -(-num_tokens // block)
    most = max(1, num_blocks // max(1, MIN_SPLIT_TOKENS // block))
    wanted = max(1, min(most, -(-TARGET_PROGRAMS // max(num_pairs, 1))))
    split = -(-num_blocks // wanted) * block
    return -(-num_tokens // split), split


def combine_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out [..., S, D], lse [..., S] per split -> (out [..., D], lse [...])."""
    if out.shape[-2] == 1:
        return out[..., 0, :], lse[..., 0]
    total = torch.logsumexp(lse, dim=-1)
    weights = torch.exp(lse - total[..., None])
    return (weights[..., None] * out).sum(-2), total


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, dst_ptr, S, D: tl.constexpr, BS: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)        # one (row, head) pair
    s = tl.arange(0, BS)
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + pair * S + s, mask=s < S, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))     # an empty split weighs 0
    parts = tl.load(out_ptr + (pair * S + s)[:, None] * D + d[None, :], mask=(s < S)[:, None],
                    other=0.0)
    merged = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(dst_ptr + pair * D + d, merged.to(dst_ptr.dtype.element_ty))


def merge_splits(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [..., S, D] float32, lse [..., S] (contiguous) -> the merged out [..., D] in `dtype`:
    `combine_splits`'s output in one launch (exactly the one split's output where the others are
    empty). D a power of two."""
    *lead, num_splits, head_dim = out.shape
    dst = torch.empty(*lead, head_dim, dtype=dtype, device=out.device)
    _merge_kernel[(lse.numel() // num_splits,)](out, lse, dst, num_splits, D=head_dim,
                                                BS=triton.next_power_of_2(num_splits))
    return dst
