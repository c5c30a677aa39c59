"""The C paged attention (kernels/cpu): the reference's results on mixed batches (decodes, verify
rows, prefill chunks; GQA, sliding windows, soft-capping, head sizes off the 8-float lanes), rows
that are bit-identical whatever shares the call, and the dispatch's choice and fallback."""
from __future__ import annotations

import logging

import pytest
import torch

from specserve.kernels import dispatch
from specserve.kernels.cpu import native
from specserve.kernels.cpu import paged_attention as cpu_paged
from specserve.kernels.metadata import PagedAttentionMetadata
from specserve.kernels.reference.paged_attention import paged_attention as reference


def make_batch(shapes, block_size, num_heads, num_kv, dim, seed=0, num_blocks=96):
    """shapes: (context length, new queries) per request; blocks drawn at random from the pool."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks * block_size, num_kv, dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, num_kv, dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, query_start, used = [], [0], 0
    for length, num_q in shapes:
        nb = -(-length // block_size)
        tables.append(tuple(perm[used:used + nb]))
        used += nb
        query_start.append(query_start[-1] + num_q)
    q = torch.randn(query_start[-1], num_heads, dim, generator=g)
    return q, k_cache, v_cache, query_start, tables


def meta_of(shapes, query_start, tables, block_size):
    return PagedAttentionMetadata(list(query_start), [s[0] for s in shapes], list(tables),
                                  block_size)


def dot_form(cache_dtype, dim) -> bool:
    """Whether the kernel reads this cache on the bf16 dot-product units (this build's form)."""
    return cache_dtype == torch.bfloat16 and dim % 32 == 0 and cpu_paged.bf16_dot()


SEGMENT = 512          # paged_attention_dot.h's DOT_SEG: keys whose softmax is taken together


def rounded_reference(q, k_cache, v_cache, shapes, query_start, tables, block_size, scale,
                      window=0, softcap=0.0):
    """The dot form's arithmetic in float64: each query rounded to bfloat16; the keys a row sees
    taken in segments of SEGMENT (by key index), each segment's weights exp(s - its maximum)
    rounded to bfloat16 (from float32) and their sum unrounded; the segments' weighed values and
    sums scaled to the row's maximum, summed, and divided."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[1]
    qb = q.bfloat16().double()
    for b, (length, num_q) in enumerate(shapes):
        slots = torch.tensor([tables[b][j // block_size] * block_size + j % block_size
                              for j in range(length)])
        k, v = k_cache[slots].double(), v_cache[slots].double()
        for i in range(num_q):
            pos = length - num_q + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(q.shape[1]):
                s = k[lo:pos + 1, h // group] @ qb[query_start[b] + i, h] * scale
                if softcap:
                    s = torch.tanh(s / softcap) * softcap
                top, acc, total = s.max(), 0.0, 0.0
                for a in range(lo - lo % SEGMENT, pos + 1, SEGMENT):
                    seg = slice(max(a, lo) - lo, min(a + SEGMENT, pos + 1) - lo)
                    e = torch.exp(s[seg] - s[seg].max())
                    w = e.float().bfloat16().double()
                    shift = torch.exp(s[seg].max() - top)
                    acc = acc + (w[:, None] * v[lo:pos + 1][seg, h // group]).sum(0) * shift
                    total = total + e.sum() * shift
                out[query_start[b] + i, h] = (acc / total).float()
    return out


def assert_rounded_alike(got, want):
    """Within float32 rounding of the rounded reference but for rare weights whose bfloat16
    rounding flips with the float32 score's last bits (a flip moves an output by < 1e-2)."""
    diff = (got - want).abs()
    assert float((diff > 1e-5).float().mean()) < 2e-3, float(diff.max())
    assert float(diff.max()) < 1e-2


@pytest.mark.parametrize("num_heads,num_kv,dim", [(9, 3, 64), (4, 4, 20), (8, 2, 16)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (6, 0.0), (0, 5.0), (11, 3.0)])
def test_matches_reference_on_mixed_batches(num_heads, num_kv, dim, window, softcap):
    block_size = 4
    # decodes, verify rows (up to the 16-row short limit), prefill chunks (first and later), a
    # context on a block boundary and one just past it
    shapes = [(9, 1), (13, 5), (20, 20), (37, 17), (16, 1), (17, 3), (30, 16), (22, 22), (1, 1)]
    q, k_cache, v_cache, query_start, tables = make_batch(shapes, block_size, num_heads, num_kv,
                                                          dim)
    scale = dim ** -0.5
    # the reference in float64: torch's float32 path has given a first soft-capped call that
    # differs from its own later calls by ~1e-4 (right after a kernel build in the process)
    want = reference(q.double(), k_cache.double(), v_cache.double(),
                     meta_of(shapes, query_start, tables, block_size), scale, window,
                     softcap).float()
    assert cpu_paged.supports(q, k_cache, v_cache, None, scale)
    got = cpu_paged.paged_attention(q, k_cache, v_cache,
                                    meta_of(shapes, query_start, tables, block_size), scale,
                                    window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_takes_strided_queries():
    """q as the model hands it: a view of the q-and-k tensor (rows further apart than the heads)."""
    shapes = [(12, 1), (7, 3)]
    qk, k_cache, v_cache, query_start, tables = make_batch(shapes, 4, 6, 2, 8)
    q = qk[:, :4]
    assert not q.is_contiguous()
    meta = lambda: meta_of(shapes, query_start, tables, 4)  # noqa: E731
    torch.testing.assert_close(cpu_paged.paged_attention(q, k_cache, v_cache, meta(), 0.3),
                               reference(q.contiguous(), k_cache, v_cache, meta(), 0.3),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_heads,num_kv,dim,window,softcap,cache_dtype", [
    (9, 3, 64, 0, 0.0, torch.float32), (9, 3, 64, 0, 0.0, torch.bfloat16),
    (4, 2, 24, 50, 0.0, torch.float32), (6, 6, 12, 0, 4.0, torch.float32),
    (2, 1, 88, 0, 0.0, torch.bfloat16), (9, 3, 64, 0, 0.0, torch.float8_e4m3fn),
    (4, 2, 20, 50, 2.0, torch.float8_e4m3fn), (9, 3, 64, 1030, 0.0, torch.bfloat16)])
def test_rows_do_not_depend_on_what_shares_the_call(threads, num_heads, num_kv, dim, window,
                                                    softcap, cache_dtype):
    """A verify row, or a prompt chunk's row (the chunk cut into tiles, run rows in lanes),
    computes bit for bit what the decode at its position computes alone, over short and long
    contexts, and a request's rows are the same with or without neighbours (any thread count;
    head sizes on and off the vector widths, sliding windows, soft-capping, bf16 and fp8
    caches)."""
    torch.set_num_threads(threads)
    block_size = 16
    shapes = [(150, 5), (40, 1), (211, 16), (97, 3), (60, 40), (35, 35), (1100, 70),
              (930, 17), (300, 9)]
    q, k_cache, v_cache, query_start, tables = make_batch(shapes, block_size, num_heads, num_kv,
                                                          dim, num_blocks=200)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = dim ** -0.5
    opts = dict(window=window, softcap=softcap)
    batch = cpu_paged.paged_attention(q, k_cache, v_cache,
                                      meta_of(shapes, query_start, tables, block_size), scale,
                                      **opts)
    for b, (length, num_q) in enumerate(shapes):
        for i in range(num_q):
            row = query_start[b] + i
            alone = cpu_paged.paged_attention(
                q[row:row + 1], k_cache, v_cache,
                meta_of([(length - num_q + i + 1, 1)], [0, 1], [tables[b]], block_size), scale,
                **opts)
            assert torch.equal(alone[0], batch[row]), (b, i)
        own = cpu_paged.paged_attention(
            q[query_start[b]:query_start[b + 1]], k_cache, v_cache,
            meta_of([shapes[b]], [0, num_q], [tables[b]], block_size), scale, **opts)
        assert torch.equal(own, batch[query_start[b]:query_start[b + 1]])
    rows = [query_start[1], query_start[3] + 2]      # two decodes: (40, 1) and 97's last row
    two = cpu_paged.paged_attention(q[rows], k_cache, v_cache,
                                    meta_of([(40, 1), (97, 1)], [0, 1, 2],
                                            [tables[1], tables[3]], block_size), scale, **opts)
    assert torch.equal(two, batch[rows])
    if dot_form(cache_dtype, dim):
        assert_rounded_alike(batch, rounded_reference(q, k_cache, v_cache, shapes, query_start,
                                                      tables, block_size, scale, **opts))
        return
    torch.testing.assert_close(
        batch, reference(q, k_cache, v_cache, meta_of(shapes, query_start, tables, block_size),
                         scale, window, softcap), rtol=1e-5, atol=1e-5)


def test_a_chunk_goes_in_as_tiles_ending_at_their_last_row():
    """Every query is the C kernel's, however long its context: a prompt chunk is cut into tiles
    of SHORT_QUERY rows, each a request ending at its last row's position."""
    shapes = [(40, 30), (9, 1), (28, 20)]
    _, _, _, query_start, tables = make_batch(shapes, 4, 6, 2, 16)
    short = cpu_paged.short_requests(meta_of(shapes, query_start, tables, 4))
    assert short.requests.tolist() == [[0, 16, 26], [16, 14, 40], [30, 1, 9], [31, 16, 24],
                                       [47, 4, 28]]


def test_dispatch_picks_the_c_kernel_on_cpu_and_reference_when_forced(monkeypatch):
    op = dispatch.get_op("paged_attention", "cpu")
    assert isinstance(op, dispatch.Kernel) and op.kind == "C"
    monkeypatch.setenv("SPECSERVE_KERNELS", "reference")
    assert dispatch.get_op("paged_attention", "cpu") is reference


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_heads,num_kv,dim", [(9, 3, 64), (4, 4, 20), (8, 2, 16)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (6, 0.0), (11, 3.0)])
def test_a_narrow_cache_is_the_float32_kernel_on_the_widened_cache(num_heads, num_kv, dim, window,
                                                                   softcap, cache_dtype):
    """--kv-cache-dtype bfloat16 / fp8: the kernel's bf16 and fp8 forms widen each value exactly
    and sum in the float32 form's order, so their rows are bit for bit the float32 kernel's over
    the widened cache (decodes, verify rows, chunks in tiles; a 9-row pass, in tiles over fp8 and
    row by row over float32). The fp8 cache holds every e4m3 value: subnormals, the largest
    (448), both zeros."""
    shapes = [(9, 1), (13, 5), (20, 20), (37, 17), (16, 1), (30, 16), (40, 30), (1, 1), (50, 9)]
    q, k32, v32, query_start, tables = make_batch(shapes, 4, num_heads, num_kv, dim)
    k16, v16 = k32.to(cache_dtype), v32.to(cache_dtype)
    if cache_dtype == torch.float8_e4m3fn:
        codes = torch.arange(256, dtype=torch.int32)
        codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)            # every value but NaN
        g = torch.Generator().manual_seed(1)
        k16, v16 = (codes[torch.randint(len(codes), k32.shape, generator=g)].view(cache_dtype)
                    for _ in range(2))
    assert cpu_paged.supports(q, k16, v16, None, 0.3)
    meta = lambda: meta_of(shapes, query_start, tables, 4)  # noqa: E731
    got = cpu_paged.paged_attention(q, k16, v16, meta(), dim ** -0.5, window, softcap)
    if dot_form(cache_dtype, dim):           # its own arithmetic: test_the_dot_form_* below
        return
    want = cpu_paged.paged_attention(q, k16.float(), v16.float(), meta(), dim ** -0.5, window,
                                     softcap)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    atol = 1e-4 * float(v16.float().abs().max())     # fp8: values to 448, scores to thousands
    torch.testing.assert_close(got, reference(q, k16, v16, meta(), dim ** -0.5, window, softcap),
                               rtol=1e-4, atol=atol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_heads,num_kv,dim,window,softcap", [
    (9, 3, 64, 0, 0.0), (8, 2, 128, 6, 0.0), (4, 4, 32, 11, 3.0), (16, 2, 64, 0, 0.0),
    (6, 1, 96, 0, 0.0)])
