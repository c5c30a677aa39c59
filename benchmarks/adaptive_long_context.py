"""lossy_kv at a long context, fixed k against FASER's controller (issue 35 item 4): decode TPOT,
the mean draft length the controller chose, and the draft-pass prices it fitted (per pass, per
row, per context key), one request at a time on the embedded model.

    /work/tools/bench-quiet .venv/bin/python benchmarks/adaptive_long_context.py \
        [--compressors window,quant,mustafar --context 2800 --new-tokens 64 --k 8] \
        [--only adaptive --rounds 3]

`--rounds`: the whole sequence again (plain first each time), so plain and the drafters
alternate on a host whose speed drifts; `--only`: the fixed-k or the `adaptive` cells alone.

The prompt: the first `--context` tokens of the repository's largest Python file. Each cell is a
fresh engine (warmed up as the server does), greedy, ignore_eos; its output must equal plain
decoding's. TPOT: (last token - first token) / (tokens - 1).
"""
from __future__ import annotations

import argparse
import statistics
import time

from long_prompt_interleave import greedy, long_prompts
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer


def cell(spec: SpeculativeConfig | None, prompt: list[int], new_tokens: int,
         device: str = "auto") -> tuple:
    core = EngineCore(EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=4096,
                                   speculative=spec, device=device))
    core.warm_up()
    core.add_request(EngineRequest("a", prompt, greedy(new_tokens)))
    times, drafts, out = [], [], []
    while core.has_unfinished():
        step = core.step()
        for o in step.outputs:
            out += o.new_token_ids
            times += [time.perf_counter()] * len(o.new_token_ids)
        if step.stats is not None and step.stats.num_prompt_tokens == 0:
            drafts.append(step.stats.num_draft_tokens)
    return out, (times[-1] - times[0]) / (len(times) - 1), statistics.mean(drafts), \
        core.scheduler.cost.prices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compressors", default="window,quant,mustafar")
    ap.add_argument("--context", type=int, default=2800)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--device", default="auto", help="auto: cuda where present, else cpu")
    ap.add_argument("--only", choices=["fixed", "adaptive"], default=None)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    prompt = long_prompts(load_tokenizer(None), 1, args.context)[0]
    kinds = {"fixed": (False,), "adaptive": (True,), None: (False, True)}[args.only]
    for _ in range(args.rounds):
        run_round(args, prompt, kinds)


def run_round(args: argparse.Namespace, prompt: list[int], kinds: tuple[bool, ...]) -> None:
    plain, tpot, _, _ = cell(None, prompt, args.new_tokens, args.device)
    print(f"plain: TPOT {tpot * 1e3:.1f} ms", flush=True)
    for comp in args.compressors.split(","):
        for adaptive in kinds:
            spec = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=args.k,
                                     kv_compressor=comp, adaptive=adaptive)
            out, tpot, k, p = cell(spec, prompt, args.new_tokens, args.device)
            assert out == plain, comp
            print(f"{comp} {'adaptive' if adaptive else f'k={args.k}'}: TPOT {tpot * 1e3:.1f} ms, "
                  f"mean drafts a step {k:.2f}; a draft pass {p.draft_pass * 1e3:.2f} ms + "
                  f"{p.pass_row * 1e3:.2f} ms a row + {p.pass_key * 1e6:.2f} us a context key",
                  flush=True)


if __name__ == "__main__":
    main()
