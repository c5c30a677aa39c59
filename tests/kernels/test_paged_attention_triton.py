"""The Triton paged attention == the reference on a mixed batch, under TRITON_INTERPRET=1 (in a child
interpreter, so the interpreter flag never leaks into other tests)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r'''
import torch
from specserve.kernels import dispatch
from specserve.kernels.reference.paged_attention import PagedAttentionMetadata

from specserve.kernels.triton import splits

fast, ref = dispatch.get_op("paged_attention", "cpu"), dispatch.reference("paged_attention")
assert fast.__module__ == "specserve.kernels.triton.paged_attention", fast.__module__
cases = [
        # (context length, new queries): decodes, verify rows, prefill chunks (first and later), block edges
        (4, 4, 2, 16, [(9, 1), (13, 4), (20, 20), (37, 17), (16, 1), (17, 3)], torch.float32),
        (16, 6, 2, 32, [(300, 1), (150, 9), (64, 1), (65, 2), (1, 1)], torch.float32),
        (16, 3, 3, 64, [(200, 5), (33, 33), (90, 1)], torch.bfloat16)]
for (block_size, heads, kv_heads, dim, shapes, dtype), min_split in [(c, m) for m in (1024, 64) for c in cases]:
    splits.MIN_SPLIT_TOKENS = min_split          # one split at these sizes, then several merged
    torch.manual_seed(block_size + dim)
    num_blocks = sum(-(-n // block_size) for n, _ in shapes) + 3
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    perm = torch.randperm(num_blocks).tolist()
    tables, query_start, used = [], [0], 0
    for length, num_q in shapes:
        nb = -(-length // block_size)
        tables.append(perm[used:used + nb])
        used += nb
        query_start.append(query_start[-1] + num_q)
    q = torch.randn(query_start[-1], heads + kv_heads, dim).to(dtype)[:, :heads]   # a strided view, as in the model
    lens = [s[0] for s in shapes]
    want = ref(q, k_cache, v_cache, PagedAttentionMetadata(query_start, lens, tables, block_size), dim ** -0.5)
    got = fast(q, k_cache, v_cache, PagedAttentionMetadata(query_start, lens, tables, block_size), dim ** -0.5)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
print("ok paged")
'''


def test_triton_paged_attention_matches_reference():
    import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)
    env = dict(os.environ, TRITON_INTERPRET="1", SPECSERVE_KERNELS="triton", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok paged" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
