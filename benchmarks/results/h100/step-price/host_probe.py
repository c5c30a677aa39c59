"""Probe (GPU): where a step's time goes with speculation off / n-gram / FASER, chat batch 8.

Run from the repository root: `python3 host_probe.py off ngram-adaptive ngram ...` (methods as
`benchmarks/speculation.py` names them). Prints one JSON line per method: tok/s, the wall time
of each engine call summed over the run (ms), step times by draft rows, the fitted prices.
"""
import json
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import speculation as sp  # noqa: E402
from specserve.scheduler.config import EngineConfig, SpeculativeConfig  # noqa: E402
from specserve.scheduler.engine import EngineCore  # noqa: E402
from specserve.scheduler.messages import EngineRequest  # noqa: E402
from specserve.server.tokenizer import load_tokenizer  # noqa: E402
from specserve.spec_phases.sampling_params import SamplingParams  # noqa: E402

DEV = "cuda"


def timed(obj, name, bucket):
    """Wrap obj.name so each call's wall time is appended to bucket[name]."""
    f = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        bucket.setdefault(name, []).append(time.perf_counter() - t)
        return r
    setattr(obj, name, wrapper)


def probe(method, prompts):
    core = EngineCore(EngineConfig(kv_cache_memory_gb=0.5, device=DEV,
                                   speculative=SpeculativeConfig.from_json(sp.METHODS[method])))
    sp.run(core, sp.noise_like(prompts), 8, 16)                       # warm-up
    b = {}
    for obj, name in [(core.scheduler, "schedule"), (core.scheduler, "commit"),
                      (core.worker, "execute"), (core.worker, "_draft"),
                      (core.worker.verifier, "verify")]:
        timed(obj, name, b)
    ctl = core.scheduler.controller
    if ctl is not None:
        timed(ctl, "choose", b)
        timed(ctl.cost, "fit", b)
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"p{i}", ids, params))
    t0 = time.perf_counter()
    steps = toks = drafted = dsteps = 0
    by = {}
    while core.has_unfinished():
        s = core.step()
        steps += 1
        toks += sum(len(o.new_token_ids) for o in s.outputs)
        if s.stats:
            drafted += s.stats.num_draft_tokens
            dsteps += s.stats.num_draft_tokens > 0
            by.setdefault(min(s.stats.num_draft_tokens, 9), []).append(s.stats.step_time_s)
    el = time.perf_counter() - t0
    return {"method": method, "tok_s": round(toks / el, 1), "steps": steps,
            "ms_per_step": round(1e3 * el / steps, 3), "drafted": drafted,
            "drafting_steps": dsteps,
            "total_ms": {k: round(1e3 * sum(v), 1) for k, v in b.items()},
            "step_ms_by_drafts": {k: round(1e3 * statistics.median(v), 3)
                                  for k, v in sorted(by.items())},
            "coef": ctl.cost.coef.tolist() if ctl is not None else None}


def main():
    prompts = sp.workload(load_tokenizer(None), "chat")[:8]
    methods = sys.argv[1:] or ["off", "ngram-adaptive", "ngram", "off", "ngram-adaptive", "ngram"]
    for m in methods:
        print(json.dumps(probe(m, prompts)), flush=True)


if __name__ == "__main__":
    main()
