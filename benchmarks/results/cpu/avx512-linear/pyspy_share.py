"""Share of a py-spy raw profile's samples (`py-spy record -f raw`) under the engine's step that
each function is on the stack of: `python pyspy_share.py pyspy-faser8-9bc0069.txt.gz`."""
import collections
import gzip
import sys


def main() -> None:
    total, inclusive = 0, collections.Counter()
    with gzip.open(sys.argv[1], "rt") as f:
        for line in f:
            stack, count = line.rstrip("\n").rsplit(" ", 1)
            frames = stack.split(";")
            if not any("EngineCore.step (" in frame for frame in frames):
                continue
            total += int(count)
            for name in {frame.split(":")[0] for frame in frames}:
                inclusive[name] += int(count)
    print(f"{total} samples in EngineCore.step")
    for name, count in inclusive.most_common(40):
        print(f"{100 * count / total:5.1f}% {name}")


if __name__ == "__main__":
    main()
