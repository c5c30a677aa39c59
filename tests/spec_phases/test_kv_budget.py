"""The KV budget as vLLM sizes it: on CUDA 0.9 of the device (less what is in use after the
weights) when no size is given, the given size otherwise; on a CPU the given size
(--kv-cache-memory-gb / --kv-cache-memory-bytes / VLLM_CPU_KVCACHE_SPACE), 1 GiB when none is.
The CUDA branch runs with torch.cuda's memory query stubbed."""
from __future__ import annotations

import types

import pytest
import torch

from specserve.scheduler.config import EngineConfig
from specserve.server.cli import build_parser, engine_config
from specserve.spec_phases.config import WorkerConfig
from specserve.spec_phases.worker import (ACTIVATION_RESERVE_GB, DEFAULT_GPU_MEMORY_UTILIZATION,
                                          DEFAULT_KV_CACHE_GB, Worker)

GIB = 2**30


def budget(device: str, **config) -> float:
    worker = types.SimpleNamespace(config=WorkerConfig(**config), device=device)
    return Worker._device_kv_budget_gb(worker)


@pytest.fixture
def h100(monkeypatch):
    """An 80 GiB device with 20 GiB in use (the weights)."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GIB, 80 * GIB))


def test_cuda_defaults_to_vllms_utilization(h100):
    assert DEFAULT_GPU_MEMORY_UTILIZATION == 0.9
    assert budget("cuda:0") == pytest.approx(0.9 * 80 - 20 - ACTIVATION_RESERVE_GB)
    assert budget("cuda:0", gpu_memory_utilization=0.5) == pytest.approx(
        0.5 * 80 - 20 - ACTIVATION_RESERVE_GB)


def test_cuda_given_size_wins_as_in_vllm(h100):
    assert budget("cuda:0", kv_cache_memory_gb=4.0) == 4.0
    assert budget("cuda:0", kv_cache_memory_gb=4.0, gpu_memory_utilization=0.5) == 4.0


def test_cpu_takes_the_given_size_or_one_gib():
    assert budget("cpu") == DEFAULT_KV_CACHE_GB == 1.0
    assert budget("cpu", kv_cache_memory_gb=3.0) == 3.0
    assert budget("cpu", kv_cache_memory_gb=3.0, gpu_memory_utilization=0.5) == 3.0


def test_kv_cache_memory_bytes_is_vllms_flag_and_wins(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = build_parser().parse_args(["serve", "--kv-cache-memory-bytes", str(3 * GIB)])
    config = engine_config(args)
    assert config.kv_cache_memory_bytes == 3 * GIB and config.kv_cache_memory_gb is None
    assert config.worker_config().kv_cache_memory_gb == 3.0
    both = EngineConfig(kv_cache_memory_gb=0.5, kv_cache_memory_bytes=GIB // 4)
    assert both.worker_config().kv_cache_memory_gb == 0.25
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert engine_config(args).worker_config().kv_cache_memory_gb == 3.0
    assert engine_config(build_parser().parse_args(["serve"])).kv_cache_memory_gb == 2.0
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be positive"):
        EngineConfig(kv_cache_memory_bytes=0)


def test_no_size_given_on_a_cpu_engine_is_one_gib(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert engine_config(build_parser().parse_args(["serve"])).kv_cache_memory_gb is None
    from specserve.scheduler.engine import EngineCore
    core = EngineCore(EngineConfig(model="tiny-random", device="cpu", max_model_len=64))
    assert core.worker.device_kv_gb == 1.0
    assert core.worker.storage.nbytes <= GIB
