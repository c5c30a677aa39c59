"""The single place that chooses between an op's PyTorch reference and its Triton kernel.

Convention: op `foo` is the function `foo` in `kernels/reference/foo.py` and, where a kernel exists,
the function `foo` with the same signature in `kernels/triton/foo.py`.

Choice, per call site (`get_op(name, device)`):
- SPECSERVE_KERNELS=reference forces the reference; SPECSERVE_KERNELS=triton forces Triton.
- otherwise Triton on CUDA tensors when `triton` imports and the kernel exists, else the reference.
- on CPU the reference runs, except under TRITON_INTERPRET=1 with SPECSERVE_KERNELS=triton (how CI
  compares each kernel with its reference).
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Callable


@functools.cache
def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:
        return False
    return True


@functools.cache
def _load(kind: str, name: str) -> Callable | None:
    try:
        module = importlib.import_module(f"specserve.kernels.{kind}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith(f"{kind}.{name}"):
            return None
        raise
    return getattr(module, name)


def reference(name: str) -> Callable:
    fn = _load("reference", name)
    if fn is None:
        raise KeyError(f"no reference implementation for op {name!r}")
    return fn


def triton_kernel(name: str) -> Callable | None:
    return _load("triton", name) if _triton_available() else None


def get_op(name: str, device: str = "cpu") -> Callable:
    mode = os.environ.get("SPECSERVE_KERNELS", "auto")
    if mode == "reference":
        return reference(name)
    kernel = triton_kernel(name)
    if mode == "triton":
        if kernel is None:
            raise RuntimeError(f"SPECSERVE_KERNELS=triton but op {name!r} has no usable Triton kernel")
        return kernel
    if kernel is not None and str(device).startswith("cuda"):
        return kernel
    return reference(name)
