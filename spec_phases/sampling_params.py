"""Per-request sampling parameters, validated once (the server maps `ParamError` to a 400)."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ParamError(ValueError):
    """A request parameter is out of range. `param` names the field, as the OpenAI error envelope
    does."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "tool_calls")
# the Hermes-style tags around each call a "tool_calls" constraint admits (server/tool_calls.py
# parses the same tags out of free text)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Constraint:
    """What the output must match (structured output), as plain text: the engine compiles it
    (`scheduler/structured_output.py`, cached by this value) and the worker masks every sampled
    or verified row (`spec_phases/grammar.py`).

    kind: "json_schema" (spec: the schema as JSON text), "json_object" (any JSON object), "regex"
    (spec: the pattern), "choice" (one of `choices`, verbatim), "lark" (spec: a Lark grammar),
    "tool_calls" (spec: JSON text {"tools": [{"name", "parameters"}], "parallel": bool}: one call,
    or with `parallel` one or more, each
    `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` with arguments valid against
    that function's parameter schema).
    `param` names the request field it came from, for error messages."""
    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    param: str = "response_format"

    def __post_init__(self) -> None:
        _check(self.kind in CONSTRAINT_KINDS, self.param,
               f"unknown constraint kind {self.kind!r}; one of {list(CONSTRAINT_KINDS)}.")
        object.__setattr__(self, "choices", tuple(str(c) for c in self.choices))
        if self.kind == "choice":
            _check(bool(self.choices), self.param, "choice needs at least one option.")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0                # in (0, 1]
    top_k: int = 0                    # 0 or -1: off
    min_p: float = 0.0                # in [0, 1]
    presence_penalty: float = 0.0     # over output tokens, in [-2, 2]
    frequency_penalty: float = 0.0    # over output tokens, in [-2, 2]
    repetition_penalty: float = 1.0   # over prompt + output tokens (HF/vLLM rule), > 0
    # token id -> bias, clamped to [-100, 100]
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None           # per-request generator: same output whatever else is batched
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # EOS and stop_token_ids are masked until this many tokens exist
    min_tokens: int = 0
    # top-N logprobs of each generated token (0: the sampled one only)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # per-request cap on drafts (ours); 0 turns speculation off
    num_speculative_tokens: int | None = None
    # structured output: every sampled token keeps the text a prefix of a match (None: free text)
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check(self.temperature >= 0, "temperature",
               f"temperature must be non-negative, got {self.temperature}.")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _check(self.top_k >= -1, "top_k",
               f"top_k must be 0 or -1 (off) or at least 1, got {self.top_k}.")
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value}.")
        _check(self.repetition_penalty > 0, "repetition_penalty",
               f"repetition_penalty must be greater than 0, got {self.repetition_penalty}.")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}.")
        if self.seed is not None:
            _check(INT64_MIN <= self.seed <= INT64_MAX, "seed",
                   f"seed must fit in 64 bits, got {self.seed}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(value >= 0, name,
                       f"`{name}` must be a non-negative value (-1 is not supported).")
                _check(value <= MAX_LOGPROBS, name,
                       f"{name} must be at most {MAX_LOGPROBS}, got {value}.")
        if self.num_speculative_tokens is not None:
            _check(self.num_speculative_tokens >= 0, "num_speculative_tokens",
                   f"num_speculative_tokens must be non-negative, got "
                   f"{self.num_speculative_tokens}.")
        clamped = {int(k): max(-100.0, min(100.0, float(v))) for k, v in self.logit_bias.items()}
        object.__setattr__(self, "logit_bias", clamped)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the parameters must exist in the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias.keys()),
                          ("stop_token_ids", self.stop_token_ids)):
            for tok in ids:
                _check(0 <= tok < vocab_size, name,
                       f"token id {tok} in {name} is out of vocabulary (size {vocab_size}).")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)
