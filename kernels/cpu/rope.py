"""Rotary position embedding, float32, through the C kernel `rope.c`: one call where eager torch
makes seven, bitwise the reference's result (`kernels/reference/rope.py`)."""
from __future__ import annotations

import ctypes
import functools

import torch

from specserve.kernels.cpu.native import BuildError, library

FAILURES = (BuildError,)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _kernel():
    fn = library("rope").rope_rows
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    return fn


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.shape[-1] % 2 == 0)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        x = x.contiguous()
    cos, sin = cos.reshape(num_tokens, dim).contiguous(), sin.reshape(num_tokens, dim).contiguous()
    out = torch.empty(x.shape)
    _kernel()(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
              num_tokens, heads, dim)
    return out


def rope_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """`rope` into a preallocated contiguous out [tokens, heads, dim]; x [tokens, heads, dim] with
    contiguous heads (any row stride), cos and sin contiguous [tokens, dim]."""
    num_tokens, heads, dim = x.shape
    _kernel()(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
              num_tokens, heads, dim)
