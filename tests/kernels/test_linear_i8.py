"""The int8 dot-product forms of the CPU linear layer (kernels/cpu/linear_i8.c): GGUF Q4_1 / Q8_0
codes summed against activations quantized per row in blocks of 32. They compute exactly the
quantized product the header states (checked against a float64 model of it), a row's bits never
depend on the rows beside it, the thread count or the build's vector form, and the product stays
close to the float32 one (the accuracy the speed costs)."""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels.cpu import linear as cpu_linear
from tests.kernels.test_linear_cpu import assert_same_bits_when_built_with, q4_1_weight, q8_0_weight


def quantized_rows(x: torch.Tensor):
    """x [M, K] -> codes [M, K / 32, 32] (float64), scale e [M, K / 32], as linear_i8.c makes
    them: round(x * (127 / amax)) to nearest, ties to even; e = amax / 127 (float32)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    codes = torch.round(blocks * inv.unsqueeze(-1))
    return codes.double(), (amax / 127.0).double()


def model_product(x, codes, d, m):
    """The header's product in float64: sum over blocks of d * e * sum(q * a) (+ m * e * t)."""
    a, e = quantized_rows(x)
    q = codes.double().reshape(codes.shape[0], -1, 32)                   # [N, B, 32]
    sums = torch.einsum("mbk,nbk->mnb", a, q) * e.unsqueeze(1)            # [M, N, B]
    out = (sums * d.double().unsqueeze(0)).sum(-1)
    if m is not None:
        out += ((a.sum(-1) * e).unsqueeze(1) * m.double().unsqueeze(0)).sum(-1)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["q4_1", "q8_0"])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (37, 64), (200, 1536)])
