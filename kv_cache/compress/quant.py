"""Integer quantization baseline (KIVI-style): keys per channel, values per token.

Within one page of P tokens and one kv head:
- keys   [P, D]: one (scale, zero) pair per channel, shared by the page's P tokens (keys have
  per-channel outliers, so channels get their own range); their codes stored channel by channel,
  packed along the page's tokens (the C drafter scores a page's tokens in vector lanes);
- values [P, D]: one (scale, zero) pair per token.
Asymmetric min/max quantization, codes in [0, 2^bits - 1], scale and zero stored as fp16, codes
bit-packed (bits in {2, 4, 8}). Attention dequantizes the pages and runs dense attention. For a
draft round the pages of all sequences are stacked (still packed, padded to the longest) once; each
draft step attends one layer for all sequences in one batched call straight from the codes (the
scales and zeros fold into the query and the probabilities: only the codes are widened, never
dequantized).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import get_op
from specserve.kv_cache.compress.base import Compressor, CompressorConfig, LayerState, PagesBatch

SUPPORTED_BITS = (2, 4, 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [..., n] with values < 2^bits -> uint8 [..., n * bits // 8] (little end
    first)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    per_byte = 8 // bits
    n = codes.shape[-1]
    if n % per_byte:
        raise ValueError(f"last dim {n} must be a multiple of {per_byte}")
    grouped = codes.reshape(*codes.shape[:-1], n // per_byte, per_byte)
    packed = grouped[..., 0].clone()
    for i in range(1, per_byte):                           # disjoint bits: an or is the sum
        packed |= grouped[..., i] << (i * bits)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., m] -> uint8 [..., m * 8 // bits] (scalar shifts on
    uint8)."""
    if bits == 8:
        return packed.clone()
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """Asymmetric quantization reducing over `dim` -> (codes uint8 like x, scale fp16, zero fp16).

    scale and zero keep `dim` with size 1. x ≈ codes * scale + zero, |error| <= scale / 2 plus fp16
    rounding of the range ends.
    """
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    qmax = (1 << bits) - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-8).half()
    zero = lo.half()
    codes = torch.floor((xf - zero.float()) / scale.float() + 0.5).clamp(0, qmax).to(torch.uint8)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + zero.float()


FIELDS = ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero")


@dataclass
class QuantPage:
    k_packed: torch.Tensor      # [H, D, P * kbits / 8] uint8 (channel-major)
    k_scale: torch.Tensor       # [1, H, D] fp16 (per channel)
    k_zero: torch.Tensor
    v_packed: torch.Tensor      # [P, H, D * vbits / 8] uint8
    v_scale: torch.Tensor       # [P, H, 1] fp16 (per token)
    v_zero: torch.Tensor


class QuantArena:
    """One layer's pages of one sequence in six contiguous page-major tensors, [capacity, *the
    field's page shape] each, the capacity doubled as pages arrive: every `QuantPage`'s fields are
    views of them, so a page is held once and the C drafter (`draft_attention.c`) reads a
    layer from six pointers. Quant pages are only ever appended (a rebuilt state starts anew)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, pages: list[QuantPage]) -> None:
        """Moves pages[count:] in, and points those pages' fields at their rows."""
        if len(pages) <= self.count:
            return
        cap = next(iter(self.tensors.values())).shape[0] if self.tensors else 0
        if len(pages) > cap:
            cap = max(len(pages), 2 * cap, 4)
            old, proto = self.tensors, pages[0]
            self.tensors = {name: getattr(proto, name).new_empty((cap, *getattr(proto, name).shape))
                            for name in FIELDS}
            for name, t in old.items():
                self.tensors[name][:self.count] = t[:self.count]
            self._point(pages, 0, self.count)           # the pages moved with their tensors
        new = pages[self.count:]
        for name in FIELDS:
            self.tensors[name][self.count:len(pages)] = torch.stack([getattr(p, name)
                                                                      for p in new])
        self._point(pages, self.count, len(pages))
        self.count = len(pages)

    def _point(self, pages: list[QuantPage], first: int, end: int) -> None:
        """pages[first:end] as views of their rows."""
        rows = [self.tensors[name][first:end].unbind(0) for name in FIELDS]
        pages[first:end] = [QuantPage(*fields) for fields in zip(*rows)]


