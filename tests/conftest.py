"""Shared fixtures. Every EngineCore built during a test is checked for leaked KV blocks afterwards
(style.md 5.13): the engine is run until idle, then free + cached + owned == total in every pool."""
from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specserve.scheduler import engine as engine_module  # noqa: E402
from specserve.scheduler.config import EngineConfig  # noqa: E402

_created: list = []
_original_init = engine_module.EngineCore.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _created.append(self)


engine_module.EngineCore.__init__ = _tracking_init

# On a GPU machine `device="auto"` picks CUDA and `dtype="auto"` bf16; SPECSERVE_TEST_DTYPE=float32 makes
# "auto" mean float32 there, so the token-identity tests run on CUDA at the precision they assume.
if os.environ.get("SPECSERVE_TEST_DTYPE"):
    from specserve.spec_phases import worker as _worker

    _resolve_dtype = _worker.resolve_dtype
    _worker.resolve_dtype = lambda dtype, device: _resolve_dtype(
        os.environ["SPECSERVE_TEST_DTYPE"] if dtype == "auto" else dtype, device)


@pytest.fixture(autouse=True)
def kv_integrity():
    start = len(_created)
    yield
    engines, _created[start:] = _created[start:], []
    for core in engines:
        owner = getattr(core, "async_owner", None)
        if owner is not None and not owner.is_dead:
            deadline = time.monotonic() + 30
            while (core.has_unfinished() or owner.num_unfinished) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.05)
        elif owner is None:
            core.run_until_idle()
        core.check_integrity()


@pytest.fixture(scope="session")
def tokenizer():
    from specserve.server.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture
def make_engine():
    """EngineCore on the tiny random model; kwargs override EngineConfig fields."""
    from specserve.scheduler.engine import EngineCore

    def make(**kwargs):
        kwargs.setdefault("model", "tiny-random")
        kwargs.setdefault("kv_cache_memory_gb", 0.05)
        return EngineCore(EngineConfig(**kwargs))
    return make
