"""RMSNorm and the residual add before it, float32, through the C kernel `rms_norm.c`: one call
where eager torch makes eight (the reference's signatures and results up to rounding)."""
from __future__ import annotations

import ctypes
import functools

import torch

from specserve.kernels.cpu.native import BuildError, library

FAILURES = (BuildError,)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _kernel():
    fn = library("rms_norm").rms_norm_rows
    fn.restype = None
    fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, ctypes.c_int]
    return fn


def supports(*args, **kwargs) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    norm = torch.empty(rows.shape)
    _kernel()(rows.data_ptr(), None, weight.contiguous().data_ptr(), None, norm.data_ptr(),
              rows.shape[0], rows.shape[1], eps, torch.get_num_threads())
    return norm.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x + delta, norm(x + delta))."""
    rows, deltas = _rows(x), _rows(delta)
    total, norm = torch.empty(rows.shape), torch.empty(rows.shape)
    _kernel()(rows.data_ptr(), deltas.data_ptr(), weight.contiguous().data_ptr(),
              total.data_ptr(), norm.data_ptr(), rows.shape[0], rows.shape[1], eps,
              torch.get_num_threads())
    return total.view(x.shape), norm.view(x.shape)


def add_rms_norm_into(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, norm: torch.Tensor) -> None:
    """In place, on contiguous float32 [rows, n] buffers: x += delta (when given), norm =
    RMSNorm(x) * weight: bitwise `add_rms_norm` (the decoder's preallocated path,
    `spec_phases/cpu_decoder.py`)."""
    rows, n = x.shape
    _kernel()(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
              None if delta is None else x.data_ptr(), norm.data_ptr(), rows, n, eps,
              torch.get_num_threads())
