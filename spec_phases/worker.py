"""The worker: model + KV storage + runner on one device. The scheduler reaches the device only
through `Worker.execute(plan)`; everything it needs to know comes back as plain numbers."""
from __future__ import annotations

import logging

import torch

from specserve.kv_cache.host_pool import HostKVPool
from specserve.kv_cache.storage import KVStorage, num_blocks_for_budget
from specserve.spec_phases.loader import load_model
from specserve.spec_phases.plan import StepPlan, StepResult
from specserve.spec_phases.proposers.base import Proposer
from specserve.spec_phases.proposers.layer_skip import LayerSkipProposer, default_skip_layers
from specserve.spec_phases.proposers.ngram import NgramProposer
from specserve.spec_phases.proposers.token_recycling import TokenRecyclingProposer
from specserve.spec_phases.runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


class Worker:
    def __init__(self, model: str | None, device: str = "auto", dtype: str = "auto", block_size: int = 16,
                 kv_cache_memory_gb: float = 1.0, num_kv_blocks: int | None = None, seed: int = 0,
                 num_threads: int | None = None, tiny_seed: int = 0, speculative=None,
                 host_kv_cache_memory_gb: float | None = None, cpu_weight_packing: bool = True):
        """kv_cache_memory_gb budgets the device KV: the full cache, or with lossy_kv keeping the full
        cache in a HostKVPool, the compressed drafting caches; that host pool is then sized from
        host_kv_cache_memory_gb (None: kv_cache_memory_gb). num_kv_blocks sizes the full cache."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        in_host = speculative is not None and speculative.method == "lossy_kv" and self._full_kv_in_host(speculative)
        if host_kv_cache_memory_gb is not None and not in_host:           # refused before loading weights
            raise ValueError("host_kv_cache_memory_gb sizes the host pool of lossy_kv with the full cache in "
                             "host memory; on a CPU host set \"full_kv_in_host\": true in --speculative-config")
        torch.manual_seed(seed)
        self.model = load_model(model, self.dtype, self.device, tiny_seed=tiny_seed)
        if cpu_weight_packing and self.model.pack_for_cpu():
            logger.info("linear weights prepacked for oneDNN (fp32 on CPU)")
        cfg = self.config = self.model.config
        full_budget_gb = host_kv_cache_memory_gb if host_kv_cache_memory_gb is not None else kv_cache_memory_gb
        self.num_blocks = num_kv_blocks or num_blocks_for_budget(
            full_budget_gb * 2**30, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        if self.num_blocks < 1:
            raise ValueError("the KV cache budget is too small for one block")
        self.block_size = block_size
        self.kv_cache_memory_gb = kv_cache_memory_gb
        shape = (cfg.num_layers, self.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        self._swap_seen = (0, 0, 0)                    # pool h2d, pool d2h, drafter tokens encoded
        self.last_swap_bytes = (0, 0)                  # (host->device, device->host) of the last step
        if in_host:
            self.storage = HostKVPool(*shape)          # VeriCache: the device keeps the compressed cache
        else:
            self.storage = KVStorage(*shape, self.device)
        self.runner = ModelRunner(self.model, self.storage, cfg.eos_token_ids, seed)
        self.runner.proposer = self._proposer(model, speculative)
        if speculative is not None and speculative.overlap_draft:
            self.runner.overlap_drafts, self.runner.overlap_max_len = True, speculative.num_speculative_tokens
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s on %s)", self.num_blocks, block_size,
                    self.storage.nbytes / 2**20, self.dtype, self.device)

    def _full_kv_in_host(self, spec) -> bool:
        """lossy_kv keeps the full cache in host memory on GPU hosts by default; on a CPU host both
        pools are host memory anyway, so staging is opt-in there (`"full_kv_in_host": true`)."""
        choice = spec.full_kv_in_host
        return self.device.startswith("cuda") if choice is None else bool(choice)

    def _proposer(self, model: str | None, spec) -> Proposer | None:
        """spec: a SpeculativeConfig (duck-typed; spec_phases does not import scheduler)."""
        if spec is None or spec.num_speculative_tokens == 0:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if spec.method == "token_recycling":
            return TokenRecyclingProposer(self.config.vocab_size, spec.recycling_top_k, self.device)
        if spec.method == "layer_skip":
            skip = spec.skip_layers
            if skip is None:
                skip = default_skip_layers(model, self.model, spec.num_speculative_tokens)
            logger.info("layer_skip drafter skips layers %s", list(skip))
            return LayerSkipProposer(self.runner.forward_rows, self.config.num_layers, tuple(skip))
        if spec.method == "lossy_kv":
            from specserve.spec_phases.proposers.lossy_kv import LossyKVProposer
            # with the full cache in the host pool the device KV budget holds only the compressed caches
            capacity = int(self.kv_cache_memory_gb * 2**30) if isinstance(self.storage, HostKVPool) else None
            return LossyKVProposer(self.model, self.storage, spec.kv_compressor, dict(spec.kv_compressor_config),
                                   capacity_bytes=capacity)
        raise ValueError(f"speculative method {spec.method!r} is not available yet")

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.runner.execute(plan)
        self.last_swap_bytes = self._swap_delta()
        return result

    def _swap_delta(self) -> tuple[int, int]:
        """Full-cache bytes moved since the last call, with the full cache in a HostKVPool (else 0, 0):
        host->device = the verify pass's staging (`HostKVPool.bytes_h2d`) plus the drafter's sync reads
        of newly verified tokens (tokens encoded x full bytes per token); device->host = write-back."""
        storage = self.storage
        if not isinstance(storage, HostKVPool):
            return 0, 0
        encoded = getattr(self.runner.proposer, "num_encoded_tokens", 0)
        h2d, d2h, seen_encoded = self._swap_seen
        self._swap_seen = (storage.bytes_h2d, storage.bytes_d2h, encoded)
        return (storage.bytes_h2d - h2d + (encoded - seen_encoded) * storage.bytes_per_token,
                storage.bytes_d2h - d2h)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.runner.generators.pop(request_id, None)
        if self.runner.proposer is not None:
            self.runner.proposer.release(request_ids)

    def release_drafts(self, request_ids: list[str]) -> None:
        """Drop the drafting caches of preempted requests (recompute preemption frees their compressed
        bytes too; their sampling generators stay, so seeded sampling resumes where it was)."""
        proposer = self.runner.proposer
        if hasattr(proposer, "seq_bytes") and request_ids:           # lossy_kv only
            proposer.release(request_ids)

    def held_request_ids(self) -> set[str]:
        """Requests the worker keeps per-request state for (sampling generators, drafter caches)."""
        held = set(self.runner.generators)
        if self.runner.proposer is not None:
            held |= self.runner.proposer.held_request_ids()
        return held

    def draft_cache_usage(self) -> dict | None:
        """VeriCache's compressed (device) pool: bytes used by the held drafting caches, the capacity
        (None when not budgeted) and bytes per token per pool; None without the lossy_kv drafter."""
        proposer = self.runner.proposer
        return proposer.bytes_used() if hasattr(proposer, "seq_bytes") else None

    def draft_cache_bytes_for(self, num_tokens: int) -> int | None:
        """Compressed bytes one request's drafting cache will take at num_tokens tokens (None without
        the lossy_kv drafter): with `draft_cache_usage()["capacity_bytes"]`, enough to admit by
        device memory."""
        proposer = self.runner.proposer
        return proposer.seq_bytes(num_tokens) if hasattr(proposer, "seq_bytes") else None

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())
