"""Feeding the metrics: engine steps (engine thread) and request timings (asyncio side).

    AsyncEngine.on_step(StepStats) ──► StepRecorder.record     tokens, spec decode, preemptions, KV,
                                                                queue depth; the periodic log line
    ChoiceStream outputs ───────────► RequestTracker            TTFT, ITL, e2e,
                                                                queue/prefill/decode, sizes,
                                                                request_success, prompt tokens

Only counting happens on the engine thread: a handful of inc/set/observe calls per step, a loop over
the step's draft lengths, and one entry per request the step scheduled for the first time.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.scheduler.messages import EngineRequest, RequestOutput
from specserve.scheduler.messages import StepStats
from specserve.server.metrics_catalog import EngineMetrics

logger = logging.getLogger("specserve.metrics")
# first-scheduled times kept for requests nobody collected (aborts)
MAX_TRACKED_SCHEDULED = 8192


@dataclass
class Totals:
    """Plain running sums for the periodic log line (Prometheus keeps its own)."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def minus(self, other: Totals) -> Totals:
        per_pos = [a - (other.accepted_per_pos[i] if i < len(other.accepted_per_pos) else 0)
                   for i, a in enumerate(self.accepted_per_pos)]
        return Totals(self.prompt_tokens - other.prompt_tokens,
                      self.generation_tokens - other.generation_tokens,
                      self.prefix_queries - other.prefix_queries,
                      self.prefix_hits - other.prefix_hits,
                      self.num_drafts - other.num_drafts,
                      self.num_draft_tokens - other.num_draft_tokens,
                      self.num_accepted_tokens - other.num_accepted_tokens, per_pos)

    def copy(self) -> Totals:
        return self.minus(Totals())


