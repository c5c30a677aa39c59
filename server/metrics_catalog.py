"""Every Prometheus series specserve exports, declared once (metrics-and-deploy.md §2).

`vllm:*` series keep vLLM's names, types, label names and bucket edges, so vLLM's dashboards, the
production-stack router and `vllm bench serve` read them unchanged. Counters are declared without
`_total`: prometheus_client appends it (and a `_created` sample). Our own series use `specserve:`.
Every engine series carries `model_name` (the served name) and `engine` ("0": one engine).

Nothing here counts; `server/metrics_recorders.py` feeds these objects.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
REJECT_REASONS = ("overloaded", "engine_dead", "invalid")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

# vLLM's bucket edges (vllm/v1/metrics: the lists its loggers pass to each histogram)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100)
# ours: the k a request was given in one step, and VeriCache swap latency
DRAFT_LEN_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
SWAP_SECONDS_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's size buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class MetricLabels:
    model_name: str
    engine: str = "0"
    spec_method: str | None = None           # None: speculation off, no spec-decode series
    num_speculative_tokens: int = 0
    kv_compressor: str = "none"


class EngineMetrics:
    """The Prometheus objects, label children pre-bound so the hot path only calls inc/set/observe.

    Series that vLLM exports even at zero (running/waiting, per-reason success, per-position
    acceptance) are created here, so they exist from the first scrape, idle or not.
    """

    def __init__(self, registry: CollectorRegistry, labels: MetricLabels, max_model_len: int):
        self.labels = labels
        base = {"model_name": labels.model_name, "engine": labels.engine}
        names = list(base)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry).labels(**base)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**base)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**base)

        self._declare_scheduler_state(registry, base, names, gauge, counter)
        self._declare_request_histograms(histogram, max_model_len)
        self._declare_specserve(registry, base, names)
        self._declare_spec_decode(registry, base, names)

    def _declare_scheduler_state(self, registry: CollectorRegistry, base: dict, names: list[str],
                                 gauge, counter) -> None:
        # -- scheduler state (gauges) ------------------------------------------------------------
        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Waiting requests by reason.",
                          names + ["reason"], registry=registry)
        self.waiting_by_reason = {r: by_reason.labels(**base, reason=r) for r in WAITING_REASONS}
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (0..1).")
        self.gpu_kv_usage = gauge("vllm:gpu_cache_usage_perc",
                                  "Legacy alias of vllm:kv_cache_usage_perc (production-stack "
                                  "router).")
        self.gpu_prefix_hit_rate = gauge("vllm:gpu_prefix_cache_hit_rate",
                                         "Legacy: prefix cache hits / queries since start.")
        # -- token and request counters -----------------------------------------------------------
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Prompt tokens served from the prefix cache.")
        by_source = Counter("vllm:prompt_tokens_by_source",
                            "Prompt tokens by where their KV came from.",
                            names + ["source"], registry=registry)
        self.prompt_by_source = {s: by_source.labels(**base, source=s) for s in PROMPT_SOURCES}
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens emitted.")
        success = Counter("vllm:request_success", "Finished requests by finish reason.",
                          names + ["finished_reason"], registry=registry)
        self.request_success = {r: success.labels(**base,
                                                  finished_reason=r) for r in FINISHED_REASONS}
        self.num_preemptions = counter("vllm:num_preemptions", "Requests preempted (recompute).")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache.")
        self.gpu_prefix_queries = counter("vllm:gpu_prefix_cache_queries",
                                          "Legacy alias of vllm:prefix_cache_queries.")
        self.gpu_prefix_hits = counter("vllm:gpu_prefix_cache_hits",
                                       "Legacy alias of vllm:prefix_cache_hits.")

    def _declare_request_histograms(self, histogram, max_model_len: int) -> None:
        # -- request histograms --------------------------------------------------------------------
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Gap between consecutive outputs of a request (one per engine step).",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: decode time / (output tokens - 1).", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Arrival to first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "First scheduled to last token.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "First scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "First token to last token.",
                                     REQUEST_LATENCY_BUCKETS)
        sizes = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens per request.", sizes)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Output tokens per request.", sizes)
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Most output tokens among a request's n choices.", sizes)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "max_tokens per request.", sizes)
        self.request_n = histogram("vllm:request_params_n", "n per request.", N_BUCKETS)
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions", "Preemptions each finished request went through.",
            PREEMPTION_BUCKETS)
        self.request_prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens whose KV each finished request computed (prefix-cache hits excluded).",
            sizes)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Tokens computed per engine step.",
                                          ITERATION_TOKEN_BUCKETS)

    def _declare_specserve(self, registry: CollectorRegistry, base: dict, names: list[str]) -> None:
        comp = {"kv_compressor": self.labels.kv_compressor}
        rejected = Counter("specserve:requests_rejected",
                           "API requests refused at admission (never started), by reason; not "
                           "counted in vllm:request_success or the latency histograms.",
                           names + ["reason"], registry=registry)
        self.requests_rejected = {r: rejected.labels(**base, reason=r) for r in REJECT_REASONS}
        self.kv_bytes_per_token = Gauge(
            "specserve:kv_bytes_per_token", "KV bytes one token takes, by pool and compressor.",
            names + ["pool", "kv_compressor"], registry=registry)
        self.kv_cache_bytes = Gauge("specserve:kv_cache_bytes",
                                    "KV cache capacity in bytes, by pool and tier.",
                                    names + ["pool", "tier"], registry=registry)
        self.kv_compressed_blocks = Gauge("specserve:kv_compressed_blocks",
                                          "KV blocks held compressed.",
                                          names + ["kv_compressor"],
                                          registry=registry).labels(**base, **comp)
        self.preemptions = Counter("specserve:preemptions",
                                   "Preemptions by mode (recompute; swap later).",
                                   names + ["mode"], registry=registry).labels(**base,
                                                                               mode="recompute")
        self.verify_rounds = Counter("specserve:verify_rounds",
                                     "VeriCache verify rounds against full KV.",
                                     names, registry=registry).labels(**base)
        self.swap_bytes = Counter("specserve:full_kv_swap_bytes",
                                  "VeriCache full-KV bytes swapped in.",
                                  names, registry=registry).labels(**base)
        self.swap_seconds = Histogram("specserve:full_kv_swap_seconds",
                                      "VeriCache full-KV swap time.",
                                      names, buckets=SWAP_SECONDS_BUCKETS,
                                      registry=registry).labels(**base)
        self.grammar_compile_seconds = Histogram(   # structured output (docs/structured-output.md)
            "specserve:grammar_compile_seconds", "Grammar compile time per new constraint.",
            names, buckets=SWAP_SECONDS_BUCKETS, registry=registry).labels(**base)
        self.grammar_cache_hits = Counter(
            "specserve:grammar_cache_hits", "Constrained requests whose grammar was compiled "
            "already.", names, registry=registry).labels(**base)

    def _declare_spec_decode(self, registry: CollectorRegistry, base: dict,
                             names: list[str]) -> None:
        """vLLM registers its four spec-decode counters only when speculation is configured; so do
        we."""
        self.spec_enabled = self.labels.spec_method is not None
        if not self.spec_enabled:
            return
        k = self.labels.num_speculative_tokens
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts",
                                   "Draft-verify steps (one per request with "
                                   "at least one draft token).", names,
                                   registry=registry).labels(**base)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens",
                                         "Draft tokens proposed.",
                                         names, registry=registry).labels(**base)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted (bonus/recovered not counted).",
                                     names, registry=registry).labels(**base)
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted draft tokens by position (position i needs 0..i-1 accepted).",
                          names + ["position"], registry=registry)
        self.spec_accepted_per_pos = [per_pos.labels(**base, position=str(i)) for i in range(k)]
        drafted_per_pos = Counter("specserve:spec_decode_num_draft_tokens_per_pos",
                                  "Draft tokens proposed by position (the true per-position "
                                  "denominator).",
                                  names + ["position"], registry=registry)
        self.spec_drafted_per_pos = [drafted_per_pos.labels(**base,
                                                            position=str(i)) for i in range(k)]
        self._per_pos, self._base = (per_pos, drafted_per_pos), base
        by = {"method": self.labels.spec_method, "kv_compressor": self.labels.kv_compressor}
        extra = names + ["method", "kv_compressor"]
        self.spec_drafts_by = Counter("specserve:spec_decode_num_drafts",
                                      "Draft-verify steps by drafter and "
                                      "KV compressor.", extra, registry=registry).labels(**base,
                                                                                         **by)
        self.spec_draft_tokens_by = Counter("specserve:spec_decode_num_draft_tokens",
                                            "Draft tokens by drafter and KV compressor.",
                                            extra, registry=registry).labels(**base, **by)
        self.spec_accepted_by = Counter("specserve:spec_decode_num_accepted_tokens",
                                        "Accepted draft tokens by drafter and KV compressor.",
                                        extra, registry=registry).labels(**base, **by)
        self.spec_draft_len = Histogram("specserve:spec_decode_draft_len",
                                        "Draft length (k) chosen per request "
                                        "and step.", extra, buckets=DRAFT_LEN_BUCKETS,
                                        registry=registry).labels(**base, **by)
        self.spec_pruned_tokens = Counter("specserve:spec_decode_pruned_tokens",
                                          "Draft tokens the target never "
                                          "computed: an earlier verification frontier rejected "
                                          "(FASER early "
                                          "pruning).", extra, registry=registry).labels(**base,
                                                                                        **by)
        self.spec_frontiers = Counter("specserve:spec_decode_frontiers",
                                      "Verify forwards (frontiers) run in "
                                      "steps that carried drafts; one per such step without "
                                      "frontiers.",
                                      extra, registry=registry).labels(**base, **by)

    def ensure_position(self, pos: int) -> None:
        """A per-request k above the configured one should not happen; grow the children if it
        does."""
        while len(self.spec_accepted_per_pos) <= pos:
            i = str(len(self.spec_accepted_per_pos))
            self.spec_accepted_per_pos.append(self._per_pos[0].labels(**self._base, position=i))
            self.spec_drafted_per_pos.append(self._per_pos[1].labels(**self._base, position=i))
