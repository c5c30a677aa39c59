"""Probe (not a benchmark of record): does the compare harness' 8-s window decide FASER x plain on
workload B? Runs `compare.run_server` on workload B alone at c = 8 and 16 with 8-s windows over
the harness' 32 requests and with long windows over a larger pool, servers alternating per round.

    python benchmarks/results/cpu/window-length/window.py \
        specserve-plain,specserve-ngram-adaptive 3 8:32,40:128 > window.log
"""
import sys
from pathlib import Path

from specserve.loadtests import compare


def main() -> None:
    names, rounds = sys.argv[1].split(","), int(sys.argv[2])
    shapes = [tuple(map(float, s.split(":"))) for s in sys.argv[3].split(",")]
    print(compare.lscpu(), flush=True)
    for rnd in range(rounds):
        for name in names:
            for cell_s, num in shapes:
                loads = {"B": compare.workloads(0, int(num))["B"]}
                out = compare.run_server(name, loads, [8, 16], cell_s,
                                         Path("/tmp/window-probe-logs"))
                for cell, r in out["cells"].items():
                    print(f"ROW {rnd} {name} {cell_s:g}s/{int(num)} {cell} {r['tok_s']} tok/s "
                          f"started {r['completed'] + r['cancelled']} "
                          f"done {r['completed']}", flush=True)


if __name__ == "__main__":
    main()
