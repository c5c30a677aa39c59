"""Engine configuration: frozen dataclasses validated once. CLI flags map onto these fields."""
from __future__ import annotations

from dataclasses import dataclass

from specserve.spec_phases.config import (KV_CACHE_DTYPES, SPEC_METHODS, SpeculativeConfig,
                                          WorkerConfig)

__all__ = ["KV_CACHE_DTYPES", "SPEC_METHODS", "EngineConfig", "SchedulerConfig",
           "SpeculativeConfig"]

@dataclass(frozen=True)
class EngineConfig:
    # None: embedded SmolLM2 GGUF; "tiny-random"; a .gguf; an HF folder
    model: str | None = None
    device: str = "auto"                # auto -> cuda if available else cpu
    dtype: str = "auto"                 # auto -> float32 on cpu, bfloat16 on cuda
    max_model_len: int | None = None    # None: the model's context length
    block_size: int = 16
    # device KV budget in GiB; num_blocks is derived from it (lossy_kv with the full cache in host
    # memory: the compressed drafting caches). None: on a CPU 1 GiB (VLLM_CPU_KVCACHE_SPACE sets
    # it through the CLI), on CUDA gpu_memory_utilization's budget (0.9 when not given, as vLLM)
    kv_cache_memory_gb: float | None = None
    # vLLM's --kv-cache-memory-bytes: the same budget in bytes; wins over kv_cache_memory_gb
    kv_cache_memory_bytes: int | None = None
    # lossy_kv + full_kv_in_host: sizes the full-KV host
    host_kv_cache_memory_gb: float | None = None
                                        # pool (None: the device budget above, as before)
    num_kv_blocks: int | None = None    # overrides the budget (tests force preemption with it)
    # vLLM's --kv-cache-dtype: the full cache's elements, "auto" (the model's dtype), "bfloat16"
    # or "fp8" (a half / a quarter of the bytes a token on CPU: the budget holds 2x / 4x the
    # blocks); KV_CACHE_DTYPES
    kv_cache_dtype: str = "auto"
    # CUDA: size the device KV budget as vLLM does, from this fraction of the device's memory less
    # what is in use after the weights (default 0.9 where no KV size is given); on a CPU it does
    # not apply (docs/vllm-flags.md)
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # chunked prefill beside decodes: prompt chunks take at most (s - 1) times what the decoding
    # rows cost alone (measured; Scheduler.prefill_allowance), so a decoding request's token
    # takes about s times its time alone at most. None: the token budget alone (vLLM's policy)
    max_decode_slowdown: float | None = 1.5
    # bounded queue: submit() beyond it raises EngineOverloadedError (503). None: 2 x max_num_seqs,
    # two batches' worth waiting beside the running one
    max_waiting_requests: int | None = None
    seed: int = 0
    num_threads: int | None = None      # torch intra-op threads on CPU (None: torch's default)
    # on CPU: pack linear weights once (fp32: the C kernel, bf16: oneDNN; faster GEMMs; the tied
    # LM head is held a second time)
    cpu_weight_packing: bool = True
    tiny_random_seed: int = 0           # weights of the "tiny-random" model
    # CUDA: decode and verify batches replay CUDA graphs (spec_phases/cuda_graphs.py); True: eager
    enforce_eager: bool = False
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        for name in ("kv_cache_memory_gb", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: one of "
                             f"{list(KV_CACHE_DTYPES)}")
        if self.max_decode_slowdown is not None and not self.max_decode_slowdown > 1:
            raise ValueError(f"max_decode_slowdown must be above 1, got {self.max_decode_slowdown}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be positive")
        if self.host_kv_cache_memory_gb is not None:
            spec = self.speculative
            if not self.host_kv_cache_memory_gb > 0:
                raise ValueError(f"host_kv_cache_memory_gb must be positive, got "
                                 f"{self.host_kv_cache_memory_gb}")
            if spec is None or spec.method != "lossy_kv" or not spec.full_kv_in_host:
                raise ValueError("host_kv_cache_memory_gb sizes the full-KV host pool of lossy_kv "
                                 "(--speculative-config '{\"method\": \"lossy_kv\", "
                                 "\"full_kv_in_host\": true}')")

    @property
    def waiting_bound(self) -> int:
        """The waiting queue's bound: `max_waiting_requests`, by default derived from capacity."""
        if self.max_waiting_requests is not None:
            return self.max_waiting_requests
        return 2 * self.max_num_seqs

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            model=self.model, device=self.device, dtype=self.dtype, block_size=self.block_size,
            kv_cache_memory_gb=(self.kv_cache_memory_bytes / 2**30
                                if self.kv_cache_memory_bytes is not None
                                else self.kv_cache_memory_gb),
            host_kv_cache_memory_gb=self.host_kv_cache_memory_gb,
            num_kv_blocks=self.num_kv_blocks, kv_cache_dtype=self.kv_cache_dtype,
            seed=self.seed, num_threads=self.num_threads,
            gpu_memory_utilization=self.gpu_memory_utilization,
            tiny_random_seed=self.tiny_random_seed, cpu_weight_packing=self.cpu_weight_packing,
            enforce_eager=self.enforce_eager, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, speculative=self.speculative)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler's policy needs, derived by the engine from EngineConfig and the model."""
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_speculative_tokens: int = 0
    adaptive: bool = False              # FASER's controller picks each request's draft length
    frontier_size: int = 0              # FASER early pruning: verify drafts f positions at a time
    # the worker proposes drafts at the end of a step (`WorkerFacts.proposes_ahead`): a request
    # is scheduled at most the drafts it reported (`StepResult.draft_lens`)
    proposes_ahead: bool = False
    # EngineConfig.max_decode_slowdown (None here: the token budget alone)
    max_decode_slowdown: float | None = None
