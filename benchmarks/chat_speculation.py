"""Speculation against plain decoding on distinct chat prompts (the compare harness' workload B),
in-process, one closed batch (a benchmark, not a test): every request runs `--max-tokens` tokens,
greedy; output tokens/s, steps, the engine's own time per step outside the worker (schedule,
commit and the FASER controller), drafted and accepted tokens, for each method in the order given
(repeat a method to alternate: `off ngram off ngram`), and the median step time by the number of
draft rows the step verified (decode steps only: no prompt tokens), which prices a verify row
against a decode row.

    python benchmarks/chat_speculation.py --concurrency 16 --methods off ngram adaptive off
    python benchmarks/chat_speculation.py --concurrency 8 --requests 32 --methods off adaptive

With `--requests`, a closed loop as the compare harness runs it: every finished request is
replaced by the next, so prompt chunks join decode steps.

n-gram is the JSON the compare harness gives both servers (k = 4, prompt_lookup_max 4, so
prompt_lookup_min 4 as vLLM fills it in); `adaptive` adds the FASER controller.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# loadtests/ is a tool folder of the checkout, not installed with the server
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadtests.workloads import chat_prompts  # noqa: E402
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
METHODS = {"off": None, "ngram": NGRAM, "adaptive": {**NGRAM, "adaptive": True}}


def run(prompts: list[list[int]], spec: dict | None, max_tokens: int, concurrency: int) -> str:
    config = SpeculativeConfig(**spec) if spec else None
    core = EngineCore(EngineConfig(speculative=config))
    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    core.add_request(EngineRequest("warm-up", prompts[0], warm))
    core.run_until_idle()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    pending = list(enumerate(prompts))                      # `concurrency` of them in flight
    in_flight = tokens = steps = drafted = accepted = drafting_steps = 0
    host = 0.0                    # a step's time outside the worker: schedule, commit, FASER
    by_drafts: dict[int, list[float]] = {}        # decode steps' times by their draft rows
    start = time.perf_counter()
    full: tuple[int, float] | None = None         # tokens and time while every slot was busy
    while pending or core.has_unfinished():
        while pending and in_flight < concurrency:
            i, ids = pending.pop(0)
            core.add_request(EngineRequest(f"r{i}", ids, params))
            in_flight += 1
        if full is None and in_flight < concurrency:
            full = tokens, time.perf_counter() - start
        t = time.perf_counter()
        step = core.step()
        host += time.perf_counter() - t - step.stats.step_time_s
        steps += 1
        in_flight -= sum(o.finished for o in step.outputs)
        tokens += sum(len(o.new_token_ids) for o in step.outputs)
        drafted += step.stats.num_draft_tokens
        accepted += step.stats.num_accepted_tokens
        drafting_steps += step.stats.num_draft_tokens > 0
        if step.stats.num_prompt_tokens == 0 and step.stats.num_running == concurrency:
            by_drafts.setdefault(step.stats.num_draft_tokens, []).append(step.stats.step_time_s)
    elapsed = time.perf_counter() - start
    core.check_integrity()
    times = ", ".join(f"{d}: {1000 * statistics.median(t):.1f} ({len(t)})"
                      for d, t in sorted(by_drafts.items()) if len(t) >= 5)
    # the closed loop's tail (fewer requests than slots) waits on its slowest request: the rate
    # while every slot was busy is what a server under steady load sees
    busy = f" ({full[0] / full[1]:.1f} while every slot was busy)" if full and full[1] else ""
    return (f"{tokens / elapsed:.1f} tok/s{busy}, {steps} steps ({1000 * elapsed / steps:.1f} ms, "
            f"{1000 * host / steps:.2f} of them outside the worker), "
            f"drafted {drafted}, accepted {accepted} in {drafting_steps} steps; ms per step by "
            f"draft rows (steps): {times}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in all, --concurrency of them in flight, each finished one "
                         "replaced (the compare harness' closed loop; default: one batch)")
    ap.add_argument("--methods", nargs="+", default=["off", "ngram", "adaptive", "off"],
                    choices=list(METHODS))
    args = ap.parse_args()
    tokenizer = load_tokenizer(None)
    count = args.requests or args.concurrency
    prompts = [tokenizer.encode(p) for p in chat_prompts(max(32, count), 1)][:count]
    for method in args.methods:
        result = run(prompts, METHODS[method], args.max_tokens, args.concurrency)
        print(f"c={args.concurrency} {method}: {result}", flush=True)


if __name__ == "__main__":
    main()
