"""/metrics: vLLM's names, labels and counter arithmetic, fed by the real engine on the tiny
model."""
from __future__ import annotations

import logging
import types

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from specserve.scheduler.async_engine import AsyncEngine
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest, RequestOutput
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.scheduler.messages import StepStats
from specserve.server.app import build_app
from specserve.server.metrics import ServerMetrics, make_router
from specserve.server.metrics_catalog import (ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS,
                                              buckets_1_2_5)
from specserve.server.metrics_recorders import RequestTracker
from specserve.server.settings import ServerSettings
from specserve.server.tokenizer import load_tokenizer

NGRAM = SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=4,
                          num_speculative_tokens=4)
LABELS = {"model_name": "tiny", "engine": "0"}


@pytest.fixture
def tiny_core(engines):
    def make(spec=NGRAM) -> EngineCore:
        return engines.core(model="tiny-random", max_model_len=256, num_kv_blocks=64,
                            num_threads=1, speculative=spec)
    return make


def stand_in(core: EngineCore):
    """What ServerMetrics reads from an AsyncEngine, without its thread."""
    return types.SimpleNamespace(model_info=core.model_info, engine_info=core.engine_info,
                                 on_step=None)


def samples(metrics: ServerMetrics) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.expose().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict, name: str, **labels) -> float:
    return found[(name, tuple(sorted({**LABELS, **labels}.items())))]


def families(metrics: ServerMetrics) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(metrics.expose().decode())}


