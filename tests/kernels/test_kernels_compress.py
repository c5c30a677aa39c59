"""Triton kernels of the KV compressors == their PyTorch references, under TRITON_INTERPRET=1.

Each case runs in a fresh interpreter (this file executed as a script) so that TRITON_INTERPRET=1
and SPECSERVE_KERNELS=triton never leak into other tests sharing the pytest process. The cases go
through `kernels.dispatch.get_op`, so they also check that dispatch picks the Triton kernel.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = ["spherical_encode", "spherical_attention", "mustafar_encode", "mustafar_attention"]


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case):
    import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)
    env = dict(os.environ, TRITON_INTERPRET="1", SPECSERVE_KERNELS="triton")
    proc = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ok {case}" in proc.stdout


# ---- cases (run in the child) -------------------------------------------------------------------

def _ops(name):
    import torch  # noqa: F401
    from specserve.kernels import dispatch
    fast = dispatch.get_op(name, "cpu")
    ref = dispatch.reference(name)
    assert isinstance(fast, dispatch.Kernel) and fast.kernel.__module__.startswith(
        "specserve.kernels.triton"), fast
    return fast.kernel, ref                      # the kernel itself, never its fallback


def case_spherical_encode():
    import torch
    fast, ref = _ops("spherical_encode")
    for h, t, d, g, k, page in [(2, 128, 64, 16, 64, 64), (1, 64, 64, 32, 8, 32),
                                (3, 32, 128, 16, 16, 16)]:
        torch.manual_seed(t + d)
        cb = torch.nn.functional.normalize(torch.randn(h, d // g, k, g), dim=-1)
        keys = torch.randn(h, t, d) * torch.rand(h, t, 1) * 5
        a, b = ref(keys, cb, page), fast(keys, cb, page)
        assert torch.equal(a[0], b[0]), "theta differs"
        assert (a[1].int() - b[1].int()).abs().max() <= 1 and (a[1] != b[1]).float().mean() < 0.01
        torch.testing.assert_close(a[2], b[2], rtol=1e-6, atol=1e-6)
    from specserve.kernels import dispatch           # pages under 16 tokens: the reference serves
    op = dispatch.get_op("spherical_encode", "cpu")
    cb = torch.nn.functional.normalize(torch.randn(3, 8, 16, 16), dim=-1)
    keys = torch.randn(3, 16, 128)
    assert op.supports(keys, cb, 16) and not op.supports(keys, cb, 8)
    assert all(torch.equal(a, b) for a, b in zip(op(keys, cb, 8), ref(keys, cb, 8)))


def case_spherical_attention():
    import torch
    fast, ref = _ops("spherical_attention")
    for nq, hq, h, t, d, g, k, page in [(2, 6, 2, 128, 64, 16, 64, 64), (1, 3, 3, 40, 64, 32, 8, 8),
                                        (3, 4, 1, 100, 128, 16, 16, 4)]:
        torch.manual_seed(t)
        cb = torch.nn.functional.normalize(torch.randn(h, d // g, k, g), dim=-1)
        theta = torch.randint(0, k, (h, t, d // g), dtype=torch.uint8)
        radius = torch.randint(0, 256, (h, t, d // g), dtype=torch.uint8)
        scale = torch.rand(h, t // page, d // g) * 4
        v = torch.randn(h, t, d).half()
        q = torch.randn(nq, hq, d)
        (o1, l1), (o2, l2) = ref(q, theta, radius, scale, cb, v, 0.125, page), \
            fast(q, theta, radius, scale, cb, v, 0.125, page)
        torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)


def case_mustafar_encode():
    import torch
    fast, ref = _ops("mustafar_encode")
    for n, density in [(1, 1.0), (7, 0.3), (16, 0.0), (5, 0.9)]:
        torch.manual_seed(n)
        x = torch.randn(n, 64).half()
        x[torch.rand(n, 64) >= density] = 0
        for a, b in zip(ref(x), fast(x)):
            assert torch.equal(a, b)


def case_mustafar_attention():
    import torch
    from specserve.kernels.reference.mustafar_encode import mustafar_encode
    fast, ref = _ops("mustafar_attention")
    for nq, hq, h, nb, d, density in [(2, 6, 2, 2, 64, 0.3), (1, 2, 1, 1, 128, 1.0),
                                      (3, 3, 3, 1, 64, 0.05)]:
        torch.manual_seed(nb * d)
        t = nb * 64
        keys, vals = torch.randn(h, t, d), torch.randn(h, t, d)
        keys[torch.rand(h, t, d) >= density] = 0
        vals[torch.rand(h, t, d) >= density] = 0
        kb, ko, kv = mustafar_encode(keys.reshape(h, nb, 64, d).transpose(2, 3).reshape(-1, 64))
        vb, vo, vv = mustafar_encode(vals.reshape(-1, 64))
        args = (kb.view(h, nb, d), ko.view(h, nb, d), kv,
                vb.view(h, t, d // 64), vo.view(h, t, d // 64), vv, 0.1)
        q = torch.randn(nq, hq, d)
        (o1, l1), (o2, l2) = ref(q, *args), fast(q, *args)
        torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from specserve.kernels.triton import splits
    # attention: one split at these sizes, then several merged (encoders do not split)
    for min_split in (splits.MIN_SPLIT_TOKENS, 64) if sys.argv[1].endswith("attention") else (0,):
        splits.MIN_SPLIT_TOKENS = min_split or splits.MIN_SPLIT_TOKENS
        globals()[f"case_{sys.argv[1]}"]()
    if sys.argv[1].endswith("attention"):                 # the t = 128 cases split in two at 64
        assert splits.plan_splits(128, 2 * 6, 64)[0] == 2
    print(f"ok {sys.argv[1]}")
