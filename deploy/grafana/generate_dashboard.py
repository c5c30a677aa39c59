"""Writes dashboards/specserve.json: `python deploy/grafana/generate_dashboard.py` (stdlib only).

The committed JSON is what Grafana loads; this file is its source. tests/deploy checks that the two
agree and evaluates every `expr` below against a real Prometheus scraping a real specserve.

Why a generator and not grafana-foundation-sdk: the panels are a few dozen queries plus layout, and
the SDK is a large code-generated package tied to one Grafana schema release; plain dicts keep the
queries as data that the tests can read without a new dependency.

Rows 1-2 are vLLM's "Speculative Decoding" panels with vLLM's queries (they work against a vLLM peer
too); row 3 is specserve's own series; row 4 is the serving view of vLLM's classic dashboard; row 5 is
vLLM's router in front of the replicas (deploy/docker-compose.yml, deploy/k8s/router.yaml).
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "specserve.json"
SEL = 'job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"'
RI = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}


def rate(name: str, by: str = "", extra: str = "") -> str:
    grouping = f" by({by})" if by else ""
    labels = SEL + (", " + extra if extra else "")
    return f"sum{grouping}(rate({name}{{{labels}}}[{RI}]))"


def guarded(expr: str) -> str:
    """A denominator that is dropped, not divided by, when zero (the panel then shows "No
    traffic")."""
    return f"({expr} > 0)"


def quantiles(hist: str, legend: str) -> list[tuple[str, str]]:
    out = [(f"histogram_quantile({q}, {rate(hist + '_bucket', 'le')})", f"p{int(q * 100)} {legend}")
           for q in (0.5, 0.95, 0.99)]
    out.append((f"{rate(hist + '_sum')} / {guarded(rate(hist + '_count'))}", f"mean {legend}"))
    return out


ACC, DRAFT_TOK, DRAFTS = ("vllm:spec_decode_num_accepted_tokens_total",
                          "vllm:spec_decode_num_draft_tokens_total",
                          "vllm:spec_decode_num_drafts_total")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
OUR = "specserve:spec_decode_num_{}_total"
GEN = "vllm:generation_tokens_total"


def panels_spec_stats() -> list[dict]:
    return [
        stat("Draft acceptance rate", f"{rate(ACC)} / {guarded(rate(DRAFT_TOK))}", "percentunit"),
        stat("Mean acceptance length", f"1 + {rate(ACC)} / {guarded(rate(DRAFTS))}", "none"),
        stat("Accepted tokens/s", rate(ACC), "tps"),
        stat("Draft tokens/s", rate(DRAFT_TOK), "tps"),
        stat("Drafts/s", rate(DRAFTS), "ops"),
        stat("Output from drafts", f"{rate(ACC)} / {guarded(rate(GEN))}", "percentunit"),
    ]


def panels_acceptance() -> list[dict]:
    return [
        series("Draft acceptance rate by model",
               [(f"{rate(ACC, 'model_name')} / {guarded(rate(DRAFT_TOK, 'model_name'))}",
                 "{{model_name}}")],
               "percentunit", max_=1),
        series("Mean acceptance length",
               [(f"1 + {rate(ACC, 'model_name')} / {guarded(rate(DRAFTS, 'model_name'))}",
                 "{{model_name}}")],
               "none"),
        series("Acceptance rate by draft position",
               [(f"{rate(PER_POS, 'position')} / on() group_left() {guarded(rate(DRAFTS))}",
                 "position {{position}}")],
               "percentunit", max_=1),
        series("Acceptance rate by engine",
               [(f"{rate(ACC, 'instance, engine')} "
                 f"/ {guarded(rate(DRAFT_TOK, 'instance, engine'))}",
                 "{{instance}} engine {{engine}}")], "percentunit", max_=1),
        series("Draft tokens/s: proposed, accepted, rejected",
               [(rate(DRAFT_TOK), "proposed"), (rate(ACC), "accepted"),
                (f"{rate(DRAFT_TOK)} - {rate(ACC)}", "rejected")], "tps"),
        series("Inter-token latency (one observation per step: may cover several tokens)",
               quantiles("vllm:inter_token_latency_seconds", "ITL"), "s"),
    ]


def panels_specserve() -> list[dict]:
    by = "method, kv_compressor"
    drafted_per_pos = "specserve:spec_decode_num_draft_tokens_per_pos_total"
    return [
        series("Acceptance by drafter and KV compressor",
               [(f"{rate(OUR.format('accepted_tokens'), by)} "
                 f"/ {guarded(rate(OUR.format('draft_tokens'), by))}",
                 "{{method}} / {{kv_compressor}}")], "percentunit", max_=1),
        series("True per-position acceptance (accepted / drafted at that position)",
               [(f"{rate(PER_POS, 'position')} / {guarded(rate(drafted_per_pos, 'position'))}",
                 "position {{position}}")], "percentunit", max_=1),
        heatmap("Draft length per request and step (k)",
                f"sum by(le)(increase(specserve:spec_decode_draft_len_bucket{{{SEL}}}[{RI}]))"),
        series("Mean draft length",
               [(f"{rate('specserve:spec_decode_draft_len_sum')} / "
                 f"{guarded(rate('specserve:spec_decode_draft_len_count'))}", "mean k")], "none"),
        series("KV bytes per token",
               [(f"max by(pool, kv_compressor)(specserve:kv_bytes_per_token{{{SEL}}})",
                                       "{{pool}} / {{kv_compressor}}")], "decbytes"),
        series("Preemptions/s", [(rate("vllm:num_preemptions_total"), "preemptions")], "ops"),
        series("Pruned draft tokens/s, frontiers/s, VeriCache swap",
               [(rate("specserve:spec_decode_pruned_tokens_total"), "pruned draft tokens/s"),
                (rate("specserve:spec_decode_frontiers_total"), "verify frontiers/s"),
                (rate("specserve:full_kv_swap_bytes_total"), "swap bytes/s"),
                (rate("specserve:verify_rounds_total"), "verify rounds/s")], "short"),
    ]


def panels_serving() -> list[dict]:
    return [
        series("Token throughput", [(rate("vllm:prompt_tokens_total"), "prompt tokens/s"),
                                    (rate(GEN), "generation tokens/s")], "tps"),
        series("Time to first token", quantiles("vllm:time_to_first_token_seconds", "TTFT"), "s"),
        series("E2E request latency", quantiles("vllm:e2e_request_latency_seconds", "E2E"), "s"),
        series("Scheduler state", [(f"sum(vllm:num_requests_running{{{SEL}}})", "running"),
                                   (f"sum(vllm:num_requests_waiting{{{SEL}}})", "waiting")],
               "short"),
        series("KV cache usage", [(f"max(vllm:kv_cache_usage_perc{{{SEL}}})", "KV usage")],
               "percentunit", max_=1),
        series("Prefix cache hit rate",
               [(f"{rate('vllm:prefix_cache_hits_total')} "
                 f"/ {guarded(rate('vllm:prefix_cache_queries_total'))}",
                 "hit rate")], "percentunit", max_=1),
        series("Finish reason",
               [(f"sum by(finished_reason)(increase(vllm:request_success_total{{{SEL}}}[{RI}]))",
                                  "{{finished_reason}}")], "short"),
        series("Queue, prefill and decode time (mean)",
               [(f"{rate(f'vllm:request_{p}_time_seconds_sum')} / "
                 f"{guarded(rate(f'vllm:request_{p}_time_seconds_count'))}", p)
                for p in ("queue", "prefill", "decode")],
               "s"),
    ]


def panels_router() -> list[dict]:
    """vLLM's router (vllm-router) in front of the replicas: its own vllm_router_* series, not
    filtered by the variables above (they carry no model_name); counters that appear only once
    something happens (retries, failures) read 0 until then."""
    def r(expr: str, by: str = "") -> str:
        grouping = f" by({by})" if by else ""
        return f"sum{grouping}(rate({expr}[{RI}]))"
    return [
        series("Router: requests per replica",
               [(r("vllm_router_processed_requests_total", "worker"), "{{worker}}")], "reqps"),
        series("Router: routing decisions",
               [(r("vllm_router_prefix_routing_decisions_total", "outcome"), "{{outcome}}"),
                (r("vllm_router_policy_decisions_total", "policy, worker"),
                 "{{policy}} -> {{worker}}")], "ops"),
        series("Router: healthy replicas and open circuits",
               [("sum(vllm_router_worker_health)", "healthy workers"),
                ("sum(vllm_router_cb_state > 0) or vector(0)", "circuits not closed"),
                ("sum by(worker)(vllm_router_running_requests)", "running {{worker}}")],
               "short"),
        series("Router: retries and failed attempts",
               [(r("vllm_router_retries_total") + " or vector(0)", "retries/s"),
                (r('vllm_router_cb_outcomes_total{outcome="failure"}') + " or vector(0)",
                 "failed attempts/s")], "ops"),
    ]


# -- panel builders -------------------------------------------------------------------------------
def targets(exprs: list[tuple[str, str]]) -> list[dict]:
    return [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
             "range": True}
            for i, (expr, legend) in enumerate(exprs)]


