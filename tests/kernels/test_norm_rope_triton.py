"""The Triton RMSNorm (with and without the residual add), RoPE and split merge == their
references, under TRITON_INTERPRET=1 (in a child interpreter, so the flag never leaks into other
tests); dispatch routes to them under SPECSERVE_KERNELS=triton, and inputs a kernel does not take
(a strided norm input) go to the reference."""
from __future__ import annotations

CHILD = r'''
import torch
from specserve.kernels import dispatch
from specserve.kernels.reference import rms_norm as ref_norm, rope as ref_rope
from specserve.kernels.triton import rms_norm as tri_norm, rope as tri_rope
from specserve.kernels.triton.splits import combine_splits, merge_splits

for name in ("rms_norm", "add_rms_norm", "rope"):
    op = dispatch.get_op(name, "cpu")
    assert op.kernel.__module__.startswith("specserve.kernels.triton."), (name, op.kernel)
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
    x = torch.randn(7, 96).to(dtype)
    delta = torch.randn(7, 96).to(dtype)
    w = torch.rand(96) + 0.5
    torch.testing.assert_close(tri_norm.rms_norm(x, w, 1e-5), ref_norm.rms_norm(x, w, 1e-5),
                               rtol=tol, atol=tol)
    got_sum, got = tri_norm.add_rms_norm(x, delta, w, 1e-6)
    want_sum, want = ref_norm.add_rms_norm(x, delta, w, 1e-6)
    assert got_sum.dtype == dtype                                      # the add, in x's dtype
    # (the interpreter casts float32 to bf16 by truncation, a GPU rounds to nearest: bf16 within
    # an ulp here)
    torch.testing.assert_close(got_sum, want_sum, rtol=0 if dtype == torch.float32 else tol,
                               atol=0 if dtype == torch.float32 else tol)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # q and k inside a fused qkv row (a strided view), 6 + 2 heads of 16
    qkv = torch.randn(5, (6 + 2 + 2) * 16).to(dtype)
    qk = qkv[:, :8 * 16].view(5, 8, 16)
    angles = torch.rand(5, 1, 8) * 6.0
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    got, want = tri_rope.rope(qk, cos, sin), ref_rope.rope(qk, cos, sin)
    assert got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:                          # two products and a sum, no FMA
        assert torch.equal(got, want), (got - want).abs().max()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
# a strided norm input is not the kernel's: dispatch gives it to the reference
strided = torch.randn(4, 3, 32)[:, 1]
op = dispatch.get_op("rms_norm", "cpu")
assert not tri_norm.supports(strided, torch.ones(32), 1e-5)
assert torch.equal(op(strided, torch.ones(32), 1e-5),
                   ref_norm.rms_norm(strided, torch.ones(32), 1e-5))
# merge: several splits, some empty (lse -inf, out 0), against combine_splits
out = torch.randn(6, 3, 5, 16)
lse = torch.randn(6, 3, 5)
lse[:, :, 3:] = float("-inf")
out[:, :, 3:] = 0
torch.testing.assert_close(merge_splits(out, lse, torch.float32), combine_splits(out, lse)[0],
                           rtol=1e-6, atol=1e-6)
lse[:, :, 1:] = float("-inf")                 # one split holds everything: exactly its output
out[:, :, 1:] = 0
assert torch.equal(merge_splits(out, lse, torch.float32), out[:, :, 0])
print("ok norm rope merge")
'''


def test_triton_norm_rope_merge_match_references(triton_interpreted):
    triton_interpreted(CHILD, "ok norm rope merge")
