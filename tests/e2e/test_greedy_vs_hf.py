"""On the real embedded model: greedy output of the engine, with a KV budget small enough to force
preemption and a token budget small enough to force chunked prefill, is token-identical to HF
transformers' greedy `generate` on the same dequantized weights for 32 new tokens, with
`--dtype float32` (float32 activations; `auto` runs the GGUF's blocks on int8 dot products).

Tie rule: where the two diverge and HF's top-2 logit margin at that position is < 1e-3, fp32
numerics decide a true tie; that is reported explicitly and allowed at most once in the set."""
import pytest
import torch

from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.spec_phases.paths import embedded_model_path

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process by which green plants",
    "List three prime numbers greater than 100:",
    "The history of the Roman Empire spans many centuries. " * 6 + "In summary,",
    "import numpy as np\n\ndef normalize(x):\n" + "    # scale the vector to unit length\n" * 3,
    "Q: What is the boiling point of water at sea level?\nA:",
]
NEW_TOKENS = 32


def engine_greedy(engines, prompts, **cfg):
    core = engines.core(dtype="float32", **cfg)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"g{i}", ids, params))
    outs = {f"g{i}": [] for i in range(len(prompts))}
    preemptions = 0
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        preemptions += step.stats.num_preemptions
    core.run_until_idle()                            # releases the last finished requests
    core.check_integrity()
    return [outs[f"g{i}"] for i in range(len(prompts))], preemptions, core


def hf_greedy(prompts):
    from transformers import AutoModelForCausalLM
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=2)
            tokens = out.sequences[0, len(ids):].tolist()
            margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
            results.append((tokens, margins))
    return results


def test_greedy_matches_hf_with_preemption_and_chunked_prefill(engines, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)      # all different lengths
    # chunks by the token budget alone (no time credit), every prompt running at once
    ours, preemptions, core = engine_greedy(engines, prompts, num_kv_blocks=20, block_size=16,
                                            max_num_batched_tokens=48, max_num_seqs=8,
                                            max_decode_slowdown=None)
    assert preemptions > 0, "the KV budget was meant to force preemption"
    assert max(len(p) for p in prompts) > 48, "a prompt was meant to need chunked prefill"
    reference = hf_greedy(prompts)
    ties = []
    for i, (mine, (theirs, margins)) in enumerate(zip(ours, reference)):
        if mine == theirs:
            continue
        k = next(j for j in range(min(len(mine), len(theirs))) if mine[j] != theirs[j])
        assert (margins[k]
                < 1e-3), f"prompt {i} diverges at token {k} with HF margin {margins[k]:.4g}"
        ties.append((i, k, margins[k]))
    if ties:
        print(f"fp32 true ties (top-2 margin < 1e-3) at (prompt, token, margin): {ties}")
    assert len(ties) <= 1, f"more than one tie: {ties}"
