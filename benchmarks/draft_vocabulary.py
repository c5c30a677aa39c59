"""How often a lossy_kv draft's vocabulary holds the token plain decoding produces (a benchmark,
not a test): the long workloads' prompts (workload C's source files) on the embedded model, plain
greedy decoding, and for each produced token whether it is among the vocabulary's first ids or
the tokens before it (prompt and output so far), as `DraftVocabulary` chooses; also the share of
the LM head's rows scored (first ids + the contexts' other tokens, over the vocabulary).

    python benchmarks/draft_vocabulary.py [--prompts 6 --context 2800 --new-tokens 128 \\
        --prefixes 0,1024,8192]
"""
from __future__ import annotations

import argparse

from adaptive_long_context import cell
from long_prompt_interleave import long_prompts
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.proposers import lossy_kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--context", type=int, default=2800)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefixes", default=f"0,1024,{lossy_kv.DRAFT_VOCAB_PREFIX}")
    args = ap.parse_args()
    tokenizer = load_tokenizer(None)
    vocab = len(tokenizer)
    prompts = long_prompts(tokenizer, args.prompts, args.context)
    outputs = [cell(None, prompt, args.new_tokens)[0] for prompt in prompts]
    for prefix in (int(p) for p in args.prefixes.split(",")):
        inside = total = rows = 0
        for prompt, out in zip(prompts, outputs):
            seen = set(prompt)
            rows += prefix + sum(1 for t in seen if t >= prefix)
            for token in out:
                total += 1
                inside += token < prefix or token in seen
                seen.add(token)
        print(f"first {prefix} ids + the context's tokens: {inside / total:.2%} of {total} "
              f"produced tokens inside; {rows / len(prompts) / vocab:.1%} of the head's "
              f"{vocab} rows scored (a prompt's)", flush=True)


if __name__ == "__main__":
    main()
