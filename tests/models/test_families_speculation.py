"""Every drafter and every drafting-cache compressor is lossless on every family: greedy output with
speculation equals greedy output without it (tiny random checkpoints written by transformers,
sliding windows and soft-caps included), and the drafter really drafted."""
import pytest

from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3"]
SMALL_PAGES = {"num_sink": 4, "window": 8, "page_size": 8}
SPECS = {
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                               prompt_lookup_max=3),
    "token_recycling": SpeculativeConfig(method="token_recycling", num_speculative_tokens=3),
    "layer_skip": SpeculativeConfig(method="layer_skip", num_speculative_tokens=3,
                                    skip_layers=(1,)),
    **{f"lossy_kv-{name}": SpeculativeConfig(method="lossy_kv", num_speculative_tokens=4,
                                             kv_compressor=name, kv_compressor_config=cfg)
       for name, cfg in {
           "window": SMALL_PAGES,
           "quant": {**SMALL_PAGES, "key_bits": 4, "value_bits": 2},
           "spherical": {**SMALL_PAGES, "tier": 1, "value_bits": 8, "calib_tokens": 64},
           "mustafar": {"num_sink": 4, "window": 8, "page_size": 64, "sparsity": 0.7}}.items()},
}
PROMPTS = [[11, 12, 13, 14, 15] * 5, [(7 * j + 3) % 240 + 3 for j in range(90)],
           [(5 * j) % 31 + 40 for j in range(47)]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
_plain: dict[str, list[list[int]]] = {}


def generate(engines, folder, speculative=None):
    core = engines.core(model=str(folder), dtype="float32", device="cpu", kv_cache_memory_gb=0.05,
                        block_size=4, max_num_batched_tokens=32, num_threads=1,
                        speculative=speculative)
    for i, ids in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"s{i}", ids, PARAMS))
    outs = {f"s{i}": [] for i in range(len(PROMPTS))}
    drafted = 0
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        drafted += step.stats.num_draft_tokens
    return [outs[f"s{i}"] for i in range(len(PROMPTS))], drafted


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_is_lossless(engines, checkpoints, family, method):
    folder = checkpoints(family)[0]
    if family not in _plain:
        _plain[family] = generate(engines, folder)[0]
    spec, drafted = generate(engines, folder, SPECS[method])
    assert drafted > 0
    assert spec == _plain[family]
