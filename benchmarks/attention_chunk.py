"""Paged attention on the CPU kernel (`kernels/cpu/paged_attention.c`) for one request's query
rows over a long context: a benchmark, not a test.

SmolLM2-135M's attention shape (9 heads, 3 kv heads, head_dim 64, blocks of 16), random K/V and
queries; the request's `--rows` queries are the last of a context of `--context` tokens (1: a
decode; up to 9: a verify pass, row by row; more: rows in lanes, as a prompt chunk's tiles).
`--layers` caches are attended in turn, as a step walks the model's layers (30 spills the cache
out of L2 and L3 like a real step; 1 keeps it there). Prints the mean time of one call per
layer, times the layers, over ~2 s, for each thread count, `--rounds` times.

    python benchmarks/attention_chunk.py --context 2816 --rows 512 --threads 1 2 --rounds 2
    python benchmarks/attention_chunk.py --context 2800 --rows 1 9 --layers 30 --threads 2 \\
        --kv-cache-dtype auto bfloat16 fp8
"""
from __future__ import annotations

import argparse
import time

import torch

from specserve.kernels.cpu import paged_attention
from specserve.kernels.metadata import PagedAttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CACHE_DTYPES = {"auto": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2816)
    ap.add_argument("--rows", type=int, nargs="+", default=[512])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=list(CACHE_DTYPES))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    blocks = args.context // BLOCK + 1
    meta = {rows: PagedAttentionMetadata([0, rows], [args.context], [list(range(blocks))], BLOCK)
            for rows in args.rows}
    q = {rows: torch.randn(rows, HEADS, HEAD_DIM, generator=g) for rows in args.rows}
    caches = {name: [(torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
                      torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype))
                     for _ in range(args.layers)]
              for name, dtype in ((n, CACHE_DTYPES[n]) for n in args.kv_cache_dtype)}
    for r in range(args.rounds):
        for name, layers in caches.items():
            for rows in args.rows:
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    for k, v in layers:
                        paged_attention.paged_attention(q[rows], k, v, meta[rows],
                                                        HEAD_DIM ** -0.5)
                    start, n = time.perf_counter(), 0
                    while time.perf_counter() - start < 2.0:
                        for k, v in layers:
                            paged_attention.paged_attention(q[rows], k, v, meta[rows],
                                                            HEAD_DIM ** -0.5)
                        n += 1
                    ms = (time.perf_counter() - start) / n * 1e3
                    print(f"round {r + 1} {name} context {args.context} rows {rows} "
                          f"layers {args.layers} threads {threads}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
