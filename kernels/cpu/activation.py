"""The gated MLP's activation, float32, through the C kernel `activation.c`: SwiGLU's
silu(gate) * up and GeGLU's gelu_tanh(gate) * up, one call where eager torch makes two or more;
its own vectorised exp, so results are the reference's up to the last bits, and a row's result
depends on that row alone. The one-call decoder (`decoder.c`) runs the same C function."""
from __future__ import annotations

import ctypes
import functools

import torch

from specserve.kernels.cpu.native import BuildError, library

FAILURES = (BuildError,)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}        # activation.c's ACT_* codes


@functools.cache
def _kernel():
    fn = library("activation").glu_rows
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, ctypes.c_int]
    return fn


def supports(gate_up: torch.Tensor) -> bool:
    return (gate_up.device.type == "cpu" and gate_up.dtype == torch.float32
            and gate_up.shape[-1] % 2 == 0)


def _glu(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], rows.shape[1] // 2)
    glu_into(rows, out, activation)
    return out.view(*gate_up.shape[:-1], out.shape[1])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The reference's signature: gate_up [..., 2 * n] -> [..., n]."""
    return _glu(gate_up, "silu")


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The reference's signature: gate_up [..., 2 * n] -> [..., n]."""
    return _glu(gate_up, "gelu_tanh")


def glu_into(gate_up: torch.Tensor, out: torch.Tensor, activation: str = "silu") -> None:
    """Into a preallocated contiguous out [rows, n]; gate_up [rows, 2 * n] with contiguous rows
    (any row stride)."""
    rows, n = out.shape
    _kernel()(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, n,
              ACTIVATIONS[activation], torch.get_num_threads())
