"""`GET /metrics`: vLLM-compatible Prometheus exposition (metrics-and-deploy.md §1–3).

`make_router(engine, settings)` is what `server/cli.py` mounts: a `MetricsRouter`, whose
`attach(app)` `build_app` calls once the app exists: it adds the HTTP middleware and hands the
engine client a `RequestTracker` factory. Engine metrics come from `engine.on_step` (StepStats,
engine thread).

With `disable_log_stats` there are no `vllm:`/`specserve:` series and no log line; `/metrics` still
answers, with the process, Python and HTTP series.
"""
from __future__ import annotations

import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram,
                               PlatformCollector, ProcessCollector, Summary, generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.responses import Response

from specserve.scheduler.messages import EngineInfo
from specserve.server.app import AppRouter
from specserve.server.metrics_catalog import EngineMetrics, MetricLabels
from specserve.server.metrics_recorders import RequestTracker, StepRecorder
from specserve.server.settings import ServerSettings

HTTP_EXCLUDED = frozenset({"/metrics", "/health", "/load", "/ping", "/version"})
HTTP_LATENCY_BUCKETS = (0.1, 0.5, 1.0)
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5,
                      4.0, 4.5,
                      5.0, 7.5, 10.0, 30.0, 60.0)


class ServerMetrics:
    """One registry per app, so tests can build several apps in one process."""

    def __init__(self, engine, settings: ServerSettings, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.engine = engine
        self.http = HttpMetrics(self.registry)
        self.engine_metrics: EngineMetrics | None = None
        self.steps: StepRecorder | None = None
        if settings.disable_log_stats:
            return
        info = engine.engine_info
        labels = MetricLabels(model_name=settings.model_name, spec_method=info.spec_method,
                              num_speculative_tokens=info.num_speculative_tokens,
                              kv_compressor=info.kv_compressor or "none")
        self.engine_metrics = EngineMetrics(self.registry, labels, engine.model_info.max_model_len)
        self.steps = StepRecorder(self.engine_metrics, settings.log_stats_interval_s,
                                  device=info.device)
        self._describe_cache(info, labels)
        engine.on_step = self.steps.record

    def _describe_cache(self, info: EngineInfo, labels: MetricLabels) -> None:
        cache = {"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_blocks),
                 "enable_prefix_caching": str(info.enable_prefix_caching),
                 "cache_dtype": info.kv_cache_dtype or info.dtype, "engine": labels.engine}
        Gauge("vllm:cache_config_info", "KV cache configuration (constant 1).", list(cache),
              registry=self.registry).labels(**cache).set(1)
        m, base = self.engine_metrics, {"model_name": labels.model_name, "engine": labels.engine}
        m.kv_bytes_per_token.labels(**base, pool="full", kv_compressor="none").set(
            info.kv_bytes_per_token)
        m.kv_cache_bytes.labels(**base, pool="full", tier="device").set(
            info.kv_bytes_per_token * info.num_blocks * info.block_size)
        if info.draft_kv_bytes_per_token is not None:
            m.kv_bytes_per_token.labels(**base, pool="draft", kv_compressor=labels.kv_compressor
                                        ).set(info.draft_kv_bytes_per_token)

    def tracker(self, requests, n: int = 1) -> RequestTracker | None:
        if self.engine_metrics is None:
            return None
        return RequestTracker(self.engine_metrics, self.steps, requests, n)

    def expose(self) -> bytes:
        return generate_latest(self.registry)


class HttpMetrics:
    """The series prometheus-fastapi-instrumentator would add (same names), without the
    dependency."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("http_requests",
                                "HTTP requests by handler, method and status class.",
                                ["handler", "method", "status"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds",
                                  "HTTP request latency by handler.",
                                  ["handler", "method"], buckets=HTTP_LATENCY_BUCKETS,
                                  registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds",
                                        "HTTP request latency, "
                                        "fine buckets, all handlers.", buckets=HTTP_HIGHR_BUCKETS,
                                        registry=registry)
        # the instrumentator reads Content-Length headers; these count the body bytes that
        # actually went through (chunked uploads and streamed responses included)
        self.request_size = Summary("http_request_size_bytes",
                                    "Bytes of request bodies received, by handler.", ["handler"],
                                    registry=registry)
        self.response_size = Summary("http_response_size_bytes",
                                     "Bytes of response bodies sent (streams included), by "
                                     "handler.", ["handler"], registry=registry)


class HttpMetricsMiddleware:
    """Plain ASGI middleware: times each HTTP request to its last body byte (streams included)."""

    def __init__(self, app, metrics: HttpMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        size_in, size_out = [0], [0]

        async def receive_wrapper():
            message = await receive()
            if message["type"] == "http.request":
                size_in[0] += len(message.get("body", b""))
            return message

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                size_out[0] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        finally:
            route = scope.get("route")
            handler = (route.path if route is not None else "") or "none"
            if handler not in HTTP_EXCLUDED:
                elapsed, method = time.perf_counter() - start, scope.get("method", "GET")
                self.metrics.requests.labels(handler, method, f"{status[0] // 100}xx").inc()
                self.metrics.duration.labels(handler, method).observe(elapsed)
                self.metrics.duration_highr.observe(elapsed)
                self.metrics.request_size.labels(handler).observe(size_in[0])
                self.metrics.response_size.labels(handler).observe(size_out[0])


class MetricsRouter(AppRouter):
    """`GET /metrics`; attached, it adds the HTTP middleware and hands the engine client a
    `RequestTracker` factory."""

    def __init__(self, engine, settings: ServerSettings):
        super().__init__()
        self.metrics = metrics = ServerMetrics(engine, settings)

        @self.get("/metrics", include_in_schema=False)
        async def prometheus_metrics():
            return Response(metrics.expose(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    def attach(self, app) -> None:
        app.add_middleware(HttpMetricsMiddleware, metrics=self.metrics.http)
        app.state.serving.client.tracker_factory = self.metrics.tracker


def make_router(engine, settings: ServerSettings) -> MetricsRouter:
    return MetricsRouter(engine, settings)
