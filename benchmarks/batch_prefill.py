"""Many short prompts prefilled in one step, in-process on the embedded model (a benchmark, not a
test): `--requests` prompts of `--prompt-len` random tokens added together, one token each,
`--rounds` times; prints each round's milliseconds until all are done.

    python benchmarks/batch_prefill.py --requests 16 --prompt-len 117 --rounds 3
"""
from __future__ import annotations

import argparse
import time

import torch

from specserve.scheduler.config import EngineConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=117)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    core = EngineCore(EngineConfig(enable_prefix_caching=False))
    core.warm_up()
    g = torch.Generator().manual_seed(0)
    for r in range(args.rounds):
        for i in range(args.requests):
            ids = torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist()
            core.add_request(EngineRequest(f"{r}-{i}", ids,
                                           SamplingParams(max_tokens=1, temperature=0.0)))
        start = time.perf_counter()
        while core.has_unfinished():
            core.step()
        print(f"{args.requests} x {args.prompt_len} prompt tokens: "
              f"{(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
