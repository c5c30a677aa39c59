"""The runner: turns a StepPlan into tensors, runs one forward over the packed batch, samples.

The only place (with the model) that touches the device. One forward serves prefill chunks, decodes
and verify rows alike; the acceptance op then turns each request's rows into its new tokens. With
verification frontiers (FASER early pruning, `plan.frontier_size`), drafts are verified a chunk at a
time and only requests whose drafts all passed pay for the next forward (`Verification`).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specserve.kernels.dispatch import get_op
from specserve.kernels.reference.paged_attention import PagedAttentionMetadata
from specserve.kv_cache.host_pool import HostKVPool, StagedPagedAttention
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases.model import LlamaModel
from specserve.spec_phases.plan import SampledTokens, ScheduledRequest, StepPlan, StepResult
from specserve.spec_phases.proposers.base import DraftRequest, Proposer
from specserve.spec_phases.sampler import SampleRow, Sampler


class PagedAttention:
    """Per-step attention over the paged cache: write the new K/V at their slots, then attend."""

    def __init__(self, storage: KVStorage, meta: PagedAttentionMetadata, slot_mapping: torch.Tensor,
                 scale: float):
        self.storage, self.meta, self.slot_mapping, self.scale = storage, meta, slot_mapping, scale
        self.op = get_op("paged_attention", str(storage.k.device))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.storage.write(layer, self.slot_mapping, k, v)
        return self.op(q, self.storage.k[layer], self.storage.v[layer], self.meta, self.scale)


class ModelRunner:
    def __init__(self, model: LlamaModel, storage: KVStorage | HostKVPool, eos_token_ids: tuple[int, ...],
                 seed: int = 0):
        """storage: the full KV cache, on the device (KVStorage) or in host memory (HostKVPool,
        VeriCache: staged to the device layer by layer for every forward)."""
        self.model, self.storage = model, storage
        self.device = model.embed_tokens.weight.device
        self.block_size = storage.block_size
        cfg = model.config
        self.scale = cfg.head_dim ** -0.5
        self.sampler = Sampler(cfg.vocab_size, eos_token_ids, self.device, seed)
        self.generators: dict[str, torch.Generator] = {}
        self.proposer: Proposer | None = None
        # FASER overlap (off unless the worker turns it on): while later verification frontiers run,
        # a worker thread drafts the next step for the requests the first frontier already decided.
        # Only for drafters whose drafts depend on the tokens alone (`drafts_from_tokens_only`: a
        # precomputed draft is the draft); `overlap_max_len` is the longest draft a later step may ask.
        self.overlap_drafts = False
        self.overlap_max_len = 0
        self._pool: ThreadPoolExecutor | None = None
        self._early: Future | None = None             # -> {request_id: (num tokens, drafts)}
        self.num_drafted_ahead = 0                    # requests whose drafts came from the thread

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Draft, then verify. With `plan.frontier_size` f > 0 the verify phase runs in frontiers: the
        first forward computes every request's new tokens plus its first f drafts, each later one the
        next f drafts of only the requests whose drafts all passed so far. Output is identical to one
        verify pass (prefix acceptance; randomness drawn up front), with less compute after rejections."""
        start = time.perf_counter()
        reqs = plan.requests
        drafts = self._propose(reqs)                      # draft phase
        size = plan.frontier_size
        first = [d[:size] if size else d for d in drafts]
        token_lists = [r.token_ids + d for r, d in zip(reqs, first)]
        starts = [r.num_computed_tokens for r in reqs]
        hidden = self.model(*self._inputs(token_lists, starts, [r.block_ids for r in reqs]))   # verify phase
        result = StepResult(sampled={}, num_frontiers=1)
        self._prompt_logprobs(reqs, first, hidden, result)
        verify = Verification(self, reqs, drafts)         # draws the step's randomness now
        pending = verify.advance(hidden, _first_spans(reqs, first, verify))
        if pending:
            self._draft_ahead([v for v in verify.states if v.tokens is not None])
        while pending:                                    # later frontiers: survivors only
            chunks = [v.drafts[v.computed:v.computed + size] for v in pending]
            hidden = self.model(*self._inputs(
                chunks, [v.req.num_computed_tokens + v.req.num_new_tokens + v.computed for v in pending],
                [v.req.block_ids for v in pending]))
            result.num_frontiers += 1
            offsets = [0]
            for c in chunks:
                offsets.append(offsets[-1] + len(c))
            pending = verify.advance(hidden, [(v, off, len(c)) for v, off, c in zip(pending, offsets, chunks)])
        verify.finish(result)
        result.draft_passes = self.last_draft_passes
        result.step_time_s = time.perf_counter() - start
        return result

    def _draft_ahead(self, decided: list[_Verifying]) -> None:
        """Overlap: next step's drafts of the requests decided by the first frontier, on a thread."""
        if not (self.overlap_drafts and decided and getattr(self.proposer, "drafts_from_tokens_only", False)):
            return
        asks = [DraftRequest(v.req.request_id, v.req.prompt_token_ids + v.req.output_token_ids + v.tokens,
                             0, []) for v in decided]
        proposer, max_len = self.proposer, self.overlap_max_len

        def draft() -> dict[str, tuple[int, list[int]]]:
            out = proposer.propose(asks, [max_len] * len(asks))
            return {a.request_id: (len(a.token_ids), d) for a, d in zip(asks, out)}

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-draft")
        self._early = self._pool.submit(draft)

    def _propose(self, reqs: list[ScheduledRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        self.last_draft_passes: list[tuple[int, float]] = []
        early = self._early.result() if self._early is not None else {}
        self._early = None                                # drafted ahead: valid for this step only
        wanted = [i for i, r in enumerate(reqs) if r.sample and r.num_draft_tokens > 0]
        if self.proposer is None or not wanted:
            return drafts
        rest = []
        for i in wanted:
            r = reqs[i]
            made_for, draft = early.get(r.request_id, (-1, None))
            if made_for == len(r.prompt_token_ids) + len(r.output_token_ids):   # drafted ahead for this context
                drafts[i] = draft[:r.num_draft_tokens]
                self.num_drafted_ahead += 1
            else:
                rest.append(i)
        wanted = rest
        if not wanted:
            return drafts
        asks = [DraftRequest(reqs[i].request_id, reqs[i].prompt_token_ids + reqs[i].output_token_ids,
                             reqs[i].num_computed_tokens, reqs[i].block_ids) for i in wanted]
        for i, d in zip(wanted, self.proposer.propose(asks, [reqs[i].num_draft_tokens for i in wanted])):
            drafts[i] = d[:reqs[i].num_draft_tokens]
        self.last_draft_passes = list(getattr(self.proposer, "last_passes", ()))
        return drafts

    def _inputs(self, token_lists: list[list[int]], starts: list[int],
                block_tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, PagedAttention]:
        """Request i computes token_lists[i] at positions starts[i], starts[i] + 1, ..."""
        dev, bs = self.device, self.block_size
        token_ids, query_start, seq_lens = [], [0], []
        for tokens, start in zip(token_lists, starts):
            token_ids.extend(tokens)
            query_start.append(query_start[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
        counts = torch.tensor([len(t) for t in token_lists])
        req_idx = torch.repeat_interleave(torch.arange(len(token_lists)), counts)
        positions = torch.tensor(starts)[req_idx] + torch.arange(len(token_ids)) \
            - torch.tensor(query_start[:-1])[req_idx]
        width = max(len(b) for b in block_tables)
        tables = torch.tensor([b + [0] * (width - len(b)) for b in block_tables])
        slot_mapping = tables[req_idx, positions // bs] * bs + positions % bs
        if isinstance(self.storage, HostKVPool):
            attn = StagedPagedAttention(self.storage, query_start, seq_lens, block_tables, slot_mapping.to(dev),
                                        self.scale, dev)
        else:
            meta = PagedAttentionMetadata(query_start, seq_lens, block_tables, bs, dev)
            attn = PagedAttention(self.storage, meta, slot_mapping.to(dev), self.scale)
        return torch.tensor(token_ids, device=dev), positions.to(dev), attn

    @torch.inference_mode()
    def forward_rows(self, rows: list[tuple[int, int, list[int]]], layers: list[int] | None) -> torch.Tensor:
        """One token per row (token id, position, block ids) through `layers`: raw logits [rows, vocab].
        The draft phase of self-speculation; its K/V land in slots the verify pass rewrites."""
        tokens, positions, tables = zip(*rows)
        hidden = self.model(*self._inputs([[t] for t in tokens], list(positions), list(tables)), layers=layers)
        return self.model.compute_logits(hidden)

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        seed = r.params.seed
        if seed is None:
            return None
        gen = self.generators.get(r.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed % (2**64))
            self.generators[r.request_id] = gen
        return gen

    def _prompt_logprobs(self, reqs: list[ScheduledRequest], drafts: list[list[int]], hidden: torch.Tensor,
                         result: StepResult) -> None:
        """Row i of a prompt chunk starting at c scores prompt token c + i + 1."""
        end = 0
        for r, d in zip(reqs, drafts):
            start, end = end, end + r.num_new_tokens + len(d)
            if not r.want_prompt_logprobs:
                continue
            num_prompt = len(r.prompt_token_ids)
            first, last = r.num_computed_tokens, min(r.num_computed_tokens + r.num_new_tokens, num_prompt - 1)
            if last <= first:
                result.prompt_logprobs[r.request_id] = []
                continue
            raw = self.model.compute_logits(hidden[start:start + last - first])
            targets = torch.tensor(r.prompt_token_ids[first + 1:last + 1], device=raw.device)
            result.prompt_logprobs[r.request_id] = Sampler.logprobs(
                raw, targets, [r.params.prompt_logprobs] * len(targets))


def _first_spans(reqs: list[ScheduledRequest], first: list[list[int]],
                 verify: Verification) -> list[tuple[_Verifying, int, int]]:
    """Rows of the first forward each sampling request verifies: [last token, its first drafts]."""
    spans, end, states = [], 0, iter(verify.states)
    for r, d in zip(reqs, first):
        end += r.num_new_tokens + len(d)
        if r.sample:
            spans.append((next(states), end - len(d) - 1, len(d) + 1))
    return spans


class _Verifying:
    """One sampling request's verification. Row i is the target's distribution after the last token
    and drafts[:i]: it verifies drafts[i] (i < k) or gives the bonus token (i == k)."""

    def __init__(self, req: ScheduledRequest, drafts: list[int], generator: torch.Generator | None):
        self.req, self.drafts, self.generator = req, drafts, generator
        self.greedy = req.params.greedy
        self.computed = 0                 # drafts the target has computed: rows 0..computed exist
        self.verified = 0                 # drafts[:verified] are accepted
        self.raw: list[torch.Tensor] = []      # raw logits per row, kept when logprobs are asked for
        self.argmax: list[int] = []             # of the processed logits (greedy)
        self.probs: list[torch.Tensor] = []     # target distribution per row (sampled)
        self.uniforms: torch.Tensor | None = None
        self.noise: torch.Tensor | None = None
        self.tokens: list[int] | None = None    # accepted drafts + one token, once decided

    @property
    def k(self) -> int:
        return len(self.drafts)

    def row(self, i: int) -> SampleRow:
        r = self.req
        return SampleRow(r.params, r.prompt_token_ids, r.output_token_ids + self.drafts[:i] if i else
                         r.output_token_ids, self.generator)


class Verification:
    """Acceptance over one or more verify forwards (frontiers), identical to a single pass.

    Greedy requests keep the longest prefix of drafts that matches the target argmax; sampled ones go
    through lossless rejection sampling (one-hot drafts). Every uniform and the stop-row noise of a
    request are drawn before the first forward, in the order a single pass draws them, so a seeded
    request's output does not depend on the frontier size. After each forward a request is decided when
    a draft was rejected or its bonus row exists; otherwise its next frontier is computed."""

    def __init__(self, runner: ModelRunner, reqs: list[ScheduledRequest], drafts: list[list[int]]):
        self.runner, self.sampler = runner, runner.sampler
        self.states = [_Verifying(r, d, runner._generator(r)) for r, d in zip(reqs, drafts) if r.sample]
        sampled = [v for v in self.states if not v.greedy]
        self.plain = not any(v.drafts for v in sampled)     # no sampled drafts: plain sampling
        if self.plain:
            return
        dev, vocab = runner.device, runner.model.config.vocab_size
        for v in sampled:
            gen = v.generator or self.sampler.generator
            v.uniforms = 1.0 - torch.rand(v.k, generator=gen, device=dev)          # (0, 1]
            v.noise = torch.empty(vocab, device=dev).exponential_(generator=gen)

    def advance(self, hidden: torch.Tensor, spans: list[tuple[_Verifying, int, int]]) -> list[_Verifying]:
        """spans: (request, first hidden row, rows) of the rows this forward computed. Returns the
        requests that need their next frontier."""
        if not spans:
            return []
        idx = [first + j for _, first, n in spans for j in range(n)]
        raw = self.runner.model.compute_logits(hidden[torch.tensor(idx, device=hidden.device)])
        rows, inputs = [], []
        for v, _, n in spans:
            for i in range(len(v.argmax), len(v.argmax) + n):     # rows so far .. + n
                rows.append(v.row(i))
                inputs.append(v.drafts[i - 1] if i else v.req.token_ids[-1])
        if self.runner.proposer is not None:              # raw logits of every computed row, in order
            self.runner.proposer.observe(torch.tensor(inputs), raw)
        want_logprobs = any(v.req.params.logprobs is not None for v, _, _ in spans)
        logits = self.sampler.process(raw.clone() if want_logprobs else raw, rows)
        argmax = logits.argmax(dim=-1).tolist()
        at, sampled, plain = 0, [], []
        for v, _, n in spans:
            sl = slice(at, at + n)
            at += n
            if v.req.params.logprobs is not None:
                v.raw.append(raw[sl])                     # unprocessed: cloned before process()
            v.argmax.extend(argmax[sl])
            v.computed = len(v.argmax) - 1
            if v.greedy:
                self._greedy(v)
            elif self.plain:
                plain.append((v, logits[sl], rows[sl]))
            else:
                v.probs.append(self.sampler.probs(logits[sl], rows[sl]))
                sampled.append(v)
        if plain:                                         # k = 0 everywhere: decided by the first forward
            tokens = self.sampler.sample(torch.cat([lg for _, lg, _ in plain]),
                                         [row for _, _, rs in plain for row in rs]).tolist()
            for (v, _, _), tok in zip(plain, tokens):
                v.tokens = [tok]
        if sampled:
            self._reject(sampled)
        return [v for v, _, _ in spans if v.tokens is None]

    @staticmethod
    def _reachable(v: _Verifying) -> int:
        """Drafts whose verify row exists: one past the computed drafts (its row is the last one)."""
        return min(v.k, v.computed + 1)

    def _greedy(self, v: _Verifying) -> None:
        hi, a = self._reachable(v), v.verified
        while a < hi and v.drafts[a] == v.argmax[a]:
            a += 1
        if a < hi or v.computed == v.k:                   # a rejection, or the bonus row is there
            v.tokens = v.drafts[:a] + [v.argmax[a]]
        else:
            v.verified = a

    def _reject(self, states: list[_Verifying]) -> None:
        """Rejection sampling over the drafts each request can verify now, [verified, reachable).
        Rows past a rejection never matter, so a frontier sees exactly what a single pass sees; a
        missing stop row (all accepted, more drafts to come) is zero and its token is discarded."""
        spans = [(v.verified, self._reachable(v)) for v in states]
        width = max(hi - lo for lo, hi in spans)
        dev, vocab = self.runner.device, self.runner.model.config.vocab_size
        target = torch.zeros(len(states), width + 1, vocab, device=dev)
        draft_ids = torch.zeros(len(states), width, dtype=torch.long, device=dev)
        uniforms = torch.ones(len(states), width, device=dev)
        for b, (v, (lo, hi)) in enumerate(zip(states, spans)):
            probs = torch.cat(v.probs)[lo:hi + 1]         # rows lo..hi, or lo..hi-1 if hi is not computed
            target[b, :len(probs)] = probs
            draft_ids[b, :hi - lo] = torch.tensor(v.drafts[lo:hi], dtype=torch.long)
            uniforms[b, :hi - lo] = v.uniforms[lo:hi]
        num_drafts = torch.tensor([hi - lo for lo, hi in spans], device=dev)
        noise = torch.stack([v.noise for v in states])
        tokens, num_accepted = get_op("rejection_sample", str(dev))(target, draft_ids, num_drafts, None,
                                                                    uniforms, noise)
        for b, (v, (lo, hi)) in enumerate(zip(states, spans)):
            a = int(num_accepted[b])
            if a < hi - lo or v.computed == v.k:
                v.tokens = v.drafts[:lo] + tokens[b, :a + 1].tolist()
            else:
                v.verified = hi

    def finish(self, result: StepResult) -> None:
        """Tokens, counts and logprobs into the result."""
        for v in self.states:
            out = SampledTokens(v.tokens, num_drafted=v.k, num_pruned=v.k - v.computed)
            if v.req.params.logprobs is not None:
                n, raw = len(v.tokens), torch.cat(v.raw)
                out.logprobs = Sampler.logprobs(raw[:n], torch.tensor(v.tokens, device=raw.device),
                                                [v.req.params.logprobs] * n)
            result.sampled[v.req.request_id] = out
