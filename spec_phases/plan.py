"""The step contract: what the scheduler asks a step to do, and what the step returns.

    schedule() -> StepPlan      execute(plan) -> StepResult      commit(plan, result) -> outputs

Two crossings per step, both plain snapshots (tuples, ints, typed `SamplingParams`) that pickle, so
the worker could run in another process. Nothing else crosses: the plan names the requests whose
device-side state the worker drops, the result carries the swap bytes and draft-pass timings.

Every forward pass is a verify phase: a prefill chunk is a verify over prompt tokens with nothing
to sample until the chunk reaches the end; a decode is a verify with zero drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.spec_phases.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """Raw (pre-temperature, pre-penalty) log-probability of one position, as vLLM reports it."""
    token_id: int
    logprob: float
    rank: int                            # 1-based rank of token_id in the raw distribution
    top_token_ids: list[int]             # the top-N alternatives, best first (N = logprobs asked)
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]      # tokens to compute: a prompt chunk, or (last sampled token,)
    num_computed_tokens: int        # position of token_ids[0]
    num_draft_tokens: int           # at most this many drafts may follow (the draft phase proposes)
    block_ids: tuple[int, ...]      # covers num_computed_tokens + len(token_ids) + drafts slots
    sample: bool                    # this chunk reaches the end of the sequence: produce tokens
    params: SamplingParams
    num_prompt_tokens: int
    num_output_tokens: int          # committed output tokens before this step
    history: tuple[int, ...] = ()   # prompt + output tokens, sent only when the step needs them
                                    # (drafting, penalties, prompt logprobs): see `needs_history`
    want_prompt_logprobs: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.history[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.history[self.num_prompt_tokens:]

    @property
    def next_position(self) -> int:
        """Sequence position of the first token this step samples."""
        return self.num_computed_tokens + self.num_new_tokens


def needs_history(params: SamplingParams, num_draft_tokens: int, prompt_logprobs: bool) -> bool:
    """Whether a scheduled request must carry its tokens: drafters read them, penalties count them,
    prompt logprobs score them. Plain decoding sends only the new tokens."""
    return num_draft_tokens > 0 or params.has_penalties or prompt_logprobs


@dataclass(frozen=True, slots=True)
class StepPlan:
    requests: tuple[ScheduledRequest, ...]
    frontier_size: int = 0          # > 0: verify drafts this many positions at a time (pruning)
    finished_ids: tuple[str, ...] = ()    # finished or aborted since the last plan: drop state
    preempted_ids: tuple[str, ...] = ()   # preempted (recompute): drop their drafting caches

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    def is_empty(self) -> bool:
        return not (self.requests or self.finished_ids or self.preempted_ids)


@dataclass(slots=True)
class SampledTokens:
    token_ids: list[int]                        # accepted drafts + exactly one more token
    num_drafted: int = 0                        # drafts proposed for verification
    num_pruned: int = 0                         # of those, drafts the target never computed: an
                                                # earlier frontier already rejected (0 without)
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for
    num_masked: int = 0                         # of num_drafted, drafts cut before verification:
                                                # the grammar forbids them (counted as rejected)


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, SampledTokens] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # per chunk
    step_time_s: float = 0.0
    num_frontiers: int = 1                      # forward passes the verify phase ran
    draft_passes: list[tuple[int, float]] = field(default_factory=list)   # (rows, seconds) per
                                                # forward of a model-running drafter this step
    swap_bytes: tuple[int, int] = (0, 0)        # full-cache bytes (host->device, device->host)
                                                # moved this step (VeriCache with a host pool)
    num_drafted_ahead: int = 0                  # requests whose drafts came from the overlap thread
    grammar_compile_s: list[float] = field(default_factory=list)   # structured output: each
                                                # grammar compiled since the last step, in seconds
    grammar_cache_hits: int = 0                 # requests that found their grammar compiled
