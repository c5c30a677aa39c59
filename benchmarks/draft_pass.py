"""lossy_kv's draft pass at a long context, in-process on the embedded model: what one pass costs
and where (the one C call's linear layers, attention and elementwise kernels; the rest is the LM
head and Python), and what encoding a context into the drafting state costs (a request's first
draft round pays it). A benchmark, not a test.

    python benchmarks/draft_pass.py --compressors window,quant --context 2800

Per compressor: a fresh engine (lossy_kv, k = 8), one synthetic state of `--context` random K/V
tokens a layer (as `LossyKVProposer.calibrate` builds it; the encode timed), then `--rounds`
rounds of 8 draft passes over it; the best three rounds are printed, ms a pass.
"""
from __future__ import annotations

import argparse
import time

import torch

import decoder_timers
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compressors", default="window,quant")
    ap.add_argument("--context", type=int, default=2800)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    decoder_timers.install()
    for name in args.compressors.split(","):
        core = EngineCore(EngineConfig(enable_prefix_caching=False, speculative=SpeculativeConfig(
            method="lossy_kv", num_speculative_tokens=8, kv_compressor=name)))
        proposer = core.worker.proposer
        comp, pool, n = proposer.pool.comp, proposer.pool, args.context
        c, gen = comp.config, torch.Generator().manual_seed(0)
        state, encode_s = comp.new_state(pool.state_dtype, str(pool.device)), 0.0
        for layer in range(c.num_layers):
            k, v = torch.randn(2, n, c.num_kv_heads, c.head_dim, generator=gen)
            start = time.perf_counter()
            comp.encode(state, layer, k, v)
            encode_s += time.perf_counter() - start
        rounds = []
        for _ in range(args.rounds):
            decoder_timers.reset()
            start = time.perf_counter()
            proposer._draft([state], [1], [n], [8], refresh_mass=False, since=start)
            per_pass = (decoder_timers.SECONDS / 8).tolist()
            rounds.append(((time.perf_counter() - start) / 8, *per_pass))
        best = sorted(rounds)[:3]
        print(f"{name} at {n} tokens: encode {encode_s * 1e3:.1f} ms; a pass (ms: all, linear, "
              f"attention, elementwise), best 3 of {args.rounds}: "
              + "; ".join(" ".join(f"{x * 1e3:.2f}" for x in r) for r in best), flush=True)


if __name__ == "__main__":
    main()
