"""FASER phase management under open-loop bursty load (a benchmark, not a test; one run, side by
side).

A mixed workload (code-edit prompts that n-gram drafting predicts well, chat prompts it predicts
badly) arrives in bursts at a low, a medium and a high rate. Each configuration serves the same
arrivals on the embedded model:
    off            speculation off
    k=2, k=4, k=8  drafting (`--drafter`: n-gram, or lossy_kv on a small window) with a fixed draft
                   length
    faser          the goodput controller picks k per request each step (k_max 8)
    faser+prune    the controller plus verification in frontiers of 2 positions (early pruning)
    faser+prune+overlap   and the next step's drafts made while later frontiers verify (n-gram only)
With --repeats R every configuration serves every rate R times, configurations alternating within
each repeat (a drift of the shared machine then falls on all of them alike); tok/s is the median of
the R runs (their range printed beside it), latencies are percentiles of the gaps of all R runs
pooled. Reported per rate: output tokens/s (tokens / makespan), inter-token latency as a streaming
client sees it (the gap between a request's successive outputs; one output may carry several tokens)
p50/p99, and time per output token per request (TPOT, vLLM's definition) p50/p99, and the ratios the
issue asks for: faser vs spec off and vs the best fixed k.

    python benchmarks/faser.py --rates 0.15 0.6 40 --requests 6 12 48 --max-tokens 32 \
        --json out.json
    # a drafter whose every draft token costs a forward:
    python benchmarks/faser.py --drafter lossy_kv ...
    python benchmarks/faser.py --drafter lossy_kv --repeats 3 --json out.json --plot out.png
    python benchmarks/faser.py --render out.json --plot out.png   # table and plot of a saved run
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from speculation import NGRAM, noise_like, workload  # noqa: E402

from specserve.scheduler.config import EngineConfig, SpeculativeConfig  # noqa: E402
from specserve.scheduler.engine import EngineCore  # noqa: E402
from specserve.scheduler.messages import EngineRequest  # noqa: E402
from specserve.spec_phases.sampling_params import SamplingParams  # noqa: E402
from specserve.server.tokenizer import load_tokenizer  # noqa: E402

# drafters: n-gram (drafts cost nothing, so a long fixed k is cheap) and VeriCache's lossy_kv (the
# target model on a 32-token window + 4 sinks: every draft position costs a forward, and requests
# whose next tokens depend on text outside the window accept badly)
DRAFTERS = {
    "ngram": NGRAM,
    "lossy_kv": {"method": "lossy_kv", "kv_compressor": "window",
                 "kv_compressor_config": {"window": 32, "num_sink": 4}},
}
CONFIGS = {
    "off": None,
    "k=2": {"num_speculative_tokens": 2},
    "k=4": {"num_speculative_tokens": 4},
    "k=8": {"num_speculative_tokens": 8},
    "faser": {"num_speculative_tokens": 8, "adaptive": True},
    "faser+prune": {"num_speculative_tokens": 8, "adaptive": True, "frontier_size": 2},
    "faser+prune+overlap": {"num_speculative_tokens": 8, "adaptive": True, "frontier_size": 2,
                            "overlap_draft": True},
}


def bursty_arrivals(num: int, rate: float, seed: int, max_burst: int = 4) -> list[float]:
    """Burst start times are Poisson; each burst brings 1..max_burst requests at once (mean rate
    kept)."""
    rng = random.Random(seed)
    mean_burst = (1 + max_burst) / 2
    times, t = [], 0.0
    while len(times) < num:
        t += rng.expovariate(rate / mean_burst)
        times.extend([t] * rng.randint(1, max_burst))
    return times[:num]


def serve(core: EngineCore, prompts: list[list[int]], arrivals: list[float],
          max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    stamps: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
    nxt, tokens, start = 0, 0, time.perf_counter()
    drafted = accepted = 0
    while nxt < len(order) or core.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            core.add_request(EngineRequest(f"q{i}", prompts[i % len(prompts)], params))
            stamps[f"q{i}"] = [start + arrivals[i]]
            nxt += 1
        if not core.has_unfinished():
            time.sleep(max(0.0, arrivals[order[nxt]] - now))
            continue
        step = core.step()
        outs = step.outputs
        t = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                stamps[o.request_id].append(t)
                counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
                tokens += len(o.new_token_ids)
        drafted += step.stats.num_draft_tokens
        accepted += step.stats.num_accepted_tokens
    makespan = time.perf_counter() - start - min(arrivals)
    core.check_integrity()
    return {"tokens": tokens, "makespan": makespan, "drafted": drafted, "accepted": accepted,
            # the gaps after each request's first token, and each request's time per output token
            # after its first (vLLM's TPOT): speculation's several tokens per output count there,
            # once in a gap
            "gaps": [b - a for s in stamps.values() for a, b in zip(s[1:], s[2:])],
            "tpots": [(s[-1] - s[1]) / (counts[r] - 1) for r, s in stamps.items()
                      if counts.get(r, 0) > 1]}


def summarize(runs: list[dict]) -> dict:
    """One cell over its repeats: median tok/s (and range), percentiles of all runs' gaps pooled."""
    rates = sorted(r["tokens"] / r["makespan"] for r in runs)
    gaps = sorted(g for r in runs for g in r["gaps"])
    tpots = sorted(t for r in runs for t in r["tpots"])
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else None  # noqa: E731
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
            "itl_p50_ms": pick(gaps, 0.5), "itl_p99_ms": pick(gaps, 0.99),
            "tpot_p50_ms": pick(tpots, 0.5), "tpot_p99_ms": pick(tpots, 0.99),
            "acceptance_rate": accepted / drafted if drafted else None,
            "draft_tokens": drafted / len(runs)}


