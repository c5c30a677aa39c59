"""Every family's layer on the one-call C decoder (`kernels/cpu/decoder.c`): Gemma's (1 + w) norms,
scaled embeddings, sandwich norms, query scale, GeGLU and score soft-cap, Gemma 3's per-head q/k
norms and second RoPE for its sliding layers, and Phi-3's layer shape give hidden states, K/V and
logits bitwise the modules' over prompt chunks, decodes and verify rows, on random tiny models,
over every cache element type the C decoder takes (float32, bfloat16, fp8).
(tests/models/test_families_cpu_decoder.py serves transformers' own checkpoints of each family.)"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.spec_phases import cpu_decoder
from specserve.spec_phases.loader import build_random_model, tiny_config
from specserve.spec_phases.model import FamilyOptions
from specserve.spec_phases.rope import RopeConfig

GEMMA2 = dict(family=FamilyOptions(norm_offset=1.0, scale_embeddings=True,
                                   activation="gelu_tanh", sandwich_norms=True,
                                   query_pre_attn_scalar=12.0, attn_softcap=2.0,
                                   final_softcap=3.0),
              windows=(8, 0))
GEMMA3 = dict(family=replace(GEMMA2["family"], qk_norm=True, attn_softcap=0.0,
                             final_softcap=0.0, query_pre_attn_scalar=40.0),
              windows=(8, 0), rope=RopeConfig(100000.0, "linear", 2.0),
              local_rope=RopeConfig(5000.0))
GEMMA1 = dict(family=FamilyOptions(norm_offset=1.0, scale_embeddings=True,
                                   activation="gelu_tanh"))
PHI3 = dict(windows=(8, 8))                    # Llama's layer, one window everywhere
FAMILIES = {"gemma": GEMMA1, "gemma2": GEMMA2, "gemma3": GEMMA3, "phi3": PHI3}


def family_model(name: str):
    model = build_random_model(replace(tiny_config(vocab_size=300), **FAMILIES[name]), seed=5)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():                       # norms away from their all-ones start
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    assert model.pack_for_cpu()
    return model


@pytest.mark.parametrize("cache_dtype", cpu_decoder.CACHE_DTYPES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_bitwise_the_modules_for_every_family(name, cache_dtype, monkeypatch, decoder_runners,
                                              same_steps):
    model = family_model(name)
    assert cpu_decoder.unsupported(model) is None
    fast, modules = decoder_runners(model, cache_dtype)
    calls = []
    one_call = cpu_decoder.fused.forward
    monkeypatch.setattr(cpu_decoder.fused, "forward",
                        lambda *a, **kw: calls.append(len(a[2])) or one_call(*a, **kw))
    tables = same_steps(fast, modules, seed=2)
    assert calls == [model.config.num_layers] * 3
    for run in ([1], [0]):                      # a layer subset (self-speculation's)
        assert torch.equal(fast.forward([(3,)], [41], [tables[2]], run),
                           modules.forward([(3,)], [41], [tables[2]], run))


def test_every_option_is_applied(decoder_runners):
    """Each Gemma option changes the one call's hidden states (none is silently dropped)."""
    base = family_model("gemma3")
    ids, want = [tuple(range(3, 30))], None

    def hidden(model):
        fast, _ = decoder_runners(model)
        return fast.forward(ids, [0], [tuple(range(8))])

    want = hidden(base)
    layer = base.layers[1]
    for name, change in [("query_scale", 1.0), ("activation", "silu"),
                         ("rope_index", 1 - layer.rope_index)]:
        old = getattr(layer, name)
        setattr(layer, name, change)
        assert not torch.equal(hidden(base), want), name
        setattr(layer, name, old)
    for name in ("attn_out_norm", "mlp_out_norm", "q_norm"):
        old = getattr(layer, name)
        setattr(layer, name, None)
        if name == "q_norm":
            layer.k_norm, k_old = None, layer.k_norm
        assert not torch.equal(hidden(base), want), name
        setattr(layer, name, old)
        if name == "q_norm":
            layer.k_norm = k_old
    assert torch.equal(hidden(base), want)


def test_exact_gelu_stays_on_the_modules():
    """GeLU without the tanh approximation has no C kernel: the accept-list names it."""
    model = build_random_model(replace(tiny_config(vocab_size=300), family=replace(
        GEMMA1["family"], activation="gelu")))
    assert model.pack_for_cpu()
    assert cpu_decoder.unsupported(model) == "the gelu activation"