class StepRecorder:
    """StepStats → Prometheus, on the engine thread."""

    def __init__(self, metrics: EngineMetrics, log_interval_s: float | None = 10.0,
                 clock: Callable[[], float] = time.monotonic, device: str = "cpu"):
        self.metrics = metrics
        # vLLM's log says "GPU KV cache usage"; on a CPU the cache is host memory: "KV cache usage"
        self.kv_usage_name = "GPU KV cache usage" if device.startswith("cuda") else "KV cache usage"
        self.clock = clock
        self.totals = Totals()
        self.first_scheduled: dict[str, float] = {}      # engine request id -> monotonic time
        self.last_step_time_s = 0.0
        self.log_interval_s = log_interval_s
        self._last_log_time = clock()
        self._last_log_totals = Totals()
        self._last_stats = StepStats()

    def record(self, stats: StepStats) -> None:
        m, t = self.metrics, self.totals
        now = self.clock()
        self._last_stats, self.last_step_time_s = stats, stats.step_time_s
        m.num_running.set(stats.num_running)
        m.num_waiting.set(stats.num_waiting)
        m.waiting_by_reason["capacity"].set(stats.num_waiting)
        m.kv_usage.set(stats.kv_usage)
        m.gpu_kv_usage.set(stats.kv_usage)
        if stats.num_generation_tokens:
            m.generation_tokens.inc(stats.num_generation_tokens)
            t.generation_tokens += stats.num_generation_tokens
        if stats.num_prompt_tokens or stats.num_generation_tokens:
            m.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        if stats.num_preemptions:
            m.num_preemptions.inc(stats.num_preemptions)
            m.preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self._record_prefix(stats.prefix_cache_queries, stats.prefix_cache_hits)
        if stats.num_drafts and m.spec_enabled:
            self._record_spec(stats)
        # VeriCache: full-cache bytes brought to the device
        if stats.swap_bytes_h2d:
            m.swap_bytes.inc(stats.swap_bytes_h2d)
        for seconds in stats.grammar_compile_s:                # structured output
            m.grammar_compile_seconds.observe(seconds)
        m.grammar_cache_hits.inc(stats.grammar_cache_hits)
        if stats.first_scheduled:
            self._note_scheduled(stats.first_scheduled, now - stats.step_time_s)
        if self.log_interval_s is not None and now - self._last_log_time >= self.log_interval_s:
            self.log(now)

    def _record_prefix(self, queries: int, hits: int) -> None:
        m, t = self.metrics, self.totals
        m.prefix_queries.inc(queries)
        m.gpu_prefix_queries.inc(queries)
        m.prefix_hits.inc(hits)
        m.gpu_prefix_hits.inc(hits)
        t.prefix_queries += queries
        t.prefix_hits += hits
        m.gpu_prefix_hit_rate.set(t.prefix_hits / t.prefix_queries)

    def _record_spec(self, stats: StepStats) -> None:
        """Worked example: one request drafts 4 and 2 are accepted → drafts +1, draft tokens +4,
        accepted +2, accepted_per_pos{0,1} +1, draft_tokens_per_pos{0,1,2,3} +1. With frontiers of 2
        the third draft's rejection is seen after the first forward: pruned tokens +2, frontiers
        +1."""
        m, t = self.metrics, self.totals
        m.spec_drafts.inc(stats.num_drafts)
        m.spec_draft_tokens.inc(stats.num_draft_tokens)
        m.spec_accepted.inc(stats.num_accepted_tokens)
        m.spec_drafts_by.inc(stats.num_drafts)
        m.spec_draft_tokens_by.inc(stats.num_draft_tokens)
        m.spec_accepted_by.inc(stats.num_accepted_tokens)
        m.spec_pruned_tokens.inc(stats.num_pruned_tokens)
        m.spec_frontiers.inc(stats.num_frontiers)
        t.num_drafts += stats.num_drafts
        t.num_draft_tokens += stats.num_draft_tokens
        t.num_accepted_tokens += stats.num_accepted_tokens
        if len(t.accepted_per_pos) < len(stats.accepted_per_pos):
            t.accepted_per_pos.extend([0] * (len(stats.accepted_per_pos) - len(t.accepted_per_pos)))
        for pos, count in enumerate(stats.accepted_per_pos):
            if count:
                m.ensure_position(pos)
                m.spec_accepted_per_pos[pos].inc(count)
                t.accepted_per_pos[pos] += count
        # drafted at position i = number of drafts longer than i:
        #   draft_lens = [4, 2, 4]  →  ends = [0, 1, 0, 2]  →  per position [3, 3, 2, 2]
        longest = max(stats.draft_lens, default=0)
        ends = [0] * longest
        for num_drafted in stats.draft_lens:
            m.spec_draft_len.observe(num_drafted)
            if num_drafted:
                ends[num_drafted - 1] += 1
        m.ensure_position(longest - 1)
        alive = 0
        for pos in range(longest - 1, -1, -1):
            alive += ends[pos]
            m.spec_drafted_per_pos[pos].inc(alive)

    def _note_scheduled(self, request_ids: list[str], step_start: float) -> None:
        seen = self.first_scheduled
        for request_id in request_ids:
            seen.setdefault(request_id, step_start)
        while len(seen) > MAX_TRACKED_SCHEDULED:        # oldest first: entries nobody popped
            del seen[next(iter(seen))]

    def add_prompt_tokens(self, num: int) -> None:
        self.totals.prompt_tokens += num

    # -- the periodic log line (vLLM's fields) --------------------------------------------------
    def log(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        elapsed = max(now - self._last_log_time, 1e-9)
        d = self.totals.minus(self._last_log_totals)
        self._last_log_time, self._last_log_totals = now, self.totals.copy()
        s = self._last_stats
        hit_rate = 100.0 * d.prefix_hits / d.prefix_queries if d.prefix_queries else 0.0
        lines = [f"Engine {self.metrics.labels.engine:0>3}: Avg prompt throughput: "
                 f"{d.prompt_tokens / elapsed:.1f} tokens/s, Avg generation throughput: "
                 f"{d.generation_tokens / elapsed:.1f} tokens/s, Running: {s.num_running} reqs, "
                 f"Waiting: {s.num_waiting} reqs, {self.kv_usage_name}: {100.0 * s.kv_usage:.1f}%, "
                 f"Prefix cache hit rate: {hit_rate:.1f}%"]
        if self.metrics.spec_enabled and d.num_drafts:
            per_pos = ", ".join(f"{a / d.num_drafts:.3f}" for a in d.accepted_per_pos)
            lines.append(
                f"SpecDecoding metrics: Mean acceptance length: "
                f"{1 + d.num_accepted_tokens / d.num_drafts:.2f}, "
                f"Accepted throughput: {d.num_accepted_tokens / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {d.num_draft_tokens / elapsed:.2f} tokens/s, "
                f"Accepted: {d.num_accepted_tokens} tokens, Drafted: {d.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: "
                f"{100.0 * d.num_accepted_tokens / max(d.num_draft_tokens, 1):.1f}%")
        if d.prompt_tokens or d.generation_tokens or s.num_running or s.num_waiting:
            for line in lines:
                logger.info(line)
        return lines


@dataclass
class _Timing:
    arrival: float
    max_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache
    num_preemptions: int = 0             # as of the request's latest output
    done: bool = False


class RequestTracker:
    """One per ChoiceStream (one API request: prompts × n engine requests, in that order).

    The stream calls `output` for every engine output it hands on, `stopped` when a stop string ends
    a choice, `failed` on an exception, and `close` once; unfinished requests then count as aborted.
    """

    def __init__(self, metrics: EngineMetrics, steps: StepRecorder, requests: list[EngineRequest],
                 n: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics, self.steps, self.clock = metrics, steps, clock
        self.requests = requests
        self.n = max(n, 1)
        self.timings = [_Timing(r.arrival_time, r.sampling_params.max_tokens,
                                num_prompt_tokens=len(r.prompt_token_ids)) for r in requests]
        self.was_rejected = False

    def output(self, index: int, out: RequestOutput) -> None:
        timing = self.timings[index]
        if timing.done:
            return
        now = self.clock()
        num_new = len(out.new_token_ids)
        timing.num_preemptions = max(timing.num_preemptions, out.num_preemptions)
        if out.num_prompt_tokens:
            timing.num_prompt_tokens = out.num_prompt_tokens
            timing.num_cached_tokens = min(out.num_cached_tokens, out.num_prompt_tokens)
        if num_new:
            if timing.first_token is None:
                timing.first_token = now
                self.metrics.ttft.observe(now - timing.arrival)
                self._count_prompt(out)
            else:
                self.metrics.itl.observe(now - timing.last_token)
            timing.last_token = now
            timing.num_generation_tokens += num_new
        if out.finished:
            self._finish(index, out.finish_reason or "stop", out.num_prompt_tokens)

    def stopped(self, index: int) -> None:
        self._finish(index, "stop", None)

    def failed(self, index: int) -> None:
        self._finish(index, "error", None)

    def rejected(self, reason: str) -> None:
        """Refused at admission (overload, a dead engine, input the engine refuses): counted as one
        rejection, never as a finished request, and kept out of the latency histograms."""
        self.metrics.requests_rejected[reason].inc()
        self.was_rejected = True

    def close(self) -> None:
        if self.was_rejected:
            return                                    # nothing ran: nothing to count
        for index, timing in enumerate(self.timings):
            if not timing.done:
                self._finish(index, "abort", None)
        m = self.metrics
        for start in range(0, len(self.timings), self.n):
            group = self.timings[start:start + self.n]
            m.request_n.observe(len(group))
            m.request_max_generation_tokens.observe(max(t.num_generation_tokens for t in group))

    def _count_prompt(self, out: RequestOutput) -> None:
        m, cached = self.metrics, min(out.num_cached_tokens, out.num_prompt_tokens)
        m.prompt_tokens.inc(out.num_prompt_tokens)
        m.prompt_tokens_cached.inc(cached)
        m.prompt_by_source["local_cache_hit"].inc(cached)
        m.prompt_by_source["local_compute"].inc(out.num_prompt_tokens - cached)
        m.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.steps.add_prompt_tokens(out.num_prompt_tokens)

    def _finish(self, index: int, reason: str, num_prompt_tokens: int | None) -> None:
        timing = self.timings[index]
        if timing.done:
            return
        timing.done = True
        m, now = self.metrics, self.clock()
        m.request_success[reason if reason in m.request_success else "error"].inc()
        m.e2e.observe(now - timing.arrival)
        m.request_generation_tokens.observe(timing.num_generation_tokens)
        m.request_max_tokens.observe(timing.max_tokens)
        m.request_num_preemptions.observe(timing.num_preemptions)
        m.request_prefill_kv_computed.observe(timing.num_prompt_tokens - timing.num_cached_tokens)
        scheduled = self.steps.first_scheduled.pop(self.requests[index].request_id, None)
        if timing.first_token is None:
            return
        if scheduled is None or scheduled > timing.first_token:   # finished within its first step
            scheduled = max(timing.arrival, timing.first_token - self.steps.last_step_time_s)
        m.queue_time.observe(max(scheduled - timing.arrival, 0.0))
        m.prefill_time.observe(timing.first_token - scheduled)
        m.decode_time.observe(timing.last_token - timing.first_token)
        m.inference_time.observe(timing.last_token - scheduled)
        if timing.num_generation_tokens > 1:
            decode_s = timing.last_token - timing.first_token
            m.tpot.observe(decode_s / (timing.num_generation_tokens - 1))
