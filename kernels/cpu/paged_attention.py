"""Paged attention on the CPU (float32 queries; a float32, bfloat16 or fp8 e4m3 cache): every
query of a step in one call of the C kernel `paged_attention.c`, which reads K/V from the paged
cache in place. Decodes and verify rows (q_len <= SHORT_QUERY) go in as they are; a prompt chunk
goes in as tiles of SHORT_QUERY rows, each tile a request of its own that ends at its last row.
The kernel's float32 and widening forms run a request of 10 rows or more (9 over an fp8 cache)
in lanes, a shorter one (decodes, short verify passes) row by row. A row's output depends only
on its query and the keys it sees, by construction (see the C source): a prompt row computes
bit for bit what a decode at its position computes, whatever the chunking, the context length or
what shares the call.

An fp8 e4m3 cache (`--kv-cache-dtype fp8`) is read by the kernel's fp8 form, which widens each
value exactly to float32 and sums in the float32 form's order (bit for bit the float32 kernel over
the widened cache). A bfloat16 cache (the CPU's default under `--dtype auto`) is read on the bf16
dot-product units where the build has them (AVX512-BF16, head sizes a multiple of 32:
`paged_attention_dot.h`, `bf16_dot()`): queries and softmax weights rounded to bfloat16, every
row the same arithmetic, so rows stay invariant; elsewhere like fp8, by widening.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from specserve.kernels.cpu.native import BuildError, library
from specserve.kernels.metadata import PagedAttentionMetadata
from specserve.kernels.reference.paged_attention import SHORT_QUERY

FAILURES = (BuildError,)
# caches the kernel reads (float32 queries), and the suffix of the form that reads each
CACHE_DTYPES = {torch.float32: "", torch.bfloat16: "_bf16", torch.float8_e4m3fn: "_fp8"}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _kernel(cache_dtype: torch.dtype = torch.float32):
    """The C kernel's form that reads a cache of `cache_dtype` (CACHE_DTYPES)."""
    return bind(library("paged_attention"), cache_dtype)


@functools.cache
def bf16_dot() -> bool:
    """Whether this build reads a bfloat16 cache on the bf16 dot-product units (queries and
    weights rounded to bfloat16) rather than widening it to float32."""
    return bool(library("paged_attention").paged_attention_bf16_dot())


def bind(lib: ctypes.CDLL, cache_dtype: torch.dtype):
    """`lib`'s form of the kernel that reads a cache of `cache_dtype`, with its C signature (a
    build of `paged_attention.c`: the cached one, or another, `benchmarks/attention_ab.py`)."""
    fn = getattr(lib, "paged_attention_short" + CACHE_DTYPES[cache_dtype])
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                   _i64, ctypes.c_float, _i64, ctypes.c_float, ctypes.c_int]
    return fn


@dataclass(frozen=True)
class ShortRequests:
    """The step's queries as the kernel reads them: short requests, and prefill chunks cut into
    tiles of at most SHORT_QUERY rows (a tile of rows a..b of a chunk is a request of b - a rows
    whose context ends at row b's position)."""
    requests: torch.Tensor          # [n, 3] int64: first query row, q_len, seq_len
    tables: torch.Tensor            # [n, width] int64 block ids (padded with 0)


def short_requests(meta: PagedAttentionMetadata) -> ShortRequests:
    """Built once per step (every layer reuses it)."""
    return meta.memo("cpu_short", lambda: _short_requests(meta))


def _short_requests(meta: PagedAttentionMetadata) -> ShortRequests:
    rows, tables = [], []
    for b, seq_len in enumerate(meta.seq_lens):
        start, q_len = meta.query_start[b], meta.query_start[b + 1] - meta.query_start[b]
        table = meta.block_tables[b][:-(-seq_len // meta.block_size)]
        for first in range(0, q_len, SHORT_QUERY):
            rows_in = min(SHORT_QUERY, q_len - first)
            rows.append((start + first, rows_in, seq_len - q_len + first + rows_in))
            tables.append(table)
    width = max((len(t) for t in tables), default=1)
    padded = [list(t) + [0] * (width - len(t)) for t in tables]
    return ShortRequests(torch.tensor(rows, dtype=torch.int64).reshape(-1, 3),
                         torch.tensor(padded, dtype=torch.int64).reshape(-1, width))


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: PagedAttentionMetadata, scale: float, window: int = 0,
             softcap: float = 0.0) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_DTYPES
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """The reference's signature and result: q [num_tokens, num_heads, D] float32; k_cache,
    v_cache [num_slots, num_kv_heads, D] (one layer, CACHE_DTYPES) -> [num_tokens,
    num_heads, D] float32."""
    num_heads, head_dim = q.shape[1:]
    out = torch.empty(q.shape, dtype=q.dtype)
    short = short_requests(meta)
    if not short.requests.shape[0]:
        return out
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    kernel = _kernel(k_cache.dtype)
    status = kernel(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                    out.data_ptr(), out.stride(0), short.requests.data_ptr(),
                    short.tables.data_ptr(), short.tables.shape[1], short.requests.shape[0],
                    num_heads, k_cache.shape[1], head_dim, meta.block_size, scale, window,
                    softcap, torch.get_num_threads())
    if status:
        raise MemoryError("paged_attention_short: no scratch memory")
    return out