def test_idle_exposition_has_vllm_names_types_labels_and_buckets(tiny_core):
    core = tiny_core()
    metrics = ServerMetrics(stand_in(core), ServerSettings(served_model_names=("tiny",)))
    found, kinds = samples(metrics), families(metrics)
    assert (value(found, "vllm:num_requests_running") == 0
            and value(found, "vllm:num_requests_waiting") == 0)
    for name, kind in [("vllm:num_requests_running", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:gpu_cache_usage_perc", "gauge"),
                       ("vllm:gpu_prefix_cache_hit_rate", "gauge"),
                       ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"),
                       ("vllm:request_success", "counter"), ("vllm:num_preemptions", "counter"),
                       ("vllm:prefix_cache_queries", "counter"),
                       ("vllm:gpu_prefix_cache_hits", "counter"),
                       ("vllm:spec_decode_num_drafts", "counter"),
                       ("vllm:spec_decode_num_accepted_tokens_per_pos", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"),
                       ("vllm:request_queue_time_seconds", "histogram"),
                       ("vllm:iteration_tokens_total", "histogram"),
                       ("vllm:cache_config_info", "gauge"),
                       ("specserve:spec_decode_draft_len", "histogram"),
                       ("specserve:kv_bytes_per_token", "gauge"),
                       ("specserve:full_kv_swap_bytes", "counter")]:
        assert kinds.get(name) == kind, (name, kinds.get(name))
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert value(found, "vllm:request_success_total", finished_reason=reason) == 0
    for pos in "0123":
        assert value(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=pos) == 0
        assert (value(found, "specserve:spec_decode_num_draft_tokens_per_pos_total", position=pos)
                == 0)
    edges = sorted(float(dict(k[1])["le"]) for k in found
                   if k[0] == "vllm:time_to_first_token_seconds_bucket")
    assert edges[:-1] == list(TTFT_BUCKETS) and edges[-1] == float("inf")
    edges = sorted(float(dict(k[1])["le"]) for k in found
                   if k[0] == "vllm:request_prompt_tokens_bucket")
    assert edges[:-1] == [1, 2, 5, 10, 20, 50, 100, 200] == buckets_1_2_5(256)
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80 and REQUEST_LATENCY_BUCKETS[-1] == 7680
    bpt = core.worker.model_config.kv_bytes_per_token(core.worker.kv_dtype)
    assert value(found, "specserve:kv_bytes_per_token", pool="full", kv_compressor="none") == bpt
    assert value(found, "specserve:kv_cache_bytes", pool="full", tier="device") == bpt * 64 * 16
    info = [k for k in found if k[0] == "vllm:cache_config_info"]
    assert dict(info[0][1])["num_gpu_blocks"] == "64" and found[info[0]] == 1


def test_worked_example_four_drafted_two_accepted(tiny_core):
    metrics = ServerMetrics(stand_in(tiny_core()), ServerSettings(served_model_names=("tiny",)))
    metrics.steps.record(StepStats(num_running=1, num_generation_tokens=3, num_drafts=1,
                                   num_draft_tokens=4,
                                   num_accepted_tokens=2, accepted_per_pos=[1, 1], draft_lens=[4]))
    found = samples(metrics)
    assert value(found, "vllm:spec_decode_num_drafts_total") == 1
    assert value(found, "vllm:spec_decode_num_draft_tokens_total") == 4
    assert value(found, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert [value(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p)
            for p in "0123"] == [1, 1, 0, 0]
    assert [value(found, "specserve:spec_decode_num_draft_tokens_per_pos_total", position=p)
            for p in "0123"] == [1, 1, 1, 1]
    assert value(found, "vllm:generation_tokens_total") == 3
    by = {"method": "ngram", "kv_compressor": "none"}
    assert value(found, "specserve:spec_decode_num_accepted_tokens_total", **by) == 2
    assert value(found, "specserve:spec_decode_draft_len_bucket", le="3.0", **by) == 0
    assert value(found, "specserve:spec_decode_draft_len_bucket", le="4.0", **by) == 1
    # a second step: three requests drafting 4, 2 and 4 (accepting 3, 0, 1)
    metrics.steps.record(StepStats(num_drafts=3, num_draft_tokens=10, num_accepted_tokens=4,
                                   accepted_per_pos=[2, 1, 1], draft_lens=[4, 2, 4],
                                   num_preemptions=2,
                                   prefix_cache_queries=32, prefix_cache_hits=16))
    found = samples(metrics)
    assert value(found, "vllm:spec_decode_num_drafts_total") == 4
    assert [value(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p)
            for p in "0123"] == [3, 2, 1, 0]
    assert [value(found, "specserve:spec_decode_num_draft_tokens_per_pos_total", position=p)
            for p in "0123"] == [4, 4, 3, 3]
    assert value(found, "vllm:num_preemptions_total") == 2
    assert value(found, "specserve:preemptions_total", mode="recompute") == 2
    assert (value(found, "vllm:gpu_prefix_cache_hits_total")
            == value(found, "vllm:prefix_cache_hits_total") == 16)
    assert value(found, "vllm:gpu_prefix_cache_hit_rate") == 0.5


def test_counters_from_real_steps_agree_with_per_request_spec_stats(tiny_core):
    core = tiny_core()
    metrics = ServerMetrics(stand_in(core), ServerSettings(served_model_names=("tiny",)))
    prompt = [5, 6, 7, 8] * 6                      # repetitive: the n-gram drafter finds matches
    for i in range(3):
        core.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=24, temperature=0,
                                                                       ignore_eos=True)))
    final: dict[str, RequestOutput] = {}
    generated = 0
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            generated += len(out.new_token_ids)
            final[out.request_id] = out
        metrics.steps.record(step.stats)
    specs = [o.spec for o in final.values() if o.spec is not None]
    assert specs, "the n-gram drafter proposed nothing on a repetitive prompt"
    found = samples(metrics)
    assert value(found, "vllm:spec_decode_num_drafts_total") == sum(s.num_drafts for s in specs)
    assert (value(found, "vllm:spec_decode_num_draft_tokens_total")
            == sum(s.num_draft_tokens for s in specs))
    assert (value(found, "vllm:spec_decode_num_accepted_tokens_total")
            == sum(s.num_accepted_tokens for s in specs))
    for pos in range(4):
        want = sum(s.accepted_per_pos[pos] for s in specs if len(s.accepted_per_pos) > pos)
        assert value(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(pos)) == want
    assert value(found, "vllm:generation_tokens_total") == generated == 72
    assert value(found, "vllm:num_requests_running") == 0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_request_tracker_timings_reasons_and_groups(tiny_core):
    metrics = ServerMetrics(stand_in(tiny_core()), ServerSettings(served_model_names=("tiny",)))
    clock = Clock()
    params = SamplingParams(max_tokens=8)
    reqs = [EngineRequest(f"q{i}", [1, 2, 3], params, arrival_time=100.0) for i in range(4)]
    metrics.steps.first_scheduled["q0"] = 100.5
    tracker = RequestTracker(metrics.engine_metrics, metrics.steps, reqs, n=2, clock=clock)
    clock.now = 101.0
    tracker.output(0, RequestOutput("q0", [7], num_prompt_tokens=3, num_cached_tokens=1))
    clock.now = 101.25
    tracker.output(0, RequestOutput("q0", [8, 9], num_prompt_tokens=3))
    clock.now = 102.0
    tracker.output(0,
                   RequestOutput("q0", [10], finished=True, finish_reason="length",
                                 num_prompt_tokens=3))
    tracker.output(1, RequestOutput("q1", [7], num_prompt_tokens=3))
    tracker.stopped(1)                             # a stop string matched: "stop", not "abort"
    tracker.failed(2)
    tracker.close()                                # q3 never produced anything: aborted
    found = samples(metrics)
    assert [value(found, "vllm:request_success_total", finished_reason=r)
            for r in ("stop", "length", "abort", "error")] == [1, 1, 1, 1]
    assert value(found, "vllm:time_to_first_token_seconds_sum") == 1.0 + 2.0
    assert value(found, "vllm:inter_token_latency_seconds_count") == 2
    assert value(found, "vllm:inter_token_latency_seconds_sum") == 1.0
    assert value(found, "vllm:e2e_request_latency_seconds_count") == 4
    # q1: no step seen, time 0
    assert value(found, "vllm:request_queue_time_seconds_sum") == 0.5 + 2.0
    assert value(found, "vllm:request_prefill_time_seconds_sum") == 0.5
    assert value(found, "vllm:request_decode_time_seconds_sum") == 1.0
    assert value(found, "vllm:request_time_per_output_token_seconds_sum") == 1.0 / 3
    assert value(found, "vllm:prompt_tokens_total") == 6
    assert value(found, "vllm:prompt_tokens_cached_total") == 1
    assert value(found, "vllm:prompt_tokens_by_source_total", source="local_compute") == 5
    assert (value(found, "vllm:request_params_n_count") == 2
            and value(found, "vllm:request_params_n_sum") == 4)
    assert value(found, "vllm:request_max_num_generation_tokens_sum") == 4 + 0
    assert value(found, "vllm:request_generation_tokens_sum") == 5
    assert "q0" not in metrics.steps.first_scheduled


