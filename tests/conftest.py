"""Shared fixtures. Tests build engines through `engines` (or `make_engine`), which checks each of
them for leaks after the test (style.md 5.13): the engine is run (or waited) until idle, then free +
cached + owned == total in every pool and no per-request device state is held. Module-scoped
engines are checked after every test that uses them by `check_idle`."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specserve.scheduler.async_engine import AsyncEngine  # noqa: E402
from specserve.scheduler.config import EngineConfig  # noqa: E402
from specserve.scheduler.engine import EngineCore  # noqa: E402


def check_idle(engine: EngineCore | AsyncEngine) -> None:
    """Run (a core) or wait for (an async engine) idle, then check every pool balances."""
    if isinstance(engine, AsyncEngine):
        if engine.is_dead:
            return
        assert engine.wait_idle(timeout=30), "the engine did not go idle within 30 s"
        engine.check_integrity()
    else:
        engine.run_until_idle()
        engine.check_integrity()


class Engines:
    """The engines one test builds; each is checked for leaks when the test ends."""

    def __init__(self):
        self.built: list[EngineCore | AsyncEngine] = []

    def core(self, config: EngineConfig | None = None, **fields) -> EngineCore:
        core = EngineCore(config or EngineConfig(**fields))
        self.built.append(core)
        return core

    def async_engine(self, config: EngineConfig | None = None, process: bool = False,
                     warm_up: bool = False, **fields) -> AsyncEngine:
        engine = AsyncEngine(config or EngineConfig(**fields), process=process, warm_up=warm_up)
        self.built.append(engine)
        return engine

    def check_and_close(self) -> None:
        try:
            for engine in self.built:
                check_idle(engine)
        finally:
            for engine in self.built:
                if isinstance(engine, AsyncEngine):
                    engine.shutdown()

# On a GPU machine `device="auto"` picks CUDA and `dtype="auto"` bf16; SPECSERVE_TEST_DTYPE=float32
# makes
# "auto" mean float32 there, so the token-identity tests run on CUDA at the precision they assume.
if os.environ.get("SPECSERVE_TEST_DTYPE"):
    from specserve.spec_phases import worker as _worker

    _resolve_dtype = _worker.resolve_dtype
    _worker.resolve_dtype = lambda dtype, device: _resolve_dtype(
        os.environ["SPECSERVE_TEST_DTYPE"] if dtype == "auto" else dtype, device)


@pytest.fixture(autouse=True)
def torch_threads():
    """Restore torch's intra-op thread count after each test: an engine built with
    `num_threads=1` sets it for the whole process, and would slow every later test."""
    import torch
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture
def engines():
    tracker = Engines()
    yield tracker
    tracker.check_and_close()


@pytest.fixture(scope="session")
def idle_check():
    """`check_idle`, for fixtures that keep an engine across tests (check it after each)."""
    return check_idle


@pytest.fixture(scope="session")
def tokenizer():
    from specserve.server.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture
def make_engine(engines):
    """EngineCore on the tiny random model; kwargs override EngineConfig fields."""
    def make(**kwargs):
        kwargs.setdefault("model", "tiny-random")
        kwargs.setdefault("kv_cache_memory_gb", 0.05)
        return engines.core(**kwargs)
    return make


@pytest.fixture
def decoder_runners():
    """runners(model, cache_dtype=float32, num_blocks=32): two ModelRunners of `model` over two
    caches, the first on the one-call C decoder (asserted), the second on the modules."""
    import torch

    from specserve.kv_cache.storage import KVStorage
    from specserve.spec_phases.runner import ModelRunner

    def runners(model, cache_dtype=torch.float32, num_blocks=32):
        cfg = model.config
        make = lambda: KVStorage(cfg.num_layers, num_blocks, 4, cfg.num_kv_heads,  # noqa: E731
                                 cfg.head_dim, cache_dtype, "cpu")
        fast, modules = ModelRunner(model, make()), ModelRunner(model, make())
        assert fast.cpu_decoder is not None
        modules.cpu_decoder = None
        return fast, modules
    return runners


@pytest.fixture
def same_steps():
    """check(fast, modules, steps=None, seed=1): each step (tokens, starts, tables) gives both
    runners the same hidden states, logits and K/V cache, bit for bit. steps None: three mixed
    steps over random prompts (`seed`) of 23, 9 and 40 tokens in blocks 0-7, 8-11 and 12-23 (a
    prompt chunk beside a whole prompt; the rest beside a decode and a third prompt; decodes
    beside 4 verify rows). Returns the steps' tables."""
    import torch

    def check(fast, modules, steps=None, seed=1) -> list[tuple[int, ...]]:
        tables = [tuple(range(0, 8)), tuple(range(8, 12)), tuple(range(12, 24))]
        if steps is None:
            g = torch.Generator().manual_seed(seed)
            p = [tuple(torch.randint(0, 300, (n,), generator=g).tolist()) for n in (23, 9, 40)]
            steps = [([p[0][:16], p[1]], [0, 0], tables[:2]),
                     ([p[0][16:], (5,), p[2]], [16, 9, 0], tables),
                     ([(7,), (8, 9, 10, 11), (12,)], [23, 10, 40], tables)]
        for tokens, starts, step_tables in steps:
            got = fast.forward(tokens, starts, step_tables)
            want = modules.forward(tokens, starts, step_tables)
            assert torch.equal(got, want)
            assert torch.equal(fast.compute_logits(got), modules.compute_logits(want))
            assert torch.equal(fast.storage.k, modules.storage.k)
            assert torch.equal(fast.storage.v, modules.storage.v)
        return tables
    return check


@pytest.fixture
def triton_interpreted():
    """run(code, marker, *args): `python -c code args` under TRITON_INTERPRET=1 with
    SPECSERVE_KERNELS=triton (in a child interpreter, so the flag never leaks into other tests);
    asserts it exits 0 and prints `marker`. Missing triton fails the test, never skips it."""
    import subprocess
    import sys

    import triton  # noqa: F401  (a test dependency)

    def run(code: str, marker: str, *args: str) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1", SPECSERVE_KERNELS="triton",
                   OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0 and marker in proc.stdout, (proc.stdout[-2000:]
                                                                + proc.stderr[-4000:])
    return run
