"""VeriCache's drafter: the target model decoding on a compressed (lossy) copy of each request's KV.

The drafting pool (`kv_cache/draft_pool.py`) keeps per request a compressor `SequenceState` that
mirrors the *verified* prefix of the full paged cache. Each `propose` first has the pool sync it,
then runs the whole model greedily for `max_len` tokens. The draft tokens' own K/V never enter the
compressed state: they live in a small dense per-round scratch. So a rejected draft costs nothing to
undo (the scratch is dropped), no page is ever compressed from unverified K/V, and after a
preemption the pool rebuilds the state from the recomputed cache.

Drafting is batched across requests: one model forward per draft position for every request still
drafting. Where no state holds compressed pages (the `window` compressor keeps none; every
compressor's state is dense until the context outgrows its window), a round's draft steps run in
one call of the C decoder (`CpuDecoder.draft`: each step's forward, LM head, argmax and the next
step's embedding in C; the head scores the drafts' vocabulary alone, `DraftVocabulary`) over a
small paged cache of the states' dense tokens (`DenseDraftCache`), each step as a plain decode
step runs; so do steps over states holding compressed pages, which the C kernel
`draft_attention.c` attends as they are stored
(`Compressor.draft_kernel`: quant's codes in their `QuantArena`, Mustafar's bitmap-sparse tiles
and Spherical-KV's codes joined a layer at a time).
Otherwise (Spherical-KV with a retention budget or quantized values, or no C decoder) the modules
run it, with per layer two attention calls for all requests:
the compressor's `PagesBatch` over the compressed pages, and one padded dense attention over each
request's sinks + dense tail + scratch, merged exactly by log-sum-exp (the same math as
`compressor.attend(state)` merged with the scratch).

The verify pass reads and writes only the full cache, so output is identical to plain decoding.
"""
from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import asdict

import torch
from specserve.kernels.cpu import decoder as fused
from specserve.kernels.cpu import linear as cpu_linear
from specserve.kernels.dispatch import get_op
from specserve.kv_cache.compress.base import Compressor, SequenceState
from specserve.kv_cache.compress.quant import FIELDS as QUANT_FIELDS
from specserve.kv_cache.compress.spherical import TIERS
from specserve.kv_cache.draft_pool import DraftPool
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases.cpu_decoder import CpuDecoder
from specserve.spec_phases.plan import DrafterTiming
from specserve.spec_phases.proposers.base import DraftRequest, Drafts, Proposer
from specserve.spec_phases.runner import ModelRunner


# ---- the drafter --------------------------------------------------------------------------------
MASS_REFRESH_ROUNDS = 8          # retention reads attention mass refreshed every this many rounds


