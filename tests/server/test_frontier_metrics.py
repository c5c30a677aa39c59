"""FASER early pruning at the edges: `frontier_size` in `--speculative-config`, and the pruned-token
and frontier counters from StepStats to Prometheus."""
from __future__ import annotations

import types

import pytest
from prometheus_client.parser import text_string_to_metric_families
from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.scheduler.messages import StepStats
from specserve.server.cli import build_parser, engine_config
from specserve.server.metrics import ServerMetrics
from specserve.server.settings import ServerSettings

LABELS = {"model_name": "tiny", "engine": "0", "method": "ngram", "kv_compressor": "none"}
PRUNED, FRONTIERS = ("specserve:spec_decode_pruned_tokens_total",
                     "specserve:spec_decode_frontiers_total")


@pytest.fixture
def core_with(engines):
    def make(spec) -> EngineCore:
        return engines.core(model="tiny-random", max_model_len=256, num_kv_blocks=64,
                            num_threads=1, speculative=spec)
    return make


def metrics_for(core: EngineCore) -> ServerMetrics:
    engine = types.SimpleNamespace(model_info=core.model_info, engine_info=core.engine_info,
                                   on_step=None)
    return ServerMetrics(engine, ServerSettings(served_model_names=("tiny",)))


def samples(metrics: ServerMetrics) -> dict[str, float]:
    """name -> value for the two series (one label set each: checked)."""
    out = {}
    for family in text_string_to_metric_families(metrics.expose().decode()):
        for s in family.samples:
            if s.name in (PRUNED, FRONTIERS):
                assert s.labels == LABELS, s.labels
                out[s.name] = s.value
    return out


def test_cli_frontier_size_flows_into_the_engine(engines):
    args = build_parser().parse_args(["serve", "tiny-random", "--speculative-config",
                                      '{"method": "ngram", "prompt_lookup_min": 1, '
                                      '"prompt_lookup_max": 4, "num_speculative_tokens": 6, '
                                      '"frontier_size": 2}'])
    config = engine_config(args)
    assert config.speculative.frontier_size == 2
    core = engines.core(model="tiny-random", num_kv_blocks=32, speculative=config.speculative)
    assert core.scheduler.config.frontier_size == 2
    core.add_request(EngineRequest("r", [3, 4, 5], SamplingParams(max_tokens=2)))
    assert core.scheduler.schedule().frontier_size == 2   # the plan carries it to the runner
    core.abort_request("r")
    core.run_until_idle()                                 # the next plan releases it
    assert SpeculativeConfig.from_json('{"method": "ngram"}').frontier_size == 0   # off by default


@pytest.mark.parametrize("value", ["-1", "33", '"2"', "2.5", "true", "null"])
def test_cli_refuses_bad_frontier_sizes_with_a_clear_message(value):
    args = build_parser().parse_args(["serve", "tiny-random", "--speculative-config",
                                      f'{{"method": "ngram", "frontier_size": {value}}}'])
    with pytest.raises(SystemExit) as exc:
        engine_config(args)
    message = str(exc.value)
    assert message.startswith(
        "specserve: bad --speculative-config: frontier_size must be an integer in [0, 32]")
    with pytest.raises(ValueError, match="frontier_size"):
        SpeculativeConfig(method="ngram", frontier_size=-2)


def test_recorder_adds_pruned_tokens_and_frontiers_of_spec_steps(core_with):
    metrics = metrics_for(core_with(SpeculativeConfig(method="ngram", prompt_lookup_min=1,
                                                      prompt_lookup_max=4, num_speculative_tokens=4,
                                                      frontier_size=2)))
    assert samples(metrics) == {PRUNED: 0, FRONTIERS: 0}  # exported from the first scrape
    # the worked example: 4 drafted, the third rejected, seen after the first frontier
    metrics.steps.record(StepStats(num_drafts=1, num_draft_tokens=4, num_accepted_tokens=2,
                                   accepted_per_pos=[1, 1], draft_lens=[4], num_pruned_tokens=2,
                                   num_frontiers=1))
    assert samples(metrics) == {PRUNED: 2, FRONTIERS: 1}
    metrics.steps.record(StepStats(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=5,
                                   accepted_per_pos=[2, 1, 1, 1], draft_lens=[4, 4],
                                   num_pruned_tokens=0,
                                   num_frontiers=2))
    assert samples(metrics) == {PRUNED: 2, FRONTIERS: 3}
    # a step without drafts
    metrics.steps.record(StepStats(num_generation_tokens=3, num_frontiers=1))
    assert samples(metrics) == {PRUNED: 2, FRONTIERS: 3}


def test_counters_from_real_steps_match_the_step_stats(core_with):
    core = core_with(SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=4,
                                       num_speculative_tokens=5, frontier_size=1))
    metrics = metrics_for(core)
    for i, prompt in enumerate([[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [3, 4] * 9]):
        core.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0,
                                                                       ignore_eos=True)))
    pruned = frontiers = spec_steps = drafted = 0
    while core.has_unfinished():
        step = core.step()
        stats = step.stats
        metrics.steps.record(stats)
        if stats.num_drafts:
            spec_steps += 1
            pruned += stats.num_pruned_tokens
            frontiers += stats.num_frontiers
            drafted += stats.num_draft_tokens
            # frontier_size 1: one per draft
            assert 1 <= stats.num_frontiers <= max(stats.draft_lens)
            assert stats.num_pruned_tokens <= stats.num_draft_tokens - stats.num_accepted_tokens
    assert spec_steps > 0 and drafted > 0
    assert samples(metrics) == {PRUNED: pruned, FRONTIERS: frontiers}
    assert frontiers >= spec_steps


def test_no_frontier_series_without_speculation(core_with):
    metrics = metrics_for(core_with(None))
    names = {f.name for f in text_string_to_metric_families(metrics.expose().decode())}
    assert ("specserve:spec_decode_pruned_tokens" not in names
            and "specserve:spec_decode_frontiers" not in names)
    assert "vllm:num_requests_running" in names
