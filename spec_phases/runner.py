"""The runner: turns a StepPlan into tensors, runs one forward over the packed batch, samples.

The only place (with the model) that touches the device. One forward serves prefill chunks, decodes
and verify rows alike; the acceptance op then turns each request's rows into its new tokens.
"""
from __future__ import annotations

import time

import torch

from specserve.kernels.dispatch import get_op
from specserve.kernels.reference.paged_attention import PagedAttentionMetadata
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases.model import LlamaModel
from specserve.spec_phases.plan import SampledTokens, ScheduledRequest, StepPlan, StepResult
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
    def __init__(self, model: LlamaModel, storage: KVStorage, eos_token_ids: tuple[int, ...], seed: int = 0):
        self.model, self.storage = model, storage
        self.device = storage.k.device
        self.block_size = storage.block_size
        cfg = model.config
        self.scale = cfg.head_dim ** -0.5
        self.sampler = Sampler(cfg.vocab_size, eos_token_ids, self.device, seed)
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        for request_id in plan.finished_request_ids:
            self.generators.pop(request_id, None)
        reqs = plan.requests
        hidden = self.model(*self._inputs(reqs))
        result = StepResult(sampled={})
        self._sample(reqs, hidden, result)
        self._prompt_logprobs(reqs, hidden, result)
        result.step_time_s = time.perf_counter() - start
        return result

    def _inputs(self, reqs: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, PagedAttention]:
        dev, bs = self.device, self.block_size
        token_ids, query_start, seq_lens = [], [0], []
        for r in reqs:
            token_ids.extend(r.token_ids)
            query_start.append(query_start[-1] + r.num_new_tokens)
            seq_lens.append(r.num_computed_tokens + r.num_new_tokens)
        counts = torch.tensor([r.num_new_tokens for r in reqs])
        req_idx = torch.repeat_interleave(torch.arange(len(reqs)), counts)
        starts = torch.tensor([r.num_computed_tokens for r in reqs])
        positions = starts[req_idx] + torch.arange(len(token_ids)) - torch.tensor(query_start[:-1])[req_idx]
        width = max(len(r.block_ids) for r in reqs)
        tables = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs])
        slot_mapping = tables[req_idx, positions // bs] * bs + positions % bs
        meta = PagedAttentionMetadata(query_start, seq_lens, [r.block_ids for r in reqs], bs, dev)
        attn = PagedAttention(self.storage, meta, slot_mapping.to(dev), self.scale)
        return torch.tensor(token_ids, device=dev), positions.to(dev), attn

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        seed = r.params.seed
        if seed is None:
            return None
        gen = self.generators.get(r.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed % (2**64))
            self.generators[r.request_id] = gen
        return gen

    def _sample(self, reqs: list[ScheduledRequest], hidden: torch.Tensor, result: StepResult) -> None:
        """Rows [last token, d_1..d_k] of each finishing request -> accepted drafts + one token."""
        row_ids, rows, owners, end = [], [], [], 0
        for r in reqs:
            end += r.num_new_tokens
            if not r.sample:
                continue
            k = r.num_draft_tokens
            gen = self._generator(r)
            drafts = r.token_ids[len(r.token_ids) - k:] if k else []
            for i in range(k + 1):
                history = r.output_token_ids + drafts[:i] if i else r.output_token_ids
                rows.append(SampleRow(r.params, r.prompt_token_ids, history, gen))
                row_ids.append(end - k - 1 + i)
            owners.append((r, len(rows) - k - 1, drafts))
        if not rows:
            return
        raw = self.model.compute_logits(hidden[torch.tensor(row_ids, device=hidden.device)])
        want_logprobs = any(r.params.logprobs is not None for r, _, _ in owners)
        logits = self.sampler.process(raw.clone() if want_logprobs else raw, rows)
        target = self.sampler.sample(logits, rows).tolist()
        for r, first, drafts in owners:
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == target[first + num_accepted]:
                num_accepted += 1
            if drafts and not r.params.greedy:
                raise NotImplementedError("rejection sampling of drafts lands with the speculation core")
            tokens = target[first:first + num_accepted + 1]
            out = SampledTokens(tokens)
            if r.params.logprobs is not None:
                sl = slice(first, first + len(tokens))
                out.logprobs = Sampler.logprobs(raw[sl], torch.tensor(tokens, device=raw.device),
                                                [r.params.logprobs] * len(tokens))
            result.sampled[r.request_id] = out

    def _prompt_logprobs(self, reqs: list[ScheduledRequest], hidden: torch.Tensor, result: StepResult) -> None:
        """Row i of a prompt chunk starting at c scores prompt token c + i + 1."""
        end = 0
        for r in reqs:
            start, end = end, end + r.num_new_tokens
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