class DraftAttention:
    """The attention of one draft round, batched over its requests. Row i of every forward is
    request i's newest token; requests are ordered by draft length, longest first, so the rows still
    drafting at step t are always the first ones (views, no gathers).

    Per layer, built on first use and kept for the round: the compressor's `PagesBatch` over the
    requests' compressed pages, and a dense fp32 buffer [B, kv_heads, max_dense + max_len, D]
    holding each request's sinks + dense tail (padded to the longest) followed by the round's
    scratch: the k/v of the drafts themselves, written at column max_dense + step. Attention = pages
    (+) dense, merged by lse; the scratch is dropped with the object."""

    def __init__(self, comp: Compressor, states: list[SequenceState], max_len: int,
                 observe_mass: bool = False):
        """observe_mass: at the round's first step, feed each page's share of the attention to the
        compressor's retention (`Compressor.observe`; Spherical-KV's rate-distortion budget)."""
        self.comp, self.states, self.max_len = comp, states, max_len
        self.observe_mass = observe_mass
        self.step = 0
        self.layers: list[tuple | None] = [None] * len(states[0].layers) if states else []

    def _build(self, layer: int, like: torch.Tensor) -> tuple:
        lss = [s.layers[layer] for s in self.states]
        lens = [ls.sink_k.shape[0] + ls.tail_k.shape[0] for ls in lss]
        width = max(lens)
        num_kv_heads, head_dim = like.shape[1:]
        shape = (len(lss), num_kv_heads, width + self.max_len, head_dim)     # head-major
        k = torch.zeros(shape, dtype=torch.float32, device=like.device)
        v = torch.zeros_like(k)
        for i, ls in enumerate(lss):
            n = ls.sink_k.shape[0]
            k[i, :, :n], v[i, :, :n] = ls.sink_k.transpose(0, 1), ls.sink_v.transpose(0, 1)
            k[i, :, n:lens[i]] = ls.tail_k.transpose(0, 1)
            v[i, :, n:lens[i]] = ls.tail_v.transpose(0, 1)
        cols = torch.arange(width + self.max_len, device=k.device)
        held = cols[None, :] < torch.tensor(lens, device=k.device)[:, None]
        valid = held | (cols[None, :] >= width)
        return k, v, valid, width, self.comp.draft_pages(layer, lss)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        if self.layers[layer] is None:
            self.layers[layer] = self._build(layer, k)
        if self.observe_mass and self.step == 0:
            for state, qi in zip(self.states, q.split(1)):
                if state.layers[layer].pages:
                    self.comp.observe(state, layer, self.comp.page_attention_mass(state, layer, qi))
        dk, dv, valid, width, pages = self.layers[layer]
        rows, col = q.shape[0], width + self.step
        dk[:rows, :, col], dv[:rows, :, col] = k, v
        dense = get_op("batched_attention", q.device.type)(
            q, dk[:rows, :, :col + 1], dv[:rows, :, :col + 1], self.comp.sm_scale,
            valid[:rows, :col + 1])
        if pages is None:
            return dense[0].to(q.dtype)
        merge = get_op("merge_attention", q.device.type)
        return merge([pages.attend(q, rows), dense])[0].to(q.dtype)


