"""Latency percentiles, throughput and goodput under an SLO, from per-request results.

Definitions follow `vllm bench serve` so the two can be compared:
- TTFT: request sent -> first chunk with non-empty choices.
- ITL: gaps between consecutive content chunks of one request (with speculation a chunk may carry
  several tokens, so ITL is per chunk, not per token).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request.
- Output tokens/s: tokens delivered / wall time of the whole cell, where delivered = usage tokens of
  completed requests + content chunks streamed by requests cancelled at the cell's deadline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default).

    Ranks are 0-based: the value at fractional rank r = q/100 * (n - 1). NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Sequence[float],
                 percentiles: Iterable[float] = PERCENTILES) -> dict[str, float]:
    """{"mean", "p50", "p90", "p99"} for a list of seconds (NaN when empty)."""
    out = {"mean": sum(values) / len(values) if values else math.nan}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out


@dataclass(frozen=True)
class SLO:
    """Per-request latency objective; a None bound is not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met_by(self, ttft_s: float, tpot_s: float, e2e_s: float) -> bool:
        checks = ((self.ttft_s, ttft_s), (self.tpot_s, tpot_s), (self.e2e_s, e2e_s))
        return all(bound is None or (not math.isnan(value) and value <= bound)
                   for bound, value in checks)


def tpot(e2e_s: float, ttft_s: float, num_output_tokens: int) -> float:
    """Time per output token after the first; NaN when fewer than two tokens came back."""
    if num_output_tokens < 2:
        return math.nan
    return (e2e_s - ttft_s) / (num_output_tokens - 1)


def summarize(results: Sequence, duration_s: float, slo: SLO | None = None) -> dict:
    """Aggregate `client.RequestResult`s of one cell (one peer, one workload, one load level).

    Failed requests count towards `num_failed` only; goodput counts completed requests that meet the
    SLO, per second of the cell's wall time.
    """
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok]
    e2es = [r.e2e_s for r in ok]
    tpots = [v for v in (tpot(r.e2e_s, r.ttft_s, r.completion_tokens) for r in ok)
             if not math.isnan(v)]
    itls = [gap for r in ok for gap in r.itls_s]
    num_output_tokens = sum(r.completion_tokens for r in ok)
    num_delivered = num_output_tokens + sum(r.completion_tokens for r in results
                                            if r.error == "cancelled")
    num_good = sum(1 for r in ok if slo is None or slo.met_by(
        r.ttft_s, tpot(r.e2e_s, r.ttft_s, r.completion_tokens), r.e2e_s))
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: math.nan)
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_failed": len(results) - len(ok),
        "duration_s": duration_s,
        "num_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "num_output_tokens": num_output_tokens,
        "mean_output_tokens": num_output_tokens / len(ok) if ok else math.nan,
        "num_cancelled": sum(1 for r in results if r.error == "cancelled"),
        "output_tokens_per_s": per_s(num_delivered),
        "requests_per_s": per_s(len(ok)),
        "goodput_requests_per_s": per_s(num_good),
        "slo_attainment": num_good / len(results) if results else math.nan,
        "tokens_per_chunk": (num_output_tokens / max(1, sum(r.num_chunks for r in ok)) if ok
                             else math.nan),
        "ttft_s": distribution(ttfts),
        "itl_s": distribution(itls),
        "tpot_s": distribution(tpots),
        "e2e_s": distribution(e2es),
    }


def ratio(ours: float, theirs: float) -> float:
    """ours / theirs, NaN when either side is missing or theirs is zero."""
    if theirs is None or ours is None or math.isnan(ours) or math.isnan(theirs) or theirs == 0:
        return math.nan
    return ours / theirs
