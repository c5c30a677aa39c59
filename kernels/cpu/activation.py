"""SwiGLU's activation, float32, through the C kernel `activation.c`: one call where eager torch
makes two; its own vectorised exp, so results are the reference's up to the last bits, and a
row's result depends on that row alone."""
from __future__ import annotations

import ctypes
import functools

import torch

from specserve.kernels.cpu.native import BuildError, library

FAILURES = (BuildError,)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _kernel():
    fn = library("activation").silu_mul_rows
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _ptr, _i64, _i64, ctypes.c_int]
    return fn


def supports(gate_up: torch.Tensor) -> bool:
    return (gate_up.device.type == "cpu" and gate_up.dtype == torch.float32
            and gate_up.shape[-1] % 2 == 0)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The reference's signature: gate_up [..., 2 * n] -> [..., n]."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], rows.shape[1] // 2)
    silu_mul_into(rows, out)
    return out.view(*gate_up.shape[:-1], out.shape[1])


def silu_mul_into(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """Into a preallocated contiguous out [rows, n]; gate_up [rows, 2 * n] with contiguous rows
    (any row stride)."""
    rows, n = out.shape
    _kernel()(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, n,
              torch.get_num_threads())
