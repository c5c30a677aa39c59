"""The message boundary between the server and the engine.

Everything that crosses it is a plain, picklable dataclass, so the engine can move from a background
thread to its own process by changing only `server/engine_client.py`.

    server --EngineRequest--> engine      (submit)
    server --request_id-----> engine      (abort)
    server <--RequestOutput-- engine      (one delta per engine step that produced something)
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from specserve.spec_phases.sampling_params import SamplingParams
from specserve.spec_phases.plan import TokenLogprob  # noqa: F401  (re-exported for the server)




@dataclass(frozen=True)
class EngineRequest:
    request_id: str                      # unique inside the engine (the server adds a suffix to client ids)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class SpecStats:
    """Cumulative speculative-decoding counters of one request (vLLM's definitions). Every output of
    a request that speculation is on for carries it (zeros until its first draft); None otherwise."""
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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output only; [0] is None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache
    spec: SpecStats | None = None
    error: str | None = None             # set with finish_reason "error": this request failed alone


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the served model, without touching torch."""
    name: str                            # default served name (file stem)
    path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


class EngineDeadError(RuntimeError):
    """The engine loop died; every request fails and /health turns 503."""


class EngineOverloadedError(RuntimeError):
    """The bounded waiting queue is full (the server answers 503 with Retry-After)."""


class EngineClientProtocol(Protocol):
    """What the server may call on an engine (the real one is `scheduler.async_engine.AsyncEngine`;
    tests may pass a fake with the same methods). All methods are called from the asyncio loop."""

    model_info: ModelInfo

    @property
    def is_dead(self) -> bool: ...

    def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Raises EngineOverloadedError (queue full), EngineDeadError or ParamError (e.g. prompt too
        long) before yielding anything. The iterator ends after the output with `finished=True`; a
        consumer that stops early (client gone) must call `abort(request_id)`."""
        ...

    def abort(self, request_id: str) -> None:
        """Idempotent; the request's KV blocks are freed within one engine step."""
        ...

    def shutdown(self) -> None: ...
