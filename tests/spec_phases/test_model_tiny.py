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
    assert not torch.allclose(a, other_seed.compute_logits(other_seed(ids, torch.arange(6), causal)))


def test_skipping_layers_changes_the_output():
    model = build_random_model(tiny_config(vocab_size=100), seed=0)
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    full = model(ids, pos, causal)
    assert not torch.allclose(full, model(ids, pos, causal, layers=[0]))
