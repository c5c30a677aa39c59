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

import torch

from specserve.spec_phases.plan import SampledTokens, ScheduledRequest, StepResult
from specserve.spec_phases.proposers.base import Proposer
from specserve.spec_phases.runner import ModelRunner
from specserve.spec_phases.sampler import SampleRow, Sampler


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
        spans, end = [], 0                     # (request, drafts, first row, rows) that sample
        for r, d in zip(reqs, drafts):
            end += r.num_new_tokens + len(d)
            if r.sample:
                spans.append((r, d, end - len(d) - 1, len(d) + 1))
        if not spans:
            return result
        rows = [first + j for _, _, first, n in spans for j in range(n)]
        raw = self.runner.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        uniforms = self.sampler.uniforms([(r, len(d) + 1) for r, d, _, _ in spans])
        tokens = self.sample_rows(raw, [(r, d, 0, n) for r, d, _, n in spans], uniforms)
        at = 0
        for r, d, _, n in spans:
            out = accept(d, tokens[at:at + n])
            result.sampled[r.request_id] = self.sampled_tokens(r, len(d), out, raw[at:at + n])
            at += n
        return result

    def sample_rows(self, raw: torch.Tensor, spans: list[tuple[ScheduledRequest, list[int], int,
                    int]], uniforms: list[torch.Tensor]) -> list[int]:
        """Raw logits of rows [lo, lo + n) of each (request, drafts, lo, n) -> the token each row
        draws; uniforms[i] holds request i's uniforms for all its rows."""
        sample_rows, inputs = [], []
        for r, d, lo, n in spans:
            for i in range(lo, lo + n):
                sample_rows.append(self.row(r, d, i))
                inputs.append(d[i - 1] if i else r.token_ids[-1])
        if self.observer is not None:
            self.observer.observe(torch.tensor(inputs), raw)
        keep_raw = bool(self.masks) or any(r.params.logprobs is not None  # logprobs read raw
                                           for r, _, _, _ in spans)
        logits = self.sampler.process(raw.clone() if keep_raw else raw, sample_rows)
        if self.masks:
            self.apply_masks(logits, raw, spans)
        u = torch.cat([us[lo:lo + n] for (_, _, lo, n), us in zip(spans, uniforms)])
        return self.sampler.sample(logits, sample_rows, u).tolist()

    def apply_masks(self, logits: torch.Tensor, raw: torch.Tensor,
                    spans: list[tuple[ScheduledRequest, list[int], int, int]]) -> None:
        """Forbidden tokens -> -inf in each constrained row. A row the processors had already
        emptied of every allowed token (min_tokens banning the EOS the grammar needs) keeps the
        grammar: its raw logits over the allowed tokens."""
        at = 0
        for r, _, lo, n in spans:
            mask = self.masks.get(r.request_id)
            if mask is not None:
                allowed = mask[lo:lo + n].to(logits.device)
                rows = logits[at:at + n].masked_fill(~allowed, float("-inf"))
                dead = torch.isneginf(rows).all(dim=-1)
                if bool(dead.any()):
                    rows[dead] = raw[at:at + n][dead].masked_fill(~allowed[dead], float("-inf"))
                logits[at:at + n] = rows
            at += n

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
