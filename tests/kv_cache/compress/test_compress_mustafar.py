"""Mustafar: pruning rule, bitmap packing round trips, sparsity-0 exactness, byte formula."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specserve.kernels.reference.mustafar_encode import (
    magnitude_prune, mustafar_decode, mustafar_encode)
from specserve.kernels.reference.attention import dense_attention
from specserve.kv_cache.compress.base import CompressorConfig
from specserve.kv_cache.compress.mustafar import MustafarCompressor


@settings(max_examples=60, deadline=None)
@given(num_tiles=st.integers(0, 6), density=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_bitmap_pack_round_trip(num_tiles, density, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tiles, 64, generator=g).half().float()
    x[torch.rand(num_tiles, 64, generator=g) >= density] = 0
    bitmaps, offsets, values = mustafar_encode(x)
    assert values.numel() == int((x != 0).sum())
    for i in range(num_tiles):                                     # MSB = element 0
        bits = [(int(bitmaps[i]) >> (63 - e)) & 1 for e in range(64)]
        assert bits == (x[i] != 0).int().tolist()
    assert torch.equal(offsets, torch.cumsum((x != 0).sum(1), 0) - (x != 0).sum(1))
    assert torch.equal(mustafar_decode(bitmaps, offsets, values), x)


def test_bitmap_worked_example():
    x = torch.zeros(2, 64)
    x[0, 1], x[0, 3], x[1, 0] = 3, 5, 7
    bitmaps, offsets, values = mustafar_encode(x)
    assert bitmaps.tolist() == [(1 << 62) | (1 << 60), -(1 << 63)]      # bit 63 is the sign bit
    assert offsets.tolist() == [0, 2] and values.tolist() == [3, 5, 7]


@settings(max_examples=30, deadline=None)
@given(sparsity=st.floats(0.0, 0.95), d=st.sampled_from([64, 128]), seed=st.integers(0, 1000))
def test_magnitude_prune_keeps_the_largest_per_token(sparsity, d, seed):
    x = torch.randn(5, 2, d, generator=torch.Generator().manual_seed(seed))
    y = magnitude_prune(x, sparsity)
    keep = d - int(sparsity * d)
    assert ((y != 0).sum(-1) == keep).all()
    kept_min = torch.where(y != 0, x.abs(), torch.inf).amin(-1)
    dropped_max = torch.where(y == 0, x.abs(), -torch.inf).amax(-1)
    assert (kept_min >= dropped_max).all()
    assert torch.equal(y[y != 0], x[y != 0])


def _kv(n, h=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, d, generator=g).half(), torch.randn(n, h, d, generator=g).half()


def test_sparsity_zero_equals_dense_attention():
    cfg = CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_sink=4, window=32,
                           page_size=64)
    comp = MustafarCompressor(cfg, 0.0, 0.0)
    k, v = _kv(300)
    state = comp.new_state()
    comp.encode(state, 0, k, v)
    assert len(state.layers[0].pages) == 4                       # 296 non-sink tokens, tail 40
    q = torch.randn(3, 6, 64)
    out, lse = comp.attend(state, 0, q)
    ref_out, ref_lse = dense_attention(q, k, v, comp.sm_scale)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_sparse_attention_equals_dense_attention_over_pruned_cache():
    cfg = CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_sink=0, window=16,
                           page_size=64)
    comp = MustafarCompressor(cfg, 0.7, 0.5)
    k, v = _kv(150)
    state = comp.new_state()
    comp.encode(state, 0, k, v)
    ls = state.layers[0]
    n = ls.tail_start
    kp, vp = magnitude_prune(k[:n], 0.7), magnitude_prune(v[:n], 0.5)
    q = torch.randn(2, 4, 64)
    out, _ = comp.attend(state, 0, q)
    ref, _ = dense_attention(q, torch.cat([kp, k[n:]]), torch.cat([vp, v[n:]]), comp.sm_scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    decoded = comp._decode_page(ls.pages[0])
    assert torch.equal(decoded[0].half(), kp[:64]) and torch.equal(decoded[1].half(), vp[:64])


def test_the_join_grows_with_the_pages_and_equals_one_made_at_once():
    """`joined` (the pages as one cache, kept in the state's arena) extended page by page as
    tokens arrive equals the join of all pages made at once; the same object while no page
    came."""
    cfg = CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_sink=4, window=16,
                           page_size=64)
    comp = MustafarCompressor(cfg, 0.7, 0.5)
    k, v = _kv(300)
    grown, whole = comp.new_state(), comp.new_state()
    for a, b in ((0, 100), (100, 101), (101, 230), (230, 300)):
        comp.encode(grown, 0, k[a:b], v[a:b])
        j = comp.joined(grown.layers[0])
        assert comp.joined(grown.layers[0]) is j
    comp.encode(whole, 0, k, v)
    assert len(grown.layers[0].pages) == len(whole.layers[0].pages) == 4
    once = comp.joined(whole.layers[0])
    assert all(torch.equal(j[name], once[name]) for name in once)


def test_pages_compressed_at_once_equal_pages_compressed_one_by_one():
    cfg = CompressorConfig(num_layers=1, num_kv_heads=3, head_dim=128, num_sink=4, window=16,
                           page_size=128)
    comp = MustafarCompressor(cfg, 0.6, 0.8)
    k, v = _kv(512, h=3, d=128)
    k, v = k.reshape(4, 128, 3, 128), v.reshape(4, 128, 3, 128)
    together = comp._compress_pages(0, k, v)
    for i, page in enumerate(together):
        alone = comp._compress_pages(0, k[i:i + 1], v[i:i + 1])[0]
        for name in ("k_bitmaps", "k_offsets", "k_values", "v_bitmaps", "v_offsets", "v_values"):
            assert torch.equal(getattr(page, name), getattr(alone, name)), (i, name)
        dk, dv = comp._decode_page(page)
        assert torch.equal(dk.half(), magnitude_prune(k[i].half(), 0.6))
        assert torch.equal(dv.half(), magnitude_prune(v[i].half(), 0.8))


@settings(max_examples=20, deadline=None)
@given(ks=st.sampled_from([0.0, 0.5, 0.7, 0.9]), vs=st.sampled_from([0.0, 0.5, 0.7]),
       h=st.integers(1, 3),
       d=st.sampled_from([64, 128]))
def test_bytes_per_token_formula(ks, vs, h, d):
    cfg = CompressorConfig(num_layers=1, num_kv_heads=h, head_dim=d, num_sink=0, window=0,
                           page_size=64)
    comp = MustafarCompressor(cfg, ks, vs)
    state = comp.new_state()
    k, v = _kv(128, h, d)
    comp.encode(state, 0, k, v)
    pages = state.layers[0].pages
    assert sum(comp.page_bytes(p) for p in pages) == pytest.approx(comp.bytes_per_token() * 128)


def test_bytes_at_paper_setting():
    """D = 128, s = 0.7: 39 kept per token; (24 + 78) bytes for K and for V per head vs 512 fp16
    bytes."""
    cfg = CompressorConfig(num_layers=1, num_kv_heads=1, head_dim=128, page_size=64)
    comp = MustafarCompressor(cfg, 0.7, 0.7)
    assert comp.bytes_per_token() == 204
    assert comp.bytes_per_token() / cfg.dense_bytes_per_token() == pytest.approx(0.398, abs=1e-3)
