"""The step contract: what the scheduler asks a step to do, and what the step returns.

    schedule() -> StepPlan      execute(plan) -> StepResult      commit(plan, result) -> outputs

Two crossings per step, both plain snapshots (tuples, ints, text, typed `SamplingParams`) that
pickle, so the worker can run in another process (tests/scheduler/test_worker_process.py runs it
so). Nothing else crosses: the plan names the requests whose device-side state the worker drops
and carries each constrained request's compiled grammar once, the result carries the swap bytes and
draft-pass timings. Before the first step the worker sends its `WorkerFacts`, once; with FASER's
controller the engine's warm-up asks it for its drafter's `DrafterTiming`, once.

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


def needs_history(params: SamplingParams, num_draft_tokens: int, prompt_logprobs: bool,
                  proposes: bool = False) -> bool:
    """Whether a scheduled request must carry its tokens: drafters read them (proposes: a drafter
    of tokens alone proposes this request's next drafts after the step), penalties count them,
    prompt logprobs score them. Plain decoding sends only the new tokens."""
    return num_draft_tokens > 0 or proposes or params.has_penalties or prompt_logprobs


@dataclass(frozen=True, slots=True)
class RequestGrammar:
    """A constrained request's compiled grammar (llguidance's grammar text, validated by the
    engine: scheduler/structured_output.py), sent with the first plan that schedules it."""
    request_id: str
    grammar: str


@dataclass(frozen=True, slots=True)
class StepPlan:
    requests: tuple[ScheduledRequest, ...]
    frontier_size: int = 0          # > 0: verify drafts this many positions at a time (pruning)
    finished_ids: tuple[str, ...] = ()    # finished or aborted since the last plan: drop state
    preempted_ids: tuple[str, ...] = ()   # preempted (recompute): drop their drafting caches
    grammars: tuple[RequestGrammar, ...] = ()   # requests scheduled for the first time with a
                                                # constraint: the worker builds their matchers

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
    draft_state_s: float = 0.0                  # the drafter building first-time requests' state
    swap_bytes: tuple[int, int] = (0, 0)        # full-cache bytes (host->device, device->host)
                                                # moved this step (VeriCache with a host pool)
    num_drafted_ahead: int = 0                  # requests whose drafts came from the overlap thread
    # a drafter of tokens alone (`WorkerFacts.proposes_ahead`): the drafts proposed for each
    # sampling request's next step, how many (the scheduler schedules at most these)
    draft_lens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerFacts:
    """What the worker is, sent once when it starts: all the engine sizes its scheduler and KV
    manager with and reports (the engine reads nothing else of the worker)."""
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    max_model_len: int              # the config's or the model's, capped by the KV cache
    num_blocks: int                 # full-cache blocks
    device: str                     # "cpu", "cuda", ...
    dtype: str                      # the model's: "float32", "bfloat16", ...
    kv_cache_dtype: str             # the full cache's elements
    kv_bytes_per_token: int         # full cache, all layers, K + V
    device_kv_gb: float             # the device's KV budget
    # lossy_kv's drafting pool when its bytes are budgeted (full cache in host memory), else None:
    # the device bytes for every request's compressed cache, and one request's bytes at n tokens
    # for n = 0 .. max_model_len
    draft_capacity_bytes: int | None = None
    draft_bytes_at: tuple[int, ...] = ()
    draft_kv_bytes_per_token: float | None = None   # lossy_kv: compressed pages, all layers
    # the drafter proposes from tokens alone, at the end of the step that sampled them
    # (`StepResult.draft_lens`): every sampling request's step carries its tokens
    proposes_ahead: bool = False


@dataclass(frozen=True)
class DrafterTiming:
    """A drafter timed at start-up (`Proposer.calibrate`), plain data for the engine."""
    # draft passes: (rows, seconds, context keys, 1 for a round's first pass) each
    passes: list[tuple[int, float, int, int]]
    # seconds a context token adds to building a request's drafting state (its first draft
    # round; 0: the drafter keeps none)
    state_per_token: float
