"""Linear layers on the CPU, on weights packed once at load: the C kernel `linear.c` for float32
(column panels; every output element summed over k in one fixed order, so a row's result does
not depend on how many rows share the call, as oneDNN's and MKL's do), oneDNN's prepacked GEMM
for bfloat16 (where the CPU has AVX512-BF16 or AMX) and for float32 where no C compiler is
available. The one home of the CPU GEMM choice."""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from specserve.kernels.cpu.native import BuildError, library

logger = logging.getLogger(__name__)

PANEL = 16                      # output columns per packed panel (linear.c)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library("linear")
    lib.linear_pack.restype = None
    lib.linear_pack.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.linear_forward.restype = None
    lib.linear_forward.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, ctypes.c_int]
    return lib


@functools.cache
def c_kernel_available() -> bool:
    """The C kernel builds and loads here (logged once where it does not)."""
    try:
        _lib()
    except BuildError as exc:
        logger.warning("C linear kernel unavailable (%s); float32 linears run oneDNN", exc)
        return False
    return True


def packing_available(dtype: torch.dtype) -> bool:
    """Weights of `dtype` can be packed here: float32 always (C, or oneDNN), bfloat16 where
    oneDNN has a prepacked bf16 GEMM (AVX512-BF16 or AMX)."""
    if dtype == torch.float32:
        return c_kernel_available() or torch.backends.mkldnn.is_available()
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor          # C: [ceil(out / 16), in, 16] float32; oneDNN: its blocked tensor
    out_features: int
    in_features: int
    onednn: bool


def pack(weight: torch.Tensor) -> PackedWeight:
    """An [out, in] weight of a dtype `packing_available` accepts, packed for `linear`."""
    out_features, in_features = weight.shape
    if weight.dtype == torch.float32 and c_kernel_available():
        w = weight.detach().contiguous()
        data = torch.empty(-(-out_features // PANEL), in_features, PANEL)
        _lib().linear_pack(w.data_ptr(), out_features, in_features, data.data_ptr())
        return PackedWeight(data, out_features, in_features, onednn=False)
    data = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
    return PackedWeight(data, out_features, in_features, onednn=True)


def weight_rows(packed: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a C-packed weight, copied exactly: [len(rows), in] (a tied embedding's lookup read
    from the packed LM head, so the matrix is held once)."""
    return packed.data[rows // PANEL, :, rows % PANEL]


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype (the weight's)."""
    if packed.onednn:
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    rows = x.reshape(-1, packed.in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], packed.out_features)
    if bias is not None:
        bias = bias.contiguous()
    _lib().linear_forward(rows.data_ptr(), rows.shape[0], packed.in_features,
                          packed.data.data_ptr(), packed.out_features,
                          None if bias is None else bias.data_ptr(), out.data_ptr(),
                          torch.get_num_threads())
    return out.view(*x.shape[:-1], packed.out_features)
