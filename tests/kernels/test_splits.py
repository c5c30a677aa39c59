"""The split-context merge used by the compressed-attention kernels is exact (pure PyTorch)."""
from __future__ import annotations

import torch

from specserve.kernels.triton.splits import combine_splits, plan_splits


def test_plan_splits_covers_the_context_with_non_empty_block_multiples():
    for tokens in (1, 63, 64, 65, 1000, 4096, 65536):
        for pairs in (1, 9, 81, 5000):
            n, split = plan_splits(tokens, pairs, 64)
            assert split % 64 == 0 and n >= 1
            assert (n - 1) * split < tokens <= n * split          # the last split is non-empty
            # short splits cost more than they save
            assert n == 1 or split >= 1024
            if pairs >= 1024 or tokens < 2048:
                assert n == 1
    assert plan_splits(65536, 9, 64)[0] >= 50                     # a long decode fills the GPU


def test_combine_splits_equals_one_softmax_over_the_whole_context():
    torch.manual_seed(0)
    logits, values = torch.randn(3, 5, 300) * 4, torch.randn(300, 8)
    want_lse = torch.logsumexp(logits, -1)
    want = torch.softmax(logits, -1) @ values
    cuts = [0, 64, 128, 200, 300]
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        part = logits[..., a:b]
        outs.append(torch.softmax(part, -1) @ values[a:b])
        lses.append(torch.logsumexp(part, -1))
    out, lse = combine_splits(torch.stack(outs, -2), torch.stack(lses, -1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    one, one_lse = combine_splits(want[..., None, :], want_lse[..., None])
    assert torch.equal(one, want) and torch.equal(one_lse, want_lse)