def test_disable_log_stats_leaves_only_process_and_http_series(tiny_core):
    engine = stand_in(tiny_core())
    metrics = ServerMetrics(engine,
                            ServerSettings(served_model_names=("tiny",), disable_log_stats=True))
    names = families(metrics)
    assert not [n for n in names if n.startswith(("vllm:", "specserve:"))]
    assert "process_cpu_seconds" in names and "http_requests" in names
    assert engine.on_step is None and metrics.tracker([]) is None


def test_periodic_log_line_has_vllm_fields(caplog, tiny_core):
    metrics = ServerMetrics(stand_in(tiny_core()), ServerSettings(served_model_names=("tiny",)))
    steps, clock = metrics.steps, Clock()
    steps.clock, steps._last_log_time, steps.log_interval_s = clock, 100.0, 10.0
    steps.add_prompt_tokens(50)
    clock.now = 105.0
    steps.record(StepStats(num_running=2, num_waiting=1, kv_usage=0.25, num_generation_tokens=30,
                           num_drafts=10, num_draft_tokens=40, num_accepted_tokens=20,
                           accepted_per_pos=[8, 6, 4, 2], draft_lens=[4] * 10,
                           prefix_cache_queries=100, prefix_cache_hits=25))
    assert not caplog.records                      # 5 s < the 10 s interval
    clock.now = 110.0
    with caplog.at_level(logging.INFO, logger="specserve.metrics"):
        steps.record(StepStats(num_running=2, num_waiting=1, kv_usage=0.25))
    engine_line, spec_line = [r.getMessage() for r in caplog.records]
    assert engine_line == (
        "Engine 000: Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: "
                           "3.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                           "Prefix cache hit rate: 25.0%")
    assert spec_line == (
        "SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 2.00 "
                         "tokens/s, Drafted throughput: 4.00 tokens/s, Accepted: 20 tokens, "
                         "Drafted: 40 "
                         "tokens, Per-position acceptance rate: 0.800, 0.600, 0.400, 0.200, "
                         "Avg Draft acceptance rate: 50.0%")


@pytest.fixture(scope="module")
def served():
    engine = AsyncEngine(EngineConfig(model="tiny-random", max_model_len=256, num_kv_blocks=64,
                                      num_threads=1, speculative=NGRAM))
    settings = ServerSettings(served_model_names=("tiny",), sse_keepalive_s=0)
    router = make_router(engine, settings)
    app = build_app(engine, load_tokenizer("tiny-random"), settings, routers=[router])
    with TestClient(app) as client:
        yield client, router.metrics, engine
    engine.shutdown()


@pytest.fixture
def metrics_client(served, idle_check):
    """The module's served app; its engine is checked for leaks after each test."""
    yield served[0], served[1]
    idle_check(served[2])


def test_http_requests_feed_request_and_http_metrics(metrics_client):
    client, metrics = metrics_client
    before = samples(metrics)
    body = {"model": "tiny", "prompt": "a b c a b c a b c", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    usage = client.post("/v1/completions", json=body).json()["usage"]
    streamed = client.post("/v1/completions", json={**body, "stream": True, "n": 2})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("[DONE]")
    reply = client.get("/metrics")
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    found = samples(metrics)

    def delta(name, **labels):
        return value(found, name, **labels) - value(before, name, **labels)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:prompt_tokens_total") == 3 * usage["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 3 * usage["completion_tokens"] == 18
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:request_params_n_sum") == 1 + 2
    http = found[("http_requests_total", (("handler", "/v1/completions"), ("method", "POST"),
                                          ("status", "2xx")))]
    assert http >= 2
    assert not [k for k in found
                if k[0] == "http_requests_total" and dict(k[1])["handler"] == "/metrics"]
    assert value(found, "vllm:num_requests_running") == 0


def test_cli_flag_and_router_attach(metrics_client):
    from specserve.server.cli import build_parser, server_settings
    args = build_parser().parse_args(["serve", "tiny-random", "--disable-log-stats"])
    assert server_settings(args, types.SimpleNamespace(name="tiny", path="")).disable_log_stats
    client, _ = metrics_client
    assert client.app.state.serving.client.tracker_factory is not None
    assert httpx.codes.OK == client.get("/metrics").status_code


def test_kv_compressor_label_names_the_drafting_cache_under_lossy_kv(tiny_core):
    """The label comes from the engine's info message (it was always "none" when read from the
    engine config's top level, where the compressor is not)."""
    spec = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=2, kv_compressor="quant",
                             kv_compressor_config={"window": 8, "page_size": 8})
    core = tiny_core(spec)
    assert core.engine_info.kv_compressor == "quant" and core.engine_info.spec_method == "lossy_kv"
    metrics = ServerMetrics(stand_in(core), ServerSettings(served_model_names=("tiny",)))
    core.add_request(EngineRequest("r", [5, 6, 7, 8] * 6, SamplingParams(max_tokens=8,
                                                                       temperature=0)))
    while core.has_work():
        metrics.steps.record(core.step().stats)
    found = samples(metrics)
    spec_labels = {"method": "lossy_kv", "kv_compressor": "quant"}
    assert value(found, "specserve:spec_decode_num_drafts_total", **spec_labels) > 0
    draft_rate = value(found, "specserve:kv_bytes_per_token", pool="draft", kv_compressor="quant")
    full_rate = value(found, "specserve:kv_bytes_per_token", pool="full", kv_compressor="none")
    assert 0 < draft_rate < full_rate
    assert not [k for k in found if dict(k[1]).get("kv_compressor") == "none"
                and k[0].startswith("specserve:spec_decode")]


def test_requests_refused_at_admission_are_rejections_not_finished_requests(tiny_core):
    """A 503 at admission (queue full) counts in specserve:requests_rejected_total, never as an
    abort in vllm:request_success_total, and never in the latency histograms (issue 19, D5)."""
    import asyncio

    from specserve.scheduler.messages import EngineOverloadedError
    from specserve.server.engine_client import EngineClient

    metrics = ServerMetrics(stand_in(tiny_core()), ServerSettings(served_model_names=("tiny",)))

    class Full:
        model_info, is_dead = None, False

        def submit(self, request):
            raise EngineOverloadedError("queue full")

    client = EngineClient(Full())
    client.tracker_factory = metrics.tracker
    request = EngineRequest("x", [5, 6, 7], SamplingParams(max_tokens=4))

    async def main():
        with pytest.raises(EngineOverloadedError):
            async with client.open([request, request], n=2):
                pass
    asyncio.run(main())
    found = samples(metrics)
    assert value(found, "specserve:requests_rejected_total", reason="overloaded") == 1
    assert value(found, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(found, "vllm:e2e_request_latency_seconds_count") == 0
