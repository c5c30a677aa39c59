"""Probe (GPU): where a step's time goes with speculation off / n-gram / FASER, chat batch 8."""
import json, statistics, sys, time
sys.path.insert(0, "benchmarks")
import speculation as sp
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.sampling_params import SamplingParams

def timed(obj, name, bucket):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); bucket.setdefault(name, []).append(time.perf_counter() - t); return r
    setattr(obj, name, w)

tok = load_tokenizer(None)
prompts = sp.workload(tok, "chat")[:8]
DEV = "cuda"
methods = sys.argv[1:] or ["off", "ngram-adaptive", "ngram", "off", "ngram-adaptive", "ngram"]
for m in methods:
    core = EngineCore(EngineConfig(kv_cache_memory_gb=0.5, device=DEV,
                                   speculative=SpeculativeConfig.from_json(sp.METHODS[m])))
    sp.run(core, sp.noise_like(prompts), 8, 16)
    b = {}
    for obj, name in [(core.scheduler, "schedule"), (core.scheduler, "commit"), (core.worker, "execute"),
                      (core.worker, "_draft"), (core.worker.verifier, "verify")]:
        timed(obj, name, b)
    if core.scheduler.controller is not None:
        timed(core.scheduler.controller, "choose", b); timed(core.scheduler.controller.cost, "fit", b)
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"p{i}", ids, params))
    t0 = time.perf_counter(); steps = toks = drafted = dsteps = 0; by = {}
    while core.has_unfinished():
        s = core.step(); steps += 1; toks += sum(len(o.new_token_ids) for o in s.outputs)
        if s.stats: 
            drafted += s.stats.num_draft_tokens; dsteps += s.stats.num_draft_tokens > 0
            by.setdefault(min(s.stats.num_draft_tokens, 9), []).append(s.stats.step_time_s)
    el = time.perf_counter() - t0
    tot = {k: round(1e3 * sum(v), 1) for k, v in b.items()}
    print(json.dumps({"method": m, "tok_s": round(toks / el, 1), "steps": steps, "ms_per_step": round(1e3 * el / steps, 3),
                      "drafted": drafted, "drafting_steps": dsteps, "total_ms": tot,
                      "step_ms_by_drafts": {k: round(1e3 * statistics.median(v), 3) for k, v in sorted(by.items())},
                      "coef": core.scheduler.controller.cost.coef.tolist() if core.scheduler.controller else None}), flush=True)
