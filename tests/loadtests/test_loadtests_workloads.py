"""Seeded workloads: reproducible, the right shapes, and arrival statistics."""
import statistics

import pytest

from loadtests.workloads import (cells, chat_prompts, code_edit_prompts, gamma_arrivals,
                                           long_prompts)


def test_same_seed_same_prompts_other_seed_differs():
    assert chat_prompts(10, seed=3) == chat_prompts(10, seed=3)
    assert chat_prompts(10, seed=3) != chat_prompts(10, seed=4)
    assert code_edit_prompts(3, seed=1) == code_edit_prompts(3, seed=1)


def test_code_edit_prompt_holds_the_code_to_copy():
    prompt = code_edit_prompts(1, seed=0)[0]
    head, code = prompt.split("```python\n", 1)
    old = head.split("`")[1]
    assert old in code and code.count("\n") > 20
    assert prompt.endswith("Updated code:\n```python\n")


def test_long_prompts_fit_a_token_budget_exactly_with_a_counter():
    count = lambda text: len(text.split())           # a stand-in tokenizer: one token per word
    prompts = long_prompts(2, seed=0, num_tokens=500, count_tokens=count)
    for p in prompts:
        assert 490 <= count(p) <= 500
    assert prompts[0] != prompts[1]


def test_gamma_arrivals_mean_rate_and_burstiness():
    poisson = gamma_arrivals(4000, rate=4.0, burstiness=1.0, seed=0)
    bursty = gamma_arrivals(4000, rate=4.0, burstiness=0.25, seed=0)
    gaps = lambda ts: [b - a for a, b in zip([0.0] + ts, ts)]
    assert statistics.mean(gaps(poisson)) == pytest.approx(0.25, rel=0.1)
    assert statistics.mean(gaps(bursty)) == pytest.approx(0.25, rel=0.15)
    # coefficient of variation is 1/sqrt(shape): 1 for Poisson, 2 for shape 0.25
    cv = lambda g: statistics.pstdev(g) / statistics.mean(g)
    assert cv(gaps(poisson)) == pytest.approx(1.0, rel=0.15)
    assert cv(gaps(bursty)) == pytest.approx(2.0, rel=0.2)
    assert poisson == sorted(poisson)
    with pytest.raises(ValueError):
        gamma_arrivals(3, rate=0.0, burstiness=1.0, seed=0)


def test_cells_cover_every_workload_and_are_bounded():
    out = cells("smoke", seed=0)
    assert {c.workload for c in out} == {"chat", "code-edit", "long", "bursty"}
    for c in out:
        assert 0 < c.time_limit_s <= 120 and 0 < len(c.requests) <= 100
        assert (c.concurrency is None) != (c.rate is None)
    bursty = [c for c in out if c.workload == "bursty"][0]
    assert bursty.label.startswith("bursty") and bursty.requests[0].arrival_s > 0
    assert [c.requests for c in cells("smoke", seed=0)] == [c.requests for c in out]
