"""VeriCache's drafter: the target model decoding on a compressed (lossy) copy of each request's KV.

Per request a compressor `SequenceState` mirrors the *verified* prefix of the full paged cache. Each
`propose` first syncs it (encode the full-cache K/V of positions [verified, num_computed_tokens) read
from `KVStorage` through the block table: prefill chunks, accepted drafts and bonus tokens all arrive
by this one path), then runs the whole model greedily for `max_len` tokens. The draft tokens' own K/V
never enter the compressed state: they live in a small dense per-round scratch. So a rejected draft
costs nothing to undo (the scratch is dropped), no page is ever compressed from unverified K/V, and
`truncate` is needed only after preemption (then the state is rebuilt from the recomputed cache).

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
from dataclasses import fields

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
from specserve.kv_cache.host_pool import HostKVPool
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases.proposers.base import DraftRequest

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


class LossyKVProposer:
    name = "lossy_kv"

    def __init__(self, model, storage: KVStorage | HostKVPool, compressor: str = "mustafar",
                 settings: dict | None = None, capacity_bytes: int | None = None):
        """capacity_bytes: the device memory the compressed caches may use (None: not budgeted, e.g.
        when the full cache is device-resident too); reported by `bytes_used` and enforced by the
        scheduler, which reserves `seq_bytes` per running request against it (docs/vericache.md)."""
        self.model, self.storage = model, storage
        self.capacity_bytes = capacity_bytes
        self.comp = build_compressor(compressor, model, settings or {})
        self.compressor_name = compressor
        self.states: dict[str, SequenceState] = {}
        self.state_dtype = torch.float16 if storage.k.dtype == torch.float32 else storage.k.dtype
        # counters (monotonic)
        self.last_passes: list[tuple[int, float]] = []      # (rows, seconds) per draft forward, last call
        self.num_rounds = self.num_draft_steps = self.num_encoded_tokens = self.num_rebuilds = 0
        self.encode_s = self.draft_s = 0.0

    # -- sync --------------------------------------------------------------------------------------
    def _sync(self, req: DraftRequest) -> SequenceState:
        """Bring the state to exactly the full cache's first num_computed_tokens tokens."""
        state = self.states.get(req.request_id)
        target = req.num_computed_tokens
        if state is not None and state.num_tokens > target:        # preempted and recomputed
            state = None
            self.num_rebuilds += 1
        if state is None:
            state = self.states[req.request_id] = self.comp.new_state(self.state_dtype, str(self.device))
        start = state.num_tokens
        if target > start:
            bs = self.block_size
            pos = torch.arange(start, target)
            blocks = torch.tensor(req.block_ids)[pos // bs]
            slots = (blocks * bs + pos % bs).to(self.storage.k.device)   # the full cache may be in host memory
            for layer in range(len(state.layers)):
                self.comp.encode(state, layer, self.storage.k[layer][slots].to(self.device),
                                 self.storage.v[layer][slots].to(self.device))
            self.num_encoded_tokens += target - start
        return state

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def block_size(self) -> int:
        return self.storage.block_size

    # -- propose -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> list[list[int]]:
        t0 = time.perf_counter()
        states = [self._sync(r) for r in requests]
        t1 = time.perf_counter()
        self.encode_s += t1 - t0
        drafts: list[list[int]] = [[] for _ in requests]
        self.last_passes = []
        order = sorted((i for i, n in enumerate(max_lens) if n > 0), key=lambda i: -max_lens[i])
        if order:
            num_steps = max_lens[order[0]]
            attn = self._attention([states[i] for i in order], num_steps)
            dev = self.device
            current = torch.tensor([requests[i].token_ids[-1] for i in order], device=dev)
            start = torch.tensor([requests[i].num_computed_tokens for i in order], device=dev)
            for step in range(num_steps):
                t = time.perf_counter()
                rows = sum(1 for i in order if max_lens[i] > step)        # a prefix: sorted by length
                attn.step = step
                hidden = self.model(current[:rows], start[:rows] + step, attn)
                current = self.model.compute_logits(hidden).argmax(-1)
                for i, tok in zip(order, current.tolist()):             # .tolist() syncs: t is honest
                    drafts[i].append(tok)
                self.num_draft_steps += 1
                self.last_passes.append((rows, time.perf_counter() - t))
        self.num_rounds += 1
        self.draft_s += time.perf_counter() - t1
        return drafts

    def _attention(self, states: list[SequenceState], max_len: int) -> DraftAttention:
        return DraftAttention(self.comp, states, max_len)

    def observe(self, input_token_ids: torch.Tensor, logits: torch.Tensor) -> None:
        pass

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def held_request_ids(self) -> set[str]:
        return set(self.states)

    # -- accounting --------------------------------------------------------------------------------
    def bytes_used(self) -> dict[str, float]:
        """Bytes per pool for the tokens the drafter holds: the compressed (draft, device) pool as
        packed, the full pool as the paged cache stores those same tokens (storage dtype, all layers).
        Per token, all layers: the measured compressed average, the steady-state rate of compressed
        pages, the dense rate of sinks and window, and the full pool's rate."""
        tokens = sum(s.num_tokens for s in self.states.values())
        compressed = sum(self.comp.state_bytes(s) for s in self.states.values())
        k = self.storage.k                                   # [layers, slots, kv_heads, head_dim]
        full_per_token = 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()
        layers = self.comp.config.num_layers
        return {"num_tokens": tokens, "compressed_bytes": compressed, "full_bytes": tokens * full_per_token,
                "compressed_bytes_per_token": compressed / tokens if tokens else 0.0,
                "compressed_page_bytes_per_token": self.comp.bytes_per_token() * layers,
                "dense_bytes_per_token": float(self.comp.config.dense_bytes_per_token() * layers),
                "full_bytes_per_token": float(full_per_token),
                "capacity_bytes": self.capacity_bytes}

    def seq_bytes(self, num_tokens: int) -> int:
        """Compressed (device) bytes of one request's drafting cache once it holds num_tokens tokens,
        all layers, known in advance (see `Compressor.predict_state_bytes`): what admission by device
        memory needs per request."""
        return self.comp.predict_state_bytes(num_tokens)

    def stats(self) -> dict[str, float]:
        return {"compressor": self.comp.name, "num_rounds": self.num_rounds,
                "num_draft_steps": self.num_draft_steps, "num_encoded_tokens": self.num_encoded_tokens,
                "num_rebuilds": self.num_rebuilds, "encode_s": self.encode_s, "draft_s": self.draft_s,
                "num_requests": len(self.states), **self.bytes_used()}