def stat(title: str, expr: str, unit: str) -> dict:
    return {"type": "stat", "title": title, "datasource": DS,
            "targets": targets([(expr, "__auto")]),
            "fieldConfig": {"defaults": {"unit": unit, "noValue": "No traffic", "decimals": 2},
                            "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto"}}


def series(title: str, exprs: list[tuple[str, str]], unit: str, max_: float | None = None) -> dict:
    defaults = {"unit": unit, "noValue": "No traffic",
                "custom": {"lineWidth": 1, "fillOpacity": 10}}
    if max_ is not None:
        defaults.update(min=0, max=max_)
    return {"type": "timeseries", "title": title, "datasource": DS, "targets": targets(exprs),
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}}}


def heatmap(title: str, expr: str) -> dict:
    panel = series(title, [(expr, "{{le}}")], "short")
    panel["type"] = "heatmap"
    panel["targets"][0]["format"] = "heatmap"
    panel["options"] = {"calculate": False, "yAxis": {"unit": "short"},
                        "color": {"scheme": "Oranges"}}
    return panel


def variable(name: str, label: str, query: str) -> dict:
    return {"type": "query", "name": name, "label": label, "datasource": DS, "refresh": 2,
            "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
            "definition": query, "query": {"query": query, "refId": name}, "sort": 1}


