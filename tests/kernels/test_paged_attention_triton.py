"""The Triton paged attention == the reference on a mixed batch, under TRITON_INTERPRET=1 (in a
child interpreter, so the interpreter flag never leaks into other tests)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

CHILD = r'''
import torch
from specserve.kernels import dispatch
from specserve.kernels.metadata import PagedAttentionMetadata

from specserve.kernels.triton import paged_attention as pa

op, ref = dispatch.get_op("paged_attention", "cpu"), dispatch.reference("paged_attention")
fast = op.kernel                                 # the kernel itself, never its fallback
assert fast.__module__ == "specserve.kernels.triton.paged_attention", fast.__module__
cases = [
        # (context length, new queries): decodes, verify rows, prefill chunks (first and
        # later), block edges
        (4, 4, 2, 16, [(9, 1), (13, 4), (20, 20), (37, 17), (16, 1), (17, 3)], torch.float32),
        (16, 6, 2, 32, [(300, 1), (150, 9), (64, 1), (65, 2), (1, 1)], torch.float32),
        (16, 3, 3, 64, [(200, 5), (33, 33), (90, 1)], torch.bfloat16)]
several = False
for (block_size, heads, kv_heads, dim, shapes, dtype), min_split in [
        (c, m) for m in (1024, 64) for c in cases]:
    pa.SPLIT_TOKENS = min_split                  # one split at these sizes, then several merged
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
    # a strided view, as in the model
    q = torch.randn(query_start[-1], heads + kv_heads, dim).to(dtype)[:, :heads]
    lens = [s[0] for s in shapes]
    several |= max(lens) > pa.SPLIT_TOKENS
    # plain; a sliding window (Mistral, Gemma) with a soft-cap (Gemma 2), applied to the scores
    for window, softcap in [(0, 0.0), (7, 0.0), (20, 1.5)] if min_split == 64 else [(0, 0.0)]:
        meta = lambda: PagedAttentionMetadata(query_start, lens, tables, block_size)  # noqa: E731
        want = ref(q, k_cache, v_cache, meta(), dim ** -0.5, window, softcap)
        got = fast(q, k_cache, v_cache, meta(), dim ** -0.5, window, softcap)
        assert got.dtype == q.dtype and got.shape == q.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        if window:
            plain = ref(q, k_cache, v_cache, meta(), dim ** -0.5)
            assert not torch.allclose(got.float(), plain.float(), atol=1e-2)
assert several                                   # the merge of several splits was exercised
print("ok paged")
'''


def test_triton_paged_attention_matches_reference(triton_interpreted):
    triton_interpreted(CHILD, "ok paged")


INVARIANT = r'''
import sys
import torch
from specserve.kernels import dispatch
from specserve.kernels.metadata import PagedAttentionMetadata
from specserve.kernels.triton import paged_attention as pa

dev = sys.argv[1]                                # cpu (interpreted) or cuda
fast = dispatch.get_op("paged_attention", dev).kernel
assert fast.__module__ == "specserve.kernels.triton.paged_attention", fast.__module__
torch.manual_seed(0)
bs, heads, kv_heads, dim = 16, 6, 2, 32
k = torch.randn(420 * bs, kv_heads, dim).to(dev, torch.bfloat16)
v = torch.randn(420 * bs, kv_heads, dim).to(dev, torch.bfloat16)
q = torch.randn(16, heads, dim).to(dev, torch.bfloat16)
mine = list(range(0, 170))                       # the row's request: 2500 tokens of context
other = list(range(170, 420))                    # a longer one beside it: 4000 tokens


def run(query_start, lens, tables):
    return fast(q[:query_start[-1]], k, v,
                PagedAttentionMetadata(query_start, lens, tables, bs), dim ** -0.5)


alone = run([0, 1], [2500], [mine])[0]           # a decode, alone in its step
# the same row beside a longer request (more splits in the launch), then as the first row of a
# verify pass (drafts after it: a longer context of its own, masked for this row)
beside = run([0, 1, 2], [2500, 4000], [mine, other])[0]
drafts = run([0, 5, 6], [2504, 4000], [mine, other])[0]
assert torch.equal(alone, beside) and torch.equal(alone, drafts)
# a prompt of 40 rows at positions 2460..2499, as one chunk and as two (23 + 17 rows; the tiles
# fall elsewhere): each row equals the row alone as a decode at its position
qp = torch.randn(40, heads, dim).to(dev, torch.bfloat16)
whole = fast(qp, k, v, PagedAttentionMetadata([0, 40], [2500], [mine], bs), dim ** -0.5)
parts = torch.cat([fast(qp[:23], k, v, PagedAttentionMetadata([0, 23], [2483], [mine], bs),
                        dim ** -0.5),
                   fast(qp[23:], k, v, PagedAttentionMetadata([0, 17], [2500], [mine], bs),
                        dim ** -0.5)])
for row in (0, 15, 16, 22, 23, 39):
    single = fast(qp[row:row + 1], k, v,
                  PagedAttentionMetadata([0, 1], [2461 + row], [mine], bs), dim ** -0.5)[0]
    assert torch.equal(whole[row], single) and torch.equal(parts[row], single), row
print("ok invariant")
'''


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_attention_does_not_depend_on_its_step(device, triton_interpreted):
    """A decode row's output is bit for bit the same alone, beside a longer request, as the
    first row of a verify pass, and as a row of a prompt chunk however the prompt is chunked: the
    splits are fixed in length and merged in order and prompt rows take the same kernel in tiles,
    so neither the batch, the drafts after a row nor the chunking change its sums (lossless
    speculation on the GPU)."""
    if device == "cpu":
        triton_interpreted(INVARIANT, "ok invariant", "cpu")
        return
    proc = subprocess.run([sys.executable, "-c", INVARIANT, "cuda"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "ok invariant" in proc.stdout, proc.stderr[-4000:]


def _mixed_batch(head_dim: int):
    import torch

    from specserve.kernels.metadata import PagedAttentionMetadata
    torch.manual_seed(head_dim)
    k_cache, v_cache = torch.randn(64, 2, head_dim), torch.randn(64, 2, head_dim)
    # a decode, verify rows, a prefill chunk
    q = torch.randn(1 + 3 + 20, 4, head_dim)
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11]]

    def meta():
        return PagedAttentionMetadata([0, 1, 4, 24], [9, 13, 20], tables, 4)
    return q, k_cache, v_cache, meta


def test_the_reference_serves_when_the_kernel_cannot(monkeypatch):
    """A kernel that fails to compile or fit on this GPU, or a head size it cannot tile, must not
    stop serving: dispatch falls back to the reference (and remembers a failure)."""
    from triton.runtime.errors import OutOfResources

    from specserve.kernels import dispatch
    from specserve.kernels.triton import paged_attention as tpa

    class Failing:
        calls = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Failing.calls += 1
                raise OutOfResources(300_000, 232_448, "shared memory")
            return launch

    monkeypatch.setattr(tpa, "_paged_kernel", Failing())
    op = dispatch.Kernel("paged_attention", tpa)                   # fresh: not the cached one
    ref = dispatch.reference("paged_attention")
    q, k, v, meta = _mixed_batch(16)
    assert (op(q, k, v, meta(), 0.25) == ref(q, k, v, meta(), 0.25)).all()
    assert Failing.calls == 1 and "OutOfResources" in op.unusable
    op(q, k, v, meta(), 0.25)                                      # remembered: no second attempt
    assert Failing.calls == 1
    op = dispatch.Kernel("paged_attention", tpa)
    # not a power of two: never launched
    q, k, v, meta = _mixed_batch(48)
    assert (op(q, k, v, meta(), 0.25) == ref(q, k, v, meta(), 0.25)).all()
    assert Failing.calls == 1 and op.unusable is None
