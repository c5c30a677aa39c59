"""The C RoPE (kernels/cpu/rope.py): bitwise the reference's result (two products and a sum, each
rounded), on the strided q/k view the model passes, and the dispatch's choice (C for float32 on
CPU, the reference for other dtypes)."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import dispatch
from specserve.kernels.cpu import rope as cpu_rope
from specserve.kernels.reference import rope as ref_rope


def tables(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = torch.outer(positions.double(), inv)
    cos, sin = freqs.cos().float(), freqs.sin().float()
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (7, 4, 2, 32),
                                                       (40, 2, 1, 6), (0, 3, 1, 8)])
def test_bitwise_the_reference_on_the_models_strided_view(tokens, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(tokens * 10 + dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 4
    qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)   # row-strided
    cos, sin = tables(torch.randint(0, 5000, (tokens,), generator=g), dim)
    got = cpu_rope.rope(qk, cos, sin)
    assert got.shape == qk.shape and got.is_contiguous()
    assert torch.equal(got, ref_rope.rope(qk, cos, sin))
    assert torch.equal(qkv[:, :(heads + kv_heads) * dim].view_as(qk), qk)      # input untouched


def test_rows_do_not_depend_on_the_batch():
    qk, (cos, sin) = torch.randn(6, 5, 16), tables(torch.arange(6) * 37, 16)
    whole = cpu_rope.rope(qk, cos, sin)
    assert torch.equal(cpu_rope.rope(qk[2:3], cos[2:3], sin[2:3]), whole[2:3])


def test_dispatch_runs_c_for_float32_and_the_reference_otherwise():
    op = dispatch.get_op("rope", "cpu")
    assert isinstance(op, dispatch.Kernel) and op.kind == "C"
    x, (cos, sin) = torch.randn(3, 2, 8).bfloat16(), tables(torch.arange(3), 8)
    assert not cpu_rope.supports(x, cos, sin)
    got = op(x, cos, sin)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref_rope.rope(x, cos, sin))