def test_int8_forms_compute_the_quantized_product(threads, layout, out_features, in_features):
    torch.set_num_threads(threads)
    make, pack = ((q4_1_weight, cpu_linear.pack_q4_1) if layout == "q4_1"
                  else (q8_0_weight, cpu_linear.pack_q8_0))
    blocks, dequantized = make(out_features, in_features, out_features)
    packed = pack(blocks, in_features, int8=True)
    assert packed.layout == f"{layout}_i8h"                  # the file's fp16 scales kept
    assert packed.data.nbytes == -(-out_features // 16) * 16 * blocks.shape[1]  # the file's bytes
    if layout == "q4_1":
        codes, d, m = cpu_linear.q4_1_codes(blocks, in_features)
    else:
        (codes, d), m = cpu_linear.q8_0_codes(blocks, in_features), None
    wide = cpu_linear.pack_codes(f"{layout}_i8", codes, d, m)           # float32 scales
    assert wide.data.nbytes > packed.data.nbytes
    with pytest.raises(ValueError):                  # scales of the other width: refused
        cpu_linear.pack_codes(f"{layout}_i8h", codes, d, m)
    g = torch.Generator().manual_seed(9)
    x, b = torch.randn(300, in_features, generator=g), torch.randn(out_features, generator=g)
    x[3, :32] = 0.0                                           # an all-zero block: scale 0
    full = cpu_linear.linear(x, packed, b)
    assert torch.equal(cpu_linear.linear(x, wide, b), full)        # the scales widen exactly
    for rows in (0, 1, 2, 3, 4, 5, 8, 9, 17, 64, 65, 130):                 # every tile shape
        assert torch.equal(cpu_linear.linear(x[:rows], packed, b), full[:rows]), rows
        assert torch.equal(cpu_linear.linear(x[:rows], wide, b), full[:rows]), rows
    assert torch.equal(cpu_linear.linear(x[201:202], packed, b)[0], full[201])
    want = model_product(x, codes, d, m) + b.double()
    scale = F.linear(x.double().abs(), dequantized.double().abs()) + b.double().abs() + 1e-30
    assert float(((full.double() - want).abs() / scale).max()) <= 1e-5
    # against the float32 product of the dequantized weight: int8 activations' rounding only
    exact = F.linear(x.double(), dequantized.double(), b.double())
    assert float(((full.double() - exact).abs() / scale).max()) <= 2e-2
    assert float((full.double() - exact).norm() / exact.norm()) <= 1e-2


def test_rows_of_the_int8_q8_0_head_are_the_dequantized_rows():
    blocks, dequantized = q8_0_weight(100, 576, 4)
    packed = cpu_linear.pack_q8_0(blocks, 576, int8=True)
    codes, d = cpu_linear.q8_0_codes(blocks, 576)
    rows = torch.tensor([0, 5, 17, 99, 5])
    for weight in (packed, cpu_linear.pack_codes("q8_0_i8", codes, d, None)):
        assert torch.equal(cpu_linear.weight_rows(weight, rows), dequantized[rows])
    with pytest.raises(IndexError):
        cpu_linear.weight_rows(packed, torch.tensor([100]))


@pytest.mark.parametrize("form", ["avx2", "plain"])
def test_every_vector_form_gives_the_same_bits(monkeypatch, tmp_path, form):
    """Where the CPU has AVX512-VNNI the sums run on `vpdpbusd`; a build without AVX-512
    (`SPECSERVE_CFLAGS`) takes the AVX2 form (`vpmaddubsw`), one without AVX2 the plain C form:
    the same integer sums and float steps, so the same bits (off x86 every build is the C
    form)."""
    g = torch.Generator().manual_seed(6)
    blocks4, _ = q4_1_weight(200, 576, 21)
    blocks8, _ = q8_0_weight(200, 576, 22)
    blocks5, _ = random_blocks("q5_1", 200, 576, 23)
    weights = [cpu_linear.pack_q4_1(blocks4, 576, int8=True),             # fp16 scales
               cpu_linear.pack_q8_0(blocks8, 576, int8=True),
               cpu_linear.pack_codes("q4_1_i8", *cpu_linear.q4_1_codes(blocks4, 576)),
               cpu_linear.pack_codes("q8_0_i8", *cpu_linear.q8_0_codes(blocks8, 576), None),
               cpu_linear.pack_gguf("q5_1", blocks5, 576, int8=True),     # the U8 family
               cpu_linear.pack_codes("u8_i8", *cpu_linear.gguf_codes("q5_1", blocks5, 576)),
               cpu_linear.pack_codes("u8s_i8", torch.randint(0, 64, (200, 576), generator=g,
                                                             dtype=torch.uint8),
                                     torch.rand(200, 36, generator=g) * 1e-2, None),
               # every code 15 against rows of equal x: each int16 lane of the AVX2 form's
               # Q4_1 block sums 16 products of 15 * (+-127), its bound
               cpu_linear.pack_codes("q4_1_i8", torch.full((200, 576), 15, dtype=torch.uint8),
                                     torch.rand(200, 18, generator=g) * 1e-2,
                                     torch.rand(200, 18, generator=g) * 1e-2)]
    x, b = torch.randn(70, 576, generator=g), torch.randn(200, generator=g)
    x[1, 64:] *= 1e3                  # large codes: Q8_0's pairs near the int16 bound (AVX2)
    x[2], x[3] = 1.0, -1.0
    rows = (1, 2, 3, 4, 7, 70)
    flags = {"avx2": "-mno-avx512f", "plain": "-mno-avx2 -mno-avx512f"}[form]
    x86 = platform.machine() in ("x86_64", "AMD64")
    assert_same_bits_when_built_with(flags if x86 else "-O2", weights, x, b, rows, monkeypatch,
                                     tmp_path)


@pytest.mark.parametrize("form", ["avx2", "plain"])
def test_every_vector_form_gives_the_same_bits_for_q4_k(monkeypatch, tmp_path, form):
    """Q4_K's super-block layout (its products of scales formed in registers) in the AVX2 and
    plain C builds: the VNNI build's bits."""
    blocks, _ = random_blocks("q4_k", 40, 512, 31)
    weights = [cpu_linear.pack_gguf("q4_k", blocks, 512, int8=True)]
    g = torch.Generator().manual_seed(32)
    x, b = torch.randn(20, 512, generator=g), torch.randn(40, generator=g)
    flags = {"avx2": "-mno-avx512f", "plain": "-mno-avx2 -mno-avx512f"}[form]
    x86 = platform.machine() in ("x86_64", "AMD64")
    assert_same_bits_when_built_with(flags if x86 else "-O2", weights, x, b, (1, 3, 20),
                                     monkeypatch, tmp_path)


# GGUF types: block bytes, and where each block's float16 scales sit
BLOCKS = {"q4_0": (32, 18, [0]), "q5_0": (32, 22, [0]), "q5_1": (32, 24, [0, 2]),
          "q4_k": (256, 144, [0, 2]), "q5_k": (256, 176, [0, 2]), "q6_k": (256, 210, [208])}


def random_blocks(kind: str, out_features: int, in_features: int, seed: int,
                  scale: tuple[float, float] = (1e-3, 1e-2)):
    """Random GGUF blocks of `kind` (codes and 6-bit scales random, float16 scales drawn from
    `scale`) and gguf's own dequantization of them."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    per, nbytes, halves = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (out_features, in_features // per, nbytes), dtype=np.uint8)
    for at in halves:
        field = rng.uniform(*scale, raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = field.view(np.uint8).reshape(*raw.shape[:2], 2)
    raw = raw.reshape(out_features, -1)
    kind_enum = GGMLQuantizationType[kind.upper()]
    dequantized = np.asarray(quants.dequantize(raw, kind_enum), dtype=np.float32)
    return torch.from_numpy(raw), torch.from_numpy(dequantized.reshape(out_features, -1).copy())


def model_product_halves(x, codes, d, m):
    """The U8 family's product in float64: per half block of 16, d * e * sum(q * a) + m * e * t."""
    a, e = quantized_rows(x)
    a = a.reshape(a.shape[0], -1, 16)
    e = e.repeat_interleave(2, 1)
    q = codes.double().reshape(codes.shape[0], -1, 16)
    sums = torch.einsum("mbk,nbk->mnb", a, q) * e.unsqueeze(1)
    return ((sums * d.double().unsqueeze(0)).sum(-1)
            + ((a.sum(-1) * e).unsqueeze(1) * m.double().unsqueeze(0)).sum(-1))


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_gguf_types_run_from_their_codes(kind):
    """Every kept GGUF type reads back into its family's codes and scales (the weight gguf
    dequantizes), runs on the int8 form with rows independent of the row count and the
    quantized product the header states, and (4-bit types) on the float32 form within float32
    rounding of the dequantized weight's product."""
    out_features, in_features = 48, 512
    blocks, dequantized = random_blocks(kind, out_features, in_features, len(kind))
    codes, d, m = cpu_linear.gguf_codes(kind, blocks, in_features)
    per = in_features // d.shape[1]
    rebuilt = codes.double() * d.double().repeat_interleave(per, 1)
    if m is not None:                                         # (Q5_0: the Q8_0 family's codes)
        rebuilt += m.double().repeat_interleave(per, 1)
    torch.testing.assert_close(rebuilt.float(), dequantized, rtol=1e-6, atol=1e-7)
    g = torch.Generator().manual_seed(3)
    x, b = torch.randn(40, in_features, generator=g), torch.randn(out_features, generator=g)
    packed = cpu_linear.pack_gguf(kind, blocks, in_features, int8=True)
    # scales a file stores as fp16 stay fp16; a K-quant's (products of two) are float32
    assert packed.layout.endswith("_i8" if kind.endswith("_k") else "_i8h")
    full = cpu_linear.linear(x, packed, b)
    if not kind.endswith("_k"):                              # the scales widen exactly
        wide = cpu_linear.pack_codes(packed.layout[:-1], codes, d, m)
        assert wide.data.nbytes > packed.data.nbytes
        assert torch.equal(cpu_linear.linear(x, wide, b), full)
    if kind == "q4_k":                 # d * sc, -(dmin * mn) formed in the kernel: the same bits
        assert packed.layout == "q4_k_i8"
        wide = cpu_linear.pack_codes("q4_1_i8", codes, d, m)
        assert wide.data.nbytes * 296 == packed.data.nbytes * 384
        assert torch.equal(cpu_linear.linear(x, wide, b), full)
    if kind == "q6_k":                      # m = -32 d, computed in the kernel: the same bits
        assert packed.layout == "u8s_i8"
        wide = cpu_linear.pack_codes("u8_i8", codes, d, m)
        assert wide.data.nbytes * 5 == packed.data.nbytes * 6
        assert torch.equal(cpu_linear.linear(x, wide, b), full)
    for rows in (1, 2, 3, 5, 9, 33):
        assert torch.equal(cpu_linear.linear(x[:rows], packed, b), full[:rows]), rows
    want = (model_product_halves(x, codes, d, m) if per == 16
            else model_product(x, codes, d, m)) + b.double()
    scale = F.linear(x.double().abs(), dequantized.double().abs()) + b.double().abs()
    assert float(((full.double() - want).abs() / scale).max()) <= 1e-5
    exact = F.linear(x.double(), dequantized.double(), b.double())
    assert float((full.double() - exact).norm() / exact.norm()) <= 2e-2
    dense = cpu_linear.pack_gguf(kind, blocks, in_features)
    if cpu_linear.GGUF_FAMILIES[kind] == "u8":
        assert dense is None                    # only the int8 form reads 5- and 6-bit codes
    else:
        got = cpu_linear.linear(x, dense, b).double()
        assert float(((got - exact).abs() / scale).max()) <= 1e-6


def test_a_fused_weight_of_mixed_types_runs_on_byte_codes():
    """q/k/v of different GGUF types (Q4_K beside Q6_K) pack together onto the U8 family (a 4-bit
    block's d and m serve both halves) and compute each part's quantized product; with float32
    activations, or with a Q8_0 part, they are not packed (the dense weight serves)."""
    q4, deq4 = random_blocks("q4_k", 32, 256, 1)
    q6, deq6 = random_blocks("q6_k", 16, 256, 2)
    packed = cpu_linear.pack_gguf_parts([("q4_k", q4), ("q6_k", q6)], 256, int8=True)
    assert packed.layout == "u8_i8" and packed.out_features == 48
    codes4, d4, m4 = cpu_linear.gguf_codes("q4_k", q4, 256)
    codes6, d6, m6 = cpu_linear.gguf_codes("q6_k", q6, 256)
    codes = torch.cat((codes4, codes6))
    d = torch.cat((d4.repeat_interleave(2, 1), d6))
    m = torch.cat((m4.repeat_interleave(2, 1), m6))
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(4))
    got = cpu_linear.linear(x, packed, None).double()
    scale = F.linear(x.double().abs(), torch.cat((deq4, deq6)).double().abs())
    assert float(((got - model_product_halves(x, codes, d, m)).abs() / scale).max()) <= 1e-5
    assert cpu_linear.pack_gguf_parts([("q4_k", q4), ("q6_k", q6)], 256) is None
    q8, deq8 = q8_0_weight(16, 256, 3)
    assert cpu_linear.pack_gguf_parts([("q4_k", q4), ("q8_0", q8)], 256, int8=True) is None


