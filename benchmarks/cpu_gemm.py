"""Why fp32, why packed weights, and why verify rows are not free on a CPU: time one
SmolLM2-sized linear layer (gate_up, 3072 x 576) and the LM head (49152 x 576) at 1, 9 and 16 rows:
fp32 through F.linear (MKL sgemm), fp32 with the weight prepacked for oneDNN, fp32 through the C
kernel on its packed panels (what the model runs on CPU, `kernels/cpu/linear.py`), bf16 and fp16
(a benchmark, not a test). Median of repeated calls.
Then, for the fp32 kernels, whether a row's result depends on how many rows share the call, and one
forward of the embedded model (stub attention: linear layers, norms, RoPE, LM head) by rows in the
step, dense weights vs packed.

    python benchmarks/cpu_gemm.py
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from specserve.spec_phases.loader import load_model
from specserve.kernels.cpu import linear as cpu_linear


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, 16)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def c_linear(x: torch.Tensor, packed: cpu_linear.PackedWeight) -> torch.Tensor:
    return cpu_linear.linear(x, packed, None)


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
        kernels = {"fp32 mkl": (w32, F.linear), "fp32 onednn": (onednn_pack(w32), onednn_linear)}
        if cpu_linear.c_kernel_available():
            kernels["fp32 C"] = (cpu_linear.pack(w32), c_linear)
        kernels["bf16"] = (w32.bfloat16(), F.linear)
        kernels["fp16"] = (w32.half(), F.linear)
        for kernel, (w, fn) in kernels.items():
            one_row = None
            for rows in (1, 9, 16):
                x = torch.randn(rows, shape[1]).to(torch.float32 if "fp32" in kernel else w.dtype)
                us = median_us(lambda: fn(x, w), repeats)
                one_row = one_row or us
                gflops = 2 * shape[0] * shape[1] * rows / us / 1e3
                print(f"{name:>8} {kernel:>13} {rows:>4} {us:>8.0f} {gflops:>8.1f} "
                      f"{us / one_row:>8.2f}")
    if cpu_linear.c_kernel_available():
        row_invariance()
        model_forward()


def row_invariance(counts=(1, 2, 7, 8, 9, 16, 17, 72, 144, 200)) -> None:
    """Are the first m rows of a call bit-identical to the same rows computed in a call of 200
    rows?"""
    torch.manual_seed(0)
    print(f"{'layer':>16} {'fp32 mkl':>9} {'fp32 onednn':>12} {'fp32 C':>7}   "
          f"(rows bit-identical at {list(counts)} rows)")
    for shape in ((960, 576), (3072, 576), (576, 1536), (49152, 576)):
        w, x = torch.randn(*shape), torch.randn(max(counts), shape[1])
        same = []
        for fn, packed in ((F.linear, w), (onednn_linear, onednn_pack(w)),
                           (c_linear, cpu_linear.pack(w))):
            full = fn(x, packed)
            same.append(all(torch.equal(fn(x[:m], packed), full[:m]) for m in counts))
        print(f"{f'{shape[0]}x{shape[1]}':>16} {str(same[0]):>9} {str(same[1]):>12} "
              f"{str(same[2]):>7}")


def model_forward(row_counts=(1, 8, 16, 72, 144), repeats: int = 10) -> None:
    model = load_model(None)

    def stub(layer, q, k, v):                    # attention left out: this times everything else
        return q

    def forward_ms(rows: int) -> float:
        ids, pos = torch.randint(0, model.config.vocab_size, (rows,)), torch.arange(rows)
        with torch.inference_mode():
            return median_us(lambda: model.compute_logits(model(ids, pos, stub)), repeats) / 1e3

    dense = {n: forward_ms(n) for n in row_counts}
    model.pack_for_cpu()
    packed = {n: forward_ms(n) for n in row_counts}
    print(f"{'rows':>5} {'dense ms':>9} {'packed ms':>10} {'speedup':>8}   "
          "(embedded model, one forward, stub attention)")
    for n in row_counts:
        print(f"{n:>5} {dense[n]:>9.1f} {packed[n]:>10.1f} {dense[n] / packed[n]:>7.2f}x")


if __name__ == "__main__":
    main()
