"""Structured-output benchmark (a benchmark, not a test): output tokens/s with and without a JSON
schema, at batch 1 and 8, speculation off and on, measured one after another in one run; plus the
grammar's own cost (cutting drafts and computing masks) per engine step and per sampled row.

    python benchmarks/structured.py                       # the embedded model, the full grid
    python benchmarks/structured.py --tiny --max-tokens 16 --batch 1 2    # a quick smoke run
"""
from __future__ import annotations

import argparse
import json
import time

from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.sampling_params import Constraint, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "country", "continent", "is_capital", "population_millions",
                       "landmarks"],
          "properties": {"name": {"type": "string", "maxLength": 32},
                         "country": {"type": "string", "maxLength": 32},
                         "continent": {"enum": ["Africa", "Asia", "Europe", "North America",
                                                "South America", "Oceania"]},
                         "is_capital": {"type": "boolean"},
                         "population_millions": {"type": "integer", "minimum": 0,
                                                 "maximum": 100},
                         "landmarks": {"type": "array", "maxItems": 3,
                                       "items": {"type": "string", "maxLength": 40}}}}
CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Sydney", "Toronto", "Berlin", "Cairo"]
METHODS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3},
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 4},
}


def prompts(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe the city of {c} as JSON with its name, country, "
                                     f"continent, whether it is a capital, its population in "
                                     f"millions and up to three landmarks."}],
        tokenize=False, add_generation_prompt=True) for c in CITIES]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def run(core: EngineCore, ids: list[list[int]], batch: int, max_tokens: int,
        constraint: Constraint | None) -> dict:
    """Closed batches of `batch` requests. Without a schema EOS is ignored so both arms make
    comparable numbers of tokens; with one, a request stops when its JSON is complete."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=constraint is None,
                            constraint=constraint)
    grammars = core.worker.grammars
    mask_before = grammars.mask_seconds
    tokens = steps = rows = drafted = accepted = 0
    start = time.perf_counter()
    for first in range(0, len(ids), batch):
        for i, prompt in enumerate(ids[first:first + batch]):
            core.add_request(EngineRequest(f"b{first + i}", prompt, params))
        while core.has_unfinished():
            step = core.step()
            new = sum(len(o.new_token_ids) for o in step.outputs)
            tokens += new
            s = step.stats
            if s is not None:
                steps += 1
                rows += s.num_draft_tokens - s.num_masked_tokens + len(step.outputs)
                drafted, accepted = drafted + s.num_draft_tokens, accepted + s.num_accepted_tokens
    core.run_until_idle()
    elapsed = time.perf_counter() - start
    core.check_integrity()
    mask_s = grammars.mask_seconds - mask_before
    return {"tokens": tokens, "tokens_per_s": tokens / elapsed,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mask_ms_per_step": 1e3 * mask_s / steps if steps else 0.0,
            "mask_us_per_row": 1e6 * mask_s / rows if constraint is not None and rows else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--tiny", action="store_true", help="the tiny random-weight model (smoke run)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = "tiny-random" if args.tiny else None
    tokenizer = load_tokenizer(model)
    ids = prompts(tokenizer)
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    rows = []
    for method in ["off"] + [m for m in args.methods if m != "off"]:
        core = EngineCore(EngineConfig(model=model, kv_cache_memory_gb=0.5, device=args.device,
                                       dtype=args.dtype,
                                       speculative=SpeculativeConfig.from_json(METHODS[method])))
        run(core, ids[:1], 1, 8, schema)              # warm-up; compiles (and caches) the schema
        for batch in args.batch:
            for name, constraint in (("free", None), ("schema", schema)):
                r = run(core, ids[:max(batch, 2)], batch,
                        args.max_tokens, constraint)
                rows.append({"batch": batch, "method": method, "output": name, **r})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| batch | speculation | output | tok/s | × free | acceptance | mask ms/step "
          "| mask µs/row |")
    print("|---|---|---|---|---|---|---|---|")
    free = {(r["batch"], r["method"]): r["tokens_per_s"] for r in rows if r["output"] == "free"}
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(f"| {r['batch']} | {r['method']} | {r['output']} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / free[(r['batch'], r['method'])]:.2f} | {acc} | "
              f"{r['mask_ms_per_step']:.2f} | {r['mask_us_per_row']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
