"""Where a step's time goes (a benchmark, not a test): decode at c = 1 and c = 16 and one 100-token
prefill on the embedded model, in-process, by torch.profiler operator categories.

    python benchmarks/profile_step.py [--dtype float32|bfloat16] [--threads N]

Categories: linear layers (the C kernel, oneDNN / MKL GEMMs; the LM head also timed alone at the
same rows), attention (the C kernel, SDPA, KV gathers, KV writes), elementwise (norms, RoPE, SiLU,
residuals, casts) and the rest of the ops; "Python and dispatch" is the wall time no operator
accounts for. The C kernels are ctypes calls, labelled for the profiler (`label_c_kernels`), on
both paths (the modules' and `spec_phases/cpu_decoder.py`'s); a step of short queries runs the
whole decoder stack in one call (`kernels/cpu/decoder.c`), which times its kernels itself and
whose times are added to their categories here.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specserve.kernels.cpu import decoder as cpu_fused
from specserve.kernels.cpu import linear as cpu_linear
from specserve.kernels.cpu import paged_attention as cpu_attention
from specserve.kernels.cpu import rms_norm as cpu_norm
from specserve.kernels.cpu import rope as cpu_rope
from specserve.kernels.dispatch import cpu_kernel

from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams

CATEGORIES = {
    "linear (GEMM)": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear",
                      "C linear"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select",
                  "aten::index_copy_", "aten::scaled_dot_product_attention",
                  "C paged_attention"),
    "elementwise": ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt",
                    "aten::silu", "aten::cat", "aten::_to_copy", "aten::copy_", "aten::neg",
                    "aten::sub", "C rms_norm", "C add_rms_norm", "C rope"),
}

# ms the one-call decoder stack spent per category since the last reset (`label_c_kernels`)
FUSED_MS = {"linear (GEMM)": 0.0, "attention": 0.0, "elementwise": 0.0}


def label_c_kernels() -> None:
    """The C kernels (`kernels/cpu/`) are ctypes calls the profiler cannot see: wrap each in a
    named range ("C <op>") so its time lands in its category, not in "Python and dispatch"."""
    def labelled(name, fn):
        def call(*args, **kwargs):
            with record_function(f"C {name}"):
                return fn(*args, **kwargs)
        return call
    cpu_linear.linear = labelled("linear", cpu_linear.linear)
    for op in ("paged_attention", "rms_norm", "add_rms_norm", "rope"):
        kernel = cpu_kernel(op)
        kernel.kernel = labelled(op, kernel.kernel)
    # the entry points `spec_phases/cpu_decoder.py` calls
    cpu_linear.linear_into = labelled("linear", cpu_linear.linear_into)
    cpu_norm.add_rms_norm_into = labelled("add_rms_norm", cpu_norm.add_rms_norm_into)
    cpu_rope.rope_into = labelled("rope", cpu_rope.rope_into)
    cpu_attention.paged_attention = labelled("paged_attention", cpu_attention.paged_attention)
    one_call = cpu_fused.forward

    def timed(*args, **kwargs):
        seconds = torch.zeros(3, dtype=torch.float64)
        one_call(*args, **kwargs, seconds=seconds)
        for name, sec in zip(FUSED_MS, seconds.tolist()):
            FUSED_MS[name] += sec * 1000
    cpu_fused.forward = timed


def requests(core: EngineCore, num: int, prompt_len: int, max_tokens: int, seed: int = 0) -> None:
    """`num` requests of random prompts (prompt_len + 7i tokens), seeded by `seed` or else `num`:
    a prompt seen before would be a prefix-cache hit."""
    g = torch.Generator().manual_seed(seed or num)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(num):
        ids = torch.randint(100, 40000, (prompt_len + 7 * i,), generator=g).tolist()
        core.add_request(EngineRequest(f"p{num}-{prompt_len}-{i}", ids, params))


def profile_steps(core: EngineCore, num_steps: int) -> dict[str, float]:
    """ms per step by category over `num_steps` steps."""
    FUSED_MS.update(dict.fromkeys(FUSED_MS, 0.0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(num_steps):
            core.step()
        wall = (time.perf_counter() - t) * 1000 / num_steps
    out = {name: 0.0 for name in CATEGORIES} | {"other ops": 0.0}
    for evt in prof.key_averages():
        ms = evt.self_cpu_time_total / 1000 / num_steps
        cat = next((c for c, names in CATEGORIES.items() if evt.key in names), "other ops")
        out[cat] += ms
    for cat, ms in FUSED_MS.items():
        out[cat] += ms / num_steps
    out["Python and dispatch"] = max(0.0, wall - sum(out.values()))
    out["step (wall)"] = wall
    return out


def lm_head_ms(core: EngineCore, rows: int) -> float:
    hidden = torch.randn(rows, core.worker.model_config.hidden_size, dtype=core.worker.dtype)
    model = core.worker.model
    with torch.inference_mode():
        for _ in range(3):
            model.compute_logits(hidden)
        t = time.perf_counter()
        for _ in range(10):
            model.compute_logits(hidden)
    return (time.perf_counter() - t) * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    label_c_kernels()
    core = EngineCore(EngineConfig(dtype=args.dtype, num_threads=args.threads))
    columns = {}
    for conc in (1, 16):
        requests(core, conc, 100, 40)
        for _ in range(6):                        # prefill and warm-up
            core.step()
        columns[f"decode c={conc}"] = profile_steps(core, 10) | {"of which LM head":
                                                                 lm_head_ms(core, conc)}
        core.run_until_idle()
    requests(core, 1, 100, 1, seed=100)        # a new prompt: no prefix-cache hit
    columns["prefill 100 tokens"] = profile_steps(core, 1) | {"of which LM head":
                                                              lm_head_ms(core, 1)}
    core.run_until_idle()
    rows = list(next(iter(columns.values())))
    print(f"dtype {core.worker.dtype}, {torch.get_num_threads()} threads; ms per step")
    print("| | " + " | ".join(columns) + " |\n|---" * 1 + "|---" * len(columns) + "|")
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{c[row]:.1f}" for c in columns.values()) + " |")


if __name__ == "__main__":
    main()
