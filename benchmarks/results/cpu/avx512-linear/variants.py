"""Probe (not a benchmark of record): the forms of `kernels/cpu/linear.c` behind its choices,
timed side by side at the embedded model's shapes. Each variant is this tree's linear.c with one
edit (or 7886035's), built with native.py's flags (plus -mno-avx512f for the AVX2 form) and timed
in turns on GGUF-quantized random weights; ms per call, best of five rounds, two threads.

    python benchmarks/results/cpu/avx512-linear/variants.py > variants-<rev>.log
"""
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from specserve.kernels.cpu import linear as cpu_linear
from specserve.kernels.cpu import native

SOURCE = native.SOURCE_DIR / "linear.c"
ONE_ROW_Q4 = """                if (layout == Q4_1)
                    row_group_q4(x, xs, K, group, out);
                else
                    row_group(x, xs, K, group, layout, out);"""


def rows16(text: str) -> str:
    """16 rows a register block on AVX-512 instead of 12."""
    cases = " ".join(f"ROW_CASE({n}, fn, __VA_ARGS__)" for n in range(16, 6, -1))
    start = text.index("#if ROWS == 12\n#define WIDE_CASES")
    end = text.index("#else\n#define WIDE_CASES(fn, ...)\n#endif")
    text = text[:start] + f"#if ROWS > 6\n#define WIDE_CASES(fn, ...) {cases}\n" + text[end:]
    return text.replace("#define ROWS 12\n", "#define ROWS 16\n")


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


def variants() -> dict[str, tuple[str, list[str]]]:
    text = SOURCE.read_text()
    old = subprocess.run(["git", "show", "7886035:kernels/cpu/linear.c"], capture_output=True,
                         text=True, check=True, cwd=native.SOURCE_DIR).stdout
    avx2 = ["-mno-avx512f"]
    return {
        "this tree": (text, []),
        "this tree, AVX2 form": (text, avx2),
        "7886035": (old, []),
        "7886035, AVX2 form": (old, avx2),
        "one-row Q4_1 in 512-bit vectors": (
            edit(text, ONE_ROW_Q4, "                row_group(x, xs, K, group, layout, out);"),
            []),
        "float copy above 192 rows (AVX-512)": (
            edit(text, "#define MANY_ROWS INT64_MAX", "#define MANY_ROWS 192"), []),
        "no float copy, AVX2 form": (
            edit(text, "#define MANY_ROWS 192 ", "#define MANY_ROWS INT64_MAX "), avx2),
        "16-row blocks (AVX-512)": (rows16(text), []),
    }


def build(source: str, extra: list[str], folder: Path, name: str) -> ctypes.CDLL:
    (folder / f"{name}.c").write_text(source)
    out = folder / f"{name}.so"
    subprocess.run([native._compiler(), *native.FLAGS, *extra, f"-I{native.SOURCE_DIR}", "-o",
                    str(out), str(folder / f"{name}.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.linear_forward.restype = ctypes.c_int
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.linear_forward.argtypes = [p, i, i, p, ctypes.c_int, i, p, p, ctypes.c_int]
    return lib


def weight(kind: GGMLQuantizationType, out_features: int, in_features: int):
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    raw = torch.from_numpy(np.ascontiguousarray(quants.quantize((w * 0.05).numpy(), kind)))
    if kind == GGMLQuantizationType.Q4_1:
        return cpu_linear.pack_q4_1(raw, in_features)
    return cpu_linear.pack_q8_0(raw, in_features)


def main() -> None:
    torch.set_num_threads(2)
    shapes = [("gate_up Q4_1", GGMLQuantizationType.Q4_1, 3072, 576,
               (1, 8, 12, 13, 16, 64, 256, 1024)),
              ("down Q4_1", GGMLQuantizationType.Q4_1, 576, 1536, (1, 8, 13, 16, 256)),
              ("LM head Q8_0", GGMLQuantizationType.Q8_0, 49152, 576, (1, 8, 16))]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(src, extra, Path(tmp), f"v{i}")
                for i, (name, (src, extra)) in enumerate(variants().items())}
        print("| shape | rows | " + " | ".join(libs) + " |")
        print("|---" * (len(libs) + 2) + "|")
        for label, kind, n, k, row_counts in shapes:
            packed = weight(kind, n, k)
            layout = cpu_linear.LAYOUTS[packed.layout]
            for m in row_counts:
                x = torch.randn(m, k)
                y = torch.empty(m, n)
                calls = max(1, int(20 / m)) if n < 10000 else 2
                best = {name: float("inf") for name in libs}
                for _ in range(5):
                    for name, lib in libs.items():
                        t = time.perf_counter()
                        for _ in range(calls):
                            lib.linear_forward(x.data_ptr(), m, k, packed.data.data_ptr(), layout,
                                               n, None, y.data_ptr(), 2)
                        best[name] = min(best[name], (time.perf_counter() - t) / calls * 1e3)
                print(f"| {label} | {m} | " + " | ".join(f"{best[v]:.3f}" for v in libs) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
