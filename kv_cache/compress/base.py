"""The compressor protocol: one interface for every lossy KV format (VeriCache's drafting cache).

A sequence's KV, per layer, is three regions in position order:

    | sinks (dense) | compressed pages (format-specific, may be dropped) | tail (dense, recent) |
    0          num_sink                                              tail_start        num_tokens

- `encode` appends new tokens to the dense tail. When the tail holds `window + page_size` tokens or
  more, its oldest `page_size` tokens are compressed into one page (whole pages only, so a page's
  content depends only on its tokens, never on when it was compressed).
- `attend` runs attention over each region separately and merges the parts exactly with their
  log-sum-exps (`merge_attention`): the dense window never goes through the lossy format.
- Nothing is rolled back: the drafting pool encodes only verified tokens, and rebuilds a state
  after a preemption (`kv_cache/draft_pool.py`).
- `observe` keeps an EMA of each page's share of the attention (`page_attention_mass`), fed by the
  drafter every few rounds for compressors whose retention reads it (`uses_attention_mass`).

Subclasses implement four hooks: `_compress_page`, `_attend_pages`, `_decode_page`, `page_bytes`.

Batched drafting (VeriCache's draft loop) reads the pages of many sequences at once: `draft_pages`
returns a per-round, query-independent `PagesBatch` over one layer of several states, and its
`attend(q, num_rows)` answers for the first `num_rows` states in one call. The default decodes the
pages once per round on CPU (batched dense attention), elsewhere prepares each state once per round
(`_prepare_pages`, e.g. concatenating its pages) and loops; a compressor whose format batches
(quant) overrides `draft_pages`. Attention over the dense regions (sinks, tail, the
drafts' own k/v) is the caller's, batched with `batched_attention`, merged by lse as usual.
Shapes: keys/values `[num_tokens, num_kv_heads, head_dim]`; queries `[num_q, num_heads, head_dim]`
with `num_heads % num_kv_heads == 0` (query head h reads kv head `h // (num_heads //
num_kv_heads)`).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.kernels.dispatch import get_op

FP16_BYTES = 2


@dataclass(frozen=True)
class CompressorConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_sink: int = 4             # first tokens kept dense (attention sinks)
    window: int = 64              # newest tokens always kept dense
    page_size: int = 64           # tokens per compressed page

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size) <= 0:
            raise ValueError(f"sizes must be positive: {self}")
        if self.num_sink < 0 or self.window < 0:
            raise ValueError(f"num_sink and window must be >= 0: {self}")

    def dense_bytes_per_token(self) -> int:
        """fp16 K + V of one token, one layer, all kv heads (the 100% line of every ratio)."""
        return 2 * self.num_kv_heads * self.head_dim * FP16_BYTES


@dataclass
class LayerState:
    """One layer of one sequence. `pages[i]` covers positions [page_starts[i], +page_size)."""
    sink_k: torch.Tensor          # [n_sink, num_kv_heads, head_dim]
    sink_v: torch.Tensor
    tail_k: torch.Tensor          # [n_tail, num_kv_heads, head_dim]
    tail_v: torch.Tensor
    tail_start: int = 0
    pages: list[Any] = field(default_factory=list)
    page_starts: list[int] = field(default_factory=list)
    attn_mass: list[float] = field(default_factory=list)   # per page, EMA (retention hint)
    mass_seen: list[bool] = field(default_factory=list)    # per page: observed at least once
    arena: Any = None             # the compressor's contiguous store of its pages (quant, Mustafar)

    @property
    def num_tokens(self) -> int:
        return self.tail_start + self.tail_k.shape[0]


@dataclass
class SequenceState:
    layers: list[LayerState]

    @property
    def num_tokens(self) -> int:
        return self.layers[0].num_tokens


class PagesBatch:
    """Attention over the compressed pages of one layer of several sequences, built once per draft
    round. Default: each sequence's prepared pages attended one at a time."""

    def __init__(self, comp: Compressor, layer: int, prepared: list[Any]):
        # None: a state with no pages
        self.comp, self.layer, self.prepared = comp, layer, prepared

    def attend(self, q: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_rows, num_heads, D]: row i queries state i (the first num_rows states)."""
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:2], -math.inf, dtype=torch.float32)
        for i in range(num_rows):
            if self.prepared[i] is None:
                continue
            part = self.comp._attend_prepared(self.layer, q[i:i + 1], self.prepared[i])
            if part is not None:
                out[i], lse[i] = part[0][0], part[1][0]
        return out, lse


class DecodedPagesBatch(PagesBatch):
    """Pages decoded to dense fp32 once per round, padded head-major [B, H, T, D]: one batched
    attention per step."""

    def __init__(self, comp: Compressor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor):
        self.comp, self.k, self.v, self.valid = comp, k, v, valid

    def attend(self, q: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_op("batched_attention", q.device.type)(q, self.k[:num_rows], self.v[:num_rows],
                                           self.comp.sm_scale,
                                 self.valid[:num_rows])


class Compressor(ABC):
    """Base of every KV compressor. Holds no per-sequence data: state lives in `SequenceState`.

    Contract for callers:
    - keys are post-RoPE; positions passed to `encode` must continue the sequence (no gaps);
    - `attend` sees every token encoded so far; queries must come after all compressed tokens
      (`q_positions` masks only the dense tail, e.g. for a multi-token verify/draft block);
    - the state is owned by one sequence and is not thread-safe.
    """

    name = "base"

    def __init__(self, config: CompressorConfig):
        self.config = config
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)

    # ---- hooks -------------------------------------------------------------------------------
    @abstractmethod
    def _compress_page(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Any:
        """k, v: [page_size, num_kv_heads, D] -> one page in the compressed format."""

    @abstractmethod
    def _attend_pages(self, layer: int, q: torch.Tensor, state: LayerState
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Attention over all pages of a layer -> (out, lse), or None if nothing is kept."""

    @abstractmethod
    def _decode_page(self, page: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A page back to dense (k, v) [page_size, num_kv_heads, D], or None if dropped."""

    @abstractmethod
    def page_bytes(self, page: Any) -> int:
        """Bytes the page occupies in its packed format (bit-exact accounting, metadata
        included)."""

    def bytes_per_token(self) -> float:
        """Steady-state bytes of one compressed token, one layer, all kv heads, K + V."""
        raise NotImplementedError

    def draft_kernel(self) -> str | None:
        """The page format the C drafter attends straight from (`kernels/cpu/draft_attention.c`):
        "quant" (reading `LayerState.arena`), "mustafar" (`MustafarCompressor.joined`) or
        "spherical" (`SphericalCompressor.joined`); None: drafts over this compressor's pages run
        through the modules."""
        return None

    # ---- protocol ----------------------------------------------------------------------------
    def new_state(self, dtype: torch.dtype = torch.float16, device: str = "cpu") -> SequenceState:
        c = self.config
        empty = torch.empty(0, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        return SequenceState([LayerState(empty, empty, empty, empty) for _ in range(c.num_layers)])

    def encode(self, state: SequenceState, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor | None = None) -> None:
        """Append new tokens' post-RoPE k, v [num_new, num_kv_heads, D] to one layer."""
        ls = state.layers[layer]
        if positions is not None and positions.numel():
            expected = torch.arange(ls.num_tokens, ls.num_tokens + k.shape[0],
                                    device=positions.device)
            if not torch.equal(positions.to(expected.dtype), expected):
                raise ValueError(f"positions must continue the sequence at {ls.num_tokens}")
        k, v = k.to(ls.tail_k.dtype), v.to(ls.tail_v.dtype)
        num_sink_free = max(0, self.config.num_sink - ls.sink_k.shape[0])
        if ls.tail_k.shape[0] == 0 and ls.tail_start == ls.sink_k.shape[0] and num_sink_free:
            take = min(num_sink_free, k.shape[0])
            ls.sink_k = torch.cat([ls.sink_k, k[:take]])
            ls.sink_v = torch.cat([ls.sink_v, v[:take]])
            ls.tail_start += take
            k, v = k[take:], v[take:]
        ls.tail_k = torch.cat([ls.tail_k, k])
        ls.tail_v = torch.cat([ls.tail_v, v])
        self._compress_full_pages(layer, ls)

    def _compress_full_pages(self, layer: int, ls: LayerState) -> None:
        p = self.config.page_size
        n = max(0, (ls.tail_k.shape[0] - self.config.window) // p)
        if n:
            shape = (n, p, *ls.tail_k.shape[1:])
            pages = self._compress_pages(layer, ls.tail_k[:n * p].reshape(shape).contiguous(),
                                         ls.tail_v[:n * p].reshape(shape).contiguous())
            for page in pages:
                ls.pages.append(page)
                ls.page_starts.append(ls.tail_start)
                ls.attn_mass.append(1.0)
                ls.mass_seen.append(False)
                ls.tail_start += p
            ls.tail_k, ls.tail_v = ls.tail_k[n * p:], ls.tail_v[n * p:]
        self._after_new_pages(layer, ls)

    def _compress_pages(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[Any]:
        """k, v: [num_pages, page_size, num_kv_heads, D] -> the pages, oldest first (default: one
        `_compress_page` each; a format that batches overrides it)."""
        return [self._compress_page(layer, k[i], v[i]) for i in range(k.shape[0])]

    def _after_new_pages(self, layer: int, ls: LayerState) -> None:
        """Hook for retention policies (e.g. rate-distortion downgrades). Default: nothing."""

    def attend(self, state: SequenceState, layer: int, q: torch.Tensor,
               q_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_q, num_heads, D] over everything encoded -> (out fp32, lse fp32 [num_q,
        num_heads])."""
        ls = state.layers[layer]
        dense = get_op("dense_attention", q.device.type)
        parts = [dense(q, ls.sink_k, ls.sink_v, self.sm_scale)]
        paged = self._attend_pages(layer, q, ls) if ls.pages else None
        if paged is not None:
            parts.append(paged)
        k_pos = None
        if q_positions is not None:
            k_pos = torch.arange(ls.tail_start, ls.num_tokens, device=q_positions.device)
        parts.append(dense(q, ls.tail_k, ls.tail_v, self.sm_scale, q_positions, k_pos))
        return get_op("merge_attention", q.device.type)(parts)

    # CPU drafting decodes the round's pages once (see draft_pages) while all layers' decoded pages
    # of
    # the round fit in this many bytes; past it, pages are attended per request as on the GPU.
    draft_decode_limit_bytes = 256 * 2**20

    def draft_pages(self, layer: int, states: list[LayerState]) -> PagesBatch | None:
        """A query-independent view of the pages of `states` (one layer) for a draft round, or None
        when no state has pages. The states must not change while the view is in use.

        On CPU the reference attention ops rebuild dense K/V from the pages on every call, so the
        pages are decoded once for the round instead (transient fp32, bounded by
        `draft_decode_limit_bytes`) and attended in one batched call per step. Otherwise (a GPU,
        whose kernels read the compressed format) each state's pages are prepared once and attended
        per request."""
        if not any(ls.pages for ls in states):
            return None
        c = self.config
        num_tokens = sum(len(ls.pages) for ls in states) * c.page_size
        decoded = num_tokens * c.num_kv_heads * c.head_dim * 2 * 4 * c.num_layers
        if states[0].tail_k.device.type == "cpu" and decoded <= self.draft_decode_limit_bytes:
            return self._decoded_pages(states)
        return PagesBatch(self, layer,
                          [self._prepare_pages(layer, ls) if ls.pages else None for ls in states])

    def _decoded_pages(self, states: list[LayerState]) -> DecodedPagesBatch | None:
        dense = [[d for d in map(self._decode_page, ls.pages) if d is not None] for ls in states]
        lens = [sum(d[0].shape[0] for d in ds) for ds in dense]
        if not any(lens):
            return None                                               # every page was dropped
        c, dev = self.config, states[0].tail_k.device
        k = torch.zeros(len(states), c.num_kv_heads, max(lens), c.head_dim, dtype=torch.float32,
                        device=dev)
        v = torch.zeros_like(k)
        for i, ds in enumerate(dense):
            if ds:
                k[i, :, :lens[i]] = torch.cat([d[0] for d in ds]).transpose(0, 1)
                v[i, :, :lens[i]] = torch.cat([d[1] for d in ds]).transpose(0, 1)
        valid = torch.arange(max(lens), device=dev)[None, :] < torch.tensor(lens, device=dev)[:,
                                                                                              None]
        return DecodedPagesBatch(self, k, v, valid)

    def _prepare_pages(self, layer: int, ls: LayerState) -> Any:
        """Per-round, query-independent work on one state's pages (default: none)."""
        return ls

    def _attend_prepared(self, layer: int, q: torch.Tensor, prepared: Any
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._attend_pages(layer, q, prepared)

    def nominal_page_bytes(self) -> int:
        """Bytes of one page (one layer) at the steady-state rate `bytes_per_token`."""
        return round(self.bytes_per_token() * self.config.page_size)

    def predict_state_bytes(self, num_tokens: int) -> int:
        """`state_bytes` of a sequence of num_tokens tokens, known before encoding them (for
        admission by compressed bytes): the region split depends only on the count. Exact when every
        page has its nominal size (window, quant; mustafar when kept entries are non-zero; spherical
        before RDR downgrades)."""
        c = self.config
        sinks = min(num_tokens, c.num_sink)
        pages = max(0, (num_tokens - sinks - c.window) // c.page_size)
        dense = num_tokens - pages * c.page_size
        per_layer = dense * c.dense_bytes_per_token() + pages * self.nominal_page_bytes()
        return c.num_layers * per_layer

    def state_bytes(self, state: SequenceState) -> int:
        """Actual bytes held: dense sinks and tail at fp16 plus every page in its packed format."""
        c = self.config
        dense_tokens = sum(ls.sink_k.shape[0] + ls.tail_k.shape[0] for ls in state.layers)
        paged = sum(self.page_bytes(p) for ls in state.layers for p in ls.pages)
        return dense_tokens * c.dense_bytes_per_token() + paged

    uses_attention_mass = False        # retention reads `attn_mass` (the drafter feeds `observe`)

    def set_retention(self, **hints: Any) -> None:
        """Retention hints (budgets, windows). Unknown hints raise: nothing is silently ignored."""
        if hints:
            raise TypeError(f"{self.name} takes no retention hints {sorted(hints)}")

    def observe(self, state: SequenceState, layer: int, page_mass: torch.Tensor,
                decay: float = 0.9) -> None:
        """Attention-mass feedback: page_mass [num_pages] = share of attention each page received
        (e.g. from `page_attention_mass`); kept as an EMA that retention policies read (a page's
        first observation replaces the prior)."""
        ls = state.layers[layer]
        for i, m in enumerate(page_mass.tolist()[: len(ls.pages)]):
            seen = ls.mass_seen[i]
            ls.attn_mass[i] = decay * ls.attn_mass[i] + (1 - decay) * m if seen else float(m)
            ls.mass_seen[i] = True

    def page_attention_mass(self, state: SequenceState, layer: int,
                            q: torch.Tensor) -> torch.Tensor:
        """Share of the softmax mass each page gets from queries q (mean over queries and heads),
        computed on decoded pages (a retention signal, not a hot path) -> [num_pages]."""
        ls = state.layers[layer]
        _, total = self.attend(state, layer, q)                              # [num_q, num_heads]
        mass = torch.zeros(len(ls.pages))
        for i, page in enumerate(ls.pages):
            dense = self._decode_page(page)
            if dense is not None:
                attend = get_op("dense_attention", q.device.type)
                _, lse = attend(q, dense[0], dense[1], self.sm_scale)
                mass[i] = torch.exp(lse - total).mean()
        return mass