def test_the_dot_form_rounds_queries_and_weights_to_bf16(threads, num_heads, num_kv, dim, window,
                                                         softcap):
    """A bfloat16 cache on the bf16 dot-product units (where the build has them): each row is
    the rounded reference's (queries and weights in bfloat16, sums in float32), decodes, verify
    rows and prompt tiles alike, over contexts on and off the 16-key blocks; and the float64
    reference's within bfloat16's precision. A build without them widens the cache: the float32
    kernel's rows over the widened cache."""
    torch.set_num_threads(threads)
    shapes = [(150, 5), (40, 1), (211, 16), (97, 3), (60, 40), (35, 35), (300, 9), (1, 1),
              (17, 2)]
    q, k, v, query_start, tables = make_batch(shapes, 16, num_heads, num_kv, dim,
                                              num_blocks=200)
    k, v = k.bfloat16(), v.bfloat16()
    meta = meta_of(shapes, query_start, tables, 16)
    got = cpu_paged.paged_attention(q, k, v, meta, dim ** -0.5, window, softcap)
    if not cpu_paged.bf16_dot():
        assert torch.equal(got, cpu_paged.paged_attention(q, k.float(), v.float(), meta,
                                                          dim ** -0.5, window, softcap))
        return
    assert_rounded_alike(got, rounded_reference(q, k, v, shapes, query_start, tables, 16,
                                                dim ** -0.5, window, softcap))
    torch.testing.assert_close(got, reference(q.double(), k.double(), v.double(), meta,
                                              dim ** -0.5, window, softcap).float(),
                               rtol=0, atol=2e-2)


