"""The compressors' names and settings, and `build`, the one place a compressor is constructed.

The names and settings import nothing (no torch): the CLI checks `--kv-draft-compressor` /
`--kv-draft-compressor-config` with them before any model loads; `build` imports the compressor it
builds. Settings of one compressor = the layout keys (go to `CompressorConfig`) + its constructor's
keyword arguments + shorthands `build` expands (`sparsity`, `calib_tokens`).
`tests/kv_cache/compress/test_registry.py` checks the table against the constructors' signatures.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

COMPRESSORS = ("window", "quant", "spherical", "mustafar")
LAYOUT_KEYS = ("num_sink", "window", "page_size")
SETTINGS: dict[str, tuple[str, ...]] = {
    "window": (),
    "quant": ("key_bits", "value_bits"),
    "spherical": ("tier", "value_bits", "budget_bits", "calib_tokens"),
    "mustafar": ("key_sparsity", "value_sparsity", "sparsity"),
}


def known_keys(name: str) -> tuple[str, ...]:
    if name not in SETTINGS:
        raise ValueError(f"unknown KV compressor {name!r}; one of {list(COMPRESSORS)}")
    return LAYOUT_KEYS + SETTINGS[name]


def check_settings(name: str, settings: object) -> None:
    """Raise ValueError for an unknown compressor, settings that are not a mapping, or unknown
    keys."""
    allowed = known_keys(name)
    if not isinstance(settings, dict):
        raise ValueError(f"compressor settings must be a JSON object, "
                         f"got {type(settings).__name__}")
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {name} compressor settings {unknown}; known: {sorted(allowed)}")


def build(name: str, num_layers: int, num_kv_heads: int, head_dim: int, settings: dict,
          own_keys: Callable[[int], object] | None = None, fingerprint: str = "",
          cache_root: Path | None = None, device: str = "cpu"):
    """A compressor for a model of these sizes. Spherical-KV calibrates its codebooks on
    `own_keys(n)` (post-RoPE keys [L, kv_heads, n, D] of the model's own text) once per model
    `fingerprint`, cached under `cache_root` (`spherical_calib.codebooks`)."""
    from specserve.kv_cache.compress.base import CompressorConfig
    check_settings(name, settings)
    settings = dict(settings)
    layout = {k: settings.pop(k) for k in LAYOUT_KEYS if k in settings}
    cfg = CompressorConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           **layout)
    if name == "window":
        from specserve.kv_cache.compress.window import WindowCompressor
        return WindowCompressor(cfg, **settings)
    if name == "quant":
        from specserve.kv_cache.compress.quant import QuantCompressor
        return QuantCompressor(cfg, **settings)
    if name == "mustafar":
        from specserve.kv_cache.compress.mustafar import MustafarCompressor
        if "sparsity" in settings:                   # shorthand: one sparsity for K and V
            s = settings.pop("sparsity")
            settings.setdefault("key_sparsity", s)
            settings.setdefault("value_sparsity", s)
        return MustafarCompressor(cfg, **settings)
    from specserve.kv_cache.compress.spherical import SphericalCompressor
    from specserve.kv_cache.compress.spherical_calib import codebooks
    if own_keys is None or cache_root is None:
        raise ValueError("the spherical compressor calibrates on the model's own keys: "
                         "pass own_keys and cache_root")
    num_tokens = int(settings.pop("calib_tokens", 512))
    books = codebooks(own_keys, num_tokens, head_dim, fingerprint, cache_root, device)
    return SphericalCompressor(cfg, books, **settings)