LEVELS = ("low", "medium", "high")


def measure(args) -> list[dict]:
    tok = load_tokenizer(None)
    code, chat = workload(tok, "code-edit"), workload(tok, "chat")
    # alternate good and bad acceptors
    prompts = [p for pair in zip(code, chat) for p in pair]
    configs = [c for c in args.configs if args.drafter == "ngram" or not CONFIGS[c] or
               not CONFIGS[c].get("overlap_draft")]          # overlap needs a stateless drafter
    levels = list(zip(LEVELS, args.rates, args.requests))
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for name in configs:
            spec = None if CONFIGS[name] is None else SpeculativeConfig.from_json(
                {**DRAFTERS[args.drafter], **CONFIGS[name]})
            core = EngineCore(EngineConfig(kv_cache_memory_gb=1.0, max_num_seqs=64,
                                           device=args.device, dtype=args.dtype,
                                           speculative=spec))
            serve(core, noise_like(prompts[:4]), [0.0] * 4, 16)               # warm-up
            for level, rate, num in levels:
                r = serve(core, prompts, bursty_arrivals(num, rate, args.seed), args.max_tokens)
                runs.setdefault((name, level), []).append(r)
                print(json.dumps({"repeat": rep, "config": name, "load": level,
                                  "tokens_per_s": r["tokens"] / r["makespan"],
                                  "draft_tokens": r["drafted"]}),
                      flush=True)
            del core
    return [{"config": name, "drafter": args.drafter, "load": level, "rate": rate, "requests": num,
             "repeats": args.repeats, **summarize(runs[name, level])}
            for name in configs for level, rate, num in levels]


def report(rows: list[dict]) -> None:
    print("\n| load | config | tok/s (range) | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms "
          "| acceptance | draft tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: LEVELS.index(r["load"])):
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        runs = r.get("tokens_per_s_runs", [r["tokens_per_s"]])
        spread = f" ({runs[0]:.1f}–{runs[-1]:.1f})" if len(runs) > 1 else ""
        print(f"| {r['load']} | {r['config']} | {r['tokens_per_s']:.1f}{spread} "
              f"| {r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | {r['tpot_p50_ms']:.0f} "
              f"| {r['tpot_p99_ms']:.0f} | {acc} | "
              f"{r['draft_tokens']:.0f} |")
    for level in LEVELS:
        at = {r["config"]: r for r in rows if r["load"] == level}
        fixed = [at[c] for c in ("k=2", "k=4", "k=8") if c in at]
        if not fixed:
            continue
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        for name in [c for c in at if c.startswith("faser")]:
            f = at[name]
            line = (f"{level}: {name} {f['tokens_per_s'] / best['tokens_per_s']:.2f}x the tok/s "
                    f"of the best fixed "
                    f"{best['config']}, p99 ITL {best['itl_p99_ms'] / f['itl_p99_ms']:.2f}x lower")
            if "off" in at:
                line += f"; {f['tokens_per_s'] / at['off']['tokens_per_s']:.2f}x spec off"
            print(line)


def plot(rows: list[dict], path: str) -> None:
    """Two panels, one group of bars per load: tok/s relative to spec off (the range of the repeats
    as an error bar) and p99 inter-token latency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = list(dict.fromkeys(r["config"] for r in rows))
    at = {(r["config"], r["load"]): r for r in rows}
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(configs)
    for j, name in enumerate(configs):
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(LEVELS))]
        rel, lo, hi, p99 = [], [], [], []
        for level in LEVELS:
            r, off = at[name, level], at.get(("off", level))
            base = off["tokens_per_s"] if off else 1.0
            runs = r.get("tokens_per_s_runs", [r["tokens_per_s"]])
            rel.append(r["tokens_per_s"] / base)
            lo.append((r["tokens_per_s"] - runs[0]) / base)
            hi.append((runs[-1] - r["tokens_per_s"]) / base)
            p99.append(r["itl_p99_ms"])
        ax_t.bar(xs, rel, width, yerr=[lo, hi], capsize=2, label=name)
        ax_l.bar(xs, p99, width, label=name)
    for ax in (ax_t, ax_l):
        ax.set_xticks(range(len(LEVELS)))
        ax.set_xticklabels([f"{lv}\n{at[configs[0], lv]['rate']:g} req/s, "
                            f"{at[configs[0], lv]['requests']}"
                            for lv in LEVELS])
    ax_t.axhline(1.0, color="grey", ls=":", lw=1)
    ax_t.set_ylabel("output tok/s relative to spec off")
    ax_l.set_ylabel("p99 inter-token latency, ms")
    ax_l.set_yscale("log")
    drafter, reps = rows[0]["drafter"], rows[0].get("repeats", 1)
    fig.suptitle(f"FASER under bursty load, {drafter} drafting (median of {reps} runs)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.legend(*ax_t.get_legend_handles_labels(), loc="lower center", ncol=len(configs), fontsize=9)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs=3, default=[0.15, 0.6, 40.0],
                    help="low, medium, high req/s (high must queue work: 2-6/s no longer does "
                         "on a 2-core CPU)")
    ap.add_argument("--requests", type=int, nargs=3, default=[6, 12, 48],
                    help="requests at each rate")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--drafter", default="ngram", choices=list(DRAFTERS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="serve every cell this many times, configs alternating")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None,
                    help="write the bar charts (tok/s vs spec off, p99 ITL) here")
    ap.add_argument("--render", default=None,
                    help="a --json file of an earlier run: table and plot only")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.render:
        with open(args.render) as fh:
            rows = json.load(fh)
    else:
        rows = measure(args)
    report(rows)
    if args.json and not args.render:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
