"""Plain decoding at long context with the full KV cache in float32, in bf16 (`auto` on CPU under
`--dtype auto`) and in fp8 e4m3 (`--kv-cache-dtype float32`, `bfloat16`, `fp8`): a benchmark,
not a test.

One engine per setting, built once in this process; runs alternate between them (float32, bfloat16,
float32, bfloat16, ...) so drift on a shared host lands on both. Each run: `concurrency` requests of
`prompt-len` random tokens (fresh ones every run, prefix caching off), `output-len` greedy tokens
each (ignore_eos). Reported per run: TTFT, TPOT (the mean gap between a request's tokens after
its first, as vLLM's bench computes it; p50 over requests), output tokens/s over the run, and the
decode steps' time in the one-call decoder's kernels (attention with the K/V write, linear,
elementwise: `kernels/cpu/decoder.c` times them).

    python benchmarks/kv_cache_dtype.py --prompt-len 2800 --output-len 64 --concurrency 1 \\
        --rounds 2 --json benchmarks/results/cpu/kv-cache-dtype/c1.json

`--accuracy` measures what the narrow caches cost instead: perplexity of a fixed text (the first
`--prompt-len` tokens of this Python's `argparse.py`, every row attending the cache it wrote, from
the engine's prompt logprobs) and greedy continuations (`--output-len` tokens) of held long
prompts (the first `--prompt-len` tokens of eight standard-library modules): how many match the
float32 cache's exactly, and the mean index of the first token where they part.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import time

import torch

import decoder_timers
from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams

# --accuracy's held prompts: the first tokens of these standard-library modules' sources
HELD_MODULES = ("ast", "calendar", "dataclasses", "difflib", "json", "logging", "textwrap",
                "tokenize")
def run(core: EngineCore, tag: str, concurrency: int, prompt_len: int, output_len: int,
        seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    vocab = core.worker.model_config.vocab_size
    for i in range(concurrency):
        ids = torch.randint(100, min(40000, vocab), (prompt_len,), generator=g).tolist()
        core.add_request(EngineRequest(f"{tag}-{i}", ids, params))
    start = time.perf_counter()
    stamps: dict[str, list[float]] = {}
    decode_s, decode_steps = 0.0, 0
    kernels = torch.zeros(3, dtype=torch.float64)
    while core.has_unfinished():
        decoder_timers.reset()
        t = time.perf_counter()
        step = core.step()
        now = time.perf_counter()
        for out in step.outputs:
            stamps.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
        if step.stats.num_prompt_tokens == 0 and step.outputs:         # a pure decode step
            decode_s += now - t
            decode_steps += 1
            kernels += decoder_timers.SECONDS
    elapsed = time.perf_counter() - start
    core.check_integrity()
    ttft = [s[0] - start for s in stamps.values()]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1]
    tokens = sum(len(s) for s in stamps.values())
    per_step = kernels / max(decode_steps, 1) * 1e3
    return {"ttft_s_p50": round(statistics.median(ttft), 3),
            "tpot_ms_p50": round(1e3 * statistics.median(tpot), 2),
            "output_tokens_per_s": round(tokens / elapsed, 2),
            "decode_step_ms": round(1e3 * decode_s / max(decode_steps, 1), 2),
            "decode_step_attention_ms": round(float(per_step[1]), 2),
            "decode_step_linear_ms": round(float(per_step[0]), 2),
            "decode_step_elementwise_ms": round(float(per_step[2]), 2),
            "seconds": round(elapsed, 2)}


def texts(tokenizer, prompt_len: int) -> tuple[list[int], list[list[int]]]:
    """The fixed text and the held prompts (`--accuracy`), as token ids."""
    ids = lambda name: tokenizer.encode(  # noqa: E731
        inspect.getsource(importlib.import_module(name)))[:prompt_len]
    return ids("argparse"), [ids(name) for name in HELD_MODULES]


def accuracy(core: EngineCore, text: list[int], prompts: list[list[int]],
             output_len: int) -> tuple[float, list[list[int]]]:
    """Perplexity of `text` (prompt logprobs) and the greedy continuation of each prompt."""
    core.add_request(EngineRequest("ppl", text, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"held-{i}", ids, params))
    logprobs, outs = [], {f"held-{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for out in core.step().outputs:
            if out.request_id == "ppl" and out.prompt_logprobs:
                logprobs += [lp.logprob for lp in out.prompt_logprobs if lp is not None]
            elif out.request_id in outs:
                outs[out.request_id].extend(out.new_token_ids)
    return math.exp(-sum(logprobs) / len(logprobs)), [outs[f"held-{i}"]
                                                      for i in range(len(prompts))]


def report_accuracy(cores: dict[str, EngineCore], args) -> dict:
    from specserve.spec_phases.tokenizer import load_tokenizer
    first = next(iter(cores.values()))
    tokenizer = load_tokenizer(first.worker.config.model)
    text, prompts = texts(tokenizer, args.prompt_len)
    results = {kv: accuracy(core, text, prompts, args.output_len) for kv, core in cores.items()}
    base = results[args.kv_cache_dtype[0]][1]
    table = {}
    for kv, (ppl, outs) in results.items():
        parts = [next((i for i, (a, b) in enumerate(zip(o, w)) if a != b), len(w))
                 for o, w in zip(outs, base)]
        table[kv] = {"perplexity": round(ppl, 4), "text_tokens": len(text),
                     "identical_continuations": sum(o == w for o, w in zip(outs, base)),
                     "held_prompts": len(prompts),
                     "mean_first_divergence": round(sum(parts) / len(parts), 1)}
        print(json.dumps({"kv_cache_dtype": kv, **table[kv]}), flush=True)
    return table


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "?"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (no kernel split there)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["float32", "bfloat16", "fp8"])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=2800)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--accuracy", action="store_true",
                    help="perplexity and greedy agreement instead of speed")
    args = ap.parse_args()
    decoder_timers.install()
    cores = {}
    for kv in args.kv_cache_dtype:
        cores[kv] = EngineCore(EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, kv_cache_dtype=kv,
            kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.concurrency,
            enable_prefix_caching=False))
        run(cores[kv], f"warm-{kv}", args.concurrency, 64, 8, seed=999)     # builds the kernels
    env = {"device": (torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
           "cpu": cpu_model(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "dtype": args.dtype, "model": args.model or "embedded",
           "prompt_len": args.prompt_len, "output_len": args.output_len,
           "concurrency": args.concurrency,
           "kv_bytes_per_token": {kv: c.engine_info.kv_bytes_per_token
                                  for kv, c in cores.items()},
           "num_blocks": {kv: c.worker.num_blocks for kv, c in cores.items()}}
    print(json.dumps(env))
    if args.accuracy:
        table = report_accuracy(cores, args)
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"env": env, "accuracy": table}, f, indent=2)
        return
    results = []
    for r in range(args.rounds):
        for i, (kv, core) in enumerate(cores.items()):
            res = {"round": r + 1, "kv_cache_dtype": kv,
                   **run(core, f"r{r}-{kv}", args.concurrency, args.prompt_len, args.output_len,
                         seed=100 * r + i)}
            results.append(res)
            print(json.dumps(res), flush=True)
    base = [x["tpot_ms_p50"] for x in results if x["kv_cache_dtype"] == args.kv_cache_dtype[0]]
    for kv in args.kv_cache_dtype[1:]:
        mine = [x["tpot_ms_p50"] for x in results if x["kv_cache_dtype"] == kv]
        print(f"TPOT {kv} / {args.kv_cache_dtype[0]}: "
              f"{statistics.mean(mine) / statistics.mean(base):.3f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
