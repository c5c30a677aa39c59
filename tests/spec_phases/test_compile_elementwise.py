"""SPECSERVE_COMPILE=1 swaps a layer's elementwise stages for torch.compile'd ones: same math.

Runs in a child interpreter: compiling replaces module-level functions for the whole process."""
from __future__ import annotations

import os
import subprocess
import sys

CHILD = r'''
import torch
from specserve.spec_phases import model as M
from specserve.spec_phases.loader import load_model

torch.manual_seed(0)
x, d, w = torch.randn(7, 64), torch.randn(7, 64), torch.rand(64)
qk, cos, sin, gu = torch.randn(7, 6, 16), torch.rand(7, 1, 8), torch.rand(7, 1, 8), torch.randn(7, 256)
args = {"rms_norm": (x, w, 1e-5), "add_rms_norm": (x, d, w, 1e-5), "rope": (qk, cos, sin), "silu_mul": (gu,)}
eager = {name: M.ELEMENTWISE[name](*a) for name, a in args.items()}
m = load_model("tiny-random", torch.float32, "cpu")
ids, pos = torch.tensor([5, 9, 13, 2]), torch.arange(4)

class Dense:                                       # causal attention over this call's tokens only
    def __call__(self, layer, q, k, v):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)

before = m(ids, pos, Dense())
M.compile_elementwise()
assert all(M.ELEMENTWISE[name] is not getattr(M, name) for name in args), M.ELEMENTWISE
for name, a in args.items():
    got, want = M.ELEMENTWISE[name](*a), eager[name]
    for g_, w_ in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-6)
after = m(ids, pos, Dense())
torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
print("ok compiled")
'''


def test_compiled_elementwise_stages_match_eager():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok compiled" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
