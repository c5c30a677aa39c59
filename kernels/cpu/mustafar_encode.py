"""Mustafar's pruning and bitmap encoding on float16 CPU tensors through the C kernel
`mustafar_encode.c` (the references' results: `kernels/reference/mustafar_encode.py`)."""
from __future__ import annotations

import ctypes
import functools

import torch

from specserve.kernels.cpu.native import BuildError, library

FAILURES = (BuildError,)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib():
    lib = library("mustafar_encode")
    lib.magnitude_prune_rows.restype = None
    lib.magnitude_prune_rows.argtypes = [_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int]
    lib.mustafar_encode_tiles.restype = _i64
    lib.mustafar_encode_tiles.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, ctypes.c_int]
    return lib


def supports(x: torch.Tensor, *args) -> bool:
    """float16 rows of at most 256 values on the CPU (others: the reference)."""
    return x.device.type == "cpu" and x.dtype == torch.float16 and x.shape[-1] <= 256


def magnitude_prune(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    d = x.shape[-1]
    keep = d - int(sparsity * d)
    if keep >= d:
        return x.clone()
    rows = x.contiguous()
    out = torch.empty_like(rows)
    _lib().magnitude_prune_rows(rows.data_ptr(), out.data_ptr(), rows.numel() // max(d, 1), d,
                                keep, torch.get_num_threads())
    return out


def mustafar_encode(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert tiles.shape[-1] == 64
    tiles = tiles.contiguous()
    n = tiles.shape[0]
    bitmaps = torch.empty(n, dtype=torch.int64)
    offsets = torch.empty(n, dtype=torch.int64)
    values = torch.empty(n * 64, dtype=torch.float16)
    total = _lib().mustafar_encode_tiles(tiles.data_ptr(), n, bitmaps.data_ptr(),
                                         offsets.data_ptr(), values.data_ptr(),
                                         torch.get_num_threads())
    return bitmaps, offsets, values[:total].clone()
