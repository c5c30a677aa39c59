"""Speculative decoding on the tiny model: lossless with every drafter, ragged draft lengths."""
import pytest
import torch

from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.spec_phases.proposers.ngram import NgramIndex
from specserve.spec_phases.proposers.token_recycling import TokenRecyclingProposer
from specserve.spec_phases.proposers.base import DraftRequest

SPECS = {
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=1,
                               prompt_lookup_max=3),
    "token_recycling": SpeculativeConfig(method="token_recycling", num_speculative_tokens=4),
    "layer_skip": SpeculativeConfig(method="layer_skip", num_speculative_tokens=3,
                                    skip_layers=(1,)),
}


def prompts():
    loop = [11, 12, 13, 14, 15] * 4                     # repetitive: n-gram drafts get accepted
    return [loop, [7, 8, 9, 10] * 3 + [7], [(13 * j) % 900 + 3 for j in range(17)], [5] * 9,
            [(3 * j) % 50 + 3 for j in range(33)], [400, 401, 402], loop[::-1], [42] * 16]


def generate(core, params_list):
    for i, (ids, p) in enumerate(zip(prompts(), params_list)):
        core.add_request(EngineRequest(f"q{i}", ids, p))
    outs = {f"q{i}": [] for i in range(len(params_list))}
    drafted = 0
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        drafted += step.stats.num_draft_tokens
    return [outs[f"q{i}"] for i in range(len(params_list))], drafted


def test_ngram_lookup_prefers_longest_then_most_recent():
    assert NgramIndex().lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    assert NgramIndex().lookup([5, 6, 5, 8, 5], 3, 1, 2) == [8, 5]
    assert NgramIndex().lookup([1, 2, 3], 4, 1, 3) == []


def test_token_recycling_walks_the_table():
    prop = TokenRecyclingProposer(vocab_size=10, top_k=2)
    logits = torch.zeros(3, 10)
    logits[0, 4], logits[1, 6], logits[2, 1] = 5, 5, 5
    prop.observe(torch.tensor([3, 4, 6]), logits)       # 3 -> 4 -> 6 -> 1
    req = DraftRequest("r", [9, 3], 1, [0])
    assert prop.propose([req, req], [3, 1]).token_ids == [[4, 6, 1], [4]]
    assert prop.propose([DraftRequest("r", (8,), 0, (0,))], [3]).token_ids == [[]]   # unseen: none


@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_output_is_identical_with_speculation(make_engine, method):
    caps = [None, 0, 1, 2, 3, None, 4, 5]                # ragged: a draft length per request
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             num_speculative_tokens=c)
              for c in caps]
    plain, _ = generate(make_engine(), params)
    spec, drafted = generate(make_engine(speculative=SPECS[method]), params)
    assert drafted > 0
    assert spec == plain
    # with a token budget that squeezes verify rows and a tight KV pool (preemption) too
    squeezed, _ = generate(make_engine(speculative=SPECS[method], num_kv_blocks=24, block_size=4,
                                       max_num_batched_tokens=10), params)
    assert squeezed == plain


def test_ngram_accepts_on_repetitive_text_and_counts(make_engine):
    core = make_engine(speculative=SPECS["ngram"])
    core.add_request(EngineRequest("rep", prompts()[0], SamplingParams(max_tokens=30, temperature=0,
                                                                        ignore_eos=True)))
    outs = core.run_until_idle()
    spec = outs[-1].spec
    assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_accepted_tokens
    assert sum(len(o.new_token_ids) for o in outs) == 30
    assert (spec.accepted_per_pos[0]
            >= (spec.accepted_per_pos[1] if len(spec.accepted_per_pos) > 1 else 0))
    # fewer steps than tokens: drafts were accepted
    assert len([o for o in outs if o.new_token_ids]) < 30


def test_sampling_with_speculation_runs_and_respects_limits(make_engine):
    core = make_engine(speculative=SPECS["ngram"])
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=i,
                             ignore_eos=True) for i in range(8)]
    outs, drafted = generate(core, params)
    assert drafted > 0 and all(len(o) == 20 for o in outs)
    again, _ = generate(make_engine(speculative=SPECS["ngram"]), params)
    assert again == outs                                  # per-request seeds: reproducible


