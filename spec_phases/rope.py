"""Rotary position embeddings: the base and scaling a checkpoint declares, and the frequencies.

`RopeConfig` is what a config's `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
(older folders; transformers' `AutoConfig` folds both into `rope_parameters`) say. Types default,
linear, dynamic, yarn and llama3 are computed as transformers computes them
(`transformers/modeling_rope_utils.py`); any other type is refused by the loader.

`dynamic` (NTK) rescales the base only for sequences longer than `max_position_embeddings`; the
engine never runs past that length (it is the context length), so within it dynamic is the default
rotation, exactly as transformers computes it there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0                          # linear, dynamic, yarn, llama3
    original_max_position: int | None = None     # yarn, llama3: the pretraining context
    low_freq_factor: float = 1.0                 # llama3
    high_freq_factor: float = 4.0                # llama3
    beta_fast: float = 32.0                      # yarn
    beta_slow: float = 1.0                       # yarn
    attention_factor: float | None = None        # yarn: None -> from factor (and mscale)
    mscale: float | None = None                  # yarn
    mscale_all_dim: float | None = None          # yarn
    truncate: bool = True                        # yarn

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"RoPE type {self.type!r} is not supported; supported: "
                             f"{list(ROPE_TYPES)}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies [head_dim / 2] float64, attention factor that multiplies cos and
    sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / rope.theta ** exponents
    if rope.type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    return _yarn(rope, head_dim, inv_freq)


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    old_len = rope.original_max_position
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                            - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, head_dim: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, extrapolate the high ones, a linear ramp between;
    cos and sin scaled by the attention factor."""
    factor, base, old_len = rope.factor, rope.theta, rope.original_max_position
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = (_yarn_mscale(factor, rope.mscale)
                                / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                  # as transformers: no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = inv_freq / factor
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


def rope_from_parameters(params: dict, max_position: int) -> RopeConfig:
    """A transformers-5 `rope_parameters` dict (one layer type's) -> RopeConfig. Raises ValueError
    naming the type for an unsupported one."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"RoPE type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor="
                         f"{params['partial_rotary_factor']}) are not supported")
    optional = {"low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                "attention_factor": "attention_factor", "mscale": "mscale",
                "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"}
    fields = {ours: params[theirs] for theirs, ours in optional.items()
              if params.get(theirs) is not None}
    if kind in ("yarn", "llama3"):
        fields["original_max_position"] = int(params.get("original_max_position_embeddings")
                                              or max_position)
    if kind != "default":
        factor = params.get("factor")
        if factor is None and kind == "yarn":      # transformers: the context's growth
            factor = max_position / fields["original_max_position"]
        fields["factor"] = float(factor if factor is not None else 1.0)
    return RopeConfig(theta=float(params["rope_theta"]), type=kind, **fields)
