"""The C gated activations (kernels/cpu/activation.py): silu(gate) * up and GeGLU's
gelu_tanh(gate) * up within a few float32 roundings of the exact value (its own exp, not
torch's), at the extremes they meet, over row tails that are not a multiple of 8 lanes, rows
independent of each other and of the row stride, and the dispatch's choice (C for float32 on
CPU, the reference for other dtypes)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import dispatch
from specserve.kernels.cpu import activation as cpu_activation
from specserve.kernels.reference import activation as ref_activation


def exact(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows,n", [(0, 64), (1, 1536), (5, 13), (70, 64), (3, 7)])
def test_within_float32_rounding_of_the_exact_value(rows, n):
    g = torch.Generator().manual_seed(rows * 100 + n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 6
    got = cpu_activation.silu_mul(gate_up)
    assert got.shape == (rows, n)
    err = (got.double() - exact(gate_up)).abs()
    # two roundings of torch's formula plus exp's error: a few units in the last place
    assert (err <= 4e-7 * exact(gate_up).abs() + 1e-38).all()
    torch.testing.assert_close(got, ref_activation.silu_mul(gate_up), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("op,ideal,gate,rtol", [
    ("silu_mul", "exact", [-1000.0, -100.0, -88.0, -20.0, 0.0, 1e-30, 20.0, 88.0, 100.0, 1000.0],
     4e-7),
    ("gelu_tanh_mul", "exact_gelu_tanh",
     [-1000.0, -100.0, -20.0, -5.0, 0.0, 1e-30, 5.0, 20.0, 100.0, 1000.0], 4e-6)])
def test_extremes(op, ideal, gate, rtol):
    """Large negative gates give (nearly) zero, large positive ones the gate itself, no NaN."""
    gate = torch.tensor(gate)
    gate_up = torch.cat((gate, torch.full_like(gate, 2.0)))
    got = getattr(cpu_activation, op)(gate_up[None])[0]
    assert torch.isfinite(got).all()
    assert (got[:3].abs() < 1e-30).all() and got[4] == 0
    torch.testing.assert_close(got[3:], globals()[ideal](gate_up[None])[0, 3:].float(), rtol=rtol,
                               atol=1e-38)


def test_rows_independent_of_each_other_and_of_the_stride():
    wide = torch.randn(9, 3 * 40)
    gate_up = wide[:, :80]                                       # row stride 120, not 80
    got = cpu_activation.silu_mul(gate_up)
    assert torch.equal(got, cpu_activation.silu_mul(gate_up.contiguous()))
    for r in (0, 4, 8):
        assert torch.equal(cpu_activation.silu_mul(gate_up[r:r + 1]), got[r:r + 1])
    out = torch.empty(9, 40)
    cpu_activation.glu_into(gate_up, out, "silu")
    assert torch.equal(out, got)


def test_dispatch_runs_c_for_float32_and_the_reference_otherwise():
    op = dispatch.get_op("silu_mul", "cpu")
    assert isinstance(op, dispatch.Kernel) and op.kind == "C"
    x = torch.randn(3, 16)
    assert torch.equal(op(x), cpu_activation.silu_mul(x))
    xb = x.bfloat16()
    assert torch.equal(op(xb), ref_activation.silu_mul(xb))


def exact_gelu_tanh(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@pytest.mark.parametrize("rows,n", [(0, 64), (1, 1536), (5, 13), (70, 64), (3, 7)])
def test_gelu_tanh_within_float32_rounding_of_the_exact_value(rows, n):
    """GeGLU's activation (Gemma), computed as g / (1 + exp(-2 z)): within a few float32 roundings
    of the exact value wherever that is not vanishingly small, and torch's float32 formula's
    (whose 1 + tanh(z) cancels for negative gates) within its own error."""
    g = torch.Generator().manual_seed(rows * 100 + n + 1)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 4
    got = cpu_activation.gelu_tanh_mul(gate_up)
    assert got.shape == (rows, n)
    want = exact_gelu_tanh(gate_up)
    err = (got.double() - want).abs()
    # the cubic's roundings grow through exp by |2 z|: a few ulp times that at |g| <= ~16
    assert (err <= 4e-6 * want.abs() + 1e-12).all()
    torch.testing.assert_close(got, ref_activation.gelu_tanh_mul(gate_up), rtol=1e-5, atol=1e-6)


def test_gelu_tanh_rows_independent_and_dispatched():
    wide = torch.randn(9, 3 * 40)
    gate_up = wide[:, :80]
    got = cpu_activation.gelu_tanh_mul(gate_up)
    assert torch.equal(got, cpu_activation.gelu_tanh_mul(gate_up.contiguous()))
    for r in (0, 4, 8):
        assert torch.equal(cpu_activation.gelu_tanh_mul(gate_up[r:r + 1]), got[r:r + 1])
    op = dispatch.get_op("gelu_tanh_mul", "cpu")
    assert isinstance(op, dispatch.Kernel) and op.kind == "C"
    assert torch.equal(op(gate_up), got)
    xb = gate_up.bfloat16()
    assert torch.equal(op(xb), ref_activation.gelu_tanh_mul(xb))
