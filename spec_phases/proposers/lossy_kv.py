"""VeriCache's drafter: the target model decoding on a compressed (lossy) copy of each request's KV.

The drafting pool (`kv_cache/draft_pool.py`) keeps per request a compressor `SequenceState` that
mirrors the *verified* prefix of the full paged cache. Each `propose` first has the pool sync it,
then runs the whole model greedily for `max_len` tokens. The draft tokens' own K/V never enter the
compressed state: they live in a small dense per-round scratch. So a rejected draft costs nothing to
undo (the scratch is dropped), no page is ever compressed from unverified K/V, and after a
preemption the pool rebuilds the state from the recomputed cache.

Drafting is batched across requests: one model forward per draft position for every request still
drafting, and per layer two attention calls for all of them: the compressor's `PagesBatch` over the
compressed pages, and one padded dense attention over each request's sinks + dense tail + scratch,
merged exactly by log-sum-exp (the same math as `compressor.attend(state)` merged with the scratch).

The verify pass reads and writes only the full cache, so output is identical to plain decoding.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, fields

import torch
from specserve.kv_cache.compress.base import (
    Compressor,
    CompressorConfig,
    SequenceState,
    batched_attention,
    dense_attention,
    merge_attention,
)
from specserve.kv_cache.compress.registry import COMPRESSORS
from specserve.kv_cache.draft_pool import DraftPool
from specserve.spec_phases.proposers.base import DraftRequest, Drafts, Proposer

logger = logging.getLogger(__name__)

_LAYOUT = {f.name for f in fields(CompressorConfig)} - {"num_layers", "num_kv_heads", "head_dim"}


def build_compressor(name: str, model, settings: dict) -> Compressor:
    """`kv_compressor` + `kv_compressor_config` -> a compressor sized for `model`. Layout keys
    (num_sink, window, page_size) go to CompressorConfig, the rest to the compressor; unknown keys raise."""
    cfg_m = model.config
    settings = dict(settings)
    layout = {k: settings.pop(k) for k in list(settings) if k in _LAYOUT}
    cfg = CompressorConfig(num_layers=cfg_m.num_layers, num_kv_heads=cfg_m.num_kv_heads,
                           head_dim=cfg_m.head_dim, **layout)
    if name == "window":
        from specserve.kv_cache.compress.window import WindowCompressor
        return WindowCompressor(cfg, **settings)
    if name == "quant":
        from specserve.kv_cache.compress.quant import QuantCompressor
        return QuantCompressor(cfg, **settings)
    if name == "mustafar":
        from specserve.kv_cache.compress.mustafar import MustafarCompressor
        if "sparsity" in settings:                   # the shorthand: one sparsity for K and V
            s = settings.pop("sparsity")
            settings.setdefault("key_sparsity", s)
            settings.setdefault("value_sparsity", s)
        return MustafarCompressor(cfg, **settings)
    if name == "spherical":
        from specserve.kv_cache.compress.spherical import SphericalCompressor
        num_tokens = int(settings.pop("calib_tokens", 512))
        books = spherical_codebooks(model, num_tokens)
        return SphericalCompressor(cfg, books, **settings)
    raise ValueError(f"kv_compressor must be one of {COMPRESSORS}, got {name!r}")


# ---- spherical calibration on the model's own keys ----------------------------------------------
class _DenseCache:
    """Plain causal attention over everything seen so far; keeps every layer's post-RoPE keys."""

    def __init__(self, num_layers: int):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer].append(k)
        self.v[layer].append(v)
        keys, values = torch.cat(self.k[layer]), torch.cat(self.v[layer])
        n = keys.shape[0]
        pos = torch.arange(n, device=q.device)
        out, _ = dense_attention(q, keys, values, q.shape[-1] ** -0.5, pos[n - q.shape[0]:], pos)
        return out.to(q.dtype)


