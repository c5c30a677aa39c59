"""Mustafar: per-token magnitude pruning of post-RoPE keys and values, stored as bitmap-sparse
tiles.

Each token keeps its `head_dim - int(sparsity * head_dim)` largest-magnitude channels (per kv
head, `magnitude_prune`), separately for K and V; the newest tokens (the dense window) and the
sinks are never pruned. Pages
(a multiple of 64 tokens) are packed with `mustafar_encode`: keys in column tiles (one channel × 64
tokens), values in row tiles (one token × 64 channels); layout in
kernels/reference/mustafar_attention.py.

Bytes per tile in the packed format: 8 (bitmap) + 4 (int32 offset) + 2 × non-zeros. (In memory
offsets are int64 for simplicity; the accounting uses the format's int32.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import get_op
from specserve.kv_cache.compress.base import Compressor, CompressorConfig, LayerState

TILE = 64
TILE_META_BYTES = 8 + 4


@dataclass
class MustafarPage:
    k_bitmaps: torch.Tensor     # [H, P / 64, D] int64
    k_offsets: torch.Tensor     # [H, P / 64, D] int64, into k_values
    k_values: torch.Tensor      # [nnz_k] fp16
    v_bitmaps: torch.Tensor     # [H, P, D / 64] int64
    v_offsets: torch.Tensor     # [H, P, D / 64] int64, into v_values
    v_values: torch.Tensor      # [nnz_v] fp16


class MustafarCompressor(Compressor):
    name = "mustafar"

    def __init__(self, config: CompressorConfig, key_sparsity: float = 0.7,
                 value_sparsity: float = 0.7):
        super().__init__(config)
        if config.page_size % TILE or config.head_dim % TILE:
            raise ValueError("Mustafar needs page_size and head_dim to be multiples of 64")
        if not (0 <= key_sparsity < 1 and 0 <= value_sparsity < 1):
            raise ValueError("sparsity must be in [0, 1)")
        self.key_sparsity, self.value_sparsity = key_sparsity, value_sparsity
        self.name = f"mustafar-k{key_sparsity:g}-v{value_sparsity:g}"

    def _compress_page(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> MustafarPage:
        return self._compress_pages(layer, k[None], v[None])[0]

    def _compress_pages(self, layer: int, k: torch.Tensor, v: torch.Tensor
                        ) -> list[MustafarPage]:
        """k, v [n, P, H, D]: every page's tiles encoded at once (pruning is per token and a
        tile's bitmap its own, so a page is what it would be alone), then cut into pages, each
        page's offsets rebased to its own values."""
        n, p, h, d = k.shape
        encode = get_op("mustafar_encode", str(k.device))
        prune = get_op("magnitude_prune", str(k.device))
        kp = prune(k.half(), self.key_sparsity).transpose(1, 2)                  # [n, H, P, D]
        vp = prune(v.half(), self.value_sparsity).transpose(1, 2)
        # (page, h, b, c) rows
        k_tiles = kp.reshape(n, h, p // TILE, TILE, d).transpose(3, 4).reshape(-1, TILE)
        kb, ko, kv = encode(k_tiles.contiguous())
        vb, vo, vv = encode(vp.reshape(-1, TILE).contiguous())           # (page, h, t, j) rows
        k_per, v_per = h * (p // TILE) * d, h * p * (d // TILE)         # tiles a page
        k_ends = torch.cat([ko[k_per::k_per], ko.new_tensor([kv.numel()])]).tolist()
        v_ends = torch.cat([vo[v_per::v_per], vo.new_tensor([vv.numel()])]).tolist()
        pages = []
        for i in range(n):
            ka, va = int(ko[i * k_per]), int(vo[i * v_per])
            kt, vt = slice(i * k_per, (i + 1) * k_per), slice(i * v_per, (i + 1) * v_per)
            pages.append(MustafarPage(
                kb[kt].view(h, p // TILE, d), (ko[kt] - ka).view(h, p // TILE, d),
                kv[ka:k_ends[i]], vb[vt].view(h, p, d // TILE), (vo[vt] - va).view(h, p, d // TILE),
                vv[va:v_ends[i]]))
        return pages

    def _decode_page(self, page: MustafarPage) -> tuple[torch.Tensor, torch.Tensor]:
        # [H, P, D]
        device = page.k_bitmaps.device.type
        k = get_op("mustafar_keys", device)(page.k_bitmaps, page.k_offsets, page.k_values)
        v = get_op("mustafar_values", device)(page.v_bitmaps, page.v_offsets, page.v_values)
        return k.transpose(0, 1), v.transpose(0, 1)

    def _attend_pages(self, layer: int, q: torch.Tensor, state: LayerState):
        return self._attend_prepared(layer, q, self._prepare_pages(layer, state))

    def draft_kernel(self) -> str | None:
        return "mustafar"                     # head_dim is a multiple of 64 (the constructor's)

    def _prepare_pages(self, layer: int, state: LayerState) -> dict[str, torch.Tensor]:
        return self.joined(state)

    def joined(self, state: LayerState) -> dict[str, torch.Tensor]:
        """All pages of a layer as one bitmap-sparse cache (offsets rebased; every tensor
        contiguous), for the modules and for the C drafter alike. Kept in `state.arena` with the
        number of pages it joins, and extended by the pages compressed since (pages are only
        appended): a draft round joins only its new pages. (The join holds a second copy of
        the pages' bytes, not counted in `page_bytes`.)"""
        done, parts = state.arena if state.arena is not None else (0, None)
        if done == len(state.pages):
            return parts
        names = ("kb", "ko", "kv", "vb", "vo", "vv")
        lists = {name: [] if parts is None else [parts[name]] for name in names}
        k_shift = 0 if parts is None else parts["kv"].numel()
        v_shift = 0 if parts is None else parts["vv"].numel()
        for pg in state.pages[done:]:
            lists["kb"].append(pg.k_bitmaps)
            lists["ko"].append(pg.k_offsets + k_shift)
            lists["kv"].append(pg.k_values)
            lists["vb"].append(pg.v_bitmaps)
            lists["vo"].append(pg.v_offsets + v_shift)
            lists["vv"].append(pg.v_values)
            k_shift += pg.k_values.numel()
            v_shift += pg.v_values.numel()
        parts = {name: torch.cat(ts, dim=0 if name in ("kv", "vv") else 1)
                 for name, ts in lists.items()}
        state.arena = (len(state.pages), parts)
        return parts

    def _attend_prepared(self, layer: int, q: torch.Tensor, cat: dict[str, torch.Tensor]):
        attend = get_op("mustafar_attention", str(q.device))
        return attend(q, cat["kb"], cat["ko"], cat["kv"], cat["vb"], cat["vo"], cat["vv"],
                      self.sm_scale)

    def page_bytes(self, page: MustafarPage) -> int:
        num_tiles = page.k_bitmaps.numel() + page.v_bitmaps.numel()
        return num_tiles * TILE_META_BYTES + 2 * (page.k_values.numel() + page.v_values.numel())

    def bytes_per_token(self) -> float:
        """Assumes the kept entries are non-zero (true for real activations)."""
        c = self.config
        h, d = c.num_kv_heads, c.head_dim
        kept_k = d - int(self.key_sparsity * d)
        kept_v = d - int(self.value_sparsity * d)
        # D tiles per 64 tokens
        keys = h * d * TILE_META_BYTES / TILE + h * 2 * kept_k
        # D/64 tiles per token
        values = h * (d // TILE) * TILE_META_BYTES + h * 2 * kept_v
        return keys + values
