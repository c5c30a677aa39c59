"""CUDA graphs against eager decoding on a GPU (a benchmark with a check, not a test; needs CUDA).

1. Identity: in float32, greedy outputs of prompts batched together (different lengths, one past
   a 1K-token split, different output lengths so the batch shrinks through the captured sizes)
   are token for token those of `--enforce-eager`, and with n-gram speculation (k = 4: verify
   passes replay graphs of 5 rows a request) those of plain decoding.
2. Speed: output tokens/s of the embedded model at each concurrency (closed batch, greedy, every
   request its full output length), graphs and eager alternating `--rounds` times on two engines
   built once, in `--dtype` (auto: bf16 on CUDA).

    python benchmarks/cuda_graphs.py --concurrency 1 16 64 --rounds 2 --json cuda-graphs.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from throughput import run

from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams


def engine(model: str | None, eager: bool, dtype: str, max_num_seqs: int,
           speculative: SpeculativeConfig | None = None) -> tuple[EngineCore, float]:
    start = time.perf_counter()
    core = EngineCore(EngineConfig(model=model, device="cuda", dtype=dtype, enforce_eager=eager,
                                   kv_cache_memory_gb=2.0, max_num_seqs=max_num_seqs,
                                   speculative=speculative))
    assert (core.worker.runner.graphs is None) == eager
    return core, time.perf_counter() - start


def greedy(core: EngineCore, prompts: list[list[int]], lengths: list[int]) -> dict[str, list]:
    for i, (ids, n) in enumerate(zip(prompts, lengths)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        core.add_request(EngineRequest(f"g{i}", ids, params))
    out: dict[str, list] = {}
    while core.has_unfinished():
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    core.check_integrity()
    return out


def identity(model: str | None) -> dict:
    g = torch.Generator().manual_seed(0)
    sizes = [5, 40, 129, 300, 700, 1500, 17, 64, 90, 250]
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in sizes]
    lengths = [64 - 5 * i for i in range(len(sizes))]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                              prompt_lookup_max=4)
    outs = {}
    for name, eager, spec in [("eager", True, None), ("graphs", False, None),
                              ("graphs-ngram", False, ngram)]:
        core, _ = engine(model, eager, "float32", 16, spec)
        outs[name] = greedy(core, prompts, lengths)
        del core
        torch.cuda.empty_cache()
    want = outs["eager"]
    return {"requests": len(sizes), "tokens": sum(len(v) for v in want.values()),
            **{f"identical_{name}": sum(got[k] == want[k] for k in want)
               for name, got in outs.items() if name != "eager"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    check = identity(args.model)
    print(json.dumps({"identity_float32": check}), flush=True)
    cores, startup = {}, {}
    for eager in (True, False):
        cores[eager], startup[eager] = engine(args.model, eager, args.dtype,
                                              max(args.concurrency))
        run(cores[eager], max(args.concurrency), args.prompt_len, 16)         # warm-up
    rates: dict[tuple[bool, int], list[float]] = {}
    for r in range(args.rounds):
        for eager in ((True, False) if r % 2 == 0 else (False, True)):
            for c in args.concurrency:
                res = run(cores[eager], c, args.prompt_len, args.output_len)
                rates.setdefault((eager, c), []).append(res["output_tokens_per_s"])
                print(json.dumps({"round": r, "eager": eager, **res}), flush=True)
    print(f"{'concurrency':>11} {'eager tok/s':>12} {'graphs tok/s':>13} {'ratio':>6}")
    table = []
    for c in args.concurrency:
        e, gr = statistics.median(rates[(True, c)]), statistics.median(rates[(False, c)])
        table.append({"concurrency": c, "eager": e, "graphs": gr, "ratio": round(gr / e, 2)})
        print(f"{c:>11} {e:>12.1f} {gr:>13.1f} {gr / e:>5.2f}x")
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "dtype": str(cores[False].worker.dtype), "start_s": startup,
           "graph_sizes": cores[False].worker.runner.graphs.sizes}
    print(json.dumps(env))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "identity_float32": check, "rates": table,
                       "runs": {f"{'eager' if e else 'graphs'}-c{c}": v
                                for (e, c), v in rates.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