def test_bf16_queries_go_to_the_reference():
    shapes = [(12, 1), (7, 2)]
    q, k_cache, v_cache, query_start, tables = make_batch(shapes, 4, 4, 2, 8)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    assert not cpu_paged.supports(q, k_cache, v_cache, None, 0.3)
    assert not cpu_paged.supports(q.float(), k_cache.half(), v_cache.half(), None, 0.3)
    op = dispatch.Kernel("paged_attention", cpu_paged, "C")
    meta = lambda: meta_of(shapes, query_start, tables, 4)  # noqa: E731
    assert torch.equal(op(q, k_cache, v_cache, meta(), 0.3),
                       reference(q, k_cache, v_cache, meta(), 0.3))


def test_without_a_compiler_the_reference_serves(monkeypatch, tmp_path, caplog):
    """No C compiler (or a failed build): one error in the log, then the reference's results."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.library.cache_clear()
    cpu_paged._kernel.cache_clear()
    try:
        op = dispatch.Kernel("paged_attention", cpu_paged, "C")
        shapes = [(12, 1), (7, 3)]
        q, k_cache, v_cache, query_start, tables = make_batch(shapes, 4, 4, 2, 8)
        meta = lambda: meta_of(shapes, query_start, tables, 4)  # noqa: E731
        with caplog.at_level(logging.ERROR, logger="specserve.kernels.dispatch"):
            first = op(q, k_cache, v_cache, meta(), 0.3)
            second = op(q, k_cache, v_cache, meta(), 0.3)
        assert op.unusable is not None and "BuildError" in op.unusable
        assert sum("unusable" in r.message for r in caplog.records) == 1
        want = reference(q, k_cache, v_cache, meta(), 0.3)
        assert torch.equal(first, want) and torch.equal(second, want)
        assert not list(tmp_path.glob("kernels/*"))         # nothing half-built left behind
    finally:
        native.library.cache_clear()
        cpu_paged._kernel.cache_clear()


def test_an_unwritable_cache_is_a_build_error(monkeypatch, tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "not-a-dir"))
    with pytest.raises(native.BuildError, match="kernel cache"):
        native.build("paged_attention")


def test_a_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    (tmp_path / "cc").write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake-cc 1 && exit 0\n"
                                 "echo 'broken compiler' >&2; exit 1\n")
    (tmp_path / "cc").chmod(0o755)
    monkeypatch.setenv("CC", str(tmp_path / "cc"))
    with pytest.raises(native.BuildError, match="broken compiler"):
        native.build("paged_attention")
    assert not list((tmp_path / "kernels").iterdir())


def test_a_kernel_is_rebuilt_when_a_source_it_includes_changes(monkeypatch, tmp_path):
    """`decoder.c` is built from the other kernels' sources (`#include "linear.c"`): its cache key
    covers them, so a change to one of them cannot leave a stale library in the cache."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path)
    (tmp_path / "outer.c").write_text('#include "inner.c"\nint outer(void) { return inner(); }\n')
    (tmp_path / "inner.c").write_text("static int inner(void) { return 1; }\n")
    first = native.build("outer")
    assert native.build("outer") == first                          # cached
    (tmp_path / "inner.c").write_text("static int inner(void) { return 2; }\n")
    second = native.build("outer")
    assert second != first and second.exists()
