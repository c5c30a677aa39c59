"""On the real embedded model: greedy output is token-identical with speculation off and with each
drafter on, for 8 prompts batched together with a different draft length cap per request."""
import pytest

from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Photosynthesis is the process by which",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "List the days of the week: Monday, Tuesday,",
    "Q: What is 2 + 2?\nA: 4\nQ: What is 3 + 3?\nA:",
    "Once upon a time",
]
CAPS = [None, 0, 1, 2, 3, 4, None, 2]
METHODS = {
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 4,
              "prompt_lookup_max": 3},
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 4},
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3},
}


def greedy(tokenizer, spec=None):
    core = EngineCore(EngineConfig(kv_cache_memory_gb=0.25,
                                   speculative=SpeculativeConfig.from_json(spec)))
    for i, (text, cap) in enumerate(zip(TEXTS, CAPS)):
        core.add_request(EngineRequest(f"s{i}", tokenizer.encode(text),
                                       SamplingParams(max_tokens=32, temperature=0,
                                                      num_speculative_tokens=cap)))
    outs, accepted = {f"s{i}": [] for i in range(len(TEXTS))}, 0
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        accepted += step.stats.num_accepted_tokens
    core.run_until_idle()                            # releases the last finished requests
    core.check_integrity()
    return [outs[f"s{i}"] for i in range(len(TEXTS))], accepted


@pytest.fixture(scope="module")
def plain(tokenizer):
    return greedy(tokenizer)[0]


@pytest.mark.parametrize("method", list(METHODS))
def test_speculation_is_lossless_on_the_real_model(tokenizer, plain, method):
    spec, accepted = greedy(tokenizer, METHODS[method])
    assert accepted > 0, f"{method} never had a draft accepted"
    assert spec == plain
