"""The runner: turns a StepPlan into tensors, runs one forward over the packed batch, samples.

The only place (with the model) that touches the device. One forward serves prefill chunks, decodes
and verify rows alike; the acceptance op then turns each request's rows into its new tokens.
"""
from __future__ import annotations

import time

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

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        reqs = plan.requests
        drafts = self._propose(reqs)                      # draft phase
        token_lists = [r.token_ids + d for r, d in zip(reqs, drafts)]
        starts = [r.num_computed_tokens for r in reqs]
        hidden = self.model(*self._inputs(token_lists, starts, [r.block_ids for r in reqs]))   # verify phase
        result = StepResult(sampled={})
        self._sample(reqs, drafts, hidden, result)
        self._prompt_logprobs(reqs, drafts, hidden, result)
        result.step_time_s = time.perf_counter() - start
        return result

    def _propose(self, reqs: list[ScheduledRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        wanted = [i for i, r in enumerate(reqs) if r.sample and r.num_draft_tokens > 0]
        if self.proposer is None or not wanted:
            return drafts
        asks = [DraftRequest(reqs[i].request_id, reqs[i].prompt_token_ids + reqs[i].output_token_ids,
                             reqs[i].num_computed_tokens, reqs[i].block_ids) for i in wanted]
        for i, d in zip(wanted, self.proposer.propose(asks, [reqs[i].num_draft_tokens for i in wanted])):
            drafts[i] = d[:reqs[i].num_draft_tokens]
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

    def _sample(self, reqs: list[ScheduledRequest], drafts: list[list[int]], hidden: torch.Tensor,
                result: StepResult) -> None:
        """Rows [last token, d_1..d_k] of each finishing request -> accepted drafts + one token."""
        row_ids, rows, inputs, owners, end = [], [], [], [], 0
        for r, d in zip(reqs, drafts):
            end += r.num_new_tokens + len(d)
            if not r.sample:
                continue
            k, gen = len(d), self._generator(r)
            for i in range(k + 1):
                history = r.output_token_ids + d[:i] if i else r.output_token_ids
                rows.append(SampleRow(r.params, r.prompt_token_ids, history, gen))
                row_ids.append(end - k - 1 + i)
                inputs.append(d[i - 1] if i else r.token_ids[-1])
            owners.append((r, len(rows) - k - 1, d))
        if not rows:
            return
        raw = self.model.compute_logits(hidden[torch.tensor(row_ids, device=hidden.device)])
        if self.proposer is not None:
            self.proposer.observe(torch.tensor(inputs), raw)
        want_logprobs = any(r.params.logprobs is not None for r, _, _ in owners)
        logits = self.sampler.process(raw.clone() if want_logprobs else raw, rows)
        accepted = accept(self.sampler, logits, rows, owners)
        for (r, first, d), tokens in zip(owners, accepted):
            out = SampledTokens(tokens, num_drafted=len(d))
            if r.params.logprobs is not None:
                sl = slice(first, first + len(tokens))
                out.logprobs = Sampler.logprobs(raw[sl], torch.tensor(tokens, device=raw.device),
                                                [r.params.logprobs] * len(tokens))
            result.sampled[r.request_id] = out

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


def accept(sampler: Sampler, logits: torch.Tensor, rows: list[SampleRow],
           owners: list[tuple[ScheduledRequest, int, list[int]]]) -> list[list[int]]:
    """Per request: accepted drafts + one target token. Greedy requests keep the longest prefix that
    matches the target argmax; sampled ones go through lossless rejection sampling (one-hot drafts)."""
    argmax = logits.argmax(dim=-1).tolist()
    out: list[list[int] | None] = [None] * len(owners)
    sampled = []
    for j, (r, first, d) in enumerate(owners):
        if r.params.greedy:
            a = 0
            while a < len(d) and d[a] == argmax[first + a]:
                a += 1
            out[j] = argmax[first:first + a + 1]
        else:
            sampled.append(j)
    if not sampled:
        return out
    if not any(owners[j][2] for j in sampled):            # no drafts: plain sampling
        idx = [owners[j][1] for j in sampled]
        tokens = sampler.sample(logits[idx], [rows[i] for i in idx]).tolist()
        for j, tok in zip(sampled, tokens):
            out[j] = [tok]
        return out
    k_max = max(len(owners[j][2]) for j in sampled)
    vocab, dev = logits.shape[1], logits.device
    target = torch.zeros(len(sampled), k_max + 1, vocab, device=dev)
    draft_ids = torch.zeros(len(sampled), k_max, dtype=torch.long, device=dev)
    uniforms = torch.ones(len(sampled), k_max, device=dev)
    noise = torch.empty(len(sampled), vocab, device=dev)
    for b, j in enumerate(sampled):
        r, first, d = owners[j]
        idx = list(range(first, first + len(d) + 1))
        target[b, :len(idx)] = sampler.probs(logits[idx], [rows[i] for i in idx])
        draft_ids[b, :len(d)] = torch.tensor(d, dtype=torch.long)
        gen = rows[first].generator or sampler.generator
        uniforms[b, :len(d)] = 1.0 - torch.rand(len(d), generator=gen, device=dev)   # (0, 1]
        noise[b] = torch.empty(vocab, device=dev).exponential_(generator=gen)
    num_drafts = torch.tensor([len(owners[j][2]) for j in sampled], device=dev)
    tokens, num_accepted = get_op("rejection_sample", str(dev))(target, draft_ids, num_drafts, None,
                                                                uniforms, noise)
    for b, j in enumerate(sampled):
        out[j] = tokens[b, :int(num_accepted[b]) + 1].tolist()
    return out
