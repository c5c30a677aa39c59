"""Why fp32, why prepacked weights, and why verify rows are not free on a CPU: time one SmolLM2-sized
linear layer (gate_up, 3072 x 576) and the LM head (49152 x 576) at 1, 9 and 16 rows: fp32 through
F.linear (MKL sgemm), fp32 with the weight prepacked for oneDNN (what the model runs on CPU, see
`spec_phases/model.py: Linear`), bf16 and fp16 (a benchmark, not a test). Median of interleaved calls.

    python benchmarks/cpu_gemm.py
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from specserve.spec_phases.model import cpu_packing_available, pack_cpu_weight, packed_linear


def median_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(repeats: int = 50) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'layer':>8} {'kernel':>13} {'rows':>4} {'us/call':>8} {'GFLOP/s':>8} {'x 1-row':>8}")
    for name, shape in (("gate_up", (3072, 576)), ("lm_head", (49152, 576))):
        w32 = torch.randn(*shape)
        kernels = {"fp32 mkl": (w32, F.linear)}
        if cpu_packing_available():
            kernels["fp32 packed"] = (pack_cpu_weight(w32), lambda x, w: packed_linear(x, w, None))
        kernels["bf16"] = (w32.bfloat16(), F.linear)
        kernels["fp16"] = (w32.half(), F.linear)
        for kernel, (w, fn) in kernels.items():
            one_row = None
            for rows in (1, 9, 16):
                x = torch.randn(rows, shape[1]).to(torch.float32 if "fp32" in kernel else w.dtype)
                us = median_us(lambda: fn(x, w), repeats)
                one_row = one_row or us
                gflops = 2 * shape[0] * shape[1] * rows / us / 1e3
                print(f"{name:>8} {kernel:>13} {rows:>4} {us:>8.0f} {gflops:>8.1f} {us / one_row:>8.2f}")


if __name__ == "__main__":
    main()
