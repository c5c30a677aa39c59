"""Verification: one forward over every request's [new tokens + drafts], then acceptance.

Row i of a sampling request is the target's distribution after its last token and drafts[:i]. Each
row draws the token plain sampling would draw at that position (greedy: the argmax; otherwise an
inverse-CDF draw with one uniform per position, from (seed, position) for seeded requests), and a
draft is accepted exactly when it equals that token; the first mismatch, or the row after the last
draft, gives the one new token. With one-hot drafts (every drafter here) this is rejection sampling
exactly: draft x is accepted with probability p(x), and on rejection the token is drawn from p
without x, the residual. Seeded sampling gives the same text with speculation on or off.

A constrained request (structured output) has one grammar mask per row: the grammar state after
its last token and drafts[:i] (`spec_phases/grammar.py`). The mask is applied to the row's logits
after the logit processors, before the draw, so every row draws what plain constrained decoding
would draw there, and acceptance stays exact.

Prefill chunks are verify passes over prompt tokens (nothing to sample until the chunk reaches the
end of the prompt) and plain decoding is a verify pass with zero drafts: one path.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specserve.spec_phases.plan import SampledTokens, ScheduledRequest, StepResult
from specserve.spec_phases.proposers.base import Proposer
from specserve.spec_phases.runner import ModelRunner
from specserve.spec_phases.sampler import SampleRow, Sampler


@dataclass(frozen=True, slots=True)
class RowSpan:
    """A run of one sampling request's verify rows that one forward computed.

    A request's verify row i is the target after its last token and drafts[:i]; row len(drafts) is
    the bonus row. The run is rows first .. first + count - 1, and sits in the forward's hidden
    states at hidden_start .. hidden_start + count - 1. uniforms: the request's uniforms for all its
    rows (row i draws with uniforms[i])."""
    req: ScheduledRequest
    drafts: list[int]
    first: int
    count: int
    hidden_start: int
    uniforms: torch.Tensor

    @property
    def rows(self) -> range:
        return range(self.first, self.first + self.count)


def hidden_rows(spans: Sequence[RowSpan], device: torch.device) -> torch.Tensor:
    """The hidden-state rows of the spans, span after span: the rows whose logits are computed."""
    return torch.tensor([s.hidden_start + j for s in spans for j in range(s.count)],
                        device=device)


def per_span(rows, spans: Sequence[RowSpan]) -> Iterator[tuple[RowSpan, object]]:
    """Cut `rows` (a tensor or list with one entry per row, span after span) into each span's."""
    at = 0
    for s in spans:
        yield s, rows[at:at + s.count]
        at += s.count


