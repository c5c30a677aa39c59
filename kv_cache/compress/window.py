"""StreamingLLM-style baseline: keep the sink tokens and a recent window dense, drop the rest.

Every page that leaves the window is simply forgotten (0 bytes), so attention reads only the
`num_sink + window..window + page_size` dense tokens. Rolling back into dropped tokens raises.
"""
from __future__ import annotations

import torch

from specserve.kv_cache.compress.base import Compressor, LayerState


class WindowCompressor(Compressor):
    name = "window"

    def _compress_page(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        return None                                   # dropped

    def _attend_pages(self, layer: int, q: torch.Tensor, state: LayerState) -> None:
        return None

    def _decode_page(self, page: None) -> None:
        return None

    def draft_pages(self, layer: int, states: list[LayerState]) -> None:
        return None                                   # nothing kept to attend

    def page_bytes(self, page: None) -> int:
        return 0

    def bytes_per_token(self) -> float:
        return 0.0
