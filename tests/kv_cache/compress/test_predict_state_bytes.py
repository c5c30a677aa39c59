"""`predict_state_bytes(n)` (admission by compressed bytes, before any token is encoded) equals the
`state_bytes` of a state that really holds n tokens, for every compressor and token count."""
import pytest
import torch
from specserve.kv_cache.compress.base import CompressorConfig
from specserve.kv_cache.compress.mustafar import MustafarCompressor
from specserve.kv_cache.compress.quant import QuantCompressor
from specserve.kv_cache.compress.spherical import TIERS, SphericalCompressor
from specserve.kv_cache.compress.window import WindowCompressor

H, D, LAYERS = 2, 64, 2


def codebooks():
    g = torch.Generator().manual_seed(0)
    books = {}
    for tier, t in TIERS.items():
        cb = torch.randn(LAYERS, H, D // t.group, t.num_codes, t.group, generator=g)
        books[tier] = cb / cb.norm(dim=-1, keepdim=True)
    return books


def make(name, cfg):
    return {"window": lambda: WindowCompressor(cfg),
            "quant": lambda: QuantCompressor(cfg, key_bits=4, value_bits=2),
            "mustafar": lambda: MustafarCompressor(cfg, 0.7, 0.5),
            "spherical": lambda: SphericalCompressor(cfg, codebooks(), tier=2,
                                                     value_bits=4)}[name]()


@pytest.mark.parametrize("name", ["window", "quant", "mustafar", "spherical"])
@pytest.mark.parametrize("num_sink, window", [(4, 16), (0, 0), (3, 70)])
def test_prediction_matches_encoded_states(name, num_sink, window):
    cfg = CompressorConfig(num_layers=LAYERS, num_kv_heads=H, head_dim=D, num_sink=num_sink,
                           window=window,
                           page_size=64)
    comp = make(name, cfg)
    torch.manual_seed(1)
    state, n = comp.new_state(torch.float16), 0
    seen_pages = False
    for chunk in [1, 2, 5, 60, 1, 64, 17, 130, 3, 64]:      # uneven chunks, like prefill + decode
        for layer in range(LAYERS):
            comp.encode(state, layer, torch.randn(chunk, H, D), torch.randn(chunk, H, D))
        n += chunk
        assert comp.predict_state_bytes(n) == comp.state_bytes(state), n
        seen_pages |= bool(state.layers[0].pages)
    assert seen_pages
    assert comp.predict_state_bytes(0) == 0
