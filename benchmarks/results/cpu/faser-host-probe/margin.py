"""Probe: FASER's margin in-process, the compare harness' closed loop (c = 8, its 32 requests of
workload A or B), against spec off, alternated; output tokens/s while every slot was busy.

    python benchmarks/results/cpu/faser-host-probe/margin.py B,A 2 0.03,0.1,0.2
"""
import sys
import time

from specserve.loadtests import compare
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "adaptive": True}


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run(tokenizer, specs, margin: float | None, concurrency: int = 8) -> tuple[float, int, int]:
    core = EngineCore(EngineConfig(speculative=None if margin is None
                                   else SpeculativeConfig(**NGRAM)))
    if margin is not None:
        core.scheduler.controller.margin = margin
    core.add_request(EngineRequest("warm-up", tokenizer.encode(specs[0].prompt), params(8)))
    core.run_until_idle()
    pending = [(i, tokenizer.encode(s.prompt), s.max_tokens) for i, s in enumerate(specs)]
    in_flight = tokens = drafted = accepted = 0
    start, full = time.perf_counter(), None
    while pending or core.has_unfinished():
        while pending and in_flight < concurrency:
            i, ids, max_tokens = pending.pop(0)
            core.add_request(EngineRequest(f"r{i}", ids, params(max_tokens)))
            in_flight += 1
        if full is None and in_flight < concurrency:
            full = tokens, time.perf_counter() - start
        step = core.step()
        in_flight -= sum(o.finished for o in step.outputs)
        tokens += sum(len(o.new_token_ids) for o in step.outputs)
        drafted += step.stats.num_draft_tokens
        accepted += step.stats.num_accepted_tokens
    full = full or (tokens, time.perf_counter() - start)
    return full[0] / full[1], drafted, accepted


def main() -> None:
    tokenizer = load_tokenizer(None)
    loads = compare.workloads(0, 32)
    margins = [None] + [float(m) for m in sys.argv[3].split(",")]
    for wl in sys.argv[1].split(","):
        for rep in range(int(sys.argv[2])):
            for margin in margins:
                rate, drafted, accepted = run(tokenizer, loads[wl], margin)
                print(f"{wl} rep{rep} margin {margin}: {rate:.1f} tok/s busy, drafted {drafted} "
                      f"accepted {accepted}", flush=True)


if __name__ == "__main__":
    main()
