"""The rejection sampler is lossless: emitted tokens follow the target, whatever the draft."""
import pytest
import torch
from scipy.stats import chisquare

from specserve.kernels.dispatch import get_op

rejection_sample = get_op("rejection_sample")
N = 12_000


def draws(target, draft_token, draft_dist, seed, k=1):
    """N independent requests sharing one target row per position, each with k drafts."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.shape[-1]
    target_probs = target.expand(N, k + 1, vocab)
    if draft_dist is None:
        drafts = torch.full((N, k), draft_token)
        draft_probs = None
    else:
        drafts = torch.multinomial(draft_dist, N * k, replacement=True, generator=g).view(N, k)
        draft_probs = draft_dist.expand(N, k, vocab)
    uniforms = 1.0 - torch.rand(N, k, generator=g)
    noise = torch.empty(N, vocab).exponential_(generator=g)
    return rejection_sample(target_probs, drafts, torch.full((N,), k), draft_probs, uniforms, noise)


def expected(counts, probs):
    probs = probs.double()
    return (counts.sum() * probs / probs.sum()).numpy()


CASES = {
    "one-hot draft, likely token": (torch.tensor([0.5, 0.3, 0.2]), 0, None),
    "one-hot draft, unlikely token": (torch.tensor([0.5, 0.3, 0.2]), 2, None),
    "one-hot draft outside the support": (torch.tensor([0.7, 0.3, 0.0, 0.0]), 3, None),
    "close draft distribution": (torch.tensor([0.4, 0.3, 0.2, 0.1]), None,
                                 torch.tensor([0.35, 0.3, 0.25, 0.1])),
    "badly disagreeing draft": (torch.tensor([0.05, 0.05, 0.1, 0.8]), None,
                                torch.tensor([0.8, 0.1, 0.05, 0.05])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_first_emitted_token_follows_the_target(name):
    target, draft_token, draft_dist = CASES[name]
    tokens, _ = draws(target, draft_token, draft_dist, seed=list(CASES).index(name))   # fixed seeds
    counts = torch.bincount(tokens[:, 0], minlength=len(target)).double()
    support = target > 0
    assert counts[~support].sum() == 0
    p = chisquare(counts[support].numpy(), expected(counts[support], target[support])).pvalue
    assert p > 0.01, f"{name}: chi-square p = {p}"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mean_accepted_length_matches_the_formula(k):
    target = torch.tensor([0.6, 0.25, 0.15])
    draft = torch.tensor([0.3, 0.4, 0.3])
    alpha = float(torch.minimum(target, draft).sum())            # acceptance rate = 1 - TV
    _, num_accepted = draws(target, None, draft, seed=k, k=k)
    emitted = (num_accepted + 1).double().mean().item()
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert emitted == pytest.approx(expected, rel=0.03)


def test_every_later_position_follows_the_target_too():
    target = torch.tensor([0.5, 0.3, 0.2])
    tokens, num_accepted = draws(target, 1, None, seed=5, k=3)
    for pos in range(1, 4):                                      # tokens emitted at position pos
        got = tokens[num_accepted >= pos, pos]
        counts = torch.bincount(got, minlength=3).double()
        assert chisquare(counts.numpy(), expected(counts, target)).pvalue > 0.01


def test_padding_rows_and_zero_drafts():
    target = torch.zeros(2, 3, 4)
    target[:, :, 2] = 1.0                                        # the target always says 2
    drafts = torch.tensor([[2, 1], [0, 0]])
    out, acc = rejection_sample(target, drafts, torch.tensor([2, 0]), None, torch.ones(2, 2),
                                torch.ones(2, 4))
    assert out.tolist() == [[2, 2, -1], [2, -1, -1]] and acc.tolist() == [1, 0]
