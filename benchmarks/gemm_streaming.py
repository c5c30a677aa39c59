"""Linear layers as a decode step really meets them: 30 layers' distinct weights (qkv, o, gate_up,
down at SmolLM2-135M's shapes, 425 MB in fp32), each read once per pass, so they stream from DRAM
instead of sitting in cache as a one-weight micro-benchmark's do (a benchmark, not a test). For 1,
4 and 16 rows (and `--rows`): the C kernel on panel-packed fp32 (what the model runs,
`kernels/cpu/linear.py`), oneDNN-prepacked fp32, F.linear fp32 (MKL), F.linear bf16,
int8 weight-only with bf16 activations (`_weight_int8pack_mm`), and prepacked bf16 where oneDNN
offers it (AVX512-BF16 / AVX-NE-CONVERT). Also the copy bandwidth (512 MiB, read + write bytes).

    python benchmarks/gemm_streaming.py [--threads N] [--rows 1 4 16]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specserve.kernels.cpu import linear as cpu_linear

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]       # (in, out) of one layer
LAYERS = 30


def seconds(fn, repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    src = torch.ones(128 * 2 ** 20)      # real pages (an untouched torch.empty reads the zero page)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 4 / seconds(lambda: dst.copy_(src)) / 1e9
    print(f"{torch.get_num_threads()} threads; copy bandwidth {copy_gbs:.1f} GB/s")
    weights = [[torch.randn(n, k) * 0.02 for k, n in SHAPES] for _ in range(LAYERS)]
    nbytes = sum(w.numel() * 4 for layer in weights for w in layer)
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer]
              for layer in weights]
    bf16 = [[w.bfloat16() for w in layer] for layer in weights]
    int8 = []
    for layer in weights:
        scales = [w.abs().amax(1) / 127 for w in layer]
        int8.append([((w / s[:, None]).round().to(torch.int8), s.bfloat16())
                     for w, s in zip(layer, scales)])
    c_packed = [[cpu_linear.pack(w) for w in layer] for layer in weights]
    packed_bf16 = None
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed_bf16 = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer]
                       for layer in bf16]
    for rows in args.rows:
        x = {k: torch.randn(rows, k) for k, _ in SHAPES}
        xb = {k: v.bfloat16() for k, v in x.items()}
        ways = {
            "C fp32": lambda: [cpu_linear.linear(x[p.in_features], p, None) for layer in c_packed
                               for p in layer],
            "oneDNN fp32": lambda: [torch.ops.mkldnn._linear_pointwise(
                x[k], p, None, "none", [], "") for layer in packed
                for (k, _), p in zip(SHAPES, layer)],
            "F.linear fp32": lambda: [F.linear(x[w.shape[1]], w) for layer in weights
                                      for w in layer],
            "F.linear bf16": lambda: [F.linear(xb[w.shape[1]], w) for layer in bf16
                                      for w in layer],
            "int8 wo (bf16 act)": lambda: [torch.ops.aten._weight_int8pack_mm(
                xb[q.shape[1]], q, s) for layer in int8 for q, s in layer],
        }
        if packed_bf16 is not None:
            ways["oneDNN bf16"] = lambda: [torch.ops.mkldnn._linear_pointwise(
                xb[k], p, None, "none", [], "") for layer in packed_bf16
                for (k, _), p in zip(SHAPES, layer)]
        cells = []
        for name, fn in ways.items():
            t = seconds(fn)
            cells.append(f"{name} {t * 1e3:.1f} ms")
        gbs = {k: nbytes / seconds(ways[k]) / 1e9 for k in ("C fp32", "oneDNN fp32")}
        print(f"rows {rows}: " + ", ".join(cells) + " (weights read: "
              + ", ".join(f"{k} {v:.1f} GB/s" for k, v in gbs.items()) + ")")


if __name__ == "__main__":
    main()
