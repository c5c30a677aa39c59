"""What the scheduler asks a step to do and what the step returns: plain dataclasses only.

Every forward pass is a verify phase: a prefill chunk is a verify over prompt tokens with nothing
to sample until the chunk reaches the end; a decode is a verify with zero drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """Raw (pre-temperature, pre-penalty) log-probability of one position, as vLLM reports it."""
    token_id: int
    logprob: float
    rank: int                            # 1-based rank of token_id in the raw distribution
    top_token_ids: list[int]             # the top-N alternatives, best first (N = requested logprobs)
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]            # tokens to compute: a prompt chunk, or [last sampled token]
    num_computed_tokens: int        # position of token_ids[0]
    num_draft_tokens: int           # at most this many drafts may follow (the draft phase proposes them)
    block_ids: list[int]            # covers num_computed_tokens + len(token_ids) + num_draft_tokens slots
    sample: bool                    # this chunk reaches the end of the sequence: produce tokens
    params: object                  # SamplingParams (duck-typed: spec_phases never imports scheduler)
    prompt_token_ids: list[int]     # live references, for penalties and prompt logprobs
    output_token_ids: list[int]
    want_prompt_logprobs: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    requests: list[ScheduledRequest]
    frontier_size: int = 0          # > 0: verify drafts in chunks of this many positions (early pruning)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class SampledTokens:
    token_ids: list[int]                        # accepted drafts + exactly one bonus/recovered token
    num_drafted: int = 0                        # drafts proposed for verification (0 .. num_draft_tokens)
    num_pruned: int = 0                         # of those, drafts the target never computed: an earlier
                                                # frontier already rejected (always 0 without frontiers)
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, SampledTokens]
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # per prefill chunk
    step_time_s: float = 0.0
    num_frontiers: int = 1                      # forward passes the step ran (verification frontiers)
    draft_passes: list[tuple[int, float]] = field(default_factory=list)   # (rows, seconds) per draft
                                                # forward of a model-running drafter this step
