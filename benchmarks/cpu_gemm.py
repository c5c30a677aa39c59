"""Why fp32 and why verify rows are not free on a CPU: time one SmolLM2-sized linear layer
(gate_up, 3072 x 576) at 1, 9 and 16 rows in fp32, bf16 and fp16 (a benchmark, not a test).

    python benchmarks/cpu_gemm.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def main(repeats: int = 200) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'dtype':>9} {'rows':>4} {'us/call':>8} {'GFLOP/s':>8} {'x 1-row':>8}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = torch.randn(3072, 576).to(dtype)
        one_row = None
        for rows in (1, 9, 16):
            x = torch.randn(rows, 576).to(dtype)
            for _ in range(20):
                F.linear(x, w)
            start = time.perf_counter()
            for _ in range(repeats):
                F.linear(x, w)
            seconds = (time.perf_counter() - start) / repeats
            one_row = one_row or seconds
            gflops = 2 * w.numel() * rows / seconds / 1e9
            print(f"{str(dtype)[6:]:>9} {rows:>4} {seconds * 1e6:>8.0f} {gflops:>8.1f} {seconds / one_row:>8.2f}")


if __name__ == "__main__":
    main()
