"""Per-cell summary of the engine's step dump (cells.py's log, the steps files it wrote).

    python analyze.py cells-b0fb450.log 'steps-*.txt' B8 B16

Per cell: steps, tokens, the worker's time, the engine's time per step outside it, prefill steps,
the median decode step by draft rows (steps of the cell's usual batch), and a least-squares split
of a decode step into a base, a price per draft row and a price for any drafting."""
import glob
import statistics as st
import sys

import numpy as np


def main() -> None:
    log, pattern, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
    cells = [line.split()[1:] for line in open(log) if line.startswith("CELL")]
    rows = []
    for path in sorted(glob.glob(pattern)):
        for line in open(path):
            t, ex, d, a, pr, run, gen = line.split()
            rows.append((float(t), float(ex), int(d), int(a), int(pr), int(run), int(gen)))
    rows.sort()
    for rnd, name, cell, c0, c1 in cells:
        if cell not in wanted:
            continue
        r = [x for x in rows if float(c0) <= x[0] <= float(c1)]
        gaps = [b[0] - a[0] for a, b in zip(r, r[1:])]
        worker = sum(x[1] for x in r[1:]) / 1000
        prefill = [x for x in r if x[4] > 0]
        decode = [x for x in r if x[4] == 0]
        batch = st.mode([x[5] for x in decode])
        decode = [x for x in decode if x[5] == batch]
        by = {}
        for x in decode:
            by.setdefault(x[2], []).append(x[1])
        outside = 1000 * (sum(gaps) - worker) / len(gaps)
        print(f"{rnd} {name} {cell}: {len(r)} steps, {sum(x[6] for x in r)} tokens, worker "
              f"{sum(x[1] for x in r) / 1000:.2f} s, outside it {outside:.1f} ms/step; "
              f"{len(prefill)} prefill steps {sum(x[1] for x in prefill) / 1000:.2f} s; "
              f"drafts {sum(x[2] for x in r)}, accepted {sum(x[3] for x in r)}")
        print("   decode ms by draft rows (steps):",
              {d: (round(st.median(v), 1), len(v)) for d, v in sorted(by.items())})
        if any(x[2] for x in decode):
            X = np.array([[1, x[2], x[2] > 0] for x in decode], float)
            coef, *_ = np.linalg.lstsq(X, np.array([x[1] for x in decode]), rcond=None)
            print("   fit: base %.1f ms, per draft row %.2f, any draft %.2f" % tuple(coef))


if __name__ == "__main__":
    main()
