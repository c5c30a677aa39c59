"""A long prompt's prefill on the CPU, in-process on the embedded model (a benchmark, not a test):
the wall time of its prefill steps and, from the one-call C decoder's own timers, the time in
its linear layers, attention (with the K/V write) and elementwise kernels, and each decoder call's
rows and milliseconds (one call a prompt chunk: `--max-num-batched-tokens` rows at most).

    python benchmarks/long_prefill.py --context 2800 --rounds 2

The prompt: the first `--context` tokens of the long workloads' pinned sources (as
`adaptive_long_context.py`), one token generated, prefix caching off.
"""
from __future__ import annotations

import argparse
import time

import decoder_timers
from long_prompt_interleave import long_prompts
from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2800)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=EngineConfig.max_num_batched_tokens)
    args = ap.parse_args()
    decoder_timers.install()
    prompt = long_prompts(load_tokenizer(None), 1, args.context)[0]
    core = EngineCore(EngineConfig(enable_prefix_caching=False,
                                   max_num_batched_tokens=args.max_num_batched_tokens))
    core.warm_up()
    for i in range(args.rounds):
        decoder_timers.reset()
        core.add_request(EngineRequest(f"r{i}", prompt,
                                       SamplingParams(max_tokens=1, temperature=0.0)))
        start = time.perf_counter()
        while core.has_unfinished():
            core.step()
        wall = time.perf_counter() - start
        linear, attention, elementwise = (decoder_timers.SECONDS * 1e3).tolist()
        calls = ", ".join(f"{c[0]} rows {c[1] * 1e3:.0f} ms" for c in decoder_timers.CALLS)
        print(f"prefill of {len(prompt)} tokens: {wall * 1e3:.0f} ms; linear {linear:.0f}, "
              f"attention {attention:.0f}, elementwise {elementwise:.0f} ms; calls: {calls}",
              flush=True)


if __name__ == "__main__":
    main()