class QuantCompressor(Compressor):
    name = "quant"

    def __init__(self, config: CompressorConfig, key_bits: int = 4, value_bits: int = 4):
        super().__init__(config)
        if key_bits not in SUPPORTED_BITS or value_bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be in {SUPPORTED_BITS}")
        self.key_bits, self.value_bits = key_bits, value_bits
        self.name = f"int{key_bits}k-int{value_bits}v"

    def _compress_page(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> QuantPage:
        return self._compress_pages(layer, k[None], v[None])[0]

    def _compress_pages(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[QuantPage]:
        """All the pages at once (each page's codes and ranges are its own tokens' alone, as
        `_compress_page` computes them): a long prompt's pages in a few tensor ops a layer."""
        kc, ks, kz = quantize(k, self.key_bits, dim=1)
        vc, vs, vz = quantize(v, self.value_bits, dim=3)
        kp = pack_bits(kc.permute(0, 2, 3, 1), self.key_bits)      # channel-major: [n, H, D, P']
        vp = pack_bits(vc, self.value_bits)
        return [QuantPage(*fields) for fields in zip(kp, ks, kz, vp, vs, vz)]

    def _after_new_pages(self, layer: int, ls: LayerState) -> None:
        if ls.pages:
            if ls.arena is None:
                ls.arena = QuantArena()
            ls.arena.add(ls.pages)

    def draft_kernel(self) -> str | None:
        """The C drafter weighs values 64 dimensions at a time: head_dim a multiple of 64."""
        return None if self.config.head_dim % 64 else "quant"

    def _decode_page(self, page: QuantPage) -> tuple[torch.Tensor, torch.Tensor]:
        k_codes = unpack_bits(page.k_packed, self.key_bits).permute(2, 0, 1)         # [P, H, D]
        k = dequantize(k_codes, page.k_scale, page.k_zero)
        v = dequantize(unpack_bits(page.v_packed, self.value_bits), page.v_scale, page.v_zero)
        return k, v

    def _attend_pages(self, layer: int, q: torch.Tensor, state: LayerState):
        decoded = [self._decode_page(p) for p in state.pages]
        k = torch.cat([d[0] for d in decoded])
        v = torch.cat([d[1] for d in decoded])
        return get_op("dense_attention", q.device.type)(q, k, v, self.sm_scale)

    def draft_pages(self, layer: int, states: list[LayerState]) -> QuantPagesBatch | None:
        if not any(ls.pages for ls in states):
            return None
        return QuantPagesBatch(self, states)

    def page_bytes(self, page: QuantPage) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (page.k_packed, page.k_scale, page.k_zero, page.v_packed, page.v_scale,
                    page.v_zero))

    def bytes_per_token(self) -> float:
        c = self.config
        h, d, p = c.num_kv_heads, c.head_dim, c.page_size
        # codes + per-page channel scale/zero
        key = h * d * self.key_bits / 8 + 2 * h * d * 2 / p
        value = h * d * self.value_bits / 8 + 2 * h * 2             # codes + per-token scale/zero
        return key + value


class QuantPagesBatch(PagesBatch):
    """One layer's pages of several sequences, stacked once per round, still packed, head-major and
    padded to the most pages: [B, H, max_pages, P or 1, ...]. Each attend dequantizes the first rows
    (one layer, all their pages) and runs one batched attention."""

    def __init__(self, comp: QuantCompressor, states: list[LayerState]):
        self.comp = comp
        num_pages = [len(ls.pages) for ls in states]
        most, p = max(num_pages), comp.config.page_size
        proto = next(ls.pages[0] for ls in states if ls.pages)
        self.stacked = {}
        for name in FIELDS:
            order = (1, 0, 2, 3) if name == "k_packed" else (2, 0, 1, 3)  # arena's -> [H, NP, ..]
            views = [ls.arena.tensors[name][:len(ls.pages)].permute(*order) if ls.pages else None
                     for ls in states]
            like = next(v for v in views if v is not None)
            buf = like.new_zeros((len(states), like.shape[0], most, *like.shape[2:]))
            for i, view in enumerate(views):
                if view is not None:
                    buf[i, :, :view.shape[1]] = view
            self.stacked[name] = buf
        counts = torch.tensor(num_pages, device=proto.k_packed.device)
        # [B, T]
        self.valid = torch.arange(most * p, device=counts.device)[None, :] < (counts * p)[:, None]

    def attend(self, q: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention straight from the codes: scales and zeros fold into the query (keys: per page
        and channel) and into the probabilities (values: per token), so only the codes are widened:
            logit = (q * s_k) . c_k + q . z_k,     out = (p * s_v) @ c_v + p @ z_v."""
        c, st = self.comp, {name: t[:num_rows] for name, t in self.stacked.items()}
        rows, heads, most = st["k_packed"].shape[:3]
        num_heads, d = q.shape[1:]
        group, t = num_heads // heads, most * c.config.page_size
        qg = q.float().reshape(rows, heads, 1, group, d)
        k_codes = unpack_bits(st["k_packed"], c.key_bits).float()                # [R, H, NP, D, P]
        k_scale, k_zero = st["k_scale"].float(), st["k_zero"].float()            # [R, H, NP, 1, D]
        logits = torch.matmul(qg * k_scale, k_codes)                             # [R, H, NP, g, P]
        logits = logits + torch.matmul(qg, k_zero.transpose(-1, -2))             # + q . z per page
        logits = logits.transpose(2, 3).reshape(rows, heads, group, t) * c.sm_scale
        logits = logits.masked_fill(~self.valid[:num_rows, None, None, :], -math.inf)
        lse = torch.logsumexp(logits, dim=-1)                                    # [R, H, g]
        probs = torch.exp(logits - lse[..., None].clamp_min(-1e30)).nan_to_num(0.0)
        v_codes = unpack_bits(st["v_packed"], c.value_bits).float().reshape(rows, heads, t, d)
        v_scale = st["v_scale"].float().reshape(rows, heads, 1, t)
        v_zero = st["v_zero"].float().reshape(rows, heads, t, 1)
        out = torch.matmul(probs * v_scale, v_codes) + torch.matmul(probs, v_zero)   # [R, H, g, D]
        return out.reshape(rows, num_heads, d), lse.reshape(rows, num_heads)
