"""VeriCache on the real embedded model (SmolLM2-135M): greedy output with the lossy_kv drafter is
token-identical to plain decoding for 8 long prompts batched together, for every compressor, and
each compressor gets drafts accepted on real text.

CI budget (2 shared cores): contexts of ~320 tokens (not the issue's 1-4K: a plain 8 x 1K decode
step alone takes ~3 s there), 12 new tokens, 8 drafts per round. The compressors run with a 32-token
dense window and 64-token pages, so most of each context sits in compressed pages while drafting."""
import pytest
from specserve.kv_cache.compress.spherical_calib import local_texts
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CONTEXT, NEW_TOKENS, NUM_PROMPTS = 320, 12, 8
LAYOUT = {"num_sink": 4, "window": 32, "page_size": 64}
COMPRESSORS = {
    "window": {},
    "quant": {"key_bits": 4, "value_bits": 4},
    "mustafar": {"sparsity": 0.7},
}
# spherical is covered on the tiny model; on the real model its reference attention (keys rebuilt from
# codes on every call, 30 layers x 8 requests per draft step) took > 6 min on CI-class CPUs.


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = tokenizer.encode(local_texts(40_000))
    assert len(ids) >= CONTEXT * NUM_PROMPTS
    return [ids[i * CONTEXT:(i + 1) * CONTEXT - 7 * i] for i in range(NUM_PROMPTS)]   # ragged lengths


def greedy(prompts, spec=None):
    core = EngineCore(EngineConfig(kv_cache_memory_gb=0.25, max_num_batched_tokens=4096, speculative=spec))
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"s{i}", ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                   ignore_eos=True)))
    outs, drafted, accepted = {f"s{i}": [] for i in range(len(prompts))}, 0, 0
    while core.has_unfinished():
        for out in core.step():
            outs[out.request_id].extend(out.new_token_ids)
        drafted += core.scheduler.stats.num_draft_tokens
        accepted += core.scheduler.stats.num_accepted_tokens
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
    stats = core.worker.runner.proposer.stats()
    assert stats["num_encoded_tokens"] >= sum(len(p) for p in prompts)
    print(f"\n{name}: accepted {accepted}/{drafted} drafts ({accepted / drafted:.0%}), {stats}")
