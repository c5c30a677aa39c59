"""RMSNorm and the residual add before it (Triton): one program per row, one launch per call
where the reference takes several (the add, the casts, the norm). Same contract as
kernels/reference/rms_norm.py: the add in the input's dtype, the norm in float32,
x * rsqrt(mean(x^2) + eps) * w, then the input's dtype. The mean's summation order is Triton's, so
float32 results may differ from the reference's in the last bit."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 16384           # one row per program, held in registers


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, N, eps,
                     BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    ty = out_ptr.dtype.element_ty
    xf = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:       # the add in float32 rounded to x's dtype, as torch adds bf16 tensors
        xf += tl.load(delta_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        xf = xf.to(ty).to(tl.float32)
        tl.store(sum_ptr + row * N + cols, xf.to(ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = xf * rstd * w
    tl.store(out_ptr + row * N + cols, y.to(ty), mask=mask)


def supports(x: torch.Tensor, *args) -> bool:
    """Contiguous rows (a strided view, e.g. Qwen3's per-head q/k norm, goes to the reference) of
    at most MAX_HIDDEN values, with a contiguous residual of the same shape and dtype."""
    delta = args[0] if len(args) == 3 else None
    ok = x.is_contiguous() and x.shape[-1] <= MAX_HIDDEN and x.numel() > 0
    return ok and (delta is None or (delta.is_contiguous() and delta.shape == x.shape
                                     and delta.dtype == x.dtype))


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else x
    _rms_norm_kernel[(x.numel() // n,)](
        x, delta if delta is not None else x, weight, total, out, n, eps,
        BLOCK=triton.next_power_of_2(n), HAS_DELTA=delta is not None)
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x + delta, norm(x + delta))."""
    return _launch(x, delta, weight, eps)
