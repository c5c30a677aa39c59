"""A real Prometheus scrapes a real `specserve serve` (tiny model, n-gram speculation) and the real
vLLM router in front of it (`vllm-router`, from the test extra), and every PromQL query of the
Grafana dashboard returns data through Prometheus' HTTP API.

The `prometheus` binary comes from the Debian package, which `.ci/run` installs; without it the test
fails.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = (
    '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, "num_speculative_tokens": '
    '4}')
# stands in for $__rate_interval: covers the whole run
WINDOW = "3m"
VARIABLES = {"$job": ".*", "$model_name": ".*", "$instance": ".*", "$engine": ".*"}


def ensure_prometheus() -> str:
    found = shutil.which("prometheus")
    assert found, "prometheus is missing: install the Debian package prometheus (.ci/run does)"
    return found


def router_binary() -> str:
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    assert found, "vllm-router is missing: pip install -e '.[test]' installs it"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s          # hang guard only
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def dashboard_queries() -> list[tuple[str, str]]:
    spec = importlib.util.spec_from_file_location("generate_dashboard",
                                                  ROOT / "deploy/grafana/generate_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = []
    for panel in module.dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((f'{panel["title"]} [{target["refId"]}]', target["expr"]))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = ensure_prometheus()
    tmp = tmp_path_factory.mktemp("prom")
    api_port, prom_port = free_port(), free_port()
    router_port, router_metrics_port = free_port(), free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "specserve.server", "serve", "tiny-random", "--host", "127.0.0.1",
         "--port",
         str(api_port), "--served-model-name", "tiny", "--speculative-config", SPEC,
         "--max-model-len", "256",
         "--num-kv-blocks", "96", "--num-threads", "1", "--uvicorn-log-level", "warning"],
        stdout=open(tmp / "specserve.log", "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    config = (ROOT / "deploy/prometheus.yml").read_text()
    shutil.copy(ROOT / "deploy/alerts.yml", tmp / "alerts.yml")       # rule_files: beside it
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
    config = config.replace("evaluation_interval: 30s", "evaluation_interval: 1s")
    config = config.replace('["specserve-1:8000", "specserve-2:8000"]', f'["127.0.0.1:{api_port}"]')
    config = config.replace('["router:29000"]', f'["127.0.0.1:{router_metrics_port}"]')
    (tmp / "prometheus.yml").write_text(config)
    prom = subprocess.Popen(
        [prometheus, f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=open(tmp / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    api, prom_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{prom_port}"
    router = None
    try:
        wait_for(lambda: server.poll() is None and httpx.get(api + "/health").status_code == 200,
                 "specserve")
        router = subprocess.Popen(
            [router_binary(), "--host", "127.0.0.1", "--port", str(router_port),
             "--policy", "cache_aware", "--worker-urls", api, "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(router_metrics_port)],
            stdout=open(tmp / "router.log", "w"), stderr=subprocess.STDOUT)
        routed = f"http://127.0.0.1:{router_port}"
        wait_for(lambda: router.poll() is None
                 and httpx.get(routed + "/v1/models").status_code == 200, "the router")
        wait_for(lambda: prom.poll() is None and sum(
            t["health"] == "up"
            for t in httpx.get(prom_url + "/api/v1/targets").json()["data"]["activeTargets"])
            == 2, "prometheus to scrape specserve and the router")
        time.sleep(2.5)                               # a few scrapes at zero before the load starts
        drive_load(routed)
        time.sleep(3.5)                               # and a few after it
        yield api, prom_url
    finally:
        for proc in (prom, router, server):
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def drive_load(api: str) -> None:
    """Repetitive prompts (so the n-gram drafter has something to find), streamed and not, n > 1,
    a shared prefix (prefix cache hits), over a few seconds so several scrapes see the counters
    move."""
    bodies = [{"model": "tiny",
               "prompt": "one two three four one two three four one two three " * (1 + i % 3),
               "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0,
               "n": 1 + i % 2}
              for i in range(12)]
    errors: list[str] = []

    def worker(chunk):
        with httpx.Client(timeout=120) as client:
            for body in chunk:
                reply = client.post(api + "/v1/completions", json=body)
                if reply.status_code != 200:
                    errors.append(reply.text)
                time.sleep(0.3)

    threads = [threading.Thread(target=worker, args=(bodies[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]


def query(prom_url: str, expr: str) -> list[dict]:
    reply = httpx.get(prom_url + "/api/v1/query", params={"query": expr}, timeout=30).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def substitute(expr: str) -> str:
    expr = expr.replace("$__rate_interval", WINDOW)
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def test_every_dashboard_query_returns_data(stack):
    _, prom_url = stack
    queries = dashboard_queries()
    assert len(queries) >= 30
    empty = [(title, expr) for title, expr in queries if not query(prom_url, substitute(expr))]
    assert not empty, "queries without data:\n" + "\n".join(f"{t}: {e}" for t, e in empty)


def test_acceptance_numbers_from_prometheus_are_sane(stack):
    _, prom_url = stack
    by_title = dict(dashboard_queries())
    rate = float(query(prom_url, substitute(by_title["Draft acceptance rate [A]"]))[0]["value"][1])
    length = float(query(prom_url,
                         substitute(by_title["Mean acceptance length [A]"]))[0]["value"][1])
    assert 0 < rate <= 1 and 1 < length <= 5, (rate, length)
    per_pos = query(prom_url, substitute(by_title["Acceptance rate by draft position [A]"]))
    assert sorted(r["metric"]["position"] for r in per_pos) == ["0", "1", "2", "3"]
    values = [float(r["value"][1]) for r in sorted(per_pos, key=lambda r: r["metric"]["position"])]
    assert (values == sorted(values, reverse=True)
            and math.isclose(sum(values), length - 1, rel_tol=1e-6))


def test_dashboard_variables_resolve_and_alert_rules_load(stack):
    _, prom_url = stack
    for label, want in (("model_name", "tiny"), ("engine", "0"), ("job", "specserve")):
        values = httpx.get(f"{prom_url}/api/v1/label/{label}/values",
                           params={"match[]": "vllm:num_requests_running"}).json()["data"]
        assert want in values, (label, values)
    def rules() -> list[dict]:
        groups = httpx.get(prom_url + "/api/v1/rules").json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    # a rule reads "unknown" until its group's first evaluation: wait for that, then every one must
    # be ok
    wait_for(lambda: rules() and all(r["health"] != "unknown" for r in rules()),
             "alert rules evaluated", 60)
    rules = rules()
    assert len(rules) == 7 and all(r["health"] == "ok" for r in rules), rules


def test_vllm_bench_reads_these_counters(stack):
    """What `vllm bench serve` scrapes for its Speculative Decoding block, straight from
    /metrics."""
    api, _ = stack
    text = httpx.get(api + "/metrics").text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",p'
                 'osition="3"}'):
        assert name in text
    assert json.loads(httpx.get(api + "/v1/models").text)["data"][0]["id"] == "tiny"