class DenseDraftCache:
    """A round's drafting cache where no state holds compressed pages (the `window` compressor,
    or contexts still inside every compressor's dense regions): each request's sinks and dense
    tail copied, in this order, into its own run of blocks of a small paged cache, the round's
    drafts' K/V written after them. The C decoder (`CpuDecoder.draft`) then runs the round's
    draft steps over it in one call, each as it runs a decode over the full cache: no Python per
    step or layer. Positions (RoPE) are the tokens' own; slots and context lengths are the
    buffer's."""
    BLOCK = 16

    def __init__(self):
        self.storage: KVStorage | None = None

    def fill(self, states: list[SequenceState], max_len: int) -> None:
        first = states[0].layers[0]
        dtype = torch.bfloat16 if first.tail_k.dtype == torch.bfloat16 else torch.float32
        self.lens = [s.layers[0].sink_k.shape[0] + s.layers[0].tail_k.shape[0] for s in states]
        per = -(-(max(self.lens) + max_len) // self.BLOCK)         # blocks of each request
        need = len(states) * per
        num_layers, (num_kv_heads, head_dim) = len(states[0].layers), first.tail_k.shape[1:]
        st = self.storage
        if (st is None or st.num_blocks < need or st.k.dtype != dtype
                or st.k.shape[0] != num_layers):
            self.storage = st = KVStorage(num_layers, max(need, 2 * (st.num_blocks if st else 0)),
                                          self.BLOCK, num_kv_heads, head_dim, dtype, "cpu")
        self.bases = [b * per * self.BLOCK for b in range(len(states))]
        self.tables = [tuple(range(b * per, (b + 1) * per)) for b in range(len(states))]
        for base, state, n in zip(self.bases, states, self.lens):   # every layer at once
            for cache, parts in ((st.k, ("sink_k", "tail_k")), (st.v, ("sink_v", "tail_v"))):
                dense = torch.cat([getattr(ls, part) for ls in state.layers for part in parts])
                cache[:, base:base + n] = dense.view(num_layers, n, num_kv_heads, head_dim)


def draft_pages(states: list[SequenceState], comp: Compressor) -> fused.DraftPages:
    """The round's pages as `draft_attention.c` reads them (`comp.draft_kernel()`'s format):
    layer l of state r at [l * len(states) + r]. quant: pointers into each layer's `QuantArena`
    (kept alive by the states, which do not change during the round); Mustafar, Spherical-KV:
    each layer's pages joined (their `joined`, kept alive by the struct)."""
    kind, struct = fused.DRAFT_KINDS[comp.draft_kernel()]
    table = (struct * (len(states[0].layers) * len(states)))()
    keep = []
    for r, state in enumerate(states):
        for layer, ls in enumerate(state.layers):
            if not ls.pages:
                continue
            if struct is fused.QuantPages:
                t = ls.arena.tensors
                row = struct(*(t[name].data_ptr() for name in QUANT_FIELDS), len(ls.pages))
            elif struct is fused.SphericalPages:
                j = comp.joined(ls)
                keep.append(j)
                tier = TIERS[comp.tier]
                row = struct(*(j[name].data_ptr() for name in ("theta", "radius", "scale",
                                                                "codebook", "values")),
                             j["theta"].shape[2], tier.group, tier.num_codes)
            else:
                j = comp.joined(ls)
                keep.append(j)
                row = struct(*(j[name].data_ptr() for name in ("kb", "ko", "kv", "vb", "vo",
                                                                "vv")), j["kb"].shape[1])
            table[layer * len(states) + r] = row
    bits = (comp.key_bits, comp.value_bits) if struct is fused.QuantPages else (0, 0)
    pages = fused.DraftPages(ctypes.cast(table, ctypes.c_void_p), len(states),
                             comp.config.page_size, *bits, kind)
    pages.table, pages.keep = table, keep                   # alive as long as the struct
    return pages


DRAFT_VOCAB_PREFIX = 8192       # a draft's vocabulary: the first ids, beside its contexts' tokens


class DraftVocabulary:
    """The tokens a draft chooses among: the vocabulary's first DRAFT_VOCAB_PREFIX ids (a BPE
    vocabulary's earliest merges, its commonest tokens) and every token of the drafting requests'
    contexts. A draft is a guess the verify pass checks, so the narrower choice costs only the
    drafts whose token lies outside it (`benchmarks/draft_vocabulary.py`: 0.3% of the tokens
    plain decoding produced on workload C's source files), while on the C decoder the LM head,
    a quarter of a draft pass on the embedded model, scores a sixth of its vocabulary (a pass
    0.7-1.2 ms shorter at 2.8K: `lossy_kv_trace.py --vocab-prefix`). Each logit it scores is
    the full head's, bit for bit (`linear.select_outputs`), and the modules' drafts take the
    argmax over the same tokens, so both paths draft the same. A packed head in a layout without
    stripes (`linear.STRIPES`) scores every token on both."""

    def __init__(self, vocab_size: int, head: cpu_linear.PackedWeight | None):
        self.head = head
        whole = head is not None and head.layout not in cpu_linear.STRIPES
        panel = cpu_linear.PANEL                    # whole panels of the packed head, at least one
        self.scored = vocab_size if whole else min(vocab_size,
                                                   max(panel, DRAFT_VOCAB_PREFIX // panel * panel))
        self.vocab_size = vocab_size
        self.seen: dict[str, tuple[int, set[int]]] = {}    # request -> (tokens read, ids >= scored)
        self.ids = torch.zeros(0, dtype=torch.int64)          # the round's, ascending
        self._extra: cpu_linear.PackedWeight | None = None    # their head rows, gathered once

    def round(self, contexts: dict[str, Sequence[int]]) -> None:
        """The round's tokens past the prefix: the drafting requests' contexts' (each request's
        read once)."""
        for rid in [rid for rid in self.seen if rid not in contexts]:
            del self.seen[rid]
        union: set[int] = set()
        for rid, tokens in contexts.items():
            done, ids = self.seen.get(rid, (0, set()))
            ids.update(t for t in tokens[done:] if t >= self.scored)
            self.seen[rid] = (len(tokens), ids)
            union |= ids
        if len(union) != len(self.ids) or union.difference(self.ids.tolist()):
            self.ids = torch.tensor(sorted(union), dtype=torch.int64)
            self._extra = None

    def head_rows(self) -> tuple[int, cpu_linear.PackedWeight | None, torch.Tensor | None]:
        """`CpuDecoder.draft`'s vocab for the round."""
        if not len(self.ids):
            return self.scored, None, None
        if self._extra is None:
            self._extra = cpu_linear.select_outputs(self.head, self.ids)
        return self.scored, self._extra, self.ids

    def allowed(self, device: torch.device) -> torch.Tensor | None:
        """bool [vocab]: the round's tokens (None: every token)."""
        if self.scored >= self.vocab_size:
            return None
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[:self.scored] = True
        mask[self.ids] = True
        return mask.to(device)


class LossyKVProposer(Proposer):
    """Drafts greedily with the target model over the drafting pool's compressed states: on the
    one-call C decoder where every state is dense (`DenseDraftCache`) or its pages have a C form
    (`draft_attention.c`), through the modules with the compressors' attention otherwise."""
    name = "lossy_kv"

    def __init__(self, model, pool: DraftPool, runner: ModelRunner | None = None):
        self.model, self.pool = model, pool
        self.runner = runner
        self.dense = DenseDraftCache()
        self.vocab: DraftVocabulary | None = None          # made on the first round
        self.num_rounds = self.num_draft_steps = 0         # counters (monotonic)
        self.num_c_rounds = 0
        self.draft_s = 0.0

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> Drafts:
        new = [r for r in requests if r.request_id not in self.pool.states]
        t0 = time.perf_counter()
        for r in new:                                 # first rounds: their whole context
            self.pool.sync(r.request_id, r.num_computed_tokens, r.block_ids)
        t1 = time.perf_counter()
        state_s = t1 - t0 if new else 0.0
        states = [self.pool.sync(r.request_id, r.num_computed_tokens, r.block_ids)
                  for r in requests]
        refresh = self.num_rounds % MASS_REFRESH_ROUNDS == 0
        contexts = {r.request_id: r.token_ids for r, n in zip(requests, max_lens) if n > 0}
        drafts, passes, on_c = self._draft(states, [r.token_ids[-1] for r in requests],
                                           [r.num_computed_tokens for r in requests], max_lens,
                                           refresh, since=t1, contexts=contexts)
        self.num_rounds += 1
        self.num_c_rounds += on_c
        self.num_draft_steps += len(passes)
        self.draft_s += time.perf_counter() - t1
        return Drafts(drafts, passes, state_s)

    @torch.inference_mode()
    def calibrate(self, contexts: list[int], steps: int) -> DrafterTiming:
        """Rounds of `steps` draft passes over one synthetic state of each context length (random
        K/V encoded by the compressor): what a pass costs there, (rows, seconds, keys) each, and
        what encoding a context costs a token (a request's first draft round encodes all of it;
        the encode alone is timed, not the read of the full cache), measured before any request
        drafts. FASER prices drafting with them (`CostModel.calibrate`), so it never explores a
        drafter whose pass over compressed pages at a long context costs more than drafting could
        win, nor starts one whose state costs more than its drafts could win back."""
        comp, gen = self.pool.comp, torch.Generator().manual_seed(0)
        c, out, encode_s = comp.config, [], 0.0
        for n in contexts:
            state = comp.new_state(self.pool.state_dtype, str(self.pool.device))
            for layer in range(c.num_layers):
                k, v = torch.randn(2, n, c.num_kv_heads, c.head_dim, generator=gen).to(
                    self.pool.device)
                start = time.perf_counter()
                comp.encode(state, layer, k, v)
                encode_s += time.perf_counter() - start
            _, passes, _ = self._draft([state], [1], [n], [steps], refresh_mass=False,
                                       since=time.perf_counter())
            out += [(rows, seconds, n + j, int(j == 0)) for j, (rows, seconds) in enumerate(passes)]
        return DrafterTiming(out, encode_s / max(sum(contexts), 1))

    def _draft(self, states: list[SequenceState], last_tokens: list[int], starts: list[int],
               max_lens: list[int], refresh_mass: bool, since: float,
               contexts: dict[str, Sequence[int]] | None = None
               ) -> tuple[list[list[int]], list[tuple[int, float]], bool]:
        """Greedy drafts over the states (request i: its newest token last_tokens[i] at position
        starts[i], at most max_lens[i] drafts), each pass's (rows, seconds), and whether the C
        decoder ran them. refresh_mass: feed the retention the round's attention mass. The first
        pass is timed from `since` (the round's set-up with it: `DraftPass.first`). contexts: the
        drafting requests' tokens, which the drafts may choose beside the vocabulary's first ids
        (`DraftVocabulary`; None: those alone)."""
        drafts: list[list[int]] = [[] for _ in states]
        passes = []
        order = sorted((i for i, n in enumerate(max_lens) if n > 0), key=lambda i: -max_lens[i])
        if not order:
            return drafts, passes, False
        num_steps = max_lens[order[0]]
        drafting = [states[i] for i in order]
        rows_at = [sum(1 for i in order if max_lens[i] > step)     # a prefix: sorted by length
                   for step in range(num_steps)]
        dev = self.device
        current = torch.tensor([last_tokens[i] for i in order], device=dev)
        start = torch.tensor([starts[i] for i in order], device=dev)
        vocab = self._vocabulary()
        vocab.round(contexts or {})
        fast, pages = self._c_decoder(drafting)
        if fast is not None:                     # every step in one call of the C decoder
            dense = self.dense
            dense.fill(drafting, num_steps)
            called = time.perf_counter()
            tokens, seconds = fast.draft(current, start, rows_at, dense.storage, dense.bases,
                                         dense.lens, dense.tables, dense.BLOCK,
                                         self.runner.layers, draft=pages,
                                         vocab=vocab.head_rows())
            for step, (rows, t) in enumerate(zip(rows_at, seconds)):
                for i, tok in zip(order, tokens[step, :rows].tolist()):
                    drafts[i].append(tok)
                passes.append((rows, t + (called - since if step == 0 else 0.0)))
            return drafts, passes, True
        attn = DraftAttention(self.pool.comp, drafting, num_steps,
                              observe_mass=refresh_mass and self.pool.comp.uses_attention_mass)
        allowed = vocab.allowed(dev)
        for step, rows in enumerate(rows_at):
            t = since if step == 0 else time.perf_counter()
            attn.step = step
            hidden = self.model(current[:rows], start[:rows] + step, attn)
            logits = self.model.compute_logits(hidden)
            if allowed is not None:
                logits = logits.masked_fill(~allowed, -torch.inf)
            current = logits.argmax(-1)
            for i, tok in zip(order, current.tolist()):         # .tolist() syncs: t is honest
                drafts[i].append(tok)
            passes.append((rows, time.perf_counter() - t))
        return drafts, passes, False

    def _vocabulary(self) -> DraftVocabulary:
        """The drafts' vocabulary, made on the first round (the model's head packed by then)."""
        if self.vocab is None:
            self.vocab = DraftVocabulary(self.model.config.vocab_size,
                                         self.model._lm_head_packed)
        return self.vocab

    def _c_decoder(self, states: list[SequenceState]
                   ) -> tuple[CpuDecoder | None, fused.DraftPages | None]:
        """The runner's one-call C decoder where it serves and either no state holds pages (a
        dropped page, the window compressor's, holds nothing) or the compressor's pages have a C
        form (`Compressor.draft_kernel`: quant, Mustafar), with the round's pages as the kernel
        reads them."""
        fast = self.runner.cpu_decoder if self.runner is not None else None
        if fast is None or not fast.enabled():
            return None, None
        if not any(p is not None for state in states for ls in state.layers for p in ls.pages):
            return fast, None
        if self.pool.comp.draft_kernel() is None:
            return None, None
        return fast, draft_pages(states, self.pool.comp)

    def stats(self) -> dict[str, float]:
        pool = self.pool
        return {"compressor": pool.comp.name, "num_rounds": self.num_rounds,
                "num_draft_steps": self.num_draft_steps,
                "num_c_rounds": self.num_c_rounds,
                "num_encoded_tokens": pool.num_encoded_tokens, "num_rebuilds": pool.num_rebuilds,
                "encode_s": pool.encode_s, "draft_s": self.draft_s,
                **asdict(pool.usage())}
