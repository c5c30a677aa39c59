"""Two builds of the CPU paged attention (`kernels/cpu/paged_attention.c` from two source folders,
e.g. a worktree of an older commit and this checkout) alternated in one process on the same
queries and caches: a benchmark, not a test. Prints each build's median time of one step's 30
layers, their ratio, and whether the two computed the same bits.

SmolLM2-135M's attention shape (9 heads, 3 kv heads, head_dim 64, blocks of 16, shuffled block
tables), random K/V over `--context` tokens; the request's `--rows` queries are the last of the
context (1: a decode; up to 9: a verify pass).

    git worktree add /tmp/old HEAD~1
    python benchmarks/attention_ab.py /tmp/old/kernels/cpu kernels/cpu --context 2800 \\
        --rows 1 3 9 --kv-cache-dtype auto bfloat16
"""
from __future__ import annotations

import time

import torch

from kernel_ab import alternate, builds, parser
from specserve.kernels.cpu import paged_attention
from specserve.kernels.metadata import PagedAttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
CACHE_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                "fp8": torch.float8_e4m3fn}


def main() -> None:
    ap = parser(__doc__.split("\n")[0], "paged_attention.c", alternations=12)
    ap.add_argument("--context", type=int, default=2800)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 9])
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=list(CACHE_DTYPES))
    args = ap.parse_args()
    forms = {tag: {d: paged_attention.bind(lib, d) for d in paged_attention.CACHE_DTYPES}
             for tag, lib in builds(args.a, args.b, "paged_attention.c").items()}
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    blocks = args.context // BLOCK + 1
    table = torch.randperm(blocks, generator=g).tolist()
    for name in args.kv_cache_dtype:
        dtype = CACHE_DTYPES[name]
        layers = [tuple(torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
                        for _ in range(2)) for _ in range(LAYERS)]
        for rows in args.rows:
            meta = PagedAttentionMetadata([0, rows], [args.context], [table], BLOCK)
            q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)

            def step(tag: str) -> list[torch.Tensor]:
                paged_attention._kernel = lambda d, t=tag: forms[t][d]
                return [paged_attention.paged_attention(q, k, v, meta, HEAD_DIM ** -0.5)
                        for k, v in layers]

            same = all(torch.equal(x, y) for x, y in zip(step("A"), step("B")))
            def timed(tag: str) -> float:
                step(tag)
                start = time.perf_counter()
                for _ in range(5):
                    step(tag)
                return (time.perf_counter() - start) / 5 * 1e3

            a, b = alternate(timed, args.alternations)
            print(f"{name} context {args.context} rows {rows}: A {a:.2f} ms, B {b:.2f} ms, "
                  f"B/A {b / a:.3f}, same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
