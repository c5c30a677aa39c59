"""A short decoding request while long prompts arrive: its TPOT alone and beside them, and the long
prompts' TTFT, under chunked prefill with and without the decode slowdown bound (issue 35 item 3).

    /work/tools/bench-quiet .venv/bin/python benchmarks/long_prompt_interleave.py \
        [--long 4 --long-len 2816 --short-tokens 128 --long-tokens 32 --rounds 2]

In-process EngineCore on the embedded model (SmolLM2-135M Q4_1), prefix caching off, one fresh
engine per cell (warmed up as the server does). Each cell: the short request (a ~100-token prompt,
`--short-tokens` greedy tokens, ignore_eos) decodes alone, and its TPOT is taken; then it runs
again and after its 4th token the `--long` prompts (the first `--long-len` tokens of different
source files of this repository, `--long-tokens` tokens each) are submitted together. TPOT: the
short request's (last token - first token) / (tokens - 1); TTFT: from submission to a long prompt's
first token. `slowdown=none` is vLLM's chunked prefill (decodes first, prompt chunks fill the token
budget of 2048); a number is EngineConfig.max_decode_slowdown (prompt chunks from a time credit,
measured). Cells alternate between settings, `--rounds` times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                           # the repository's loadtests package
from loadtests.workloads import pinned_sources, source_files  # noqa: E402


def long_prompts(tok, num: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the `num` largest Python files of the repository at the long
    workloads' pinned commit (`loadtests/workloads.py`'s SOURCE_COMMIT: the prompts do not move
    with the working tree)."""
    out = []
    for path in source_files(pinned_sources(ROOT)):
        ids = tok.encode(path.read_text())
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == num:
            return out
    raise SystemExit(f"fewer than {num} files of {length} tokens")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def short_alone(core: EngineCore, prompt: list[int], tokens: int, tag: str) -> float:
    core.add_request(EngineRequest(tag, prompt, greedy(tokens)))
    times = []
    while core.has_unfinished():
        for out in core.step().outputs:
            times += [time.perf_counter()] * len(out.new_token_ids)
    core.run_until_idle()
    return (times[-1] - times[0]) / (len(times) - 1)


def interleaved(core: EngineCore, short: list[int], longs: list[list[int]], short_tokens: int,
                long_tokens: int) -> dict:
    core.add_request(EngineRequest("short", short, greedy(short_tokens)))
    times: list[float] = []
    submitted, first = 0.0, {}
    chunks = []
    while core.has_unfinished():
        step = core.step()
        now = time.perf_counter()
        for out in step.outputs:
            if out.request_id == "short":
                times += [now] * len(out.new_token_ids)
            elif out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now - submitted
        if step.stats is not None and "short" in core.scheduler.requests and submitted:
            chunks.append((step.stats.num_prompt_tokens, step.stats.step_time_s))
        if len(times) == 4 and not submitted:
            submitted = time.perf_counter()
            for i, ids in enumerate(longs):
                core.add_request(EngineRequest(f"long{i}", ids, greedy(long_tokens)))
    core.run_until_idle()
    done = time.perf_counter() - submitted
    ttft = sorted(first.values())
    chunked = [n for n, _ in chunks if n]
    return {"tpot": (times[-1] - times[0]) / (len(times) - 1), "ttft": ttft, "all_done": done,
            "steps": len(chunks), "chunks": len(chunked), "chunk_p50": statistics.median(chunked)
            if chunked else 0, "worker_s": sum(t for _, t in chunks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-len", type=int, default=2816)
    ap.add_argument("--short-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default="none,1.5",
                    help="comma-separated max_decode_slowdown values ('none': unbounded)")
    args = ap.parse_args()
    settings = [None if s == "none" else float(s) for s in args.settings.split(",")]
    tok = None
    for rnd in range(args.rounds):
        for slowdown in settings:
            core = EngineCore(EngineConfig(enable_prefix_caching=False,
                                           max_decode_slowdown=slowdown))
            if tok is None:
                tok = load_tokenizer(core.model_info.path)
                longs = long_prompts(tok, args.long, args.long_len)
                short = tok.encode("Write a short story about a lighthouse keeper who finds a "
                                   "message in a bottle. " * 6)[:100]
            core.warm_up()
            alone = short_alone(core, short, args.short_tokens, "warm")   # the cost model's too
            alone = short_alone(core, short, args.short_tokens, "alone")
            r = interleaved(core, short, longs, args.short_tokens, args.long_tokens)
            name = "none" if slowdown is None else f"{slowdown:g}"
            ttft = " ".join(f"{t:.2f}" for t in r["ttft"])
            print(f"round {rnd} slowdown={name}: short TPOT alone {alone * 1e3:.1f} ms, "
                  f"beside {args.long} x {args.long_len}-token prompts {r['tpot'] * 1e3:.1f} ms "
                  f"({r['tpot'] / alone:.2f}x); long TTFT s [{ttft}] (p50 "
                  f"{statistics.median(r['ttft']):.2f}); all done {r['all_done']:.1f} s; "
                  f"beside the short: {r['steps']} steps ({r['worker_s']:.2f} s in the "
                  f"worker), {r['chunks']} with a prompt chunk, its rows p50 "
                  f"{r['chunk_p50']:g}", flush=True)
            del core


if __name__ == "__main__":
    main()
