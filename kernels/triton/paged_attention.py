"""Paged attention (Triton) for every query row (decodes, verify rows, prompt chunks), read in
place through the block tables.

The reference gathers each request's keys into a padded tensor per layer (a copy of the whole
context every layer) and runs SDPA. Here one kernel serves every row: a request's query rows are
cut into tiles of at most SHORT_QUERY rows, and one program per (tile, head, split of the context)
loads its tile as one [SHORT_QUERY, D] block, walks the context up to the tile's last row BN keys
at a time (each key's slot looked up in the block table and read once for all the tile's rows, so
a 9-row verify pass costs about what a decode costs), masks causally per row and keeps an online
softmax per row; splits are merged exactly, in order, by `merge_splits`. The splits are
SPLIT_TOKENS long whatever the batch, and keys past a row's position add exact zeros, so a row's
result depends on its own position and keys alone: not on the rows beside it, the drafts after
it, a graph's planned width, or how a prompt was chunked (a prompt row computes what the same row
as a decode would). Same contract as kernels/reference/paged_attention.py.
`paged_attention_static` is the same kernel over fixed-shape device metadata, for CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from specserve.kernels.metadata import PagedAttentionMetadata, StaticBatchMetadata
from specserve.kernels.reference.paged_attention import SHORT_QUERY
from specserve.kernels.triton.splits import merge_splits

BN = 64                 # keys a program scores at a time
SPLIT_TOKENS = 512      # keys a program walks (a multiple of BN), the same for every batch
NUM_WARPS, NUM_STAGES = 4, 3
# the dots' precision for a 16-bit query over a 16-bit or fp8 cache: both are exact in tf32 and
# only the probabilities lose bits past tf32's 10 (FlashAttention's bf16 P loses more); H200, 64K
# x 16 requests: 0.67 ms against 4.58 in "ieee". A float32 query or cache: "ieee".
NARROW_DOT = "tf32"
FAILURES = (CompilationError, OutOfResources)   # the kernel cannot run here: the reference serves


@triton.jit
def _paged_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, req_ptr, first_ptr, qlen_ptr, seqlen_ptr,
                  tables_ptr,
                  table_width, NUM_HEADS, GROUP, SPLIT, sm_scale, q_stride, kv_stride, WINDOW,
                  SOFTCAP, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                  QB: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT: tl.constexpr):
    i = tl.program_id(0)                        # i-th tile of query rows
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    kvh = head // GROUP
    req = tl.load(req_ptr + i)
    first = tl.load(first_ptr + i)              # its first query row in q
    q_len = tl.load(qlen_ptr + i)
    seq_len = tl.load(seqlen_ptr + i)
    offs_j = tl.arange(0, QB)                   # query rows of this tile (padded to QB)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    row_ok = offs_j < q_len
    # each row's absolute position: keys 0..qpos (causal)
    qpos = seq_len - q_len + offs_j
    q = tl.load(q_ptr + (first + offs_j[:, None]) * q_stride + head * D + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)               # [QB, D]
    m = tl.zeros([QB], tl.float32) - float("inf")
    l = tl.zeros([QB], tl.float32)
    acc = tl.zeros([QB, D], tl.float32)
    end = tl.minimum(seq_len, (split + 1) * SPLIT)
    for start in range(split * SPLIT, end, BN):
        t = start + offs_n
        valid = t < end
        block = tl.load(tables_ptr + req * table_width + t // BS, mask=valid, other=0).to(tl.int64)
        kv_off = (block * BS + t % BS)[:, None] * kv_stride + kvh * D + offs_d[None, :]
        # [BN, D], read once per request (not per row), widened to fp32 (Triton's interpreter, in
        # CI, has no bf16 dot); dots in DOT's precision
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT) * sm_scale                  # [QB, BN]
        if HAS_SOFTCAP:                       # cap * tanh(s / cap), tanh(x) = 2 sigmoid(2x) - 1
            s = SOFTCAP * (2 * tl.sigmoid(2 * s / SOFTCAP) - 1)
        seen = (t[None, :] <= qpos[:, None]) & valid[None, :]
        seen = seen & ((WINDOW == 0) | (t[None, :] > qpos[:, None] - WINDOW))       # sliding window
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                 # rows with no key yet
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT)
        m = m_new
    has = l > 0                                 # a split past a row's context holds nothing for it
    out = acc / tl.where(has, l, 1.0)[:, None]
    part = ((first + offs_j) * NUM_HEADS + head) * num_splits + split
    tl.store(out_ptr + part[:, None] * D + offs_d[None, :], tl.where(has[:, None], out, 0.0),
             mask=row_ok[:, None])
    tl.store(lse_ptr + part, tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf")),
             mask=row_ok)


def _row_tiles(meta: PagedAttentionMetadata, device) -> tuple | None:
    """(request index, first row, rows, context through the tile's last row, block tables [B, W]
    int32, max context) of every tile of at most SHORT_QUERY query rows; built once per step and
    shared by every layer. A tile is given the context its last row sees, so the kernel walks no
    key past it and masks the tile's earlier rows causally."""
    return meta.memo("triton_tiles", lambda: _build_tiles(meta, device))