@torch.inference_mode()
def own_keys(model, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Post-RoPE keys [L, H, num_tokens, D] of the model's own text: sampled at temperature 1 from BOS
    (a fixed seed; sampled rather than greedy so the text does not collapse into a loop)."""
    cfg, dev = model.config, model.embed_tokens.weight.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache, token = _DenseCache(cfg.num_layers), cfg.bos_token_id if cfg.bos_token_id is not None else 1
    for pos in range(num_tokens):
        hidden = model(torch.tensor([token], device=dev), torch.tensor([pos], device=dev), cache)
        probs = torch.softmax(model.compute_logits(hidden)[0].cpu(), dim=-1)
        token = int(torch.multinomial(probs, 1, generator=gen))
    return torch.stack([torch.cat(ks).float().cpu().transpose(0, 1) for ks in cache.k])


def spherical_codebooks(model, num_tokens: int = 512, iters: int = 20) -> dict[int, torch.Tensor]:
    """Codebooks for every tier that fits the head size, calibrated once and cached on disk, keyed by
    the model's config and a fingerprint of its weights."""
    from specserve.kv_cache.compress.spherical import TIERS
    from specserve.kv_cache.compress.spherical_calib import CALIB_VERSION, calibrate
    from specserve.spec_phases.paths import cache_dir
    cfg = model.config
    probe = torch.cat([p.detach().float().flatten()[:4096].cpu() for p in model.parameters()])
    key = hashlib.sha256(f"{cfg}:{num_tokens}:{iters}:{CALIB_VERSION}".encode()
                         + probe.numpy().tobytes()).hexdigest()[:16]
    path = cache_dir() / "spherical" / f"lossy_kv-{key}.pt"
    dev = model.embed_tokens.weight.device
    if path.exists():                   # on the model's device, wherever the cache was written
        return {t: b.to(dev) for t, b in torch.load(path, map_location=dev).items()}
    tiers = {t: s for t, s in TIERS.items() if cfg.head_dim % s.group == 0}
    start = time.perf_counter()
    books = calibrate(own_keys(model, num_tokens), iters=iters, tiers=tiers)
    books = {t: b.to(dev) for t, b in books.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(books)}")
    torch.save(books, tmp)
    tmp.replace(path)
    logger.info("spherical codebooks calibrated on %d own tokens in %.1fs -> %s", num_tokens,
                time.perf_counter() - start, path)
    return books


# ---- the drafter --------------------------------------------------------------------------------
class DraftAttention:
    """The attention of one draft round, batched over its requests. Row i of every forward is request
    i's newest token; requests are ordered by draft length, longest first, so the rows still drafting
    at step t are always the first ones (views, no gathers).

    Per layer, built on first use and kept for the round: the compressor's `PagesBatch` over the
    requests' compressed pages, and a dense fp32 buffer [B, kv_heads, max_dense + max_len, D] holding
    each request's sinks + dense tail (padded to the longest) followed by the round's scratch: the
    k/v of the drafts themselves, written at column max_dense + step. Attention = pages (+) dense,
    merged by lse; the scratch is dropped with the object."""

    def __init__(self, comp: Compressor, states: list[SequenceState], max_len: int):
        self.comp, self.states, self.max_len = comp, states, max_len
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
            k[i, :, n:lens[i]], v[i, :, n:lens[i]] = ls.tail_k.transpose(0, 1), ls.tail_v.transpose(0, 1)
        cols = torch.arange(width + self.max_len, device=k.device)
        valid = (cols[None, :] < torch.tensor(lens, device=k.device)[:, None]) | (cols[None, :] >= width)
        return k, v, valid, width, self.comp.draft_pages(layer, lss)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.layers[layer] is None:
            self.layers[layer] = self._build(layer, k)
        dk, dv, valid, width, pages = self.layers[layer]
        rows, col = q.shape[0], width + self.step
        dk[:rows, :, col], dv[:rows, :, col] = k, v
        dense = batched_attention(q, dk[:rows, :, :col + 1], dv[:rows, :, :col + 1], self.comp.sm_scale,
                                  valid[:rows, :col + 1])
        if pages is None:
            return dense[0].to(q.dtype)
        return merge_attention([pages.attend(q, rows), dense])[0].to(q.dtype)


class LossyKVProposer(Proposer):
    """Drafts greedily with the target model over the drafting pool's compressed states."""
    name = "lossy_kv"

    def __init__(self, model, pool: DraftPool):
        self.model, self.pool = model, pool
        self.num_rounds = self.num_draft_steps = 0         # counters (monotonic)
        self.draft_s = 0.0

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> Drafts:
        states = [self.pool.sync(r.request_id, r.num_computed_tokens, r.block_ids)
                  for r in requests]
        t1 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in requests]
        passes = []
        order = sorted((i for i, n in enumerate(max_lens) if n > 0), key=lambda i: -max_lens[i])
        if order:
            num_steps = max_lens[order[0]]
            attn = self._attention([states[i] for i in order], num_steps)
            dev = self.device
            current = torch.tensor([requests[i].token_ids[-1] for i in order], device=dev)
            start = torch.tensor([requests[i].num_computed_tokens for i in order], device=dev)
            for step in range(num_steps):
                t = time.perf_counter()
                rows = sum(1 for i in order if max_lens[i] > step)    # a prefix: sorted by length
                attn.step = step
                hidden = self.model(current[:rows], start[:rows] + step, attn)
                current = self.model.compute_logits(hidden).argmax(-1)
                for i, tok in zip(order, current.tolist()):         # .tolist() syncs: t is honest
                    drafts[i].append(tok)
                self.num_draft_steps += 1
                passes.append((rows, time.perf_counter() - t))
        self.num_rounds += 1
        self.draft_s += time.perf_counter() - t1
        return Drafts(drafts, passes)

    def _attention(self, states: list[SequenceState], max_len: int) -> DraftAttention:
        return DraftAttention(self.pool.comp, states, max_len)

    def stats(self) -> dict[str, float]:
        pool = self.pool
        return {"compressor": pool.comp.name, "num_rounds": self.num_rounds,
                "num_draft_steps": self.num_draft_steps,
                "num_encoded_tokens": pool.num_encoded_tokens, "num_rebuilds": pool.num_rebuilds,
                "encode_s": pool.encode_s, "draft_s": self.draft_s,
                **asdict(pool.usage())}
