"""Greedy output with speculation equals greedy output without it at long context: several
~3K-token prompts in flight at once, prompt chunks, decodes and k = 16 (and 8) verify passes sharing
steps, for every drafter. Every query runs the one C attention (prompt chunks rows in lanes, verify
and decode rows row by row), whose rows do not depend on what shares the step, so where drafts
take rows from the token budget and move the chunk boundaries nothing changes in a row."""
from __future__ import annotations

import pytest

from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases import loader
from specserve.spec_phases.model import ModelConfig
from specserve.spec_phases.sampling_params import SamplingParams

LENGTHS = (3100, 2900, 3000)
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PAGES = {"num_sink": 4, "window": 32, "page_size": 32}
SPECS = {
    "ngram-16": SpeculativeConfig(method="ngram", num_speculative_tokens=16, prompt_lookup_min=1,
                                  prompt_lookup_max=4),
    "token_recycling-16": SpeculativeConfig(method="token_recycling", num_speculative_tokens=16),
    "layer_skip-16": SpeculativeConfig(method="layer_skip", num_speculative_tokens=16,
                                       skip_layers=(1,)),
    "lossy_kv-window-16": SpeculativeConfig(method="lossy_kv", num_speculative_tokens=16,
                                            kv_compressor="window", kv_compressor_config=PAGES),
    "lossy_kv-quant-8": SpeculativeConfig(method="lossy_kv", num_speculative_tokens=8,
                                          kv_compressor="quant", kv_compressor_config=PAGES),
}


def prompts() -> list[list[int]]:
    """Long prompts of a repeating phrase with variation (n-gram and recycling find drafts)."""
    out = []
    for i, n in enumerate(LENGTHS):
        phrase = [(37 * j + 11 * i) % 500 + 3 for j in range(40)]
        out.append([(t + (k // 400)) % 800 + 3 for k, t in enumerate((phrase * (n // 40 + 1))[:n])])
    return out


def small(vocab_size: int = 49152, max_position: int = 4096) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       max_position=max_position, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture
def core(make_engine, monkeypatch):
    monkeypatch.setattr(loader, "tiny_config", small)

    def make(**kwargs):
        return make_engine(device="cpu", dtype="float32", num_threads=2, block_size=16,
                           max_num_batched_tokens=256, kv_cache_memory_gb=0.1, **kwargs)
    return make


def generate(core) -> tuple[list[list[int]], int, int]:
    ps = prompts()
    for i, ids in enumerate(ps):
        core.add_request(EngineRequest(f"r{i}", ids, PARAMS))
    outs = {f"r{i}": [] for i in range(len(ps))}
    drafted = accepted = 0
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        drafted += step.stats.num_draft_tokens
        accepted += step.stats.num_accepted_tokens
    return [outs[f"r{i}"] for i in range(len(ps))], drafted, accepted


@pytest.fixture(scope="module")
def plain_output():
    return {}


@pytest.mark.parametrize("name", list(SPECS))
def test_speculation_is_lossless_over_long_contexts(core, name, plain_output):
    assert core().worker.runner.cpu_decoder is not None          # the one C call serves it
    if "out" not in plain_output:
        plain_output["out"], _, _ = generate(core())
    out, drafted, _ = generate(core(speculative=SPECS[name]))
    assert drafted > 0
    assert out == plain_output["out"]
    assert all(len(o) == PARAMS.max_tokens for o in out)
