"""Mustafar's C pruning and bitmap encoding (`kernels/cpu/mustafar_encode.c`) == the references,
bit for bit, ties included (the lowest index keeps its place)."""
import pytest
import torch

from specserve.kernels import dispatch
from specserve.kernels.reference import mustafar_encode as ref


def _c(name):
    op = dispatch.cpu_kernel(name)
    assert op is not None and op.kernel.__module__ == "specserve.kernels.cpu.mustafar_encode"
    return op.kernel                                     # the kernel itself, never its fallback


@pytest.mark.parametrize("d,sparsity", [(64, 0.7), (64, 0.0), (64, 0.95), (128, 0.5),
                                        (32, 0.3)])
def test_pruning_equals_the_reference(d, sparsity):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(500, 3, d, generator=g).half()
    x[0, 0] = 0.0                                        # all zeros: any `keep` of them
    x[1, 0, ::2] = 0.5                                   # ties at the threshold
    x[1, 1, ::3] = -0.5
    x[2, 0, : d // 2] = -0.0
    got, want = _c("magnitude_prune")(x, sparsity), ref.magnitude_prune(x, sparsity)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    keep = d - int(sparsity * d)
    assert int((got != 0).sum(-1).max()) <= keep


def test_ties_keep_the_lowest_index():
    x = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 2.0, -2.0, 0.25]]).half()
    got = _c("magnitude_prune")(x, 0.5)                  # keep 4 of 8
    assert got.tolist() == [[0.0, 2.0, 2.0, 0.0, 2.0, 2.0, 0.0, 0.0]]


def test_encoding_equals_the_reference():
    g = torch.Generator().manual_seed(1)
    tiles = torch.randn(3000, 64, generator=g).half()
    tiles[torch.rand(3000, 64, generator=g) < 0.7] = 0
    tiles[5] = 0
    tiles[6, 10] = -0.0
    got, want = _c("mustafar_encode")(tiles), ref.mustafar_encode(tiles)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
