"""The server's acceptance is lossless: tokens emitted by `Verifier.verify` (and by
`FrontierVerifier`, frontiers of one draft) follow the target distribution whatever the one-hot
draft, and the mean emitted length is the rejection-sampling formula.

Every drafter here proposes one-hot drafts, so acceptance is: each row draws the token plain
sampling would draw there, a draft is kept while it equals that token (`spec_phases/verify.py`).
These tests run that code, the real `Sampler` included, on N independent requests whose target row
is fixed: a stand-in runner returns the same logits for every row, so only sampling is tested."""
import math

import pytest
import torch
from scipy.stats import chisquare

from specserve.spec_phases.frontiers import FrontierVerifier
from specserve.spec_phases.plan import ScheduledRequest
from specserve.spec_phases.sampler import Sampler
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.spec_phases.verify import Verifier

N = 12_000
PARAMS = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)


class FixedRowRunner:
    """The runner's interface with every row's logits log(target): forward returns one hidden row
    per computed token, compute_logits maps each to the target."""

    def __init__(self, target: torch.Tensor):
        self.logits = target.double().log().float()          # log 0 = -inf: outside the support
        self.forwards = 0

    def forward(self, token_lists, starts, block_tables, layers=None) -> torch.Tensor:
        self.forwards += 1
        return torch.zeros(sum(len(t) for t in token_lists), 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(hidden.shape[0], -1).clone()

    def prompt_logprobs(self, reqs, drafts, hidden, out) -> None:
        pass


def verify(target: torch.Tensor, draft: int, k: int, seed: int,
           frontier_size: int = 0) -> list[list[int]]:
    """N requests, each with k copies of the one-hot draft `draft`: the tokens each emits."""
    runner = FixedRowRunner(target)
    sampler = Sampler(len(target), eos_token_ids=(), device="cpu", seed=seed)
    verifier = (FrontierVerifier(runner, sampler, None, frontier_size=frontier_size)
                if frontier_size else Verifier(runner, sampler, None))
    reqs = tuple(ScheduledRequest(f"r{i}", (0,), 4, k, (), True, PARAMS, num_prompt_tokens=4,
                                  num_output_tokens=0) for i in range(N))
    result = verifier.verify(reqs, [[draft] * k for _ in reqs])
    return [result.sampled[r.request_id].token_ids for r in reqs]


def expected(counts: torch.Tensor, probs: torch.Tensor):
    probs = probs.double()
    return (counts.sum() * probs / probs.sum()).numpy()


CASES = {
    "likely draft": (torch.tensor([0.5, 0.3, 0.2]), 0),
    "unlikely draft": (torch.tensor([0.5, 0.3, 0.2]), 2),
    "draft outside the support": (torch.tensor([0.7, 0.3, 0.0, 0.0]), 3),
    "peaked target": (torch.tensor([0.05, 0.05, 0.1, 0.8]), 0),
}


@pytest.mark.parametrize("frontier_size", [0, 1])
@pytest.mark.parametrize("name", list(CASES))
def test_first_emitted_token_follows_the_target(name, frontier_size):
    target, draft = CASES[name]
    tokens = verify(target, draft, k=1, seed=list(CASES).index(name), frontier_size=frontier_size)
    counts = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=len(target)).double()
    support = target > 0
    assert counts[~support].sum() == 0
    p = chisquare(counts[support].numpy(), expected(counts[support], target[support])).pvalue
    assert p > 0.01, f"{name}: chi-square p = {p}"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mean_emitted_length_matches_the_formula(k):
    """A one-hot draft x is accepted with probability alpha = p(x) at each position: the expected
    number of emitted tokens is (1 - alpha^(k+1)) / (1 - alpha)."""
    target = torch.tensor([0.6, 0.25, 0.15])
    tokens = verify(target, 0, k=k, seed=k)
    alpha = float(target[0])
    emitted = sum(map(len, tokens)) / N
    assert emitted == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha), rel=0.03)


@pytest.mark.parametrize("frontier_size", [0, 1, 2])
def test_every_later_position_follows_the_target_too(frontier_size):
    target = torch.tensor([0.5, 0.3, 0.2])
    tokens = verify(target, 1, k=3, seed=5, frontier_size=frontier_size)
    for pos in range(1, 4):                              # tokens emitted at position pos
        got = torch.tensor([t[pos] for t in tokens if len(t) > pos])
        counts = torch.bincount(got, minlength=3).double()
        assert chisquare(counts.numpy(), expected(counts, target)).pvalue > 0.01


def test_a_certain_draft_is_always_kept_and_a_forbidden_one_never():
    certain = torch.tensor([0.0, 0.0, 1.0, 0.0])         # the target always says 2
    assert all(t == [2, 2, 2] for t in verify(certain, 2, k=2, seed=0)[:50])
    assert all(t == [2] for t in verify(certain, 1, k=2, seed=0)[:50])


def test_acceptance_rate_at_one_position_is_the_drafts_probability():
    target = torch.tensor([0.5, 0.3, 0.2])
    tokens = verify(target, 1, k=1, seed=9)
    rate = sum(len(t) == 2 for t in tokens) / N
    assert abs(rate - 0.3) < 4 * math.sqrt(0.3 * 0.7 / N)
