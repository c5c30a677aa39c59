"""CUDA graphs of decode and verify steps: a whole-model forward replayed from one launch.

A small model's step on a GPU is bound by kernel launches from Python (~35 ops a layer, each a few
microseconds of dispatch), not by its weights. So a step whose requests each compute a few tokens
through every layer (decodes: 1; verify passes: 1 + drafts; a prompt's last short chunk) replays a
graph captured once per shape: `sizes` requests (1, 2, 4, then multiples of 8: `capture_sizes`)
times `query_lens` rows each (1, and 1 + num_speculative_tokens with speculation). A batch runs in
the smallest shape that holds it; the rest is padding.

What the graph reads lives in one static device buffer, refilled by one host-to-device copy per
step: per token row [token id, position, slot] (request b's rows from b * Q on), then per request
[context length, query rows, block table...]. A padding row is token 0 at position 0 writing the
cache's padding slot (`KVStorage(padding_block=True)`, a block no pool hands out); a padding
request attends to that slot alone. Attention is the Triton kernel over fixed-shape metadata
(`kernels/triton/paged_attention.paged_attention_static`), its splits planned for the longest
context the tables hold. Everything else (long prefill chunks, draft passes over a subset of
layers, batches larger than the largest shape) runs eagerly.

`StepGraphs(capture=False)` runs the same static-buffer body eagerly: that is how the CPU tests
check it (under TRITON_INTERPRET=1); only capture and replay need a GPU.
"""
from __future__ import annotations

import numpy as np
import torch

from specserve.kernels.metadata import LayerAttention, StaticBatchMetadata
from specserve.kernels.reference.paged_attention import SHORT_QUERY
from specserve.kernels.triton.paged_attention import paged_attention_static, tiles
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases.model import LlamaModel

