"""The message boundary between the server and the engine.

Everything that crosses it is a plain, picklable dataclass, so the engine loop can move from a
background thread to its own process by changing only `scheduler/async_engine.py`, the engine's
side of the boundary; the server reaches the engine only through `server/engine_client.py`.

    server --EngineRequest--> engine      (submit)
    server --request_id-----> engine      (abort)
    server <--RequestOutput-- engine      (one delta per engine step that produced something)
    server <--StepStats------ engine      (one per step, for metrics)
    server <--ModelInfo, EngineInfo--     (once, at start-up)
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from specserve.spec_phases.plan import TokenLogprob  # noqa: F401  (re-exported for the server)
from specserve.spec_phases.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    # unique inside the engine (the server adds a suffix to client ids)
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class SpecStats:
    """Cumulative speculative-decoding counters of one request (vLLM's definitions). Every output of
    a request that speculation is on for carries it (zeros until its first draft); None
    otherwise."""
    num_drafts: int = 0                  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0         # bonus/recovered tokens are not counted
    accepted_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request: a delta, never the whole text so far."""
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None       # the stop token id that fired (None for EOS and length)
    new_logprobs: list[TokenLogprob] | None = None          # one per new token, when asked for
    # on the first output only; [0] is None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache
    num_preemptions: int = 0             # times this request was preempted so far
    spec: SpecStats | None = None
    error: str | None = None             # set with finish_reason "error": this request failed alone


@dataclass
class StepStats:
    """What one step did, for metrics and logs (no work beyond counting)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_prompt_tokens: int = 0           # prompt tokens computed this step
    num_generation_tokens: int = 0       # tokens emitted this step
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)
    num_pruned_tokens: int = 0           # draft tokens never computed: an earlier frontier rejected
    num_masked_tokens: int = 0           # draft tokens a request's grammar cut (structured output)
    num_frontiers: int = 0               # verify forwards this step ran (1 without frontiers)
    num_drafted_ahead: int = 0           # requests whose drafts the overlap thread made
    finished: list[tuple[str, str]] = field(default_factory=list)   # (request_id, finish_reason)
    first_scheduled: list[str] = field(default_factory=list)   # requests scheduled for the 1st time
    step_time_s: float = 0.0
    swap_bytes_h2d: int = 0              # lossy_kv, full cache in host memory: bytes moved
    swap_bytes_d2h: int = 0
    grammar_compile_s: list[float] = field(default_factory=list)   # structured output: seconds
                                         # per grammar compiled (the engine's cache missed)
    grammar_cache_hits: int = 0          # constrained requests whose constraint was compiled (or
                                         # compiling) already


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the served model, without touching torch."""
    name: str                            # default served name (file stem)
    path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


@dataclass(frozen=True)
class EngineInfo:
    """What the engine is, for metrics and logs: sent once, plain data (no torch, no live
    object)."""
    block_size: int
    num_blocks: int                      # full-cache blocks
    enable_prefix_caching: bool
    dtype: str                           # "float32", "bfloat16", ...
    device: str                          # "cpu", "cuda", ...
    kv_bytes_per_token: int              # full cache, all layers, K + V
    spec_method: str | None = None       # None: speculation off
    num_speculative_tokens: int = 0
    kv_compressor: str | None = None     # lossy_kv: the drafting cache's compressor
    draft_kv_bytes_per_token: float | None = None   # lossy_kv: compressed pages, all layers
    kv_cache_dtype: str | None = None    # the full cache's elements (None: `dtype`'s)


class EngineDeadError(RuntimeError):
    """The engine loop died; every request fails and /health turns 503."""


class EngineOverloadedError(RuntimeError):
    """The bounded waiting queue is full (the server answers 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s        # the engine's estimate of the queue's drain time


class EngineClientProtocol(Protocol):
    """What the server may call on an engine (the real one is `scheduler.async_engine.AsyncEngine`;
    tests may pass a fake with the same methods). All methods are called from the asyncio loop."""

    model_info: ModelInfo
    engine_info: EngineInfo
    on_step: Callable[[StepStats], None] | None     # set by the metrics; called per engine step

    @property
    def is_dead(self) -> bool: ...

    def submit(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Raises EngineOverloadedError (queue full), EngineDeadError or ParamError (e.g. prompt too
        long) before yielding anything. The generator ends after the output with `finished=True`;
        a consumer that stops early (client gone) must call `abort(request_id)`, and closes it."""
        ...

    def abort(self, request_id: str) -> None:
        """Idempotent; the request's KV blocks are freed within one engine step."""
        ...

    def shutdown(self) -> None: ...