def test_abort_mid_verification_frees_everything(make_engine):
    core = make_engine(speculative=SPECS["ngram"])
    for i, ids in enumerate(prompts()[:4]):
        core.add_request(EngineRequest(f"a{i}", ids, SamplingParams(max_tokens=40, temperature=0)))
    for _ in range(4):
        core.step()
    for i in range(4):
        core.abort_request(f"a{i}")
    assert not core.has_unfinished()
    core.check_integrity()


def test_adaptive_draft_lengths_stay_lossless(make_engine):
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(8)]
    plain, _ = generate(make_engine(), params)
    adaptive = SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=4,
                                 num_speculative_tokens=6, adaptive=True)
    core = make_engine(speculative=adaptive)
    spec, drafted = generate(core, params)
    assert spec == plain and drafted > 0
    assert core.scheduler.controller is not None and len(core.scheduler.controller.cost.samples) > 0


@pytest.mark.parametrize("method", ["lossy_kv", "layer_skip"])
def test_model_drafters_report_their_passes_to_the_cost_model(make_engine, method):
    """A drafter that runs the model times each draft pass; the controller's cost model prices
    passes from those (per pass, per row, per context key) and output stays that of plain
    decoding."""
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True) for _ in range(4)]
    plain, _ = generate(make_engine(), params)
    extra = {"kv_compressor": "window",
             "kv_compressor_config": {"window": 16}} if method == "lossy_kv" \
        else {"skip_layers": [1]}
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, adaptive=True, **extra)
    core = make_engine(speculative=spec)
    out, drafted = generate(core, params)
    assert out == plain and drafted > 0
    cost = core.scheduler.controller.cost
    assert len(cost.passes) > 0 and all(p.rows >= 1 and p.seconds > 0 for p in cost.passes)
    assert any(p.first for p in cost.passes)              # each round's first pass marked
    assert cost.prices.draft_pass + cost.prices.pass_row + cost.prices.pass_key > 0


@pytest.mark.parametrize("given, expected", [
    ({}, (5, 5)), ({"prompt_lookup_max": 4}, (4, 4)), ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 3}, (1, 3))])
def test_ngram_lookup_lengths_are_filled_in_as_vllm_does(given, expected):
    spec = SpeculativeConfig.from_json({"method": "ngram", **given})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == expected
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.from_json({"method": "ngram", "prompt_lookup_min": 4,
                                     "prompt_lookup_max": 2})


def test_ngram_schedules_only_drafts_that_were_proposed(make_engine):
    """The worker proposes each request's next n-gram drafts at the end of a step and reports how
    many: the scheduler reserves no slot for a draft that does not exist, so every scheduled
    draft is verified (a request with no match decodes one row), and the output is plain's."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                             prompt_lookup_max=3)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 8
    plain, _ = generate(make_engine(), params)
    core = make_engine(speculative=spec)
    steps = []
    execute = core.worker.execute
    core.worker.execute = lambda plan: steps.append((plan, execute(plan))) or steps[-1][1]
    out, drafted = generate(core, params)
    assert out == plain and drafted > 0
    ready: dict[str, int] = {}
    scheduled = 0
    for plan, result in steps:
        for r in plan.requests:
            if r.num_draft_tokens:
                assert r.num_draft_tokens <= ready[r.request_id]
                assert result.sampled[r.request_id].num_drafted == r.num_draft_tokens
                scheduled += 1
            if r.sample:
                assert r.request_id in result.draft_lens         # proposed for its next step
        ready.update(result.draft_lens)
    assert scheduled > 0 and 0 in ready.values()                # some drafted, some had none
    core.check_integrity()                        # finished requests' drafts and indexes released
    core.worker.next_drafts["gone"] = (1, [], False)
    with pytest.raises(AssertionError, match="drafts held"):
        core.check_integrity()
    del core.worker.next_drafts["gone"]
