"""Ratio table, Markdown and plots from a hand-made results dict."""
import json
import math

import pytest

from loadtests.report import markdown, ratio_rows, write


def _summary(tput, ttft, itl, e2e99, goodput, completed=4):
    return {"output_tokens_per_s": tput, "num_completed": completed, "num_requests": 4,
            "goodput_requests_per_s": goodput, "ttft_s": {"p50": ttft}, "itl_s": {"p50": itl},
            "e2e_s": {"p99": e2e99}}


def _cell(peer, tput, ttft=0.5, itl=0.05, e2e99=3.0, goodput=1.0, completed=4, spec=None):
    return {"label": "chat c=8", "workload": "chat", "concurrency": 8, "rate": None, "peer": peer,
            "summary": _summary(tput, ttft, itl, e2e99, goodput, completed), "spec_decode": spec,
            "e2e_s": [1.0, 2.0, 3.0], "ttft_s": [0.1, 0.2]}


SPEC = {"num_drafts": 10.0, "acceptance_rate": 0.5, "mean_acceptance_length": 2.5,
        "acceptance_per_pos": [0.75, 0.5, 0.25]}
RESULTS = {
    "meta": {},
    "peers": {"specserve-plain": {"status": "ok"}, "specserve-ngram": {"status": "ok"},
              "vllm-cpu": {"status": "ok"}, "llama.cpp": {"status": "failed: boom"}},
    "cells": [
        _cell("specserve-plain", 100.0, ttft=0.4),
        _cell("specserve-ngram", 150.0, ttft=0.6, spec=SPEC),
        _cell("vllm-cpu", 50.0, ttft=0.2, e2e99=6.0),
        _cell("llama.cpp", 999.0, completed=0),          # nothing completed: never "best"
    ],
}


def test_ratio_uses_best_of_each_side_and_inverts_latency():
    (row,) = ratio_rows(RESULTS)
    assert row["tput"]["ratio"] == pytest.approx(3.0)              # 150 / 50, llama.cpp ignored
    assert (row["tput"]["our_peer"], row["tput"]["their_peer"]) == ("specserve-ngram", "vllm-cpu")
    assert row["ttft"]["ratio"] == pytest.approx(0.2 / 0.4)        # lower is better: theirs / ours
    assert row["e2e99"]["ratio"] == pytest.approx(2.0)


def test_ratio_is_nan_without_a_peer():
    only_ours = dict(RESULTS, cells=RESULTS["cells"][:2])
    (row,) = ratio_rows(only_ours)
    assert math.isnan(row["tput"]["ratio"]) and row["tput"]["their_peer"] is None


def test_markdown_has_tables_spec_rows_and_peer_status():
    text = markdown(RESULTS)
    assert "| chat c=8 | 3.00 (150.0 vs 50.0) | vllm-cpu |" in text
    assert "| chat c=8 | specserve-ngram | 0.50 | 2.50 | 0.75, 0.50, 0.25 |" in text
    assert "**llama.cpp**: failed: boom" in text
    assert "999.0 (0/4)" in text


def test_write_produces_json_markdown_and_pngs(tmp_path):
    paths = write(RESULTS, tmp_path)
    assert json.loads(paths["json"].read_text())["peers"]["llama.cpp"]["status"] == "failed: boom"
    for name in ("throughput", "latency_cdf", "acceptance"):
        data = paths[name].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
