"""The C-kernel decoder (spec_phases/cpu_decoder.py) computes bitwise the hidden states the
modules compute, over prefill chunks, decodes and verify rows mixed in one step, with and without
a layer subset and attention bias; it is taken only where it serves, and the runner falls back to
the modules under SPECSERVE_KERNELS=reference."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from specserve.kernels.cpu import decoder as fused
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases import cpu_decoder
from specserve.spec_phases.loader import build_random_model, tiny_config
from specserve.spec_phases.runner import ModelRunner


def packed_model(**overrides):
    model = build_random_model(replace(tiny_config(vocab_size=300), **overrides), seed=3)
    assert model.pack_for_cpu()
    return model


@pytest.mark.parametrize("bias,windows,qk_norm", [(False, (), False), (True, (), False),
                                                  (False, (0, 8), False), (False, (), True)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_bitwise_the_modules_over_mixed_steps(bias, windows, qk_norm, cache_dtype, monkeypatch,
                                              decoder_runners, same_steps):
    """Every step (prompt chunks in tiles, decodes, verify rows) runs the whole stack in one
    call (`kernels/cpu/decoder.c`), bitwise the modules, with attention bias and with a sliding
    window on one layer, with Qwen3's per-head q/k norms; over a bf16 cache too (the one call
    rounds K/V as torch does)."""
    model = packed_model(attention_bias=bias, windows=windows,
                         family=replace(tiny_config().family, qk_norm=qk_norm))
    fast, modules = decoder_runners(model, cache_dtype)
    whole = []
    one_call = cpu_decoder.fused.forward
    monkeypatch.setattr(cpu_decoder.fused, "forward",
                        lambda *a, **kw: whole.append(len(a[2])) or one_call(*a, **kw))
    tables = same_steps(fast, modules, seed=1)
    one_call_steps = 3                                                # every step
    assert whole == [model.config.num_layers] * one_call_steps
    skip = [1]                                                        # self-speculation's subset
    assert torch.equal(fast.forward([(3,)], [41], [tables[2]], skip),
                       modules.forward([(3,)], [41], [tables[2]], skip))
    assert whole[one_call_steps:] == [1]


def test_a_long_chunk_s_mlp_runs_in_blocks_bitwise_the_modules(decoder_runners, same_steps):
    """A prompt chunk longer than the one call's MLP block (`decoder.c` MLP_ROWS, 128 rows)
    beside a decode: its rows' MLP runs block by block, each row bitwise what the modules
    compute for it (the kernels are row-invariant, so the blocking changes no result)."""
    model = packed_model()
    fast, modules = decoder_runners(model, num_blocks=96)
    g = torch.Generator().manual_seed(5)
    prompt = tuple(torch.randint(0, 300, (300,), generator=g).tolist())
    tables = [tuple(range(0, 80)), tuple(range(80, 84))]
    same_steps(fast, modules, steps=[([prompt[:290], (4, 5, 6)], [0, 0], tables),
                                     ([prompt[290:], (7,)], [290, 3], tables)])


def test_taken_only_where_it_serves(monkeypatch, decoder_runners):
    unpacked = build_random_model(tiny_config(vocab_size=300))
    assert not cpu_decoder.supported(unpacked)                        # nothing packed
    assert cpu_decoder.supported(packed_model(family=replace(         # Qwen3's q/k norms
        tiny_config().family, qk_norm=True)))
    assert cpu_decoder.supported(packed_model(family=replace(         # Gemma 2/3's norms
        tiny_config().family, sandwich_norms=True)))
    assert not cpu_decoder.supported(packed_model(family=replace(     # exact GeLU: no C kernel
        tiny_config().family, activation="gelu")))
    model = packed_model()
    assert cpu_decoder.supported(model)
    head, model._lm_head_packed = model._lm_head_packed, None        # the head off the C kernel
    assert cpu_decoder.unsupported(model) == "the LM head not on the C kernel"
    model._lm_head_packed = head
    fast, _ = decoder_runners(model)
    calls = []
    monkeypatch.setattr(cpu_decoder.CpuDecoder, "forward",
                        lambda self, *a, **k: calls.append(1) or torch.zeros(1, 1))
    monkeypatch.setenv("SPECSERVE_KERNELS", "reference")
    fast.forward([(1, 2)], [0], [(0,)])
    assert not calls
    monkeypatch.setenv("SPECSERVE_KERNELS", "auto")
    fast.forward([(1, 2)], [0], [(0,)])
    assert calls


def test_the_one_call_times_its_kernels_without_changing_their_results(monkeypatch,
                                                                           decoder_runners):
    """`benchmarks/profile_step.py` passes a float64 [3] that the call adds its time in the
    linear layers, attention and the elementwise kernels to: the hidden states and the cache are
    bitwise those of an untimed call."""
    model = packed_model()
    (plain, _), (timed, _) = decoder_runners(model), decoder_runners(model)
    seconds = torch.zeros(3, dtype=torch.float64)
    one_call = cpu_decoder.fused.forward
    steps = [([tuple(range(5, 17))], [0]), ([(9,)], [12]), ([(4, 5, 6)], [13])]
    for tokens, starts in steps:
        want = plain.forward(tokens, starts, [tuple(range(8))])
        with monkeypatch.context() as m:
            m.setattr(cpu_decoder.fused, "forward",
                      lambda *a, **kw: one_call(*a, **kw, seconds=seconds))
            got = timed.forward(tokens, starts, [tuple(range(8))])
        assert torch.equal(got, want)
    assert torch.equal(timed.storage.k, plain.storage.k)
    assert (seconds > 0).all()


def test_the_one_call_rounds_to_bf16_as_torch_does():
    """K/V written by `decoder.c` into a bf16 cache are torch's float32 -> bfloat16 (to nearest,
    ties to even): ties either way, carries into the exponent, overflow to infinity, subnormals,
    signed zeros, infinities."""
    g = torch.Generator().manual_seed(0)
    edges = np.array([0x3F80_8000, 0x3F81_8000, 0x3F80_7FFF, 0x3F80_8001, 0x3FFF_FFFF,
                      0x7F7F_FFFF, 0x7F7F_7FFF, 0x0000_8000, 0x0001_8000, 0x007F_FFFF,
                      0x8000_0000, 0x7F80_0000, 0xFF80_0000, 0xBF80_8000], dtype=np.uint32)
    x = torch.cat([torch.from_numpy(edges.view(np.float32)), torch.randn(4096, generator=g) * 3,
                   torch.randn(256, generator=g) * 1e-39, torch.randn(256, generator=g) * 1e38])
    assert torch.equal(fused.round_kv(x, torch.bfloat16).view(torch.int16),
                       x.bfloat16().view(torch.int16))


def test_the_library_reports_the_abi_its_ctypes_mirrors_match():
    """decoder.c exports its version and structure sizes; a mirror that drifted from the C
    structures is a BuildError at load, not memory read at the wrong offsets."""
    import ctypes

    from specserve.kernels.cpu.native import BuildError, library
    lib = library("decoder")
    fused.check_abi(lib)                                            # the mirrors match

    class Drifted(ctypes.Structure):                                 # a field gone
        _fields_ = [("data", ctypes.c_void_p), ("layout", ctypes.c_int64)]
    real = fused.Linear
    try:
        fused.Linear = Drifted
        with pytest.raises(BuildError, match="ABI"):
            fused.check_abi(lib)
    finally:
        fused.Linear = real


def test_the_runner_logs_which_decoder_stack_serves_and_why(caplog, decoder_runners):
    """One accept-list picks the stack (`cpu_decoder.unsupported`) and the runner logs the
    choice: the C decoder for the common shape, the modules with the reason otherwise."""
    import logging
    model = packed_model()
    qk = packed_model(family=replace(tiny_config().family, activation="gelu"))
    assert cpu_decoder.unsupported(model) is None
    assert cpu_decoder.unsupported(qk) == "the gelu activation"
    with caplog.at_level(logging.INFO, logger="specserve.spec_phases.runner"):
        decoder_runners(model)
        cfg = qk.config
        ModelRunner(qk, KVStorage(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim,
                                  torch.float32, "cpu"))
    lines = [r.message for r in caplog.records if "decoder stack" in r.message]
    assert any("one call of the C decoder" in m for m in lines)
    assert any("the modules (the gelu activation)" in m for m in lines)
