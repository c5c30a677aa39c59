"""Batched sampling: logit processors, greedy / temperature / top-k / top-p / min-p, raw logprobs.

One row per position to sample (a request's last position, or each verify row once drafts exist).
A row draws by inverse CDF from one uniform: the first token whose cumulative probability exceeds
u. A seeded request's uniform at a position is a hash of (seed, position), so its text depends on
neither the batch nor speculation; other rows share one generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.spec_phases.plan import ScheduledRequest, TokenLogprob
from specserve.spec_phases.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    num_output_tokens: int                # output tokens before this row (committed + drafts)
    prompt_token_ids: tuple[int, ...] = ()    # for penalties only
    output_token_ids: tuple[int, ...] = ()    # for penalties only: the history before this row


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that is a fixed function of (seed, position) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * mult) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


_MASK64 = (1 << 64) - 1


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...],
                 device: torch.device | str, seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)    # unseeded rows' uniforms (host)

    # -- logit processors ---------------------------------------------------------------------
    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logits: [num_rows, vocab] float32 (modified in place). Bias, min_tokens, penalties."""
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias.keys()), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
            if row.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")
        pen = [i for i, row in enumerate(rows) if row.params.has_penalties]
        if pen:
            self._apply_penalties(logits, [rows[i] for i in pen],
                                  torch.tensor(pen, device=logits.device))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow],
                         idx: torch.Tensor) -> None:
        dev, n, vocab = logits.device, len(rows), logits.shape[1]
        counts = torch.zeros(n, vocab, device=dev)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        for j, row in enumerate(rows):
            if row.output_token_ids:
                out = torch.tensor(row.output_token_ids, device=dev)
                counts[j].index_add_(0, out, torch.ones(len(out), device=dev))
            if row.prompt_token_ids:
                seen[j, torch.tensor(row.prompt_token_ids, device=dev)] = True
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[:, None]
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[:, None]
        sub = logits[idx]
        seen |= counts > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)   # prompt + output
        sub = sub - freq * counts - pres * (counts > 0).float()                    # output only
        logits[idx] = sub

    # -- sampling -----------------------------------------------------------------------------
    def uniforms(self, spans: list[tuple[ScheduledRequest, int]]) -> list[torch.Tensor]:
        """One uniform per row for each (request, rows) starting at its next position: from
        (seed, position) for seeded requests, from the shared generator for the others (drawn in
        request order, so every way of splitting the rows sees the same numbers)."""
        out = []
        for r, n in spans:
            seed = r.params.seed
            if seed is None:
                out.append(torch.rand(n, generator=self.generator, dtype=torch.float64))
            else:
                pos = r.next_position
                out.append(torch.tensor([position_uniform(seed, pos + i) for i in range(n)],
                                        dtype=torch.float64))
        return out

    def sample(self, logits: torch.Tensor, rows: list[SampleRow],
               uniforms: torch.Tensor) -> torch.Tensor:
        """Processed logits [num_rows, vocab] -> token ids [num_rows]; uniforms [num_rows]."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not sampled:
            return tokens
        idx = torch.tensor(sampled, device=logits.device)
        cdf = self.probs(logits[idx], [rows[i] for i in sampled]).double().cumsum(dim=-1)
        u = uniforms[sampled].to(cdf.device)[:, None] * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(cdf.shape[1] - 1)
        tokens[idx] = drawn
        return tokens

    def probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Target distribution of each row after temperature, min-p, top-k and top-p (greedy rows
        get temperature 1 as a placeholder; callers use their argmax)."""
        dev = logits.device
        temp = torch.tensor([r.params.temperature or 1.0 for r in rows], device=dev)[:, None]
        logits = logits / temp
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            probs = logits.softmax(dim=-1)
            top = probs.max(dim=-1, keepdim=True).values
            limit = torch.tensor(min_p, device=dev)[:, None] * top
            logits = logits.masked_fill(probs < limit, float("-inf"))
        # only the rows that ask for top-k / top-p go through the sort, so a row's distribution
        # never depends on its neighbours (docs/design.md)
        top_k = [r.params.top_k if 0 < r.params.top_k < self.vocab_size else self.vocab_size
                 for r in rows]
        top_p = [r.params.top_p for r in rows]
        ask = [i for i in range(len(rows)) if top_k[i] < self.vocab_size or top_p[i] < 1.0]
        if ask:
            idx = torch.tensor(ask, device=dev)
            logits[idx] = _top_k_top_p(logits[idx],
                                       torch.tensor([top_k[i] for i in ask], device=dev),
                                       torch.tensor([top_p[i] for i in ask], device=dev))
        return logits.softmax(dim=-1)

    # -- logprobs -----------------------------------------------------------------------------
    @staticmethod
    def logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                 num_top: list[int]) -> list[TokenLogprob]:
        """Raw logprobs (vLLM's default `raw_logprobs` mode) of the chosen tokens plus top-N."""
        logprobs = raw_logits.float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        k = max(num_top) if num_top else 0
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        out = []
        for i, n in enumerate(num_top):
            out.append(TokenLogprob(
                token_id=int(token_ids[i]), logprob=float(chosen[i]), rank=int(ranks[i]),
                top_token_ids=top_ids[i, :n].tolist() if n else [],
                top_logprobs=top_vals[i, :n].tolist() if n else []))
        return out


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and its top-p nucleus (the first token stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p 1.0 restricts nothing (float32 mass before a tail token may round to 1.0)
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
