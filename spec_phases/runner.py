"""The runner: packs requests' new tokens into one batch and runs the model over the paged cache.

One forward serves prefill chunks, decodes and verify rows alike: the runner computes positions and
the slot mapping, hands each layer a per-step attention object that writes the new K/V into the
paged cache and attends (`kernels/dispatch.py` picks the kernel), and returns hidden states. On
the CPU, where `cpu_decoder.unsupported` accepts the model (any family's layer, in float32, its
weights packed for the C kernels), steps over the device cache run `spec_phases/cpu_decoder.py`
instead of the modules (bitwise the same hidden states, without the per-op bookkeeping); the log
says which stack serves and why. On CUDA, decode and verify batches replay
CUDA graphs (`spec_phases/cuda_graphs.py`).
Verification (`spec_phases/verify.py`) turns them into tokens.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from specserve.kernels.dispatch import get_op
from specserve.kernels.metadata import LayerAttention, PagedAttentionMetadata
from specserve.kv_cache.host_pool import HostKVPool, StagedPagedAttention
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases import cpu_decoder
from specserve.spec_phases.model import LlamaModel
from specserve.spec_phases.plan import ScheduledRequest, TokenLogprob
from specserve.spec_phases.sampler import Sampler

if TYPE_CHECKING:     # (cuda_graphs imports triton: the worker imports it on CUDA only)
    from specserve.spec_phases.cuda_graphs import StepGraphs

logger = logging.getLogger(__name__)


class PagedAttention:
    """Per-step attention over the paged cache: write the new K/V at their slots, then attend
    (with each layer's sliding window and the family's score soft-cap, `LayerAttention`)."""

    def __init__(self, storage: KVStorage, meta: PagedAttentionMetadata,
                 slot_mapping: torch.Tensor, layers: LayerAttention):
        self.storage, self.meta, self.slot_mapping = storage, meta, slot_mapping
        self.layers = layers
        self.op = get_op("paged_attention", str(storage.k.device))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.storage.write(layer, self.slot_mapping, k, v)
        return self.op(q, self.storage.k[layer], self.storage.v[layer], self.meta,
                       **self.layers.options(layer))


class ModelRunner:
    def __init__(self, model: LlamaModel, storage: KVStorage | HostKVPool,
                 graphs: StepGraphs | None = None):
        """storage: the full KV cache, on the device (KVStorage) or in host memory (HostKVPool,
        VeriCache: staged to the device layer by layer for every forward). graphs: CUDA graphs
        that serve decode and verify batches (`spec_phases/cuda_graphs.py`)."""
        self.model, self.storage, self.graphs = model, storage, graphs
        self.device = model.embed_tokens.weight.device
        self.block_size = storage.block_size
        self.layers = model.config.attention()
        # the C-kernel decoder, where it serves this model and cache (checked once: after
        # packing; the cache float32, bfloat16 or fp8)
        why = (cpu_decoder.unsupported(model) if isinstance(storage, KVStorage)
               and storage.k.device.type == "cpu" and storage.k.dtype in cpu_decoder.CACHE_DTYPES
               else "not a float32, bfloat16 or fp8 paged cache in host memory")
        self.cpu_decoder = cpu_decoder.CpuDecoder(model) if why is None else None
        logger.info("decoder stack: %s", "one call of the C decoder a step (kernels/cpu/decoder.c)"
                    if why is None else f"the modules ({why})")

    @torch.inference_mode()
    def forward(self, token_lists: list[tuple[int, ...]], starts: list[int],
                block_tables: list[tuple[int, ...]],
                layers: list[int] | None = None) -> torch.Tensor:
        """Request i computes token_lists[i] at positions starts[i], starts[i] + 1, ... over the
        paged cache: hidden states [total tokens, hidden]."""
        if self.graphs is not None and self.graphs.serves(token_lists, block_tables, layers):
            return self.graphs.forward(token_lists, starts, block_tables)
        ids, positions, attn = self._inputs(token_lists, starts, block_tables)
        if self.cpu_decoder is not None and self.cpu_decoder.enabled():
            return self.cpu_decoder.forward(ids, positions, attn.storage, attn.meta,
                                            attn.slot_mapping, self.layers, layers)
        return self.model(ids, positions, attn, layers=layers)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def _inputs(self, token_lists: list[tuple[int, ...]], starts: list[int],
                block_tables: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor,
                                                              PagedAttention]:
        """Request i computes token_lists[i] at positions starts[i], starts[i] + 1, ..."""
        dev, bs = self.device, self.block_size
        token_ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
        for tokens, start, table in zip(token_lists, starts, block_tables):
            end = start + len(tokens)
            token_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + len(tokens))
            seq_lens.append(end)
        positions = torch.tensor(positions)
        slot_mapping = torch.tensor(slots)
        if isinstance(self.storage, HostKVPool):
            attn = StagedPagedAttention(self.storage, query_start, seq_lens, block_tables,
                                        slot_mapping.to(dev), self.layers, dev)
        else:
            meta = PagedAttentionMetadata(query_start, seq_lens, block_tables, bs, dev)
            attn = PagedAttention(self.storage, meta, slot_mapping.to(dev), self.layers)
        return torch.tensor(token_ids, device=dev), positions.to(dev), attn

    @torch.inference_mode()
    def forward_rows(self, rows: list[tuple[int, int, tuple[int, ...]]],
                     layers: list[int] | None) -> torch.Tensor:
        """One token per row (token id, position, block ids) through `layers`: raw logits [rows,
        vocab]. The draft phase of self-speculation; its K/V land in slots the verify rewrites."""
        tokens, positions, tables = zip(*rows)
        hidden = self.forward([(t,) for t in tokens], list(positions), list(tables), layers)
        return self.model.compute_logits(hidden)

    def prompt_logprobs(self, reqs: tuple[ScheduledRequest, ...], drafts: list[list[int]],
                        hidden: torch.Tensor, out: dict[str, list[TokenLogprob]]) -> None:
        """Row i of a prompt chunk starting at c scores prompt token c + i + 1."""
        end = 0
        for r, d in zip(reqs, drafts):
            start, end = end, end + r.num_new_tokens + len(d)
            if not r.want_prompt_logprobs:
                continue
            first = r.num_computed_tokens
            last = min(first + r.num_new_tokens, r.num_prompt_tokens - 1)
            if last <= first:
                out[r.request_id] = []
                continue
            raw = self.model.compute_logits(hidden[start:start + last - first])
            targets = torch.tensor(r.prompt_token_ids[first + 1:last + 1], device=raw.device)
            out[r.request_id] = Sampler.logprobs(
                raw, targets, [r.params.prompt_logprobs] * len(targets))
