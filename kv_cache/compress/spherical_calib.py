"""Spherical-KV codebooks: spherical k-means on the model's own post-RoPE keys, cached on disk.

`calibrate(keys)` learns, for every (layer, kv head, group) and tier, K unit codewords maximising
the summed cosine to the key groups assigned to them. `codebooks` is what serving uses: the keys
of the model's own text (computed by the caller, `spec_phases/calibration.py`), calibrated once
per model fingerprint and cached in the specserve cache directory, with progress in the log.
`load_or_calibrate` does the same for the quality benchmark, on keys `collect_keys` gets from HF
transformers over local text (no data set is downloaded).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

from specserve.kv_cache.compress.spherical import TIERS

CALIB_VERSION = 2
logger = logging.getLogger(__name__)


def spherical_kmeans(x: torch.Tensor, num_codes: int, iters: int = 20,
                     seed: int = 0) -> torch.Tensor:
    """x: [B, N, g] vectors (B independent problems) -> codebooks [B, num_codes, g] of unit vectors.

    Assignment by largest cosine; a centroid is the normalised sum of its members; an empty cluster
    is re-seeded with the worst-served vector of its problem.
    """
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(x.float(), dim=-1)                       # [B, N, g]
    num_problems, n, _ = u.shape
    init = torch.stack([torch.randperm(n, generator=gen)[:num_codes] for _ in range(num_problems)])
    codes = torch.gather(u, 1, init[..., None].expand(-1, -1, u.shape[-1]))    # [B, K, g]
    for _ in range(iters):
        sim = torch.einsum("bng,bkg->bnk", u, codes)                           # [B, N, K]
        best, assign = sim.max(-1)                                             # [B, N]
        sums = torch.zeros_like(codes).scatter_add_(1, assign[..., None].expand_as(u), u)
        counts = torch.zeros(num_problems, num_codes).scatter_add_(1, assign, torch.ones_like(best))
        new = torch.nn.functional.normalize(sums, dim=-1)
        empty = counts == 0                                                    # [B, K]
        if empty.any():
            worst = u[torch.arange(num_problems), best.argmin(-1)]             # [B, g]
            new = torch.where(empty[..., None], worst[:, None, :], new)
        codes = new
    return codes


def calibrate(keys: torch.Tensor, iters: int = 20, seed: int = 0,
              tiers: dict | None = None) -> dict[int, torch.Tensor]:
    """keys: [L, H, N, D] post-RoPE keys -> {tier: [L, H, D // g, K, g]} codebooks."""
    num_layers, num_heads, n, head_dim = keys.shape
    out = {}
    for tier, spec in (tiers or TIERS).items():
        groups = head_dim // spec.group
        x = keys.reshape(num_layers, num_heads, n, groups, spec.group).permute(0, 1, 3, 2, 4)
        x = x.reshape(num_layers * num_heads * groups, n, spec.group)
        books = [spherical_kmeans(chunk, spec.num_codes, iters, seed) for chunk in x.split(64)]
        out[tier] = torch.cat(books).reshape(num_layers, num_heads, groups, spec.num_codes,
                                             spec.group)
    return out


def collect_keys(model, token_chunks: list[torch.Tensor]) -> torch.Tensor:
    """Run an HF causal LM over each chunk [n_i] of token ids -> post-RoPE keys [L, H, sum n_i,
    D]."""
    per_chunk = []
    with torch.no_grad():
        for ids in token_chunks:
            cache = model(ids[None], use_cache=True).past_key_values
            per_chunk.append(torch.stack([layer.keys[0] for layer in cache.layers]))  # [L, H, n, D]
    return torch.cat(per_chunk, dim=2)


def local_texts(limit_chars: int, exclude: tuple[str, ...] = ("transformers",)) -> str:
    """Prose shipped with installed packages (dist-info METADATA long descriptions),
    deterministic."""
    import importlib.metadata as md
    texts, total = [], 0
    for dist in sorted(md.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = (dist.metadata["Name"] or "").lower()
        if any(e in name for e in exclude):
            continue
        body = dist.read_text("METADATA") or ""
        body = body.split("\n\n", 1)[-1]                    # drop the header block
        if len(body) > 2000:
            texts.append(body)
            total += len(body)
        if total >= limit_chars:
            break
    return "\n\n".join(texts)[:limit_chars]


def cache_path(model_path: Path, settings: str, cache_root: Path) -> Path:
    """cache_root: the specserve cache (the caller passes `spec_phases.paths.cache_dir()`)."""
    stat = os.stat(model_path)
    name = f"{model_path.name}:{stat.st_size}:{settings}:{CALIB_VERSION}"
    key = hashlib.sha256(name.encode()).hexdigest()
    folder = cache_root / "spherical"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{model_path.stem}-{key[:16]}.pt"


def load_or_calibrate(model_path: Path, get_keys: Callable[[], torch.Tensor], settings: str,
                      cache_root: Path, iters: int = 20) -> dict[int, torch.Tensor]:
    """Codebooks for this model and settings from the disk cache, or calibrated now and stored."""
    path = cache_path(model_path, f"{settings}:iters={iters}", cache_root)
    return _load_or_build(path, lambda: calibrate(get_keys(), iters=iters))


def _load_or_build(path: Path, build: Callable[[], dict[int, torch.Tensor]],
                   device: str = "cpu") -> dict[int, torch.Tensor]:
    """The codebooks stored at `path`, or `build()` stored there atomically (one disk cache for
    serving and the benchmark)."""
    if path.exists():
        return {t: b.to(device) for t, b in torch.load(path, map_location=device).items()}
    books = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(books, tmp)
    tmp.replace(path)
    return {t: b.to(device) for t, b in books.items()}


def codebooks(own_keys: Callable[[int], torch.Tensor], num_tokens: int, head_dim: int,
              fingerprint: str, root: Path, device: str = "cpu",
              iters: int = 20) -> dict[int, torch.Tensor]:
    """Codebooks for every tier that fits the head size, from the disk cache under `root` (the
    specserve cache directory) or calibrated now on `own_keys(num_tokens)` and stored."""
    from specserve.kv_cache.compress.spherical import TIERS
    key = hashlib.sha256(f"{fingerprint}:{num_tokens}:{iters}:{CALIB_VERSION}".encode())
    path = root / "spherical" / f"lossy_kv-{key.hexdigest()[:16]}.pt"

    def build() -> dict[int, torch.Tensor]:
        logger.info("spherical codebooks: calibrating on %d tokens of the model's own text (once; "
                    "cached in %s)", num_tokens, path.parent)
        start = time.perf_counter()
        tiers = {t: s for t, s in TIERS.items() if head_dim % s.group == 0}
        books = calibrate(own_keys(num_tokens), iters=iters, tiers=tiers)
        logger.info("spherical codebooks calibrated in %.1fs -> %s", time.perf_counter() - start,
                    path)
        return books
    return _load_or_build(path, build, device)
