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
def _merge_kernel(out_ptr, lse_ptr, dst_ptr, S, D: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)        # one (row, head) pair
    d = tl.arange(0, D)
    one = tl.arange(0, 1)
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s in range(0, S):                       # in order: an empty split (lse -inf, output 0)
        lse = tl.load(lse_ptr + pair * S + s + one)            # adds exact zeros
        part = tl.load(out_ptr + (pair * S + s) * D + d)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        w = tl.exp(lse - m_use)
        total = total * alpha + w
        acc = acc * alpha + w * part
        m = m_new
    tl.store(dst_ptr + pair * D + d, (acc / total).to(dst_ptr.dtype.element_ty))


def merge_splits(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [..., S, D] float32, lse [..., S] (contiguous) -> the merged out [..., D] in `dtype`:
    `combine_splits`'s output in one launch, the splits taken in order by an online softmax, so
    empty splits after a row's last one (lse -inf, output 0) leave its result bit for bit as it
    was: a row merges the same whatever the longest context beside it. D a power of two."""
    *lead, num_splits, head_dim = out.shape
    dst = torch.empty(*lead, head_dim, dtype=dtype, device=out.device)
    _merge_kernel[(lse.numel() // num_splits,)](out, lse, dst, num_splits, D=head_dim)
    return dst