class Verifier:
    def __init__(self, runner: ModelRunner, sampler: Sampler, proposer: Proposer | None):
        """proposer: told the raw logits of every verified row when it learns from the target."""
        self.runner, self.sampler = runner, sampler
        self.observer = proposer if proposer is not None and proposer.learns_from_target else None
        self.masks: dict[str, torch.Tensor] = {}      # this step's grammar masks, per request

    def verify(self, reqs: tuple[ScheduledRequest, ...], drafts: list[list[int]],
               masks: dict[str, torch.Tensor] | None = None) -> StepResult:
        """masks: request id -> bool [len(drafts) + 1, vocab], the rows' grammar masks."""
        self.masks = masks or {}
        hidden = self.runner.forward([r.token_ids + tuple(d) for r, d in zip(reqs, drafts)],
                                     [r.num_computed_tokens for r in reqs],
                                     [r.block_ids for r in reqs])
        result = StepResult()
        self.runner.prompt_logprobs(reqs, drafts, hidden, result.prompt_logprobs)
        sampling = [(r, d) for r, d in zip(reqs, drafts) if r.sample]
        if not sampling:
            return result
        uniforms = self.sampler.uniforms([(r, len(d) + 1) for r, d in sampling])
        spans = [RowSpan(r, d, 0, len(d) + 1, start, u)
                 for (r, d), start, u in zip(sampling, sample_starts(reqs, drafts), uniforms)]
        raw = self.runner.compute_logits(hidden[hidden_rows(spans, hidden.device)])
        tokens = self.sample_rows(raw, spans)
        for (s, raw_rows), (_, row_tokens) in zip(per_span(raw, spans), per_span(tokens, spans)):
            out = accept(s.drafts, row_tokens)
            result.sampled[s.req.request_id] = self.sampled_tokens(s.req, len(s.drafts), out,
                                                                   raw_rows)
        return result

    def sample_rows(self, raw: torch.Tensor, spans: Sequence[RowSpan]) -> list[int]:
        """Raw logits of the spans' rows, span after span -> the token each row draws."""
        sample_rows, inputs = [], []
        for s in spans:
            for i in s.rows:
                sample_rows.append(self.row(s.req, s.drafts, i))
                inputs.append(s.drafts[i - 1] if i else s.req.token_ids[-1])
        if self.observer is not None:
            self.observer.observe(torch.tensor(inputs), raw)
        keep_raw = bool(self.masks) or any(s.req.params.logprobs is not None  # logprobs read raw
                                           for s in spans)
        logits = self.sampler.process(raw.clone() if keep_raw else raw, sample_rows)
        if self.masks:
            self.apply_masks(logits, raw, spans)
        u = torch.cat([s.uniforms[s.first:s.first + s.count] for s in spans])
        return self.sampler.sample(logits, sample_rows, u).tolist()

    def apply_masks(self, logits: torch.Tensor, raw: torch.Tensor,
                    spans: Sequence[RowSpan]) -> None:
        """Forbidden tokens -> -inf in each constrained row. A row the processors had already
        emptied of every allowed token (min_tokens banning the EOS the grammar needs) keeps the
        grammar: its raw logits over the allowed tokens."""
        for (s, rows), (_, raw_rows) in zip(per_span(logits, spans), per_span(raw, spans)):
            mask = self.masks.get(s.req.request_id)
            if mask is not None:
                allowed = mask[s.first:s.first + s.count].to(logits.device)
                masked = rows.masked_fill(~allowed, float("-inf"))
                dead = torch.isneginf(masked).all(dim=-1)
                if bool(dead.any()):
                    masked[dead] = raw_rows[dead].masked_fill(~allowed[dead], float("-inf"))
                rows.copy_(masked)

    @staticmethod
    def row(r: ScheduledRequest, drafts: list[int], i: int) -> SampleRow:
        """The sampling row after the request's committed tokens and drafts[:i]."""
        history = r.output_token_ids + tuple(drafts[:i]) if r.params.has_penalties else ()
        return SampleRow(r.params, r.num_output_tokens + i, r.prompt_token_ids, history)

    @staticmethod
    def sampled_tokens(r: ScheduledRequest, num_drafted: int, tokens: list[int],
                       raw: torch.Tensor, num_computed: int | None = None) -> SampledTokens:
        """raw: the raw logits of the rows that produced `tokens`, in order."""
        computed = num_drafted if num_computed is None else num_computed
        out = SampledTokens(tokens, num_drafted=num_drafted, num_pruned=num_drafted - computed)
        if r.params.logprobs is not None:
            n = len(tokens)
            out.logprobs = Sampler.logprobs(raw[:n], torch.tensor(tokens, device=raw.device),
                                            [r.params.logprobs] * n)
        return out


def accept(drafts: list[int], row_tokens: list[int]) -> list[int]:
    """The longest prefix of drafts equal to the rows' tokens, then the next row's token.
    `row_tokens` covers rows 0 .. at least the first mismatch (or len(drafts))."""
    a = 0
    while a < len(drafts) and drafts[a] == row_tokens[a]:
        a += 1
    return drafts[:a] + [row_tokens[a]]


def sample_starts(reqs: Sequence[ScheduledRequest], drafts: Sequence[Sequence[int]]) -> list[int]:
    """Where each sampling request's first verify row (after its last new token) sits in a forward
    over every request's [new tokens + drafts], in order."""
    starts, end = [], 0
    for r, d in zip(reqs, drafts):
        end += r.num_new_tokens + len(d)
        if r.sample:
            starts.append(end - len(d) - 1)
    return starts
