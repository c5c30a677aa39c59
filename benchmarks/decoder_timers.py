"""The one-call C decoder's own kernel timers, for the benchmarks (`draft_pass.py`,
`kv_cache_dtype.py`, `long_prefill.py`, `lossy_kv_trace.py`): `install()` wraps
`kernels/cpu/decoder.forward` so that every call adds its seconds in the linear layers, attention
(with the K/V write) and the elementwise kernels to SECONDS, and records (rows, wall seconds,
linear, attention, elementwise) in CALLS; and `kernels/cpu/decoder.draft` (a round's draft
steps in one call) so that each of its steps does the same (its wall seconds with the LM head,
argmax and next embedding). `reset()` clears both."""
from __future__ import annotations

import inspect
import time

import torch

from specserve.kernels.cpu import decoder as fused

SECONDS = torch.zeros(3, dtype=torch.float64)       # linear, attention, elementwise, summed
CALLS: list[tuple[int, float, float, float, float]] = []
_forward, _draft = fused.forward, fused.draft


def _timed_forward(*args, **kwargs):
    seconds = torch.zeros(3, dtype=torch.float64)
    kwargs["seconds"] = seconds
    start = time.perf_counter()
    out = _forward(*args, **kwargs)
    CALLS.append((args[3]["x"].shape[0], time.perf_counter() - start, *seconds.tolist()))
    SECONDS.add_(seconds)
    return out


def _timed_draft(*args, **kwargs):
    given = inspect.signature(_draft).bind(*args, **kwargs).arguments
    rows_at, step_seconds = given["rows_at"], given["step_seconds"]
    seconds = torch.zeros(len(rows_at), 3, dtype=torch.float64)
    kwargs["seconds"] = seconds
    out = _draft(*args, **kwargs)
    for rows, wall, kernels in zip(rows_at.tolist(), step_seconds.tolist(), seconds.tolist()):
        CALLS.append((rows, wall, *kernels))
    SECONDS.add_(seconds.sum(0))
    return out


def install() -> None:
    fused.forward, fused.draft = _timed_forward, _timed_draft


def reset() -> None:
    SECONDS.zero_()
    CALLS.clear()
