"""Engine throughput on the embedded model (a benchmark, not a test).

Prints output tokens/s at each concurrency (closed batch, greedy, fixed output length, ignore_eos)
and the decode step's achieved memory bandwidth (weights + KV read per step / step time) against a
measured copy bandwidth on the same machine, all in one run.

    python benchmarks/throughput.py --concurrency 1 16 --prompt-len 128 --output-len 128
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams


def copy_bandwidth(device: str = "cpu", num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Best of `repeats` copies of a large buffer on `device`: bytes read + written per second."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def run(core: EngineCore, concurrency: int, prompt_len: int, output_len: int) -> dict:
    g = torch.Generator().manual_seed(concurrency)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        ids = torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
        core.add_request(EngineRequest(f"c{concurrency}-{i}", ids, params))
    cfg = core.worker.model_config
    kv_per_token = cfg.kv_bytes_per_token(core.worker.dtype)
    start, decode_time, decode_bytes, tokens = time.perf_counter(), 0.0, 0, 0
    while core.has_unfinished():
        contexts = [r.num_tokens for r in core.scheduler.running]
        t = time.perf_counter()
        step = core.step()
        outs = step.outputs
        dt = time.perf_counter() - t
        stats = step.stats
        tokens += sum(len(o.new_token_ids) for o in outs)
        if stats.num_prompt_tokens == 0 and contexts:            # a pure decode step
            decode_time += dt
            decode_bytes += core.worker.weight_bytes + kv_per_token * sum(contexts)
    elapsed = time.perf_counter() - start
    core.check_integrity()
    return {"concurrency": concurrency, "output_tokens": tokens, "seconds": round(elapsed, 2),
            "output_tokens_per_s": round(tokens / elapsed, 2),
            "decode_bandwidth_gbs": (round(decode_bytes / decode_time / 1e9, 2) if decode_time
                                     else None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-cpu-weight-packing", action="store_true",
                    help="F.linear (MKL) instead of oneDNN")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    core = EngineCore(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                   kv_cache_memory_gb=2.0, max_num_seqs=max(args.concurrency),
                                   cpu_weight_packing=not args.no_cpu_weight_packing))
    # warm-up: every batch shape, GPU clocks up
    run(core, max(args.concurrency), args.prompt_len, 16)
    copy_bw = copy_bandwidth(core.worker.device)
    results = [run(core, c, args.prompt_len, args.output_len) for c in args.concurrency]
    env = {"machine": platform.machine(), "processor": platform.processor() or "?",
           "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "device": core.worker.device,
           "dtype": str(core.worker.dtype), "cpu_weight_packing": not args.no_cpu_weight_packing,
           "weight_bytes": core.worker.weight_bytes,
           "copy_bandwidth_gbs": round(copy_bw / 1e9, 2)}
    print(json.dumps(env))
    print(f"{'concurrency':>11} {'out tok/s':>10} {'decode GB/s':>12} {'% of copy BW':>13}")
    for r in results:
        bw = r["decode_bandwidth_gbs"]
        share = f"{100 * bw * 1e9 / copy_bw:.0f}%" if bw else "-"
        print(f"{r['concurrency']:>11} {r['output_tokens_per_s']:>10} {bw or '-':>12} {share:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
