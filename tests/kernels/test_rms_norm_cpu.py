"""The C RMSNorm (kernels/cpu/rms_norm.py): the reference's results with and without the residual
add, rows independent of each other, and the dispatch's choice (C for float32 on CPU, the
reference for other dtypes)."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import dispatch
from specserve.kernels.cpu import rms_norm as cpu_norm
from specserve.kernels.reference import rms_norm as ref_norm


@pytest.mark.parametrize("rows,width", [(0, 576), (1, 576), (5, 64), (70, 576), (3, 20)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_matches_the_reference(rows, width, eps):
    g = torch.Generator().manual_seed(rows * 100 + width)
    x, delta = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    w = torch.rand(width, generator=g) + 0.5
    torch.testing.assert_close(cpu_norm.rms_norm(x, w, eps), ref_norm.rms_norm(x, w, eps),
                               rtol=1e-5, atol=1e-5)
    got_sum, got_norm = cpu_norm.add_rms_norm(x, delta, w, eps)
    want_sum, want_norm = ref_norm.add_rms_norm(x, delta, w, eps)
    assert torch.equal(got_sum, want_sum)                   # the add is one rounding either way
    torch.testing.assert_close(got_norm, want_norm, rtol=1e-5, atol=1e-5)


def test_strided_heads_and_row_independence():
    """q/k norms see [tokens, heads, head_dim] views of a wider tensor; a row's result is the
    same alone as in a batch."""
    qkv = torch.randn(9, 12, 64)
    heads, w = qkv[:, :9], torch.rand(64) + 0.5
    got = cpu_norm.rms_norm(heads, w, 1e-6)
    assert got.shape == heads.shape
    torch.testing.assert_close(got, ref_norm.rms_norm(heads.contiguous(), w, 1e-6),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_norm.rms_norm(heads[4:5], w, 1e-6), got[4:5])


def test_forced_triton_runs_the_reference_where_no_triton_kernel_exists(monkeypatch):
    monkeypatch.setenv("SPECSERVE_KERNELS", "triton")
    assert dispatch.get_op("dense_attention", "cpu") is dispatch.reference("dense_attention")
    assert dispatch.get_op("rms_norm", "cpu").kind == "Triton"
    assert dispatch.get_op("paged_attention", "cpu").kind == "Triton"


def test_dispatch_runs_c_for_float32_and_the_reference_otherwise():
    op = dispatch.get_op("add_rms_norm", "cpu")
    assert isinstance(op, dispatch.Kernel) and op.kind == "C"
    x, d, w = torch.randn(3, 16).bfloat16(), torch.randn(3, 16).bfloat16(), torch.rand(16)
    assert not cpu_norm.supports(x, d, w, 1e-6)
    got = op(x, d, w, 1e-6)
    want = ref_norm.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].dtype == torch.bfloat16
