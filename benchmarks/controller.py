"""The FASER controller's own cost: time of one `DraftLengthController.choose` per step (a
benchmark).

It runs on every step's critical path, so its time adds to every step: small next to a CPU step,
several percent of a GPU step with CUDA graphs (0.12-0.17 ms of 2-3 ms; docs/BENCHMARKS.md §7.3).

    python benchmarks/controller.py --batch 8 32 64
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from specserve.scheduler.faser import CostModel, DraftLengthController


def time_choose(batch: int, k_max: int, pass_cost: float, repeats: int) -> float:
    ctl = DraftLengthController(k_max, cost=CostModel(0.03, 0.0002, pass_cost))
    ids = [f"r{i}" for i in range(batch)]
    rng = np.random.default_rng(0)
    # accepting ~90%: most candidate drafts are considered
    for r in ids:
        for _ in range(20):
            ctl.observe(r, k_max, int(rng.binomial(k_max, 0.9)))
    ctl.choose(ids, [k_max] * batch, batch)
    start = time.perf_counter()
    for _ in range(repeats):
        ctl.choose(ids, [k_max] * batch, batch)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print("| requests | k_max | choose ms (n-gram-like, c2 = 0) | choose ms (draft pass 10 ms) |")
    print("|---|---|---|---|")
    for b in args.batch:
        free, dear = (time_choose(b, args.k_max, c2, args.repeats) * 1e3 for c2 in (0.0, 0.01))
        print(f"| {b} | {args.k_max} | {free:.3f} | {dear:.3f} |", flush=True)


if __name__ == "__main__":
    main()
