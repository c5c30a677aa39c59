"""Speculative decoding benchmark on the embedded model (a benchmark, not a test).

Two workloads, batch 1 and batch 8, speculation off and each drafter, measured one after another in
one run: output tokens/s, draft acceptance rate, mean acceptance length (1 + accepted / drafts).

    python benchmarks/speculation.py --batch 1 8 --max-tokens 96
"""
from __future__ import annotations

import argparse
import json
import time

from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.server.tokenizer import load_tokenizer

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
CODE_EDIT = [CODE + "\n\n# The same code again, with the variable `subtotal` renamed to "
             f"`{name}`:\n\n"
             for name in ("amount", "running_sum", "base", "net", "acc", "s", "gross", "value")]
CHAT = ["What are three tips for staying healthy?", "Explain what a hash table is.",
        "Write a short poem about the sea.", "How do airplanes fly?",
        "What is the capital of Japan?",
        "Give me a recipe for pancakes.", "Why is the sky blue?", "Summarise the plot of Hamlet."]
NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
METHODS = {
    "off": None,
    "ngram": {**NGRAM, "num_speculative_tokens": 8},
    "ngram-k4": {**NGRAM, "num_speculative_tokens": 4},
    "ngram-adaptive": {**NGRAM, "num_speculative_tokens": 8, "adaptive": True},
    "ngram-frontier": {**NGRAM, "num_speculative_tokens": 8, "frontier_size": 2},
    "ngram-frontier-overlap": {**NGRAM, "num_speculative_tokens": 8, "frontier_size": 2,
                               "overlap_draft": True},
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 4},
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3},
}


def workload(tokenizer, name: str) -> list[list[int]]:
    if name == "code-edit":
        return [tokenizer.encode(p) for p in CODE_EDIT]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in CHAT]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def noise_like(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts of the same lengths made of unrelated token ids: a warm-up that teaches drafters with
    shared state (token recycling's table, the controller's priors) nothing about the workload."""
    return [[(t * 7919 + i * 104729) % 30000 + 100 for t in range(len(p))]
            for i, p in enumerate(prompts)]


def run(core: EngineCore, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tokens = drafts = drafted = accepted = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):              # closed batches of `batch` requests
        for i, ids in enumerate(prompts[first:first + batch]):
            core.add_request(EngineRequest(f"b{first + i}", ids, params))
        while core.has_unfinished():
            step = core.step()
            tokens += sum(len(o.new_token_ids) for o in step.outputs)
            s = step.stats
            drafts, drafted, accepted = (drafts + s.num_drafts, drafted + s.num_draft_tokens,
                                         accepted + s.num_accepted_tokens)
    elapsed = time.perf_counter() - start
    core.check_integrity()
    return {"tokens_per_s": tokens / elapsed,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (<= 8)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--workloads", nargs="+", default=["code-edit", "chat"],
                    choices=["code-edit", "chat"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tokenizer = load_tokenizer(None)
    rows = []
    for method in ["off"] + [m for m in args.methods if m != "off"]:
        spec = METHODS[method]
        core = EngineCore(EngineConfig(kv_cache_memory_gb=0.5, device=args.device, dtype=args.dtype,
                                       speculative=SpeculativeConfig.from_json(spec)))
        for wl in args.workloads:
            prompts = workload(tokenizer, wl)[:args.prompts]
            for batch in args.batch:
                # warm-up: these shapes, GPU clocks up
                run(core, noise_like(prompts[:batch]), batch, 16)
                r = run(core, prompts, batch, args.max_tokens)
                rows.append({"workload": wl, "batch": batch, "method": method, **r})
                print(json.dumps(rows[-1]), flush=True)
    base = {(r["workload"], r["batch"]): r["tokens_per_s"] for r in rows if r["method"] == "off"}
    print("\n| workload | batch | method | tok/s | × off | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base[(r['workload'], r['batch'])]:.2f} | {acc} | {mal} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
