"""Two builds of the one-call C decoder (`kernels/cpu/decoder.c`, with the kernels it includes,
from two source folders, e.g. a worktree of an older commit and this checkout) alternated step by
step in one engine on the embedded model: a benchmark, not a test. Prints each build's median
step time at each concurrency and their ratio.

    git worktree add /tmp/old HEAD~1
    python benchmarks/decoder_ab.py /tmp/old/kernels/cpu kernels/cpu --concurrency 1 16
"""
from __future__ import annotations

import time

from kernel_ab import alternate, builds, parser
from profile_step import requests as add_requests     # the same prompts as the profile's
from specserve.kernels.cpu import decoder as fused
from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore


def main() -> None:
    ap = parser(__doc__.split("\n")[0], "decoder.c", alternations=100)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    kernels = {tag: fused.bind(lib) for tag, lib in builds(args.a, args.b, "decoder.c").items()}
    core = EngineCore(EngineConfig(num_threads=args.threads))

    def run(tag: str) -> float:
        fused._kernel = lambda: kernels[tag]
        start = time.perf_counter()
        core.step()
        return time.perf_counter() - start

    for conc in args.concurrency:
        add_requests(core, conc, 100, 8 + 2 * args.alternations)
        for _ in range(8):                                   # prefill and warm-up
            core.step()
        a, b = alternate(run, args.alternations)
        print(f"c={conc}: A {a * 1e3:.2f} ms, B {b * 1e3:.2f} ms a step, B/A {b / a:.3f}",
              flush=True)
        core.run_until_idle()


if __name__ == "__main__":
    main()
