"""Milliseconds per engine step, in-process, decode at c = 1 and c = 16 on the embedded model (a
benchmark, not a test): prompts of 100 + 7i random tokens, 6 warm-up steps, then `--steps` timed.

    python benchmarks/step_time.py [--steps 40] [--dtype auto] [--kernel-times]

--kernel-times adds, per step, the one-call decoder's wall time and its own timers' linear layers
(the LM head is outside the call), attention and elementwise kernels (`decoder_timers.py`).

To compare two commits on one host, alternate runs of each: check the other commit out in a
worktree, point a directory's `specserve` symlink at it and put that directory first on
PYTHONPATH (the editable install's finder comes after sys.path), e.g.
    git worktree add /tmp/old <rev> && mkdir -p /tmp/oldpkg && ln -s /tmp/old /tmp/oldpkg/specserve
    PYTHONPATH=/tmp/oldpkg python benchmarks/step_time.py      # prints which tree it ran
"""
from __future__ import annotations

import argparse
import time

import decoder_timers
import specserve
from profile_step import requests as add_requests     # the same prompts as the profile's
from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kernel-times", action="store_true")
    args = ap.parse_args()
    if args.kernel_times:
        decoder_timers.install()
    core = EngineCore(EngineConfig(dtype=args.dtype))
    cells = []
    for conc in (1, 16):
        add_requests(core, conc, 100, 6 + args.steps)
        for _ in range(6):                                   # prefill and warm-up
            core.step()
        decoder_timers.reset()
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        cells.append(f"c={conc} {(time.perf_counter() - start) * 1000 / args.steps:.1f}")
        if args.kernel_times:
            call = sum(c[1] for c in decoder_timers.CALLS) * 1000 / args.steps
            lin, attn, elem = (decoder_timers.SECONDS * 1000 / args.steps).tolist()
            cells[-1] += (f" (decoder call {call:.2f}: linear {lin:.2f}, attention {attn:.2f},"
                          f" elementwise {elem:.2f})")
        core.run_until_idle()
    print(f"{specserve.__path__[0]}: ms per step " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
