"""Mustafar bitmap encoder (Triton): pass 1 bitmaps + counts, torch prefix sum, pass 2 scatter."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mustafar_bitmap_kernel(tiles_ptr, bitmaps_ptr, counts_ptr):
    tile = tl.program_id(0)
    e = tl.arange(0, 64)
    x = tl.load(tiles_ptr + tile * 64 + e)
    bits = (x != 0).to(tl.int64)
    tl.store(bitmaps_ptr + tile, tl.sum(bits << (63 - e).to(tl.int64), axis=0))
    tl.store(counts_ptr + tile, tl.sum(bits, axis=0))


@triton.jit
def _scatter_kernel(tiles_ptr, offsets_ptr, values_ptr):
    tile = tl.program_id(0)
    e = tl.arange(0, 64)
    x = tl.load(tiles_ptr + tile * 64 + e)
    nz = x != 0
    bits = nz.to(tl.int32)
    rank = tl.cumsum(bits, axis=0) - bits
    start = tl.load(offsets_ptr + tile)
    tl.store(values_ptr + start + rank, x.to(tl.float16), mask=nz)


def mustafar_encode(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as kernels/reference/mustafar_encode.py."""
    assert tiles.shape[-1] == 64
    tiles = tiles.contiguous()
    num_tiles = tiles.shape[0]
    bitmaps = torch.empty(num_tiles, dtype=torch.int64, device=tiles.device)
    counts = torch.empty(num_tiles, dtype=torch.int64, device=tiles.device)
    if num_tiles == 0:
        return bitmaps, counts, torch.empty(0, dtype=torch.float16, device=tiles.device)
    _mustafar_bitmap_kernel[(num_tiles,)](tiles, bitmaps, counts)
    offsets = torch.cumsum(counts, 0) - counts
    values = torch.empty(int(counts.sum()), dtype=torch.float16, device=tiles.device)
    _scatter_kernel[(num_tiles,)](tiles, offsets, values)
    return bitmaps, offsets, values
