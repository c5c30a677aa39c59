"""Spherical KV: code round trips, logits from codes, tiers' byte formula, RDR budget,
calibration."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specserve.kernels.reference.spherical_attention import spherical_attention
from specserve.kernels.reference.spherical_encode import spherical_decode, spherical_encode
from specserve.kv_cache.compress import rdr
from specserve.kernels.reference.attention import dense_attention
from specserve.kv_cache.compress.base import CompressorConfig
from specserve.kv_cache.compress.spherical import (
    DROP, TIERS, SphericalCompressor, SphericalPage, key_bits_per_token)
from specserve.kv_cache.compress.spherical_calib import calibrate, spherical_kmeans


def _codebooks(num_layers, h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {t: torch.nn.functional.normalize(
        torch.randn(num_layers, h, d // s.group, s.num_codes, s.group, generator=g), dim=-1)
        for t, s in TIERS.items()}


@settings(max_examples=40, deadline=None)
@given(tier=st.sampled_from([1, 2, 3]), h=st.integers(1, 3), pages=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_encode_decode_round_trip_on_representable_keys(tier, h, pages, seed):
    """Keys that are exactly radius_code/255 * scale * codeword encode back to the same codes."""
    d, p = 64, 8
    spec = TIERS[tier]
    g = torch.Generator().manual_seed(seed)
    cb = _codebooks(1, h, d, seed)[tier][0]                                   # [H, G, K, g]
    groups = d // spec.group
    theta = torch.randint(0, spec.num_codes, (h, pages * p, groups), generator=g, dtype=torch.uint8)
    radius = torch.randint(1, 256, (h, pages * p, groups), generator=g, dtype=torch.uint8)
    radius.view(h, pages, p, groups)[:, :, 0] = 255                           # the page max is 255
    scale = torch.rand(h, pages, groups, generator=g) * 10 + 0.1
    k = spherical_decode(theta, radius, scale, cb, p)
    t2, r2, s2 = spherical_encode(k, cb, p)
    assert torch.equal(t2, theta)
    assert (r2.int() - radius.int()).abs().max() <= 0                          # exact radii
    torch.testing.assert_close(s2, scale, rtol=1e-5, atol=1e-6)


def test_attention_from_codes_equals_dense_attention_over_decoded_keys():
    h, d, p = 2, 64, 16
    cb = _codebooks(1, h, d)[1][0]
    k, v = torch.randn(h, 48, d), torch.randn(h, 48, d)
    theta, radius, scale = spherical_encode(k, cb, p)
    q = torch.randn(3, 6, d)
    out, lse = spherical_attention(q, theta, radius, scale, cb, v, 0.125, p)
    keys = spherical_decode(theta, radius, scale, cb, p)                      # [H, T, D]
    ref_out, ref_lse = dense_attention(q, keys.transpose(0, 1), v.transpose(0, 1), 0.125)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tier,expected", [(1, 56), (2, 48), (3, 22)])
def test_tier_bits_scale_with_head_dim(tier, expected):
    assert key_bits_per_token(tier, 64) == expected
    # the paper's 112 / 96 / 44
    assert key_bits_per_token(tier, 128) == 2 * expected
    assert key_bits_per_token(DROP, 64) == 0


@settings(max_examples=20, deadline=None)
@given(tier=st.sampled_from([1, 2, 3]), vbits=st.sampled_from([16, 8, 4]), h=st.integers(1, 3),
       page=st.sampled_from([8, 16]))
def test_bytes_per_token_matches_stored_pages(tier, vbits, h, page):
    cfg = CompressorConfig(num_layers=1, num_kv_heads=h, head_dim=64, num_sink=0, window=0,
                           page_size=page)
    comp = SphericalCompressor(cfg, _codebooks(1, h, 64), tier=tier, value_bits=vbits)
    state = comp.new_state()
    comp.encode(state, 0, torch.randn(2 * page, h, 64), torch.randn(2 * page, h, 64))
    pages = state.layers[0].pages
    assert len(pages) == 2
    stored = sum(t.numel() * t.element_size() for pg in pages
                 for t in (pg.theta, pg.radius, pg.scale, *(pg.v if vbits < 16 else (pg.v,))))
    packed = sum(comp.page_bytes(pg) for pg in pages)
    # theta and radius are stored one byte each; packed accounting uses bits + 8-bit radius exactly
    code_bits = key_bits_per_token(tier, 64) - 8 * (64 // TIERS[tier].group)
    groups = 64 // TIERS[tier].group
    unpacked_extra = 2 * page * h * groups * (8 - code_bits // groups) / 8
    # + one tier byte per page
    assert packed == pytest.approx(stored - unpacked_extra + 2, abs=1e-6)
    assert comp.bytes_per_token() * 2 * page == pytest.approx(packed)


@pytest.mark.parametrize("tier,vbits", [(1, 16), (2, 4), (3, 8)])
def test_pages_encoded_at_once_equal_pages_encoded_one_by_one(tier, vbits):
    """A prompt's pages encoded in one call (`_compress_pages`) are each what encoding that
    page alone gives (`_encode_keys` on its keys, its values as `_compress_page` stores them)."""
    h, page = 3, 16
    cfg = CompressorConfig(num_layers=1, num_kv_heads=h, head_dim=64, num_sink=0, window=0,
                           page_size=page)
    comp = SphericalCompressor(cfg, _codebooks(1, h, 64), tier=tier, value_bits=vbits)
    k, v = torch.randn(4, page, h, 64) * 3, torch.randn(4, page, h, 64)
    for i, got in enumerate(comp._compress_pages(0, k, v)):
        want = SphericalPage(tier=tier, layer=0)
        comp._encode_keys(0, k[i], tier, want)
        assert got.tier == tier and got.layer == 0
        for name in ("theta", "radius", "scale"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (i, name)
        assert got.radius_mass == pytest.approx(want.radius_mass, rel=1e-5)
        alone = comp._compress_pages(0, k[i:i + 1], v[i:i + 1])[0]
        pairs = zip(got.v, alone.v) if vbits < 16 else [(got.v, alone.v)]
        assert all(torch.equal(a, b) for a, b in pairs)
        torch.testing.assert_close(comp._values(got), v[i].transpose(0, 1),
                                   atol={16: 2e-3, 8: 0.02, 4: 0.25}[vbits], rtol=0)


def test_compressor_attention_is_close_to_full_with_good_codebooks():
    """Codebooks learned on the keys themselves: T1 beats T3, and both are far from garbage."""
    torch.manual_seed(0)
    h, d = 2, 64
    base = torch.randn(4, d)                                                  # clustered directions
    k = (base[torch.randint(0, 4, (400, h))] + 0.2 * torch.randn(400, h, d))
    v = torch.randn(400, h, d)
    books = calibrate(k.permute(1, 0, 2)[None], iters=10)
    cfg = CompressorConfig(num_layers=1, num_kv_heads=h, head_dim=d, num_sink=4, window=16,
                           page_size=16)
    # queries that attend sharply
    q = k[-3:].repeat_interleave(2, dim=1) * 2
    ref, _ = dense_attention(q, k, v, 1 / 8)
    errs = {}
    for tier in (1, 3):
        comp = SphericalCompressor(cfg, books, tier=tier)
        state = comp.new_state(dtype=torch.float32)
        comp.encode(state, 0, k, v)
        out, _ = comp.attend(state, 0, q)
        errs[tier] = ((out - ref).norm() / ref.norm()).item()
    assert errs[1] < errs[3] < 0.5 and errs[1] < 0.15


def test_rdr_respects_budget_and_downgrades_least_important_first():
    bits = {1: 100, 2: 80, 3: 50, 0: 1}
    units = [rdr.Unit(0, i, 1, w) for i, w in enumerate([5.0, 0.1, 1.0, 0.1])]
    moves = rdr.plan_downgrades(units, budget_bits=330, page_bits=bits.__getitem__)
    final = {i: 1 for i in range(4)} | {i: t for _, i, t in moves}
    assert sum(bits[t] for t in final.values()) <= 330
    # heaviest page untouched
    assert final[0] == 1
    assert final[1] != 1 and final[3] != 1                                    # light pages first


def test_rdr_compressor_stays_under_budget_and_keeps_attended_pages():
    h, d = 1, 64
    cfg = CompressorConfig(num_layers=2, num_kv_heads=h, head_dim=d, num_sink=0, window=0,
                           page_size=8)
    comp = SphericalCompressor(cfg, _codebooks(2, h, d), tier=1, value_bits=4)
    full = comp.bytes_per_token() * 8
    comp.set_retention(budget_bits=0.6 * full)
    state = comp.new_state()
    for layer in range(2):
        comp.encode(state, layer, torch.randn(64, h, d), torch.randn(64, h, d))
    pages = [p for ls in state.layers for p in ls.pages]
    budget_bits = 0.6 * full * len(pages) * 8                                 # 0.6 × T1 per token
    assert sum(comp.page_bytes(p) for p in pages) * 8 <= budget_bits
    assert any(p.tier != 1 for p in pages)
    q = torch.randn(2, h, d)
    out, lse = comp.attend(state, 0, q)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # attention feedback: a page that gets all the mass survives the next, tighter rebalance at T1
    fresh = comp.new_state()
    comp.set_retention(budget_bits=None)
    for layer in range(2):
        comp.encode(fresh, layer, torch.randn(64, h, d), torch.randn(64, h, d))
    for layer in range(2):
        mass = torch.zeros(8)
        mass[5] = 1.0
        comp.observe(fresh, layer, mass, decay=0.0)
    comp.set_retention(budget_bits=0.3 * full, state=fresh)
    assert all(ls.pages[5].tier == 1 for ls in fresh.layers)
    assert sum(p.tier == 1 for ls in fresh.layers for p in ls.pages) <= 4


def test_spherical_kmeans_recovers_planted_directions():
    g = torch.Generator().manual_seed(0)
    centers = torch.nn.functional.normalize(torch.randn(4, 8, generator=g), dim=-1)
    x = centers[torch.randint(0, 4, (500,), generator=g)] + 0.05 * torch.randn(500, 8, generator=g)
    books = spherical_kmeans(x[None], 4, iters=15)[0]
    # best match per centre
    cos = (books @ centers.T).max(0).values
    assert torch.allclose(books.norm(dim=-1), torch.ones(4), atol=1e-5)
    assert (cos > 0.98).all()