def layout(rows: list[tuple[str, list[dict]]]) -> list[dict]:
    """Rows of panels, 24 columns wide: stats 4 wide and 4 high, others 8 wide and 8 high."""
    out, y, next_id = [], 0, 1
    for title, panels in rows:
        out.append({"type": "row", "title": title, "id": next_id, "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y, x = next_id + 1, y + 1, 0
        for panel in panels:
            w, h = (4, 4) if panel["type"] == "stat" else (8, 8)
            if x + w > 24:
                x, y = 0, y + h
            panel.update(id=next_id, gridPos={"h": h, "w": w, "x": x, "y": y})
            out.append(panel)
            next_id, x = next_id + 1, x + w
        y += 8
    return out


def dashboard() -> dict:
    label_source = "vllm:num_requests_running"
    return {
        "uid": "specserve-spec-decode", "title": "specserve / Speculative Decoding",
        "editable": True,
        "tags": ["specserve", "vllm", "speculative-decoding"], "schemaVersion": 39, "version": 1,
        "refresh": "30s", "time": {"from": "now-1h", "to": "now"}, "timezone": "browser",
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Data source",
             "query": "prometheus",
             "current": {"text": "Prometheus", "value": "prometheus"}},
            variable("job", "Job", f"label_values({label_source}, job)"),
            variable("model_name", "Model",
                     f"label_values({label_source}{{job=~\"$job\"}}, model_name)"),
            variable("instance", "Instance",
                     f"label_values({label_source}{{model_name=~\"$model_name\"}}, instance)"),
            variable("engine", "Engine",
                     f"label_values({label_source}{{instance=~\"$instance\"}}, engine)"),
            {"type": "adhoc", "name": "filters", "label": "Filters", "datasource": DS},
        ]},
        "panels": layout([("Speculative decoding", panels_spec_stats()),
                          ("Acceptance and token flow",
                          panels_acceptance()),
                          ("specserve: drafters, compressors, KV", panels_specserve()),
                          ("Serving", panels_serving()),
                          ("Router (vllm-router)", panels_router())]),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(OUT)
