"""The four vLLM series issue 18 found missing: `http_request_size_bytes`,
`http_response_size_bytes`, `vllm:request_num_preemptions` and
`vllm:request_prefill_kv_computed_tokens`."""
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from specserve.scheduler.messages import EngineRequest, RequestOutput
from specserve.server.metrics import ServerMetrics, make_router
from specserve.server.metrics_recorders import RequestTracker
from specserve.server.settings import ServerSettings
from specserve.spec_phases.sampling_params import SamplingParams

LABELS = {"model_name": "tiny", "engine": "0"}


def samples(metrics: ServerMetrics) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.expose().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def engine_value(found, name, **labels):
    return found[(name, tuple(sorted({**LABELS, **labels}.items())))]


def stand_in(core):
    import types
    return types.SimpleNamespace(model_info=core.model_info, engine_info=core.engine_info,
                                 on_step=None)


def test_the_series_are_exposed_with_vllm_types(engines):
    core = engines.core(model="tiny-random", max_model_len=256, num_kv_blocks=64, num_threads=1)
    metrics = ServerMetrics(stand_in(core), ServerSettings(served_model_names=("tiny",)))
    types = {f.name: f.type for f in text_string_to_metric_families(metrics.expose().decode())}
    assert types["vllm:request_num_preemptions"] == "histogram"
    assert types["vllm:request_prefill_kv_computed_tokens"] == "histogram"
    assert types["http_request_size_bytes"] == "summary"
    assert types["http_response_size_bytes"] == "summary"


def test_preemptions_and_computed_prompt_tokens_per_finished_request(engines):
    """A real engine with too few KV blocks for its requests preempts them; each request's output
    carries its preemption count, and the tracker observes it and the KV it computed."""
    core = engines.core(model="tiny-random", max_model_len=256, num_kv_blocks=10, block_size=16,
                        num_threads=1, max_num_seqs=4, max_decode_slowdown=None)
    metrics = ServerMetrics(stand_in(core), ServerSettings(served_model_names=("tiny",)))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = list(range(100, 140))
    reqs = [EngineRequest(f"r{i}", prompt, params) for i in range(4)]
    tracker = RequestTracker(metrics.engine_metrics, metrics.steps, reqs)
    for req in reqs:
        core.add_request(req)
    index = {r.request_id: i for i, r in enumerate(reqs)}
    step_preemptions, last = 0, {}
    while core.has_work():
        step = core.step()
        step_preemptions += step.stats.num_preemptions
        for out in step.outputs:
            tracker.output(index[out.request_id], out)
            last[out.request_id] = out
    tracker.close()
    assert step_preemptions > 0, "the test needs preemptions to happen"
    per_request = [last[r.request_id].num_preemptions for r in reqs]
    assert sum(per_request) == step_preemptions
    found = samples(metrics)
    assert engine_value(found, "vllm:request_num_preemptions_count") == 4
    assert engine_value(found, "vllm:request_num_preemptions_sum") == step_preemptions
    assert engine_value(found, "vllm:request_num_preemptions_bucket", le="0.0") == \
        per_request.count(0)
    cached = sum(min(last[r.request_id].num_cached_tokens, 40) for r in reqs)
    assert engine_value(found, "vllm:request_prefill_kv_computed_tokens_sum") == 4 * 40 - cached
    assert engine_value(found, "vllm:request_prefill_kv_computed_tokens_count") == 4


def test_prefix_cache_hits_are_not_computed_tokens(engines):
    core = engines.core(model="tiny-random", max_model_len=256, num_kv_blocks=64, num_threads=1)
    metrics = ServerMetrics(stand_in(core), ServerSettings(served_model_names=("tiny",)))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(200, 264))                    # 64 tokens: 4 full blocks of 16
    for name in ("first", "second"):                  # the second finds the first's blocks
        req = EngineRequest(name, prompt, params)
        tracker = RequestTracker(metrics.engine_metrics, metrics.steps, [req])
        core.add_request(req)
        while core.has_work():
            for out in core.step().outputs:
                tracker.output(0, out)
        tracker.close()
    found = samples(metrics)
    computed = engine_value(found, "vllm:request_prefill_kv_computed_tokens_sum")
    cached = engine_value(found, "vllm:prompt_tokens_cached_total")
    assert cached > 0 and computed == 2 * 64 - cached


def test_http_sizes_count_the_bytes_that_went_through(engines):
    from specserve.scheduler.async_engine import AsyncEngine
    from specserve.scheduler.config import EngineConfig
    from specserve.server.app import build_app
    from specserve.server.tokenizer import load_tokenizer

    engine = engines.async_engine(EngineConfig(model="tiny-random", max_model_len=256,
                                               num_kv_blocks=64, num_threads=1))
    assert isinstance(engine, AsyncEngine)
    settings = ServerSettings(served_model_names=("tiny",), sse_keepalive_s=0)
    router = make_router(engine, settings)
    app = build_app(engine, load_tokenizer("tiny-random"), settings, routers=[router])
    body = b'{"model": "tiny", "prompt": "a b c", "max_tokens": 3, "temperature": 0}'
    with TestClient(app) as client:
        plain = client.post("/v1/completions", content=body,
                            headers={"Content-Type": "application/json"})
        streamed = client.post("/v1/completions", content=body[:-1] + b', "stream": true}',
                               headers={"Content-Type": "application/json"})
        assert plain.status_code == streamed.status_code == 200
    found = samples(router.metrics)
    handler = (("handler", "/v1/completions"),)
    assert found[("http_request_size_bytes_count", handler)] == 2
    streamed_body = len(body) + len(', "stream": true')
    assert found[("http_request_size_bytes_sum", handler)] == len(body) + streamed_body
    assert found[("http_response_size_bytes_sum", handler)] == \
        len(plain.content) + len(streamed.content)
