"""The compressors' names and settings, without importing them (no torch): the CLI checks
`--kv-draft-compressor` / `--kv-draft-compressor-config` with this before any model loads.

Settings of one compressor = the layout keys (go to `CompressorConfig`) + its constructor's keyword
arguments + shorthands that `lossy_kv.build_compressor` expands (`sparsity`, `calib_tokens`).
`tests/kv_cache/compress/test_registry.py` checks the table against the constructors' signatures.
"""
from __future__ import annotations

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
    """Raise ValueError for an unknown compressor, settings that are not a mapping, or unknown keys."""
    allowed = known_keys(name)
    if not isinstance(settings, dict):
        raise ValueError(f"compressor settings must be a JSON object, got {type(settings).__name__}")
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {name} compressor settings {unknown}; known: {sorted(allowed)}")
