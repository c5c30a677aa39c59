"""What the kernel A/B benchmarks share (`attention_ab.py`, `linear_ab.py`, `decoder_ab.py`): one
kernel source from two folders (e.g. a worktree of an older commit and this checkout) built side
by side, and the two builds alternated in one process, A first then B first, so that the host's
slow and fast phases fall on both."""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from specserve.kernels.cpu import native


def parser(description: str, source: str, alternations: int) -> argparse.ArgumentParser:
    """The arguments every A/B takes: the two folders holding `source`, --alternations and
    --threads."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("a", type=Path, help=f"folder holding build A's {source}")
    ap.add_argument("b", type=Path, help=f"folder holding build B's {source}")
    ap.add_argument("--alternations", type=int, default=alternations)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def builds(a: Path, b: Path, source: str) -> dict[str, ctypes.CDLL]:
    """`source` from folders a and b compiled as the server compiles its kernels, by tag."""
    tmp = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    libs = {}
    for tag, folder in (("A", a), ("B", b)):
        out = tmp / f"{tag.lower()}.so"
        subprocess.run([native._compiler(), *native.FLAGS, "-o", str(out), str(folder / source),
                        "-lm"], check=True)
        libs[tag] = ctypes.CDLL(str(out))
    return libs


def alternate(run: Callable[[str], float], alternations: int) -> tuple[float, float]:
    """Medians of run("A") and run("B") (each a time), alternations times each, the order
    flipped every time."""
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(alternations):
        for tag in ("A", "B") if i % 2 == 0 else ("B", "A"):
            times[tag].append(run(tag))
    return statistics.median(times["A"]), statistics.median(times["B"])
