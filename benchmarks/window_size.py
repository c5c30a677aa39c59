"""The `window` compressor's dense window against drafting speed (a benchmark, not a test): for
each of `--prompts` long prompts (the first `--context` tokens of the long workloads' pinned
source files, as workload C takes them), plain decoding's TPOT and `lossy_kv` window k = 8's at
each `--windows` size (`kv_compressor_config` {"window": w}), greedy, one request at a time on
the embedded model, every output checked equal to plain's. Prints each cell and, per window, the
geometric mean of plain's TPOT over the drafter's.

    python benchmarks/window_size.py --context 2800 --prompts 4 --windows 64 256 512 1024
"""
from __future__ import annotations

import argparse
import math

from adaptive_long_context import cell
from long_prompt_interleave import long_prompts
from specserve.scheduler.config import SpeculativeConfig
from specserve.server.tokenizer import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2800)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--windows", type=int, nargs="+", default=[64, 256, 512, 1024])
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    ratios: dict[int, list[float]] = {w: [] for w in args.windows}
    for i, prompt in enumerate(long_prompts(load_tokenizer(None), args.prompts, args.context)):
        plain, tpot, _, _ = cell(None, prompt, args.new_tokens)
        line = [f"prompt {i}: plain {tpot * 1e3:.1f} ms"]
        for w in args.windows:
            spec = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=8,
                                     kv_compressor="window", kv_compressor_config={"window": w})
            out, drafted, _, _ = cell(spec, prompt, args.new_tokens)
            assert out == plain, (i, w)
            ratios[w].append(tpot / drafted)
            line.append(f"window {w} {drafted * 1e3:.1f} ms ({tpot / drafted:.2f}x)")
        print("; ".join(line), flush=True)
    print("plain's TPOT over window k = 8's, geometric mean: " + ", ".join(
        f"{w}: {math.exp(sum(map(math.log, r)) / len(r)):.2f}x" for w, r in ratios.items()))


if __name__ == "__main__":
    main()
