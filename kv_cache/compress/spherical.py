"""Spherical KV: keys as 8-bit radii + spherical-VQ direction codes, logits straight from the codes.

Tiers (DESIGN §5.4; the paper defines them for head_dim 128, we keep group sizes and code bits and
let the number of groups scale with head_dim, so bits per key scale by head_dim / 128):

| tier | group g | code bits | codewords | key bits/token/head (G groups × (8 + bits)) | D=128 |
D=64 |
|---|---|---|---|---|---|---|
| 1 | 16 | 6 | 64 | G·14 | 112 | 56 |
| 2 | 16 | 4 | 16 | G·12 | 96 | 48 |
| 3 | 32 | 3 | 8  | G·11 | 44 | 22 |
| 0 | dropped: K and V gone | | | 0 | 0 | 0 |

Plus per page and group one fp32 radius scale and one tier byte per page. One tier per page (all kv
heads of the layer share it: a simplification of the paper's per-head pages, so one kernel call per
tier covers every head). Values: fp16, or int8/int4 per token (`value_bits`), dequantized before the
kernel, which reads dense values. Codebooks come from `spherical_calib.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import get_op
from specserve.kv_cache.compress.base import (
    Compressor, CompressorConfig, LayerState, SequenceState)
from specserve.kv_cache.compress.quant import dequantize, pack_bits, quantize, unpack_bits
from specserve.kv_cache.compress import rdr


@dataclass(frozen=True)
class Tier:
    group: int          # dims per group
    bits: int           # bits per direction code (codebook of 2**bits unit vectors)

    @property
    def num_codes(self) -> int:
        return 1 << self.bits


TIERS = {1: Tier(16, 6), 2: Tier(16, 4), 3: Tier(32, 3)}
DROP = 0


def key_bits_per_token(tier: int, head_dim: int) -> int:
    """Bits of one key (one kv head) at a tier, radius + code per group, metadata excluded."""
    if tier == DROP:
        return 0
    t = TIERS[tier]
    return head_dim // t.group * (8 + t.bits)


@dataclass
class SphericalPage:
    tier: int
    theta: torch.Tensor | None = None     # [H, P, G] uint8
    radius: torch.Tensor | None = None    # [H, P, G] uint8
    scale: torch.Tensor | None = None     # [H, 1, G] float32
    v: tuple | None = None                # fp16 [H, P, D], or (packed codes, scale, zero) per token
    # mean over tokens/heads of sum_j r_j / sqrt(D) (RDR weight)
    radius_mass: float = 0.0
    layer: int = 0


class SphericalCompressor(Compressor):
    name = "spherical"

    def __init__(self, config: CompressorConfig, codebooks: dict[int, torch.Tensor],
                 tier: int = 1, value_bits: int = 16, budget_bits: float | None = None):
        """codebooks: tier -> [num_layers, num_kv_heads, G, K, g] unit vectors (see
        spherical_calib).

        budget_bits: if set, rate-distortion retention keeps the compressed pages (all layers) at or
        under this many bits per token per layer (K + V, all kv heads), downgrading tiers greedily.
        """
        super().__init__(config)
        if tier not in TIERS or value_bits not in (16, 8, 4):
            raise ValueError(f"tier must be in {sorted(TIERS)} and value_bits in (16, 8, 4)")
        for t, cb in codebooks.items():
            want = (config.num_layers, config.num_kv_heads, config.head_dim // TIERS[t].group,
                    TIERS[t].num_codes, TIERS[t].group)
            if tuple(cb.shape) != want:
                raise ValueError(f"tier {t} codebook shape {tuple(cb.shape)} != {want}")
        self.codebooks = codebooks
        self.tier, self.value_bits, self.budget_bits = tier, value_bits, budget_bits
        self.name = (f"spherical-T{tier}-v{value_bits}"
                     + (f"-rdr{budget_bits:g}" if budget_bits else ""))

    # ---- format --------------------------------------------------------------------------------
    def _encode_keys(self, layer: int, k: torch.Tensor, tier: int, page: SphericalPage) -> None:
        kh = k.float().transpose(0, 1).contiguous()                          # [H, P, D]
        cb = self.codebooks[tier][layer]
        encode = get_op("spherical_encode", str(k.device))
        page.theta, page.radius, page.scale = encode(kh, cb, kh.shape[1])
        page.tier = tier
        r = page.radius.float() / 255 * page.scale                          # [H, P, G]
        page.radius_mass = float(r.sum(-1).mean()) / math.sqrt(self.config.head_dim)

    def _values(self, page: SphericalPage) -> torch.Tensor:
        """-> [H, P, D] float32."""
        return self._dense_values(page.v)

    def _compress_page(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> SphericalPage:
        return self._compress_pages(layer, k[None], v[None])[0]

    def _compress_pages(self, layer: int, k: torch.Tensor, v: torch.Tensor
                        ) -> list[SphericalPage]:
        """k, v [n, P, H, D]: every page's keys encoded in one call (a page's codes, radii and
        scale are its own tokens' alone, as `_encode_keys` computes them), then cut into pages."""
        n, p, h, d = k.shape
        kh = k.float().permute(2, 0, 1, 3).reshape(h, n * p, d).contiguous()      # [H, nP, D]
        encode = get_op("spherical_encode", str(k.device))
        theta, radius, scale = encode(kh, self.codebooks[self.tier][layer], p)
        r = radius.float() / 255 * scale.repeat_interleave(p, dim=1)              # [H, nP, G]
        mass = r.sum(-1).reshape(h, n, p).transpose(0, 1).reshape(n, -1).mean(-1) / math.sqrt(d)
        vh = v.permute(0, 2, 1, 3)                                                # [n, H, P, D]
        pages = []
        for i, m in enumerate(mass.tolist()):
            page = SphericalPage(self.tier, theta[:, i * p:(i + 1) * p],
                                 radius[:, i * p:(i + 1) * p], scale[:, i:i + 1], None, m, layer)
            if self.value_bits == 16:
                page.v = vh[i].half().contiguous()
            else:
                codes, s, z = quantize(vh[i].contiguous(), self.value_bits, dim=2)
                page.v = (pack_bits(codes, self.value_bits), s, z)
            pages.append(page)
        return pages

    def _decode_page(self, page: SphericalPage):
        if page.tier == DROP:
            return None
        k = get_op("spherical_decode", page.theta.device.type)(page.theta, page.radius, page.scale,
                                       self.codebooks[page.tier][page.layer],
                             page.theta.shape[1])
        return k.transpose(0, 1), self._values(page).transpose(0, 1)

    def _attend_pages(self, layer: int, q: torch.Tensor, state: LayerState):
        return self._attend_prepared(layer, q, self._prepare_pages(layer, state))

    def _prepare_pages(self, layer: int, state: LayerState) -> list[tuple]:
        """Per tier, the pages' codes and (still packed) values concatenated: once per draft
        round."""
        prepared = []
        for tier in TIERS:
            pages = [p for p in state.pages if p.tier == tier]
            if not pages:
                continue
            theta = torch.cat([p.theta for p in pages], dim=1)               # [H, T, G]
            radius = torch.cat([p.radius for p in pages], dim=1)
            scale = torch.cat([p.scale for p in pages], dim=1)               # [H, T / P, G]
            if self.value_bits == 16:
                v = torch.cat([p.v for p in pages], dim=1)                   # [H, T, D] fp16
            else:
                v = tuple(torch.cat([p.v[i] for p in pages], dim=1) for i in range(3))
            prepared.append((tier, theta, radius, scale, v))
        return prepared

    def draft_kernel(self) -> str | None:
        """The C drafter reads one tier's codes and float16 values: no retention budget (whose
        tiers vary and which feeds on the modules' attention mass) and value_bits 16."""
        plain = self.budget_bits is None and self.value_bits == 16
        return "spherical" if plain and self.config.head_dim % 8 == 0 else None

    def joined(self, state: LayerState) -> dict[str, torch.Tensor]:
        """The layer's pages (all of the compressor's tier: no budget) joined along their tokens,
        with the tier's codebook for the layer, kept in `state.arena` with the number of pages
        it joins and extended by the pages compressed since (the C drafter's input). (A second
        copy of the pages' bytes, not counted in `page_bytes`.)"""
        done, parts = state.arena if state.arena is not None else (0, None)
        if done == len(state.pages):
            return parts
        new = state.pages[done:]
        assert all(p.tier == self.tier for p in new), "one tier: no retention budget"
        # theta and radius group-major ([H, G, T]: a group's codes of consecutive tokens side by
        # side, read in vector lanes), scale [H, pages, G], values [H, T, D]
        fields = {"theta": [p.theta.transpose(1, 2) for p in new],
                  "radius": [p.radius.transpose(1, 2) for p in new],
                  "scale": [p.scale for p in new], "values": [p.v for p in new]}
        parts = {name: torch.cat(([parts[name]] if parts else []) + ts,
                                 dim=2 if name in ("theta", "radius") else 1).contiguous()
                 for name, ts in fields.items()} | {
            "codebook": self.codebooks[self.tier][new[0].layer].float().contiguous()
            if parts is None else parts["codebook"]}
        state.arena = (len(state.pages), parts)
        return parts

    def _attend_prepared(self, layer: int, q: torch.Tensor, prepared: list[tuple]):
        attend = get_op("spherical_attention", str(q.device))
        parts = [attend(q, theta, radius, scale, self.codebooks[tier][layer], self._dense_values(v),
                        self.sm_scale, self.config.page_size)
                 for tier, theta, radius, scale, v in prepared]
        return get_op("merge_attention", q.device.type)(parts) if parts else None

    def _dense_values(self, v) -> torch.Tensor:
        """Values as stored (fp16, or packed codes + per-token scale/zero) -> [H, T, D] float32."""
        if self.value_bits == 16:
            return v.float()
        packed, s, z = v
        return dequantize(unpack_bits(packed, self.value_bits), s, z)

    # ---- accounting ----------------------------------------------------------------------------
    def _page_bits(self, tier: int) -> int:
        c = self.config
        if tier == DROP:
            return 8                                                         # the tier byte
        groups = c.head_dim // TIERS[tier].group
        keys = (c.page_size * c.num_kv_heads * key_bits_per_token(tier, c.head_dim)
                + c.num_kv_heads * groups * 32)                             # + fp32 scale per group
        if self.value_bits == 16:
            values = c.page_size * c.num_kv_heads * c.head_dim * 16
        else:
            values = c.page_size * c.num_kv_heads * (c.head_dim * self.value_bits + 32)
        return keys + values + 8

    def page_bytes(self, page: SphericalPage) -> int:
        return self._page_bits(page.tier) // 8

    def bytes_per_token(self) -> float:
        return self._page_bits(self.tier) / 8 / self.config.page_size

    def nominal_page_bytes(self) -> int:
        return self._page_bits(self.tier) // 8

    # ---- retention -----------------------------------------------------------------------------
    @property
    def uses_attention_mass(self) -> bool:
        """With a rate-distortion budget, retention weighs pages by the attention they get."""
        return self.budget_bits is not None

    def set_retention(self, budget_bits: float | None = None,
                      state: SequenceState | None = None) -> None:
        """Set the rate-distortion budget (bits per token per layer over compressed pages) and,
        given a state, rebalance it now."""
        self.budget_bits = budget_bits
        if state is not None and budget_bits is not None:
            self.rebalance(state)

    def encode(self, state: SequenceState, layer: int, k, v, positions=None) -> None:
        """As the base; after the last layer's encode made new pages, rebalance under the budget."""
        num_pages = len(state.layers[layer].pages)
        super().encode(state, layer, k, v, positions)
        last = layer == self.config.num_layers - 1
        if self.budget_bits is not None and last and len(state.layers[layer].pages) > num_pages:
            self.rebalance(state)

    def rebalance(self, state: SequenceState) -> int:
        """Downgrade pages (1 → 2 → 3 → drop) until under budget; returns the number of changes."""
        units = [rdr.Unit(layer, i, p.tier, max(ls.attn_mass[i], 0.1) * p.radius_mass)
                 for layer, ls in enumerate(state.layers) for i, p in enumerate(ls.pages)]
        num_tokens = len(units) * self.config.page_size
        moves = rdr.plan_downgrades(units, self.budget_bits * num_tokens, self._page_bits)
        for layer, index, tier in moves:
            page = state.layers[layer].pages[index]
            if tier == DROP:
                state.layers[layer].pages[index] = SphericalPage(tier=DROP, layer=layer)
            else:
                k, _ = self._decode_page(page)
                self._encode_keys(layer, k, tier, page)
        return len(moves)
