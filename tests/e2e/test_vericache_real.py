"""VeriCache on the real embedded model (SmolLM2-135M): greedy output with the lossy_kv drafter is
token-identical to plain decoding for 4 prompts of 1K to 4K tokens batched together, for every
compressor, and each compressor gets drafts accepted on real text.

12 new tokens, 8 drafts per round (the CI budget: 2 shared cores; the suite runs this at one torch
thread, where 8 prompts took ~17 minutes on an AVX2 host). The compressors run with a 32-token
dense window and 64-token pages, so nearly all of each context sits in compressed pages while
drafting."""
import pytest
from specserve.kv_cache.compress.spherical_calib import local_texts
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CONTEXTS, NEW_TOKENS = [1024 * (i + 1) for i in range(4)], 12          # 1024 ... 4096 tokens
LAYOUT = {"num_sink": 4, "window": 32, "page_size": 64}
COMPRESSORS = {
    "window": {},
    "quant": {"key_bits": 4, "value_bits": 4},
    "mustafar": {"sparsity": 0.7},
    "spherical": {"tier": 1, "value_bits": 8},
}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = tokenizer.encode(local_texts(8 * sum(CONTEXTS)))
    assert len(ids) >= sum(CONTEXTS)
    starts = [sum(CONTEXTS[:i]) for i in range(len(CONTEXTS))]
    return [ids[s:s + n] for s, n in zip(starts, CONTEXTS)]


def greedy(prompts, spec=None):
    core = EngineCore(EngineConfig(kv_cache_memory_gb=1.25, max_num_batched_tokens=4096,
                                   speculative=spec))
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"s{i}", ids,
                                       SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                   ignore_eos=True)))
    outs, drafted, accepted = {f"s{i}": [] for i in range(len(prompts))}, 0, 0
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        drafted += step.stats.num_draft_tokens
        accepted += step.stats.num_accepted_tokens
    core.run_until_idle()                            # releases the last finished requests
    core.check_integrity()
    return [outs[f"s{i}"] for i in range(len(prompts))], drafted, accepted, core


@pytest.fixture(scope="module")
def plain(prompts):
    return greedy(prompts)[0]


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_vericache_is_lossless_on_the_real_model(prompts, plain, name):
    spec = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=8, kv_compressor=name,
                             kv_compressor_config={**LAYOUT, **COMPRESSORS[name]})
    out, drafted, accepted, core = greedy(prompts, spec)
    assert out == plain
    assert drafted > 0 and accepted > 0, f"{name}: no draft accepted ({accepted}/{drafted})"
    stats = core.worker.proposer.stats()
    assert stats["num_encoded_tokens"] >= sum(len(p) for p in prompts)
    print(f"\n{name}: accepted {accepted}/{drafted} drafts ({accepted / drafted:.0%}), {stats}")
