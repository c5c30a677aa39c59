"""Percentiles, TPOT, SLO goodput and the cell summary."""
import math

import pytest

from loadtests.client import RequestResult
from loadtests.stats import SLO, distribution, percentile, ratio, summarize, tpot


def test_percentile_interpolates_like_numpy_linear():
    values = [4.0, 1.0, 3.0, 2.0]                  # sorted: 1 2 3 4, ranks 0..3
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)   # rank 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_percentile_edges():
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_keys_and_mean():
    d = distribution([1.0, 2.0, 3.0])
    assert d == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}


def test_tpot_excludes_first_token_and_needs_two_tokens():
    assert tpot(e2e_s=1.0, ttft_s=0.1, num_output_tokens=10) == pytest.approx(0.1)
    assert math.isnan(tpot(1.0, 0.1, 1))


def test_slo_bounds_and_nan():
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    assert slo.met_by(0.5, 0.05, 100.0)            # e2e unchecked, bounds inclusive
    assert not slo.met_by(0.51, 0.01, 1.0)
    assert not slo.met_by(0.1, 0.06, 1.0)
    assert not slo.met_by(0.1, math.nan, 1.0)      # a 1-token answer cannot prove its TPOT
    assert SLO().met_by(9.0, math.nan, 9.0)


def _result(ttft, e2e, tokens, itls=(), ok=True):
    return RequestResult(ok=ok, ttft_s=ttft, e2e_s=e2e, completion_tokens=tokens, prompt_tokens=5,
                         itls_s=list(itls), num_chunks=len(itls) + 1 if ok else 0)


def test_summarize_counts_goodput_and_throughput():
    results = [
        _result(0.2, 1.2, 11, itls=[0.1] * 10),      # tpot 0.1: meets
        _result(0.3, 2.3, 11, itls=[0.2] * 10),      # tpot 0.2: misses tpot
        _result(2.0, 3.0, 11, itls=[0.1] * 10),      # misses ttft
        _result(math.nan, math.nan, 0, ok=False),    # failed: never good, tokens not counted
    ]
    s = summarize(results, duration_s=4.0, slo=SLO(ttft_s=1.0, tpot_s=0.15))
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (4, 3, 1)
    assert s["num_output_tokens"] == 33
    assert s["output_tokens_per_s"] == pytest.approx(33 / 4)
    assert s["requests_per_s"] == pytest.approx(3 / 4)
    assert s["goodput_requests_per_s"] == pytest.approx(1 / 4)
    assert s["slo_attainment"] == pytest.approx(1 / 4)
    assert s["ttft_s"]["p50"] == pytest.approx(0.3)
    assert s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["tokens_per_chunk"] == pytest.approx(1.0)
    assert s["e2e_s"]["mean"] == pytest.approx((1.2 + 2.3 + 3.0) / 3)


def test_summarize_without_slo_counts_every_completed_request():
    s = summarize([_result(0.1, 0.5, 3, itls=[0.2, 0.2])], duration_s=1.0)
    assert s["goodput_requests_per_s"] == 1.0


def test_ratio_handles_missing_sides():
    assert ratio(3.0, 1.5) == 2.0
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(math.nan, 1.0))
    assert math.isnan(ratio(1.0, None))
