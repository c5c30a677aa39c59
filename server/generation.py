"""One choice's text state: engine deltas in, text deltas out (shared by completions and chat).

    RequestOutput(new_token_ids, new_logprobs, finished, ...)        (from the engine)
        → IncrementalDetokenizer (whole characters only)
        → StopStringMatcher (hold back partial stops; on a match: trim and stop)
        → ChoiceDelta(text, token_ids, logprobs, finish_reason, stop_reason)

Token accounting follows vLLM: when the engine stops on EOS or a stop token id, that last token
counts as a completion token but its text is not emitted (unless `include_stop_str_in_output`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.scheduler.messages import RequestOutput, TokenLogprob
from specserve.server.detokenizer import IncrementalDetokenizer, StopStringMatcher


class EngineRequestError(RuntimeError):
    """The engine finished one request with finish_reason "error"."""


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stopped_by_string: bool = False


@dataclass
class ChoiceState:
    index: int                                  # flat choice index: prompt_index * n + i
    prompt_index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    include_stop_str_in_output: bool = False
    text: str = ""                              # everything emitted so far
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec: object | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, output: RequestOutput) -> ChoiceDelta:
        """Turn one engine delta into a text delta. Raises EngineRequestError on an engine error."""
        if output.finish_reason == "error":
            raise EngineRequestError(output.error or "the engine failed on this request")
        if output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(output.prompt_logprobs)
        if output.num_prompt_tokens:
            self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.spec is not None:
            self.spec = output.spec
        new_ids = list(output.new_token_ids)
        new_logprobs = list(output.new_logprobs or [])
        text_ids = new_ids
        if output.finished and output.finish_reason == "stop" and new_ids \
                and not self.include_stop_str_in_output:
            text_ids = new_ids[:-1]               # EOS / stop token: counted, not shown
        match = self.stops.feed(self.detokenizer.step(text_ids))
        text = match.text
        if match.stop is not None:
            self.finish_reason, self.stop_reason = "stop", match.stop
        elif output.finished:
            text += self.stops.flush()
            self.finish_reason = output.finish_reason or "stop"
            self.stop_reason = output.stop_reason
        self.text += text
        self.token_ids += new_ids
        self.logprobs += new_logprobs
        return ChoiceDelta(self.index, text, new_ids, new_logprobs, self.finish_reason,
                           self.stop_reason,
                           stopped_by_string=match.stop is not None)


def _spec_totals(states: list[ChoiceState]) -> tuple[int, int, int] | None:
    """(verify steps with drafts, draft tokens, accepted tokens) summed over the choices that
    speculated, or None when none did."""
    specs = [s.spec for s in states if s.spec is not None]
    if not specs:
        return None
    return (sum(s.num_drafts for s in specs), sum(s.num_draft_tokens for s in specs),
            sum(s.num_accepted_tokens for s in specs))


def spec_metrics(states: list[ChoiceState]) -> dict | None:
    """Summed speculative-decoding counters of a response (openai-api.md §10), or None without
    any."""
    totals = _spec_totals(states)
    if totals is None:
        return None
    num_drafts, num_draft_tokens, num_accepted = totals
    return {"speculative_decoding": {
        "mean_acceptance_length": (1 + num_accepted / num_drafts) if num_drafts else 1.0,
        "draft_acceptance_rate": (num_accepted / num_draft_tokens) if num_draft_tokens else 0.0,
        "num_spec_steps": num_drafts,
        "num_accepted_draft_tokens": num_accepted,
        "num_draft_tokens": num_draft_tokens,
    }}


def speculative_usage(states: list[ChoiceState]) -> dict | None:
    """The `usage.speculative` extension (protocol.SpeculativeUsage), or None when no choice
    speculated."""
    totals = _spec_totals(states)
    if totals is None:
        return None
    drafts, drafted, accepted = totals
    return {"num_drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_draft_length": drafted / drafts if drafts else 0.0}
