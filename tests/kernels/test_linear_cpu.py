"""The CPU linear layers (kernels/cpu/linear.py): the C kernel gives F.linear's products, its rows
are bit-identical whatever number of rows shares the call (any thread count), GGUF Q4_1 / Q8_0
panels give the dequantized weight's products within float32 rounding, and without a C compiler
float32 weights are packed for oneDNN instead."""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels.cpu import linear as cpu_linear
from specserve.kernels.cpu import native


@pytest.mark.parametrize("out_features,in_features", [(960, 576), (37, 20), (16, 7), (5, 64)])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 33])
def test_matches_f_linear(out_features, in_features, rows):
    g = torch.Generator().manual_seed(out_features * 1000 + rows)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    packed = cpu_linear.pack(w)
    assert not packed.onednn and packed.out_features == out_features
    torch.testing.assert_close(cpu_linear.linear(x, packed, None), F.linear(x, w),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_linear.linear(x, packed, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)


def test_takes_3d_and_strided_inputs():
    w, x = torch.randn(48, 32), torch.randn(3, 4, 64)[..., ::2]       # rows 2 floats apart
    got = cpu_linear.linear(x, cpu_linear.pack(w), None)
    assert got.shape == (3, 4, 48)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_the_row_count(threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    for shape in ((960, 576), (576, 1536), (3072, 576)):
        w, x = torch.randn(*shape, generator=g), torch.randn(200, shape[1], generator=g)
        packed = cpu_linear.pack(w)
        full = cpu_linear.linear(x, packed, None)
        for m in (1, 2, 5, 7, 16, 17, 72, 144):
            assert torch.equal(cpu_linear.linear(x[:m], packed, None), full[:m]), (shape, m)
        assert torch.equal(cpu_linear.linear(x[100:101], packed, None)[0], full[100])


def test_without_a_compiler_float32_goes_to_onednn(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    for cached in (native.library, cpu_linear._lib, cpu_linear.c_kernel_available):
        cached.cache_clear()
    try:
        assert not cpu_linear.c_kernel_available()
        w, x = torch.randn(40, 24), torch.randn(3, 24)
        packed = cpu_linear.pack(w)
        assert packed.onednn and cpu_linear.packing_available(torch.float32)
        torch.testing.assert_close(cpu_linear.linear(x, packed, None), F.linear(x, w),
                                   rtol=1e-5, atol=1e-5)
    finally:
        for cached in (native.library, cpu_linear._lib, cpu_linear.c_kernel_available):
            cached.cache_clear()


def test_bf16_packs_for_onednn_exactly_where_it_runs_natively():
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_linear.packing_available(torch.bfloat16) == native_bf16
    assert not cpu_linear.packing_available(torch.float16)
    if native_bf16:
        assert cpu_linear.pack(torch.randn(8, 8).bfloat16()).onednn


def q4_1_weight(out_features: int, in_features: int, seed: int):
    """GGUF Q4_1 blocks of a random weight and gguf's own dequantization of them."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    raw = quants.quantize((w * 0.05).numpy(), GGMLQuantizationType.Q4_1)
    dequantized = np.asarray(quants.dequantize(raw, GGMLQuantizationType.Q4_1), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(dequantized.copy())


def test_q4_1_codes_are_ggufs_values():
    blocks, dequantized = q4_1_weight(40, 96, 3)
    codes, d, m = cpu_linear.q4_1_codes(blocks, 96)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    rebuilt = d.repeat_interleave(32, 1) * codes.float() + m.repeat_interleave(32, 1)
    assert torch.equal(rebuilt, dequantized)


def assert_quantized_panels(quantized, dequantized, x, b):
    """Every row of a quantized panel's results is the same whatever the row count (one row:
    panels in pairs; a few row blocks: codes unpacked in registers; many, without AVX-512: a
    float copy of each panel's codes) and within float32 rounding of the dequantized weight's: no
    more than 1e-6 of sum |x| |w| from the float64 product (float32's unit roundoff is 6e-8)."""
    full = cpu_linear.linear(x, quantized, b)               # 200 rows: the float copy (AVX2)
    for m in (0, 1, 2, 5, 6, 7, 16, 24, 25, 40, 192):
        assert torch.equal(cpu_linear.linear(x[:m], quantized, b), full[:m]), m
    assert torch.equal(cpu_linear.linear(x[17:18], quantized, b)[0], full[17])
    exact = F.linear(x.double(), dequantized.double(), b.double())
    scale = F.linear(x.double().abs(), dequantized.double().abs()) + 1e-30
    assert float(((full.double() - exact).abs() / scale).max()) <= 1e-6


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (37, 64), (576, 1536)])
def test_q4_1_panels_compute_the_dequantized_weights_results(threads, out_features,
                                                            in_features):
    """Q4_1 panels, from 3/16 of the float32 panels' bytes: the dequantized weight's results within
    float32 rounding, each row independent of the row count (`assert_quantized_panels`)."""
    torch.set_num_threads(threads)
    blocks, dequantized = q4_1_weight(out_features, in_features, out_features)
    quantized, dense = cpu_linear.pack_q4_1(blocks, in_features), cpu_linear.pack(dequantized)
    assert quantized.layout == "q4_1" and quantized.out_features == out_features
    assert quantized.data.nbytes * 16 == dense.data.nbytes * 3
    g = torch.Generator().manual_seed(7)
    x, b = torch.randn(200, in_features, generator=g), torch.randn(out_features, generator=g)
    assert_quantized_panels(quantized, dequantized, x, b)


def q8_0_weight(out_features: int, in_features: int, seed: int):
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    raw = quants.quantize((w * 0.05).numpy(), GGMLQuantizationType.Q8_0)
    dequantized = np.asarray(quants.dequantize(raw, GGMLQuantizationType.Q8_0), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(dequantized.copy())


@pytest.mark.parametrize("out_features,in_features", [(300, 576), (37, 64)])
def test_q8_0_panels_and_their_rows_are_the_dequantized_weights(out_features, in_features):
    """Q8_0 panels (an LM head): the dequantized weight's results within float32 rounding, rows
    independent of the row count, and the rows an embedding lookup reads back are exactly gguf's
    dequantized rows."""
    blocks, dequantized = q8_0_weight(out_features, in_features, out_features)
    codes, d = cpu_linear.q8_0_codes(blocks, in_features)
    assert torch.equal(d.repeat_interleave(32, 1) * codes.float(), dequantized)
    quantized, dense = cpu_linear.pack_q8_0(blocks, in_features), cpu_linear.pack(dequantized)
    assert quantized.layout == "q8_0" and quantized.data.nbytes * 32 == dense.data.nbytes * 9
    g = torch.Generator().manual_seed(2)
    x, b = torch.randn(200, in_features, generator=g), torch.randn(out_features, generator=g)
    assert_quantized_panels(quantized, dequantized, x, b)
    rows = torch.tensor([0, 5, 17, out_features - 1, 5])
    assert torch.equal(cpu_linear.weight_rows(quantized, rows), dequantized[rows])
    assert torch.equal(cpu_linear.weight_rows(dense, rows), dequantized[rows])
    assert cpu_linear.weight_rows(quantized, rows[:0]).shape == (0, in_features)
    for bad in (-1, out_features):                  # never a read outside the panels
        with pytest.raises(IndexError):
            cpu_linear.weight_rows(quantized, torch.tensor([0, bad]))


def test_the_avx2_build_gives_the_native_builds_bits(monkeypatch, tmp_path):
    """linear.c keeps a panel row in one 512-bit vector on AVX-512 CPUs (12-row blocks, codes
    unpacked in registers at any row count) and in two 8-float halves elsewhere (6-row blocks, a
    float copy of the codes above 192 rows): each lane's sum is the same sequence of fused
    multiply-adds, so a build without AVX-512 (`SPECSERVE_CFLAGS`) gives the same bits (on an AVX2
    host both builds are the AVX2 form; off x86, the flag is another optimisation level)."""
    g = torch.Generator().manual_seed(5)
    blocks4, _ = q4_1_weight(200, 576, 11)
    blocks8, _ = q8_0_weight(200, 576, 12)
    weights = [cpu_linear.pack(torch.randn(200, 576, generator=g)),
               cpu_linear.pack(torch.randn(200, 576, generator=g).bfloat16().float()),
               cpu_linear.pack_q4_1(blocks4, 576), cpu_linear.pack_q8_0(blocks8, 576)]
    assert [w.layout for w in weights] == ["f32", "bf16", "q4_1", "q8_0"]
    x, b = torch.randn(300, 576, generator=g), torch.randn(200, generator=g)
    rows = (1, 3, 13, 16, 100, 300)
    no_avx512 = "-mno-avx512f" if platform.machine() in ("x86_64", "AMD64") else "-O2"
    assert_same_bits_when_built_with(no_avx512, weights, x, b, rows, monkeypatch, tmp_path)


def assert_same_bits_when_built_with(flags, weights, x, b, rows, monkeypatch, tmp_path):
    """Each weight's products on the first `rows` rows of x are the same bits from a linear
    kernel built (afresh, in tmp_path) with `SPECSERVE_CFLAGS=flags` as from this build."""
    native_out = [[cpu_linear.linear(x[:m], w, b) for m in rows] for w in weights]
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECSERVE_CFLAGS", flags)
    for cached in (native.library, cpu_linear._lib):
        cached.cache_clear()
    try:
        for w, outs in zip(weights, native_out):
            for m, want in zip(rows, outs):
                assert torch.equal(cpu_linear.linear(x[:m], w, b), want), (w.layout, m)
        assert list(tmp_path.glob("kernels/linear-*.so"))                 # built with the flag
    finally:
        for cached in (native.library, cpu_linear._lib):
            cached.cache_clear()


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_valued_weights_pack_into_bf16_panels_with_the_same_bits(threads):
    """A float32 weight whose values are all bf16's (a bf16 checkpoint served in float32) packs
    into bf16 panels, half the bytes, and gives the float32 panels' products bit for bit at every
    row count; rows read back exactly. One value off the bf16 grid keeps the float32 panels."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(8)
    w = torch.randn(200, 576, generator=g).bfloat16().float()
    packed = cpu_linear.pack(w)
    assert packed.layout == "bf16" and packed.data.element_size() == 2
    f32 = cpu_linear.PackedWeight(torch.empty(13, 576, 16), 200, 576, "f32")
    cpu_linear._lib().linear_pack(w.data_ptr(), 200, 576, f32.data.data_ptr())
    x, b = torch.randn(100, 576, generator=g), torch.randn(200, generator=g)
    for rows in (1, 5, 13, 100):
        assert torch.equal(cpu_linear.linear(x[:rows], packed, b),
                           cpu_linear.linear(x[:rows], f32, b)), rows
    ids = torch.tensor([0, 7, 199])
    assert torch.equal(cpu_linear.weight_rows(packed, ids), w[ids])
    w[3, 5] += 1e-6
    assert cpu_linear.pack(w).layout == "f32"
