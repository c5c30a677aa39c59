"""Where a lossy_kv request's time goes at a long context, and what FASER decided (a benchmark,
not a test): one request on the embedded model, the long workloads' pinned prompt, greedy.

    python benchmarks/lossy_kv_trace.py --compressor window --context 2800 --new-tokens 64 \\
        [--adaptive] [--vocab-prefix 1073741824]

Prints, per row count of the one-call C decoder (1: a draft pass or a decode; k + 1: a
verify; the engine's warm-up adds a few calls of its own shapes), the calls' median milliseconds
(all, linear layers, attention, elementwise, as `decoder.c` times them); the draft passes'
median, first of a round apart (it holds the round's set-up); with
`--adaptive`, each controller decision (the draft lengths chosen, the request's estimates, the
predicted decode step and draft price in ms) and each observation, and the cost model's fits
(samples, ms the fit took, the decode step it predicts).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import decoder_timers
from adaptive_long_context import cell
from long_prompt_interleave import long_prompts
from specserve.scheduler import faser
from specserve.scheduler.config import SpeculativeConfig
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.proposers import lossy_kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compressor", default="window")
    ap.add_argument("--context", type=int, default=2800)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--vocab-prefix", type=int, default=lossy_kv.DRAFT_VOCAB_PREFIX,
                    help="the drafts' vocabulary's first ids (beside the context's tokens); "
                         "1073741824: every token")
    args = ap.parse_args()
    lossy_kv.DRAFT_VOCAB_PREFIX = args.vocab_prefix
    log = []
    decoder_timers.install()
    choose, observe, fit = (faser.DraftLengthController.choose,
                            faser.DraftLengthController.observe, faser.CostModel.fit)

    def logged_choose(self, ids, caps, *a, **kw):
        ks = choose(self, ids, caps, *a, **kw)
        log.append(f"choose {ks} p={[round(float(x), 2) for x in self.probs(ids[0])]} decode "
                   f"{self.cost.predict(1, 0, row_keys=kw.get('row_keys', 0)) * 1e3:.1f} draft "
                   f"{self.cost.draft_price((kw.get('contexts') or [0])[0]) * 1e3:.2f}")
        return ks

    def logged_observe(self, request_id, drafted, accepted):
        log.append(f"observe {drafted} drafted, {accepted} accepted")
        return observe(self, request_id, drafted, accepted)

    def logged_fit(self):
        start = time.perf_counter()
        fit(self)
        log.append(f"fit at {len(self.samples)} samples, {(time.perf_counter() - start) * 1e3:.1f}"
                   f" ms: decode predicted {self.predict(1, 0, row_keys=args.context) * 1e3:.1f}")
    faser.DraftLengthController.choose = logged_choose
    faser.DraftLengthController.observe = logged_observe
    faser.CostModel.fit = logged_fit

    prompt = long_prompts(load_tokenizer(None), 1, args.context)[0]
    spec = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=args.k,
                             kv_compressor=args.compressor, adaptive=args.adaptive)
    passes = []
    _draft = lossy_kv.LossyKVProposer._draft

    def timed_draft(self, *a, **kw):
        out = _draft(self, *a, **kw)
        passes.append([s for _, s in out[1]])
        return out
    lossy_kv.LossyKVProposer._draft = timed_draft
    decoder_timers.reset()
    _, tpot, mean_k, _ = cell(spec, prompt, args.new_tokens)
    print(f"{args.compressor} {'adaptive' if args.adaptive else f'k={args.k}'} at "
          f"{args.context}: TPOT {tpot * 1e3:.1f} ms, mean drafts a step {mean_k:.2f}")
    calls = defaultdict(list)                     # rows -> (wall, linear, attention, elementwise)
    for rows, *times in decoder_timers.CALLS:
        calls[rows].append(times)
    for rows, v in sorted(calls.items()):
        if rows > 64:
            continue                                        # the warm-up's and prompt's chunks
        med = [statistics.median(x[i] for x in v) * 1e3 for i in range(4)]
        print(f"  decoder call of {rows} rows ({len(v)}): all {med[0]:.2f}, linear {med[1]:.2f},"
              f" attention {med[2]:.2f}, elementwise {med[3]:.2f} ms")
    rounds = [p for p in passes if p]
    if rounds:
        first = statistics.median(p[0] for p in rounds) * 1e3
        rest = [s for p in rounds for s in p[1:]]
        print(f"  draft passes ({len(rounds)} rounds): first {first:.2f} ms, the others "
              f"{statistics.median(rest) * 1e3 if rest else float('nan'):.2f} ms (with LM head)")
    for line in log:
        print("  " + line)


if __name__ == "__main__":
    main()