IDS, POSITIONS, SLOTS = 0, 1, 2                 # a token row's columns
SEQ_LEN, QUERY_LEN, TABLE = 0, 1, 2             # a request row's columns


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to max_batch (included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def query_lens(num_speculative_tokens: int) -> list[int]:
    """Rows per request captured: decodes, and verify passes of the most drafts (fewer are
    padded up to it)."""
    most = min(1 + num_speculative_tokens, SHORT_QUERY)
    return [1] if most == 1 else [1, most]


def usable(model: LlamaModel, storage: KVStorage) -> bool:
    """Graphs serve this model: on CUDA, the paged cache on the device with its padding block, and
    a head size the Triton kernel tiles."""
    return (storage.k.device.type == "cuda" and storage.padding_block is not None
            and tiles(model.config.head_dim))


class GraphAttention:
    """The attention a captured forward calls: write the new K/V at the static slots, attend over
    the static tables."""

    def __init__(self, storage: KVStorage, slots: torch.Tensor, meta: StaticBatchMetadata,
                 layers: LayerAttention):
        self.storage, self.slots, self.meta, self.layers = storage, slots, meta, layers

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.storage.write(layer, self.slots, k, v)
        return paged_attention_static(q, self.storage.k[layer], self.storage.v[layer], self.meta,
                                      **self.layers.options(layer))


class StepGraphs:
    def __init__(self, model: LlamaModel, storage: KVStorage, max_batch: int,
                 max_model_len: int, num_speculative_tokens: int = 0, capture: bool = True):
        """Graphs for batches of up to max_batch requests of up to 1 + num_speculative_tokens
        rows each, whose contexts stay within max_model_len tokens (the tables' width).
        capture=False: no graphs, the static-buffer body runs eagerly (CPU tests)."""
        if storage.padding_block is None:
            raise ValueError("step graphs need the cache's padding block")
        self.model, self.storage = model, storage
        self.layers = model.config.attention()
        self.block_size = bs = storage.block_size
        self.table_width = -(-max_model_len // bs)                 # blocks per table
        self.sizes = capture_sizes(max_batch)
        self.query_lens = query_lens(num_speculative_tokens)
        most_reqs, most_rows = self.sizes[-1], self.sizes[-1] * self.query_lens[-1]
        self.tokens_at = most_rows * 3              # request rows start here in the buffer
        length = self.tokens_at + most_reqs * (TABLE + self.table_width)
        device = storage.k.device
        self.inputs = torch.zeros(length, dtype=torch.int64, device=device)
        self.host = torch.zeros(length, dtype=torch.int64, pin_memory=capture)
        self.pad_token = np.array([0, 0, storage.padding_block * bs], dtype=np.int64)
        self.pad_request = np.zeros(TABLE + self.table_width, dtype=np.int64)
        self.pad_request[[SEQ_LEN, QUERY_LEN, TABLE]] = 1, 1, storage.padding_block
        token_rows, request_rows = self._host_views(most_reqs, self.query_lens[-1])
        token_rows[:] = self.pad_token
        request_rows[:] = self.pad_request
        self.inputs.copy_(self.host)
        self.arange = torch.arange(most_rows, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    def serves(self, token_lists: list[tuple[int, ...]], block_tables: list[tuple[int, ...]],
               layers: list[int] | None) -> bool:
        """Every layer, a batch that fits a captured shape and the tables' width."""
        return (layers is None and 0 < len(token_lists) <= self.sizes[-1]
                and max(len(t) for t in token_lists) <= self.query_lens[-1]
                and all(len(b) <= self.table_width for b in block_tables))

    def forward(self, token_lists: list[tuple[int, ...]], starts: list[int],
                block_tables: list[tuple[int, ...]]) -> torch.Tensor:
        """Request i computes token_lists[i] at positions starts[i], starts[i] + 1, ...: hidden
        states [total tokens, hidden] (a copy: the graph's output buffer is reused)."""
        n, bs = len(token_lists), self.block_size
        size = next(s for s in self.sizes if s >= n)
        rows_each = next(q for q in self.query_lens if q >= max(len(t) for t in token_lists))
        token_rows, request_rows = self._host_views(size, rows_each)
        token_rows[:] = self.pad_token
        request_rows[n:] = self.pad_request
        for i, (tokens, start, table) in enumerate(zip(token_lists, starts, block_tables)):
            count = len(tokens)
            if count == 1:                              # a decode: no arrays to build
                row = token_rows[i * rows_each]
                row[IDS], row[POSITIONS] = tokens[0], start
                row[SLOTS] = table[start // bs] * bs + start % bs
            else:
                positions = np.arange(start, start + count)
                rows = token_rows[i * rows_each:i * rows_each + count]
                rows[:, IDS], rows[:, POSITIONS] = tokens, positions
                rows[:, SLOTS] = np.asarray(table)[positions // bs] * bs + positions % bs
            request = request_rows[i]
            request[SEQ_LEN], request[QUERY_LEN] = start + count, count
            request[TABLE:TABLE + len(table)] = table
        used = self.tokens_at + size * (TABLE + self.table_width)
        self.inputs[:used].copy_(self.host[:used])
        if (size, rows_each) in self.graphs:
            graph, hidden = self.graphs[size, rows_each]
            graph.replay()
        else:
            hidden = self._body(size, rows_each)
        if rows_each == 1:
            return hidden[:n].clone()
        rows = [i * rows_each + j for i, t in enumerate(token_lists) for j in range(len(t))]
        return hidden[torch.tensor(rows, device=hidden.device)]

    def _host_views(self, size: int, rows_each: int) -> tuple[np.ndarray, np.ndarray]:
        """The host buffer as [size * rows_each, 3] token rows and [size, TABLE + W] request
        rows."""
        flat = self.host.numpy()
        tokens = flat[:size * rows_each * 3].reshape(size * rows_each, 3)
        requests = flat[self.tokens_at:self.tokens_at + size * (TABLE + self.table_width)]
        return tokens, requests.reshape(size, TABLE + self.table_width)

    def _body(self, size: int, rows_each: int) -> torch.Tensor:
        """The forward a graph captures: every op reads the static buffer."""
        tokens = self.inputs[:size * rows_each * 3].view(size * rows_each, 3)
        requests = self.inputs[self.tokens_at:self.tokens_at + size * (TABLE + self.table_width)]
        requests = requests.view(size, TABLE + self.table_width)

        def column(c: int | slice) -> torch.Tensor:     # dense int32, as the kernel reads them
            return requests[:, c].to(torch.int32).contiguous()
        meta = StaticBatchMetadata(self.arange[:size], self.arange[:size] * rows_each,
                                   column(QUERY_LEN), column(SEQ_LEN), column(slice(TABLE, None)),
                                   self.block_size)
        attn = GraphAttention(self.storage, tokens[:, SLOTS], meta, self.layers)
        return self.model(tokens[:, IDS], tokens[:, POSITIONS], attn)

    def _capture(self) -> None:
        """Largest shape first, all in one memory pool; each warmed up eagerly first (Triton's
        compile, cuBLAS' workspace). The buffer holds padding throughout: capture writes the
        padding slot alone."""
        device = self.inputs.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        pool = None
        with torch.inference_mode():
            for rows_each in reversed(self.query_lens):
                for size in reversed(self.sizes):
                    with torch.cuda.stream(stream):
                        self._body(size, rows_each)
                    torch.cuda.current_stream(device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self._body(size, rows_each)
                    pool = graph.pool()
                    self.graphs[size, rows_each] = (graph, hidden)
        torch.cuda.synchronize(device)
