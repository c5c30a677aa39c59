"""The protocol's shared machinery: region split, exact log-sum-exp merge, rollback, baselines."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specserve.kv_cache.compress.base import (
    Compressor, CompressorConfig, LayerState)
from specserve.kernels.reference.attention import dense_attention, merge_attention
from specserve.kv_cache.compress.quant import (
    QuantCompressor, dequantize, pack_bits, quantize, unpack_bits)
from specserve.kv_cache.compress.window import WindowCompressor


class ExactPages(Compressor):
    """Stores pages dense: attention through the protocol must equal plain attention."""
    name = "exact"

    def _compress_page(self, layer, k, v):
        return (k.clone(), v.clone())

    def _attend_pages(self, layer, q, state: LayerState):
        k = torch.cat([p[0] for p in state.pages])
        v = torch.cat([p[1] for p in state.pages])
        return dense_attention(q, k, v, self.sm_scale)

    def _decode_page(self, page):
        return page

    def page_bytes(self, page):
        return page[0].numel() * 4


def _kv(n, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)


def _encode_in_chunks(comp, state, k, v, chunks):
    start = 0
    for size in chunks:
        end = min(start + size, k.shape[0])
        comp.encode(state, 0, k[start:end], v[start:end], torch.arange(start, end))
        start = end
    if start < k.shape[0]:
        comp.encode(state, 0, k[start:], v[start:], torch.arange(start, k.shape[0]))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 90), sink=st.integers(0, 5), window=st.integers(0, 20),
       page=st.sampled_from([4, 8, 16]), chunk=st.integers(1, 40))
def test_dense_window_merges_exactly_with_pages(n, sink, window, page, chunk):
    cfg = CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=16, num_sink=sink, window=window,
                           page_size=page)
    comp = ExactPages(cfg)
    state = comp.new_state(dtype=torch.float32)
    k, v = _kv(n)
    _encode_in_chunks(comp, state, k, v, [chunk] * (n // chunk + 1))
    ls = state.layers[0]
    assert ls.num_tokens == n
    assert ls.tail_k.shape[0] < window + page or n < sink
    q = torch.randn(3, 4, 16)
    out, lse = comp.attend(state, 0, q)
    ref_out, ref_lse = dense_attention(q, k, v, comp.sm_scale)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_of_any_split_equals_whole():
    k, v = _kv(50, h=1, d=8)
    q = torch.randn(2, 3, 8)
    whole = dense_attention(q, k, v, 0.3)
    parts = [dense_attention(q, k[a:b], v[a:b], 0.3) for a,
             b in [(0, 7), (7, 7), (7, 31), (31, 50)]]
    out, lse = merge_attention(parts)
    torch.testing.assert_close(out, whole[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, whole[1], atol=1e-6, rtol=1e-5)
    assert math.isinf(parts[1][1][0, 0].item())          # the empty part is lse = -inf


def test_query_positions_mask_only_the_tail():
    cfg = CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=16, num_sink=2, window=8,
                           page_size=8)
    comp = ExactPages(cfg)
    state = comp.new_state(dtype=torch.float32)
    k, v = _kv(40)
    comp.encode(state, 0, k, v, torch.arange(40))
    q = torch.randn(4, 2, 16)
    q_pos = torch.tensor([36, 37, 38, 39])
    out, lse = comp.attend(state, 0, q, q_pos)
    for i, p in enumerate(q_pos.tolist()):
        ref_out, ref_lse = dense_attention(q[i:i + 1], k[:p + 1], v[:p + 1], comp.sm_scale)
        torch.testing.assert_close(out[i:i + 1], ref_out, atol=1e-5, rtol=1e-5)


def test_positions_must_continue():
    comp = ExactPages(CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=16))
    state = comp.new_state()
    k, v = _kv(4)
    with pytest.raises(ValueError):
        comp.encode(state, 0, k, v, torch.arange(1, 5))


def test_window_keeps_only_sinks_and_recent():
    cfg = CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=16, num_sink=4, window=16,
                           page_size=8)
    comp = WindowCompressor(cfg)
    state = comp.new_state(dtype=torch.float32)
    k, v = _kv(100)
    comp.encode(state, 0, k, v)
    ls = state.layers[0]
    kept = torch.cat([torch.arange(4), torch.arange(ls.tail_start, 100)])
    q = torch.randn(2, 4, 16)
    out, _ = comp.attend(state, 0, q)
    ref, _ = dense_attention(q, k[kept], v[kept], comp.sm_scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert 16 <= ls.tail_k.shape[0] < 24
    assert comp.state_bytes(state) == (4 + ls.tail_k.shape[0]) * cfg.dense_bytes_per_token()


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 4), n=st.integers(1, 6),
       seed=st.integers(0, 99))
def test_pack_bits_round_trip(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, n * 8 // bits * 2), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape[-1] == codes.shape[-1] * bits // 8
    assert torch.equal(unpack_bits(packed, bits), codes)


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), dim=st.sampled_from([0, 2]), scale=st.floats(0.01, 100),
       seed=st.integers(0, 99))
def test_quantize_error_is_half_a_step(bits, dim, scale, seed):
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(seed)) * scale
    codes, s, z = quantize(x, bits, dim)
    err = (dequantize(codes, s, z) - x).abs()
    # + fp16 rounding of the range
    bound = s.float() * 0.5 + 2e-3 * x.abs().amax(dim, keepdim=True)
    assert (err <= bound).all()


@settings(max_examples=30, deadline=None)
@given(kbits=st.sampled_from([2, 4, 8]), vbits=st.sampled_from([2, 4, 8]), h=st.integers(1, 3),
       d=st.sampled_from([16, 64]), page=st.sampled_from([8, 32]))
def test_quant_bytes_per_token_formula_matches_pages(kbits, vbits, h, d, page):
    cfg = CompressorConfig(num_layers=1, num_kv_heads=h, head_dim=d, num_sink=0, window=0,
                           page_size=page)
    comp = QuantCompressor(cfg, kbits, vbits)
    state = comp.new_state()
    k, v = _kv(3 * page, h=h, d=d)
    comp.encode(state, 0, k, v)
    pages = state.layers[0].pages
    assert len(pages) == 3
    assert (sum(comp.page_bytes(p) for p in pages)
            == pytest.approx(comp.bytes_per_token() * 3 * page))


def test_quant8_attention_is_close_and_int2_is_worse():
    cfg = CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=16, num_sink=2, window=8,
                           page_size=16)
    k, v = _kv(120)
    q = torch.randn(3, 4, 16)
    ref, _ = dense_attention(q, k, v, 0.25)
    errs = []
    for bits in (8, 2):
        comp = QuantCompressor(cfg, bits, bits)
        state = comp.new_state()
        comp.encode(state, 0, k, v)
        out, _ = comp.attend(state, 0, q)
        errs.append(((out - ref).norm() / ref.norm()).item())
    assert errs[0] < 0.02 < errs[1]


@pytest.mark.parametrize("kbits,vbits", [(4, 4), (2, 8)])
def test_quant_pages_compressed_at_once_equal_pages_compressed_one_by_one(kbits, vbits):
    """A long prompt's pages are quantized in one batch (`_compress_pages`); each is what a
    token-by-token encode makes of it, and every page is a view of its layer's `QuantArena`
    (held once, read by the C drafter from six pointers)."""
    torch.manual_seed(0)
    cfg = CompressorConfig(num_layers=1, num_kv_heads=2, head_dim=32, num_sink=4, window=8,
                           page_size=8)
    comp = QuantCompressor(cfg, kbits, vbits)
    k, v = torch.randn(2, 75, 2, 32).unbind(0)
    batch, single = comp.new_state(torch.float32), comp.new_state(torch.float32)
    comp.encode(batch, 0, k, v)
    for i in range(75):
        comp.encode(single, 0, k[i:i + 1], v[i:i + 1])
    got, want = batch.layers[0], single.layers[0]
    assert len(got.pages) == len(want.pages) == (75 - 4 - 8) // 8
    assert got.page_starts == want.page_starts and got.tail_start == want.tail_start
    assert torch.equal(got.tail_k, want.tail_k)
    arena = got.arena.tensors
    for i, (a, b) in enumerate(zip(got.pages, want.pages)):
        for name in ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert getattr(a, name).data_ptr() == arena[name][i].data_ptr()
    assert comp.page_bytes(got.pages[0]) == comp.nominal_page_bytes()
