"""What the worker is built from: plain frozen dataclasses (the engine's config maps onto them)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

SPEC_METHODS = ("ngram", "layer_skip", "token_recycling", "lossy_kv")
NGRAM_DEFAULT_LOOKUP = 5             # vLLM's prompt_lookup_min/max when neither is given
# --kv-cache-dtype, as vLLM spells it: the full paged cache's element type. auto: the model's dtype
# (on CPU bfloat16 under --dtype auto, float32 under --dtype float32); bfloat16: half a float32
# cache's bytes a token; fp8 (= fp8_e4m3): a quarter, e4m3 with a scale of 1 (vLLM's default),
# saturating at +-448 (the attention widens exactly); float32 (not vLLM's): a float32 cache
# beside the fast path's int8 activations
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "float32")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` JSON, vLLM's key names where they exist (openai-api.md §11)."""
    method: str
    num_speculative_tokens: int = 4
    # n-gram match lengths, filled in as vLLM 0.32 does: neither given -> 5 and 5; one given ->
    # the other equals it (so {"prompt_lookup_max": 4} matches 4-grams only)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    skip_layers: tuple[int, ...] | None = None      # layer_skip: None -> the calibrated default
    recycling_top_k: int = 8                        # token_recycling: candidates kept per token id
    adaptive: bool = False                          # FASER goodput controller (scheduler/faser.py)
    # FASER overlap: with frontiers, draft the next step of requests the first frontier decided
    # on a thread (n-gram only; off by default: no measured gain on a CPU)
    overlap_draft: bool = False
    # FASER early pruning: verify drafts in frontiers of this many positions; a request whose
    # drafts were rejected skips the later ones. 0: one verify pass
    frontier_size: int = 0
    kv_compressor: str = "mustafar"                 # lossy_kv: the drafting cache's compressor
    kv_compressor_config: dict = field(default_factory=dict)   # lossy_kv: compressor settings
    # lossy_kv: the full cache in a host pool, staged for every verify (capacity, not speed: on an
    # H200 at 2.8K context a step took 30 ms staged against 3.9 resident); opt-in on every device
    full_kv_in_host: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        if not 0 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens must be in [0, 32]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = NGRAM_DEFAULT_LOOKUP
        object.__setattr__(self, "prompt_lookup_min", hi if lo is None else lo)
        object.__setattr__(self, "prompt_lookup_max", lo if hi is None else hi)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.overlap_draft and (self.method != "ngram" or not self.frontier_size):
            raise ValueError("overlap_draft needs method ngram (a stateless drafter) and "
                             "frontier_size > 0")
        size = self.frontier_size
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= 32:
            raise ValueError(f"frontier_size must be an integer in [0, 32] (0: verify in one "
                             f"pass), got {size!r}")

    @classmethod
    def from_json(cls, text: str | dict | None) -> SpeculativeConfig | None:
        if text is None or text == "":
            return None
        data = json.loads(text) if isinstance(text, str) else dict(text)
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown --speculative-config keys: {unknown}")
        if data.get("skip_layers") is not None:
            data["skip_layers"] = tuple(data["skip_layers"])
        return cls(**data)


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = None            # None: the embedded GGUF; "tiny-random"; a .gguf; a folder
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory_gb: float | None = None   # device KV budget (lossy_kv with the full cache in
                                        # host memory: the compressed drafting caches); None: 1 GiB
                                        # on a CPU, gpu_memory_utilization (0.9) on CUDA
    host_kv_cache_memory_gb: float | None = None   # lossy_kv + full_kv_in_host: the host pool
    num_kv_blocks: int | None = None    # overrides the budget
    kv_cache_dtype: str = "auto"        # KV_CACHE_DTYPES: the full cache's element type
    gpu_memory_utilization: float | None = None    # CUDA: the device KV budget from this fraction
    seed: int = 0
    num_threads: int | None = None
    tiny_random_seed: int = 0
    cpu_weight_packing: bool = True
    enforce_eager: bool = False         # CUDA: no step graphs (spec_phases/cuda_graphs.py)
    max_num_seqs: int = 64              # the largest decode batch a graph is captured for
    max_model_len: int | None = None    # the graphs' block tables hold this many tokens
    speculative: SpeculativeConfig | None = None
