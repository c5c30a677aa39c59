"""Speculation against plain decoding on distinct chat prompts (the compare harness' workload B),
in-process, one closed batch (a benchmark, not a test): every request runs `--max-tokens` tokens,
greedy; output tokens/s, steps, drafted and accepted tokens, for each method in the order given
(repeat a method to alternate: `off ngram off ngram`), and the median step time by the number of
draft rows the step verified (decode steps only: no prompt tokens), which prices a verify row
against a decode row.

    python benchmarks/chat_speculation.py --concurrency 16 --methods off ngram adaptive off

n-gram is the JSON the compare harness gives both servers (k = 4, prompt_lookup_max 4, so
prompt_lookup_min 4 as vLLM fills it in); `adaptive` adds the FASER controller.
"""
from __future__ import annotations

import argparse
import statistics
import time

from specserve.loadtests.workloads import chat_prompts
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
METHODS = {"off": None, "ngram": NGRAM, "adaptive": {**NGRAM, "adaptive": True}}


def run(prompts: list[list[int]], spec: dict | None, max_tokens: int) -> str:
    config = SpeculativeConfig(**spec) if spec else None
    core = EngineCore(EngineConfig(speculative=config))
    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    core.add_request(EngineRequest("warm-up", prompts[0], warm))
    core.run_until_idle()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", ids, params))
    tokens = steps = drafted = accepted = 0
    by_drafts: dict[int, list[float]] = {}        # decode steps' times by their draft rows
    start = time.perf_counter()
    while core.has_unfinished():
        step = core.step()
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in step.outputs)
        drafted += step.stats.num_draft_tokens
        accepted += step.stats.num_accepted_tokens
        if step.stats.num_prompt_tokens == 0 and step.stats.num_running == len(prompts):
            by_drafts.setdefault(step.stats.num_draft_tokens, []).append(step.stats.step_time_s)
    elapsed = time.perf_counter() - start
    core.check_integrity()
    times = ", ".join(f"{d}: {1000 * statistics.median(t):.1f} ({len(t)})"
                      for d, t in sorted(by_drafts.items()) if len(t) >= 5)
    return (f"{tokens / elapsed:.1f} tok/s, {steps} steps ({1000 * elapsed / steps:.1f} ms), "
            f"drafted {drafted}, accepted {accepted}; ms per step by draft rows (steps): {times}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["off", "ngram", "adaptive", "off"],
                    choices=list(METHODS))
    args = ap.parse_args()
    tokenizer = load_tokenizer(None)
    prompts = [tokenizer.encode(p) for p in chat_prompts(32, 1)][:args.concurrency]
    for method in args.methods:
        print(f"c={args.concurrency} {method}: {run(prompts, METHODS[method], args.max_tokens)}",
              flush=True)


if __name__ == "__main__":
    main()
