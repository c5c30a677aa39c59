"""One layer's paged attention for a prompt chunk over a long context on the CPU kernel
(`kernels/cpu/paged_attention.c`, rows in lanes): a benchmark, not a test.

SmolLM2-135M's attention shape (9 heads, 3 kv heads, head_dim 64, blocks of 16), random K/V and
queries; the chunk's `--rows` queries are the last of a context of `--context` tokens. Prints the
mean time of a call over ~2 s, for each thread count, `--rounds` times.

    python benchmarks/attention_chunk.py --context 2816 --rows 512 --threads 1 2 --rounds 2
"""
from __future__ import annotations

import argparse
import time

import torch

from specserve.kernels.cpu import paged_attention
from specserve.kernels.metadata import PagedAttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2816)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    blocks = args.context // BLOCK + 1
    k = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    q = torch.randn(args.rows, HEADS, HEAD_DIM, generator=g)
    meta = PagedAttentionMetadata([0, args.rows], [args.context], [list(range(blocks))], BLOCK)
    for r in range(args.rounds):
        for threads in args.threads:
            torch.set_num_threads(threads)
            paged_attention.paged_attention(q, k, v, meta, HEAD_DIM ** -0.5)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 2.0:
                paged_attention.paged_attention(q, k, v, meta, HEAD_DIM ** -0.5)
                n += 1
            ms = (time.perf_counter() - start) / n * 1e3
            print(f"round {r + 1} context {args.context} rows {args.rows} threads {threads}: "
                  f"{ms:.1f} ms")


if __name__ == "__main__":
    main()
