"""Probe (not a benchmark of record): the compare harness' cells (`compare.run_server`: workloads A
then B at c = 1, 8, 16, 8-s windows) against each server, with each cell's window printed on the
engine's clock, so that the engine's per-step dump (step_dump.patch, PROBE_STEPS=prefix) can be
cut per cell.

    git apply benchmarks/results/cpu/faser-host-probe/step_dump.patch
    PROBE_STEPS=/tmp/steps python benchmarks/results/cpu/faser-host-probe/cells.py \
        specserve-plain,specserve-ngram-adaptive 2 8 > cells.log
    git checkout scheduler/engine.py
"""
import sys
import time
from pathlib import Path

from specserve.loadtests import compare

LEVELS = [1, 8, 16]
windows: list[tuple[float, float]] = []
closed_loop = compare.run_closed_loop


async def timed_closed_loop(*args, **kwargs):
    """The harness' closed loop, its window kept on perf_counter's clock."""
    start = time.perf_counter()
    load = await closed_loop(*args, **kwargs)
    windows.append((start, time.perf_counter()))
    return load


def main() -> None:
    names, rounds, cell_s = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3])
    compare.run_closed_loop = timed_closed_loop
    loads = compare.workloads(0, 32)
    for rnd in range(rounds):
        for name in names:
            windows.clear()
            out = compare.run_server(name, loads, LEVELS, cell_s, Path("/tmp/faser-probe-logs"))
            for cell, (c0, c1) in zip(out["cells"], windows[1:]):      # windows[0]: warm-up
                print(f"CELL {rnd} {name} {cell.replace(' c=', '')} {c0:.6f} {c1:.6f}")
                print(f"{rnd} {name} {cell} {out['cells'][cell]['tok_s']} tok/s", flush=True)


if __name__ == "__main__":
    main()
