"""Verification frontiers (FASER early pruning): verify drafts f positions at a time.

The first forward computes every request's new tokens plus its first f drafts; each later forward
computes the next f drafts of only the requests whose drafts all matched so far. A request is
decided by the first mismatch or by its bonus row. Each row draws the same token a single pass
would (uniforms are drawn up front, per position), so the output is identical to
`Verifier.verify`; only the compute after a rejection is saved (`SampledTokens.num_pruned`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specserve.spec_phases.plan import ScheduledRequest, StepResult
from specserve.spec_phases.verify import (RowSpan, Verifier, accept, hidden_rows, per_span,
                                          sample_starts)


@dataclass
class Verifying:
    """One sampling request across frontiers: rows[:computed + 1] exist."""
    req: ScheduledRequest
    drafts: list[int]
    uniforms: torch.Tensor
    computed: int = 0                         # drafts the target has computed
    row_tokens: list[int] = field(default_factory=list)
    raw: list[torch.Tensor] = field(default_factory=list)     # raw logits per frontier
    tokens: list[int] | None = None           # accepted drafts + one token, once decided

    def next_rows(self, count: int, hidden_start: int) -> RowSpan:
        """Its next `count` verify rows (after those computed), at hidden_start in a forward."""
        return RowSpan(self.req, self.drafts, len(self.row_tokens), count, hidden_start,
                       self.uniforms)

    def decide(self) -> None:
        """Decided once a computed row disagrees with its draft, or the bonus row exists."""
        rejected = any(d != t for d, t in zip(self.drafts, self.row_tokens))
        if rejected or self.computed == len(self.drafts):
            self.tokens = accept(self.drafts, self.row_tokens)


class FrontierVerifier(Verifier):
    def __init__(self, *args, frontier_size: int,
                 on_decided: Callable[[list[Verifying]], None] | None = None, **kwargs):
        """on_decided: called after the first frontier with the requests it decided, while later
        frontiers still run (the overlap of the next draft phase, `spec_phases/overlap.py`)."""
        super().__init__(*args, **kwargs)
        self.size, self.on_decided = frontier_size, on_decided

    def verify(self, reqs: tuple[ScheduledRequest, ...], drafts: list[list[int]],
               masks: dict[str, torch.Tensor] | None = None) -> StepResult:
        self.masks = masks or {}
        size = self.size
        first = [d[:size] for d in drafts]
        hidden = self.runner.forward([r.token_ids + tuple(d) for r, d in zip(reqs, first)],
                                     [r.num_computed_tokens for r in reqs],
                                     [r.block_ids for r in reqs])
        result = StepResult(num_frontiers=1)
        self.runner.prompt_logprobs(reqs, first, hidden, result.prompt_logprobs)
        sampling = [(r, d) for r, d in zip(reqs, drafts) if r.sample]
        uniforms = self.sampler.uniforms([(r, len(d) + 1) for r, d in sampling])
        states = [Verifying(r, d, u) for (r, d), u in zip(sampling, uniforms)]
        counts = [len(d) + 1 for r, d in zip(reqs, first) if r.sample]
        pending = self._advance(hidden, states, [
            v.next_rows(n, start)
            for v, n, start in zip(states, counts, sample_starts(reqs, first))])
        if pending and self.on_decided is not None:
            self.on_decided([v for v in states if v.tokens is not None])
        while pending:                                    # later frontiers: survivors only
            chunks = [v.drafts[v.computed:v.computed + size] for v in pending]
            hidden = self.runner.forward(
                [tuple(c) for c in chunks],
                [v.req.next_position + v.computed for v in pending],
                [v.req.block_ids for v in pending])
            result.num_frontiers += 1
            spans, start = [], 0
            for v, c in zip(pending, chunks):
                spans.append(v.next_rows(len(c), start))
                start += len(c)
            pending = self._advance(hidden, pending, spans)
        for v in states:
            result.sampled[v.req.request_id] = self.sampled_tokens(
                v.req, len(v.drafts), v.tokens, torch.cat(v.raw), num_computed=v.computed)
        return result

    def _advance(self, hidden: torch.Tensor, states: list[Verifying],
                 spans: list[RowSpan]) -> list[Verifying]:
        """spans[i]: the rows of states[i] this forward computed. Returns the requests that need
        their next frontier."""
        if not spans:
            return []
        raw = self.runner.compute_logits(hidden[hidden_rows(spans, hidden.device)])
        tokens = self.sample_rows(raw, spans)
        for v, (_, raw_rows), (_, row_tokens) in zip(states, per_span(raw, spans),
                                                      per_span(tokens, spans)):
            v.row_tokens.extend(row_tokens)
            v.raw.append(raw_rows)
            v.computed = len(v.row_tokens) - 1
            v.decide()
        return [v for v in states if v.tokens is None]
