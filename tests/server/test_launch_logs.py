"""Logs a person can read: timestamps on every line, a start-up banner saying what is served and
how, and the stats line naming the KV cache by where it lives."""
import logging
import os
import re
import socket
import subprocess
import sys
import types

import httpx

from specserve.scheduler.messages import EngineInfo, ModelInfo, StepStats
from specserve.server.cli import build_parser, log_banner, serve_launch
from specserve.server.metrics_catalog import EngineMetrics, MetricLabels
from specserve.server.metrics_recorders import StepRecorder
from specserve.server.settings import VERSION

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def stats_line(device: str) -> str:
    from prometheus_client import CollectorRegistry
    steps = StepRecorder(EngineMetrics(CollectorRegistry(), MetricLabels("m"), 128),
                         log_interval_s=None, device=device)
    steps.record(StepStats(num_running=1, kv_usage=0.5))
    return steps.log()[0]


def test_the_stats_line_says_gpu_only_on_a_gpu():
    assert ", KV cache usage: 50.0%" in stats_line("cpu") and "GPU" not in stats_line("cpu")
    assert ", GPU KV cache usage: 50.0%" in stats_line("cuda:0")


def test_the_banner_names_what_is_served(caplog):
    args = build_parser().parse_args([
        "serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config, path, _, defaults = serve_launch(args)
    engine = types.SimpleNamespace(
        model_info=ModelInfo(name="SmolLM2", path=str(path), vocab_size=49152, max_model_len=2048,
                             eos_token_ids=(2,), bos_token_id=1),
        engine_info=EngineInfo(block_size=16, num_blocks=100, enable_prefix_caching=True,
                               dtype="float32", device="cpu", kv_bytes_per_token=1024,
                               spec_method="ngram", num_speculative_tokens=3,
                               kv_cache_dtype="bfloat16"))
    with caplog.at_level(logging.INFO, logger="specserve.server"):
        log_banner(args, config, path, engine, {"temperature": 0.6})
    line = caplog.records[-1].getMessage()
    for part in (f"specserve {VERSION}", "model SmolLM2", "architecture llama (GGUF)",
                 "dtype float32", "device cpu (--device auto: torch ",
                 "KV cache 1600 tokens (100 blocks of 16, bfloat16)",
                 '"method":"ngram"', '"num_speculative_tokens":3', "'temperature': 0.6"):
        assert part in line, (part, line)


def test_the_banner_says_why_auto_chose_the_cpu(monkeypatch):
    """The CUDA image on a host with no GPU serves on the CPU; its banner says why."""
    import torch
    from specserve.server.cli import no_cuda_reason
    monkeypatch.setattr(torch.version, "cuda", None)
    assert no_cuda_reason() == f"torch {torch.__version__} is a CPU build"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert no_cuda_reason().startswith(
        f"torch {torch.__version__} is built for CUDA 13.0 but finds no CUDA device: ")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_real_start_logs_with_timestamps_and_serves_docs_offline(tmp_path, wait_healthy):
    """`specserve serve tiny-random`: every server line has a timestamp, the banner is there, and
    /docs references only assets served by the server itself."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.server", "serve", "tiny-random", "--port",
             str(port), "--host", "127.0.0.1", "--engine-in-thread", "--max-model-len", "128",
             "--kv-cache-memory-gb", "0.01", "--num-threads", "1"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        page = httpx.get(url + "/docs").text
        sources = re.findall(r'(?:src|href)="([^"]+)"', page) + re.findall(r"url: '([^']+)'", page)
        assert sources and all(s.startswith("/") for s in sources), sources
        for source in sources:
            assert httpx.get(url + source).status_code == 200, source
        redoc = httpx.get(url + "/redoc").text
        assert "/docs-assets/redoc.standalone.js" in redoc and "fonts.googleapis" not in redoc
        assert httpx.get(url + "/docs-assets/redoc.standalone.js").status_code == 200
        httpx.get(url + "/v1/models")
    finally:
        proc.terminate()
        proc.wait(60)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    banner = [line for line in lines if f"specserve {VERSION}: model tiny-random" in line]
    assert len(banner) == 1, lines
    assert re.match(STAMP + r" INFO specserve.server: ", banner[0])
    assert "KV cache " in banner[0] and "speculative off" in banner[0]
    assert "architecture llama (tiny, random weights)" in banner[0]
    untimed = [line for line in lines if not re.match(STAMP, line)]
    assert not untimed, untimed
