"""The single place that chooses between an op's PyTorch reference and its kernels (Triton for
CUDA, C for the CPU), and that falls back from a kernel to the reference.

`OPS` names every op and its module: the function `op` in `kernels/reference/<module>.py` and,
where a kernel exists, the function `op` with the same signature in `kernels/triton/<module>.py`
or `kernels/cpu/<module>.py`. A kernel module says what it supports: `supports(*args) -> bool`
(inputs it cannot take go to the reference) and `FAILURES`, the exceptions that mean it cannot run
on this machine (then the reference serves every later call; logged once).

Choice, per call site (`get_op(name, device)`):
- SPECSERVE_KERNELS=reference forces the reference; SPECSERVE_KERNELS=triton forces Triton for
  every op that has a Triton kernel (the others run the reference).
- otherwise Triton on CUDA tensors when `triton` imports and the kernel exists; the C kernel on the
  CPU where one exists (built on first use, `kernels/cpu/native.py`); else the reference.
- under TRITON_INTERPRET=1 with SPECSERVE_KERNELS=triton the Triton kernels run on the CPU (how CI
  compares each kernel with its reference).
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

OPS = {
    "paged_attention": "paged_attention",
    "rms_norm": "rms_norm",
    "add_rms_norm": "rms_norm",
    "rope": "rope",
    "silu_mul": "activation",
    "gelu_tanh_mul": "activation",
    "dense_attention": "attention",
    "batched_attention": "attention",
    "merge_attention": "attention",
    "mustafar_encode": "mustafar_encode",
    "mustafar_decode": "mustafar_encode",
    "magnitude_prune": "mustafar_encode",
    "mustafar_attention": "mustafar_attention",
    "mustafar_keys": "mustafar_attention",
    "mustafar_values": "mustafar_attention",
    "spherical_encode": "spherical_encode",
    "spherical_decode": "spherical_encode",
    "spherical_attention": "spherical_attention",
}


@functools.cache
def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:
        return False
    return True


def _module(kind: str, name: str):
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}; one of {sorted(OPS)}")
    try:
        return importlib.import_module(f"specserve.kernels.{kind}.{OPS[name]}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith(f"{kind}.{OPS[name]}"):
            return None
        raise


def reference(name: str) -> Callable:
    return getattr(_module("reference", name), name)


class Kernel:
    """A kernel (Triton or C) with its fallback to the reference: for inputs the kernel does not
    support, and for good once it failed to build, compile or fit on this machine."""

    def __init__(self, name: str, module, kind: str = "Triton"):
        self.name, self.kind = name, kind
        self.kernel, self.fallback = getattr(module, name), reference(name)
        self.supports = module.supports if "supports" in vars(module) else None
        self.failures: tuple = vars(module).get("FAILURES", ())
        self.unusable: str | None = None               # why, once the kernel failed here

    def __call__(self, *args, **kwargs):
        if self.unusable is None and (self.supports is None or self.supports(*args, **kwargs)):
            try:
                return self.kernel(*args, **kwargs)
            except self.failures as exc:
                self.unusable = f"{type(exc).__name__}: {exc}"
                logger.error("%s %s unusable here (%s); using the PyTorch reference",
                             self.kind, self.name, self.unusable)
        return self.fallback(*args, **kwargs)


@functools.cache
def triton_kernel(name: str) -> Kernel | None:
    if not _triton_available():
        return None
    return _kernel("triton", name)


@functools.cache
def cpu_kernel(name: str) -> Kernel | None:
    return _kernel("cpu", name)


def _kernel(kind: str, name: str) -> Kernel | None:
    module = _module(kind, name)
    if module is None or name not in vars(module):
        return None
    return Kernel(name, module, {"triton": "Triton", "cpu": "C"}[kind])


def get_op(name: str, device: str) -> Callable:
    mode = os.environ.get("SPECSERVE_KERNELS", "auto")
    if mode == "reference":
        return reference(name)
    if mode == "triton" or str(device).startswith("cuda"):
        if mode == "triton" and not _triton_available():
            raise RuntimeError("SPECSERVE_KERNELS=triton but triton does not import")
        kernel = triton_kernel(name)
        return kernel if kernel is not None else reference(name)
    kernel = cpu_kernel(name)          # (triton is never imported on a CPU-only path)
    return kernel if kernel is not None else reference(name)
