"""The CPU linear layer's two forms on the embedded model's own GGUF blocks: float32 activations
against codes unpacked to floats (`linear.c`) and int8 activations summed against the codes on
int8 dot products (`linear_i8.c`), by rows in the call; the two alternate call by call, medians.
A benchmark, not a test.

    python benchmarks/linear_i8.py [--rows 1 2 5 8 16 64 128 512] [--repeats 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.kernels.cpu import linear as cpu_linear
from specserve.spec_phases.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 64, 128, 512])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    model = load_model(None)
    layer = model.layers[0]
    weights = {name: getattr(layer, name).gguf_blocks
               for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    weights["lm_head"] = model.gguf_head
    pack = {"q4_1": cpu_linear.pack_q4_1, "q8_0": cpu_linear.pack_q8_0}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per call (median)")
    print(f"{'weight':>12} {'layout':>6} {'rows':>5} {'f32 act':>9} {'int8 act':>9} {'speedup':>8}")
    for name, (layout, blocks) in weights.items():
        in_features = blocks.shape[1] // (20 if layout == "q4_1" else 34) * 32
        forms = [pack[layout](blocks, in_features), pack[layout](blocks, in_features, int8=True)]
        for rows in args.rows:
            if name == "lm_head" and rows > 128:
                continue
            x = torch.randn(rows, in_features)
            out = torch.empty(rows, forms[0].out_features)
            times: list[list[float]] = [[], []]
            for i in range(args.repeats * 2 + 4):
                form = i % 2
                start = time.perf_counter()
                cpu_linear.linear_into(x, forms[form], None, out)
                if i >= 4:
                    times[form].append(time.perf_counter() - start)
            f32, i8 = (statistics.median(t) * 1e6 for t in times)
            print(f"{name:>12} {layout:>6} {rows:>5} {f32:>9.0f} {i8:>9.0f} {f32 / i8:>7.2f}x")


if __name__ == "__main__":
    main()
