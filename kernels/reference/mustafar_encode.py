"""Mustafar bitmap format (reference): 64-element tiles -> 64-bit bitmap + packed non-zeros.

    tile i (64 values)  ->  bitmaps[i]  int64, bit 63 - e set iff element e is non-zero (MSB first)
                            offsets[i]  int64, index in `values` of the tile's first non-zero
                                        (exclusive prefix sum of the tiles' non-zero counts)
                            values[offsets[i] : offsets[i] + popcount]  fp16, in element order
Worked example (4-element tiles for brevity): tiles [[0, 3, 0, 5], [7, 0, 0, 0]]
    -> bitmaps [0b0101, 0b1000], offsets [0, 2], values [3, 5, 7].
"""
from __future__ import annotations

import torch

TILE = 64


def _bit_weights(device) -> torch.Tensor:
    shifts = TILE - 1 - torch.arange(TILE, device=device)
    return torch.ones(TILE, dtype=torch.int64, device=device) << shifts


def mustafar_encode(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tiles: [num_tiles, 64] -> (bitmaps [num_tiles] int64, offsets [num_tiles] int64, values [nnz]
    fp16)."""
    assert tiles.shape[-1] == TILE
    nonzero = tiles != 0                                                      # [N, 64]
    bitmaps = (nonzero.to(torch.int64) * _bit_weights(tiles.device)).sum(-1)
    counts = nonzero.sum(-1)
    offsets = torch.cumsum(counts, 0) - counts
    return bitmaps, offsets.to(torch.int64), tiles[nonzero].half()


def magnitude_prune(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Zero all but the top `D - int(sparsity * D)` entries by |x| along the last dim (ties:
    the lowest index: a stable sort of the magnitudes)."""
    d = x.shape[-1]
    keep = d - int(sparsity * d)
    if keep >= d:
        return x.clone()
    top = x.abs().float().sort(dim=-1, descending=True, stable=True).indices[..., :keep]
    return torch.zeros_like(x).scatter(-1, top, x.gather(-1, top))


def mustafar_decode(bitmaps: torch.Tensor, offsets: torch.Tensor,
                    values: torch.Tensor) -> torch.Tensor:
    """Inverse: (bitmaps [...], offsets [...], values) -> tiles [..., 64] float32."""
    shifts = TILE - 1 - torch.arange(TILE, device=bitmaps.device)
    bits = (bitmaps[..., None] >> shifts) & 1                                 # [..., 64]
    rank = torch.cumsum(bits, -1) - bits                                      # non-zeros before e
    index = (offsets[..., None] + rank).clamp_max(max(values.numel() - 1, 0))
    gathered = values.float()[index] if values.numel() else torch.zeros(bits.shape)
    return torch.where(bits.bool(), gathered, torch.zeros((), dtype=torch.float32))