def test_symmetric_parts_beside_q8_0_run_as_q8_0():
    """Q5_0 and Q4_0 parts beside a Q8_0 one (a small model's Q4_K_M q/k/v): their codes less 16
    or 8 are Q8_0 codes, so the fused weight is one Q8_0 panel set holding exactly gguf's weight
    (read back row by row), rows independent of the row count."""
    q5, deq5 = random_blocks("q5_0", 32, 256, 5)
    q4, deq4 = random_blocks("q4_0", 16, 256, 6)
    q8, deq8 = q8_0_weight(16, 256, 7)
    packed = cpu_linear.pack_gguf_parts([("q5_0", q5), ("q4_0", q4), ("q8_0", q8)], 256,
                                        int8=True)
    assert packed.layout == "q8_0_i8h" and packed.out_features == 64
    dequantized = torch.cat((deq5, deq4, deq8))
    assert torch.equal(cpu_linear.weight_rows(packed, torch.arange(64)), dequantized)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(8))
    full = cpu_linear.linear(x, packed, None)
    for rows in (1, 2, 5):
        assert torch.equal(cpu_linear.linear(x[:rows], packed, None), full[:rows])
    exact = F.linear(x.double(), dequantized.double())
    assert float((full.double() - exact).norm() / exact.norm()) <= 2e-2
    q5_1, deq5_1 = random_blocks("q5_1", 16, 256, 9)            # asymmetric: no Q8_0 codes
    assert cpu_linear.pack_gguf_parts([("q5_1", q5_1), ("q8_0", q8)], 256, int8=True) is None
    both = cpu_linear.pack_gguf_parts([("q5_0", q5), ("q5_1", q5_1)], 256, int8=True)
    assert both.layout == "u8_i8h"                        # Q5_0's codes back in 0..31, m = -16 d
    exact = F.linear(x.double(), torch.cat((deq5, deq5_1)).double())
    got = cpu_linear.linear(x, both, None).double()
    assert float((got - exact).norm() / exact.norm()) <= 2e-2


