import math

import pytest
import torch

from specserve.spec_phases.sampling_params import SamplingParams
from specserve.spec_phases.sampler import SampleRow, Sampler

V = 10


def rows(params, outputs=None, prompt=None):
    return [SampleRow(p, len(outputs[i]) if outputs else 0, tuple(prompt[i]) if prompt else (),
                      tuple(outputs[i]) if outputs else ()) for i, p in enumerate(params)]


def uniform(n, seed=0):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def sampler():
    return Sampler(V, (9,), "cpu", seed=0)


def test_top_k_top_p_min_p_restrict_support():
    s = sampler()
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05] + [1e-9] * 5] * 3))
    probs = s.probs(logits.clone(), rows([SamplingParams(top_k=2), SamplingParams(top_p=0.65),
                                          SamplingParams(min_p=0.4)]))
    assert (probs[0] > 0).sum() == 2 and math.isclose(float(probs[0, 0]), 0.4 / 0.7, rel_tol=1e-5)
    assert (probs[1] > 0).sum() == 2                  # 0.4 + 0.3 reaches 0.65
    assert (probs[2] > 0).sum() == 3                  # min_p 0.4 * 0.4 = 0.16 keeps 0.4, 0.3, 0.2
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_temperature_sampling_follows_the_distribution():
    s = sampler()
    target = torch.tensor([0.5, 0.25, 0.125, 0.125] + [0.0] * 6)
    logits = torch.log(target.clamp_min(1e-30))[None].repeat(4000, 1)
    draws = s.sample(logits, rows([SamplingParams(temperature=1.0)] * 4000), uniform(4000))
    freq = torch.bincount(draws, minlength=V).float() / 4000
    assert torch.allclose(freq[:4], target[:4], atol=0.03) and freq[4:].sum() == 0


def test_penalties_and_bias_and_min_tokens():
    s = sampler()
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0, 0, 0, 0, 0, 3.0]] * 4)
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=1.0),
              SamplingParams(presence_penalty=1.5, logit_bias={4: 7.0}),
              SamplingParams(min_tokens=3)]
    out = s.process(logits.clone(),
                    rows(params, outputs=[[0], [1, 1], [3, 3], [5]], prompt=[[2], [], [], []]))
    assert out[0, 0] == 1.0 and out[0, 2] == -2.0 and out[0, 1] == 1.0   # output and prompt tokens
    assert out[1, 1] == -1.0 and out[1, 0] == 2.0                         # 1.0 - 2 * 1.0
    assert out[2, 3] == -1.0 and out[2, 4] == 7.0                         # presence once; bias
    # EOS masked below min_tokens
    assert out[3, 9] == float("-inf")


def test_seeded_uniforms_depend_on_seed_and_position_only():
    """A seeded request's uniform at a position is a fixed function of (seed, position): the same
    in any batch and any split of its rows; unseeded rows share one generator."""
    from specserve.spec_phases.plan import ScheduledRequest
    from specserve.spec_phases.sampler import position_uniform

    def req(rid, seed, computed):
        return ScheduledRequest(rid, (5,), computed, 0, (0,), True,
                                SamplingParams(temperature=1.0, seed=seed), 3, computed - 2)
    s = sampler()
    whole = s.uniforms([(req("a", 7, 9), 4)])[0]
    split = torch.cat([s.uniforms([(req("b", None, 3), 2), (req("a", 7, 9), 2)])[1],
                       s.uniforms([(req("a", 7, 11), 2)])[0]])
    assert torch.equal(whole, split)
    assert whole.tolist() == [position_uniform(7, p) for p in range(10, 14)]
    assert len(set(whole.tolist())) == 4 and all(0 <= u < 1 for u in whole.tolist())
    assert position_uniform(8, 10) != position_uniform(7, 10)
    draws = [position_uniform(1234, p) for p in range(20000)]
    counts = torch.histc(torch.tensor(draws), bins=10, min=0, max=1)
    assert counts.min() > 1800 and counts.max() < 2200       # uniform: 2000 per bin


def test_inverse_cdf_draw_skips_zero_probability_tokens():
    s = sampler()
    logits = torch.log(torch.tensor([[0.0, 0.5, 0.0, 0.5] + [0.0] * 6]).clamp_min(1e-45))
    logits[logits < -100] = float("-inf")
    out = [int(s.sample(logits.clone(), rows([SamplingParams(temperature=1.0)]),
                        torch.tensor([u], dtype=torch.float64))) for u in (0.0, 0.49, 0.5, 0.999)]
    assert out == [1, 1, 3, 3]


def test_greedy_rows_take_the_argmax_after_processing():
    s = sampler()
    logits = torch.tensor([[0.0, 5.0, 4.9] + [0.0] * 7])
    out = s.sample(s.process(logits.clone(),
                             rows([SamplingParams(temperature=0, logit_bias={2: 1.0})])),
                   rows([SamplingParams(temperature=0)]), uniform(1))
    assert int(out[0]) == 2


def test_logprobs_are_raw_and_ranked():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    lp = Sampler.logprobs(logits, torch.tensor([2]), [2])[0]
    want = torch.log_softmax(logits, -1)[0]
    assert lp.rank == 2 and lp.top_token_ids == [0, 2]
    assert lp.logprob == pytest.approx(float(want[2]))
    assert lp.top_logprobs == pytest.approx([float(want[0]), float(want[2])])


def test_a_rows_distribution_does_not_depend_on_its_neighbours_top_k_top_p():
    """top-k / top-p run only on the rows that ask for them, and top_p 1.0 is exactly no
    restriction: a plain row's probabilities are bit for bit the same alone and beside a row with
    top_k or top_p (its tail tokens, whose float32 mass before them rounds to 1.0, are kept)."""
    s = sampler()
    plain = torch.log(torch.tensor([1.0 - 9e-9] + [1e-9] * 9))
    alone = s.probs(plain[None].clone(), rows([SamplingParams(temperature=1.0)]))
    assert (alone[0] > 0).all()
    for neighbour in (SamplingParams(top_k=2), SamplingParams(top_p=0.5),
                      SamplingParams(top_k=3, top_p=1.0)):
        batch = torch.stack([plain, torch.log(torch.tensor([0.4, 0.3, 0.2] + [0.1 / 7] * 7))])
        both = s.probs(batch, rows([SamplingParams(temperature=1.0), neighbour]))
        assert torch.equal(both[0], alone[0]), neighbour
    with_p1 = s.probs(plain[None].clone(), rows([SamplingParams(top_k=V, top_p=1.0)]))
    assert torch.equal(with_p1[0], alone[0])
