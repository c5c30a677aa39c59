import torch
import torch.nn.functional as F

from specserve.spec_phases.loader import build_random_model, tiny_config


def causal(layer, q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(0, 1)


def test_rope_is_relative_and_model_is_deterministic():
    model = build_random_model(tiny_config(vocab_size=100), seed=3)
    ids = torch.tensor([5, 17, 42, 8, 99, 3])
    a = model.compute_logits(model(ids, torch.arange(6), causal))
    b = model.compute_logits(model(ids, torch.arange(6), causal))
    torch.testing.assert_close(a, b)
    # with causal attention over the same tokens, shifting every position leaves logits unchanged
    shifted = model.compute_logits(model(ids, torch.arange(6) + 50, causal))
    torch.testing.assert_close(a, shifted, rtol=1e-4, atol=1e-4)
    other_seed = build_random_model(tiny_config(vocab_size=100), seed=4)
    assert not torch.allclose(a,
                              other_seed.compute_logits(other_seed(ids, torch.arange(6), causal)))


def test_skipping_layers_changes_the_output():
    model = build_random_model(tiny_config(vocab_size=100), seed=0)
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    full = model(ids, pos, causal)
    assert not torch.allclose(full, model(ids, pos, causal, layers=[0]))


def test_cpu_packed_weights_match_dense_and_are_optional():
    dense = build_random_model(tiny_config(vocab_size=100), seed=1)
    packed = build_random_model(tiny_config(vocab_size=100), seed=1)
    assert packed.pack_for_cpu()
    assert (packed.layers[0].gate_up_proj.packed is not None
            and dense.layers[0].gate_up_proj.packed is None)
    ids = torch.tensor([5, 17, 42, 8, 99, 3])
    a = dense.compute_logits(dense(ids, torch.arange(6), causal))
    b = packed.compute_logits(packed(ids, torch.arange(6), causal))
    assert b.dtype == torch.float32 and b.shape == a.shape
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the tied embedding is held once: lookups read the packed head, exactly the dense rows
    assert packed.embed_tokens.weight.numel() == 0
    assert torch.equal(packed.embed(ids), dense.embed(ids))
    # an empty step (no rows); fp16 is never packed
    assert packed.compute_logits(packed(ids[:0], torch.arange(0), causal)).shape == (0, 100)
    assert not build_random_model(tiny_config(vocab_size=100), dtype=torch.float16).pack_for_cpu()


def test_bf16_packing_where_the_cpu_has_native_bf16():
    """bf16 weights are prepacked exactly where oneDNN runs bf16 natively (AVX512-BF16, AMX), and
    the packed GEMMs give the dense bf16 model's logits up to bf16 rounding."""
    dense = build_random_model(tiny_config(vocab_size=100), dtype=torch.bfloat16, seed=1)
    packed = build_random_model(tiny_config(vocab_size=100), dtype=torch.bfloat16, seed=1)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packed.pack_for_cpu() == native
    assert (packed.layers[0].qkv_proj.packed is not None) == native
    ids = torch.tensor([5, 17, 42, 8, 99, 3])
    a = dense.compute_logits(dense(ids, torch.arange(6), causal))
    b = packed.compute_logits(packed(ids, torch.arange(6), causal))
    assert b.dtype == torch.float32 and b.shape == a.shape
    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def test_engine_greedy_tokens_do_not_depend_on_weight_packing(make_engine):
    from specserve.scheduler.messages import EngineRequest
    from specserve.spec_phases.sampling_params import SamplingParams
    outs = []
    for packing in (True, False):
        engine = make_engine(cpu_weight_packing=packing)
        assert (engine.worker.model.layers[0].qkv_proj.packed is not None) == packing
        for i, ids in enumerate([[1, 5, 9, 200, 31], [7, 7, 7]]):
            engine.add_request(EngineRequest(f"r{i}", ids,
                                             SamplingParams(max_tokens=24, temperature=0,
                                                                         ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        for out in engine.run_until_idle():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert sum(map(len, tokens.values())) == 48
        outs.append(tokens)
    assert outs[0] == outs[1]
