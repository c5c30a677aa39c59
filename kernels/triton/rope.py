"""Rotary position embedding (Triton): one program per token rotates all its heads in one launch,
where the reference takes seven (casts, negation, concatenation, two products, a sum). Same
contract as kernels/reference/rope.py: x * cos + rotate_half(x) * sin in float32, two products and
a sum rounded as transformers rounds them (compiled without fused multiply-adds), then x's dtype.
x may be a strided view (q and k inside the fused qkv output); the result is contiguous."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, HEADS, x_token_stride, x_head_stride,
                 table_stride, HALF: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BH)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = heads < HEADS
    x_row = x_ptr + t * x_token_stride + heads * x_head_stride
    x1 = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * table_stride + d)
    c2 = tl.load(cos_ptr + t * table_stride + HALF + d)
    s1 = tl.load(sin_ptr + t * table_stride + d)
    s2 = tl.load(sin_ptr + t * table_stride + HALF + d)
    out_row = out_ptr + t * HEADS * 2 * HALF + heads * 2 * HALF
    ty = out_ptr.dtype.element_ty
    tl.store(out_row + d, (x1 * c1 + (-x2) * s1).to(ty), mask=mask)
    tl.store(out_row + HALF + d, (x2 * c2 + x1 * s2).to(ty), mask=mask)


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """A power-of-two head size with unit stride inside a head; float32 tables, one row per
    token."""
    head_dim = x.shape[2]
    return (head_dim >= 2 and not head_dim & (head_dim - 1) and x.stride(2) == 1
            and x.shape[0] > 0 and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous())


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, head_dim = x.shape
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    _rope_kernel[(tokens,)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                            HALF=head_dim // 2, BH=triton.next_power_of_2(heads),
                            enable_fp_fusion=False)
    return out