def _build_tiles(meta: PagedAttentionMetadata, device) -> tuple | None:
    reqs, firsts, qlens, lens = [], [], [], []
    for b, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start[b], meta.query_start[b + 1]
        for first in range(start, end, SHORT_QUERY):
            last = min(first + SHORT_QUERY, end)
            reqs.append(b)
            firsts.append(first)
            qlens.append(last - first)
            lens.append(seq_len - (end - last))
    if not reqs:
        return None
    width = max(len(t) for t in meta.block_tables) or 1
    tables = torch.zeros(len(meta.block_tables), width, dtype=torch.int32)
    for b, table in enumerate(meta.block_tables):
        tables[b, :len(table)] = torch.tensor(list(table), dtype=torch.int32)

    def as_dev(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)
    return (as_dev(reqs), as_dev(firsts), as_dev(qlens), as_dev(lens), tables.to(device),
            max(lens))


def tiles(head_dim: int) -> bool:
    """Head sizes the kernel can tile: a power of two, at least 16."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: PagedAttentionMetadata, scale: float, window: int = 0,
             softcap: float = 0.0) -> bool:
    """Heads the kernel tiles (`tiles`; others go to the reference)."""
    return tiles(q.shape[2])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Same contract as kernels/reference/paged_attention.py (dispatch falls back to it for
    unsupported head sizes and when the kernel cannot run here). A sliding window is masked (its
    keys are still walked); the soft-cap is applied to the scores before the mask. Rows past the
    last request's (padding) are left undefined."""
    plan = _row_tiles(meta, q.device)
    if plan is None:
        return torch.empty_like(q)
    reqs, firsts, qlens, lens, tables, max_ctx = plan
    part_out, part_lse = _tile_splits(q, k_cache, v_cache, reqs, firsts, qlens, lens, tables,
                                      max_ctx, meta.block_size, scale, window, softcap)
    return merge_splits(part_out, part_lse, q.dtype)


def paged_attention_static(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: StaticBatchMetadata, scale: float, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """Decode and verify rows whose metadata is device tensors of fixed shape: nothing is built on
    the host, so a CUDA graph can capture it. The splits are planned for the longest context the
    tables hold; a split past a request's context holds nothing and merges away exactly. Rows no
    request owns (padding) are left undefined."""
    part_out, part_lse = _tile_splits(
        q, k_cache, v_cache, meta.requests, meta.first_rows, meta.query_lens, meta.seq_lens,
        meta.block_tables, meta.max_context, meta.block_size, scale, window, softcap)
    return merge_splits(part_out, part_lse, q.dtype)


def _tile_splits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        reqs: torch.Tensor, firsts: torch.Tensor, qlens: torch.Tensor,
                        lens: torch.Tensor, tables: torch.Tensor, max_ctx: int, block_size: int,
                        scale: float, window: int, softcap: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over tiles of query rows: per query row, head and split of the context, the
    partial output [rows, heads, splits, D] and log-sum-exp [rows, heads, splits] (rows in no
    tile are left unwritten)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert k_cache.stride(1) == head_dim and k_cache.stride(2) == 1
    assert v_cache.stride() == k_cache.stride()
    # (padded query rows are masked out; q may be a view of rows with a stride, not of heads)
    qc = q if q.stride(2) == 1 and q.stride(1) == head_dim else q.contiguous()
    split = SPLIT_TOKENS
    num_splits = -(-max_ctx // split)
    part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                           device=q.device)
    dot = "ieee" if torch.float32 in (q.dtype, k_cache.dtype) else NARROW_DOT
    _paged_kernel[(reqs.shape[0], num_heads, num_splits)](
        qc, k_cache, v_cache, part_out, part_lse, reqs, firsts, qlens, lens, tables,
        tables.shape[1],
        num_heads, num_heads // num_kv_heads, split, scale, qc.stride(0), k_cache.stride(0),
        window, float(softcap), D=head_dim, BS=block_size, BN=BN, QB=SHORT_QUERY,
        HAS_SOFTCAP=bool(softcap), DOT=dot, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return part_out, part_lse