@pytest.mark.parametrize("kind,int8", [("f32", False), ("bf16", False), ("q8_0", False),
                                       ("q8_0", True), *((k, True) for k in BLOCKS)])
def test_selected_outputs_are_the_full_weight_s_bit_for_bit(kind, int8):
    """`select_outputs` (VeriCache's draft vocabulary): a packed weight of some outputs, in any
    order and any count (a panel's worth or not), computes exactly the full weight's outputs
    there, for every layout that GGUF types and float weights pack into (but the float32 form of
    Q4_1, whose outputs c and c + 8 share bytes)."""
    out_features, in_features = 80, 512
    if kind in ("f32", "bf16"):
        w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(3))
        packed = cpu_linear.pack(w.bfloat16().float() if kind == "bf16" else w)
    elif kind == "q8_0":
        packed = cpu_linear.pack_q8_0(q8_0_weight(out_features, in_features, 5)[0], in_features,
                                      int8)
    else:
        blocks, _ = random_blocks(kind, out_features, in_features, len(kind))
        packed = cpu_linear.pack_gguf(kind, blocks, in_features, int8=True)
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(4))
    full = cpu_linear.linear(x, packed, None)
    for ids in ([79, 0, 16, 17, 33], list(range(16, 48)), [8]):
        ids = torch.tensor(ids)
        sub = cpu_linear.select_outputs(packed, ids)
        assert sub is not None, packed.layout
        assert sub.out_features == len(ids)
        assert torch.equal(cpu_linear.linear(x, sub, None), full[:, ids])
