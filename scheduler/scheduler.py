"""Continuous batching policy: who runs this step, how many tokens each computes, who is preempted.

One number per request (vLLM v1): tokens to compute = num_tokens + num_drafts - num_computed_tokens.
It covers prefill chunks, prefix hits, resuming after preemption and verify rows alike.
"""
from __future__ import annotations

import math
from collections import deque
from itertools import islice

from specserve.kv_cache.manager import KVCacheManager
from specserve.scheduler.faser import (CostModel, DraftLengthController, DraftPass, Prices,
                                       prefill_keys)
from specserve.scheduler.messages import RequestOutput, SpecStats, StepStats
from specserve.scheduler.request import Request, RequestStatus
from specserve.scheduler.config import SchedulerConfig
from specserve.spec_phases.plan import ScheduledRequest, StepPlan, StepResult, needs_history


# the prompt chunks' time credit is spent once it holds this many decode steps' earnings
PREFILL_CREDIT_STEPS = 16
DECODE_STEP_EMA = 0.2               # weight of the newest decode step in `decode_step_s`
FIRST_CHUNK_ROWS = 16               # the first prompt chunk beside decodes, before one is measured


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig):
        """kv answers for full blocks and, with VeriCache's drafting cache, for its device bytes:
        requests are admitted and preempted by both."""
        self.kv = kv
        self.config = config
        k = config.num_speculative_tokens
        # step prices fitted on every committed step (FASER's; the first prompt chunk beside
        # decodes): until prompt rows are measured one is priced as a decode row, drafts are one
        # a request until 4 drafting steps are measured, and no drafting state is built before
        # the first fit
        self.cost = CostModel(prefill_row=Prices().row, unpriced_drafting_steps=4,
                              unpriced_steps=True)
        self.controller = (DraftLengthController(k, cost=self.cost) if config.adaptive and k
                           else None)
        self.last_swap_h2d = 0                       # full-KV bytes the last step staged (FASER)
        self.prefill_credit = 0.0                    # seconds (`prefill_allowance`)
        self.decode_step_s = 0.0                     # measured, of steps that only decoded
        self.prompt_row_s = 0.0                      # measured, the last chunks beside decodes
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []           # to release with the next plan
        self._preempted_ids: list[str] = []
        self._stats = StepStats()                    # the step being planned and committed

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return self._output(req, [], None)

    def fail(self, request_ids: list[str], message: str) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(self._output(req, [], None, error=message))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def releasing(self) -> set[str]:
        """Requests whose device-side state the next plan releases."""
        return set(self._finished_ids) | set(self._preempted_ids)

    def has_work(self) -> bool:
        """Requests to run, or device-side state to release with the next plan."""
        return bool(self.waiting or self.running or self._finished_ids or self._preempted_ids)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- schedule ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """vLLM's chunked prefill: decoding requests first (their drafts out of the same token
        budget), then prompt chunks, of running requests and then of admitted ones, fill what is
        left. A step that decodes also caps its prompt chunks by time (`prefill_allowance`)."""
        self._stats = StepStats()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int, int]] = []          # (request, tokens, draft slots)
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prompts = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        allowance = self.prefill_allowance(decoding, prompts)
        estimate = self._chunks(prompts, budget - len(decoding), allowance)
        draft_lens = self._choose_draft_lens(decoding, sum(estimate))
        first_chunk = True
        for req in decoding + prompts:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:             # preempted for an earlier one
                continue
            num_drafts = min(draft_lens.get(req.request_id, 0), budget - 1)  # drafts, not rows
            num_new = 1
            if req.num_tokens - req.num_computed_tokens > 1:
                num_new, seconds = self._chunk(req, budget, allowance, first_chunk)
                if num_new == 0:
                    break
                first_chunk, allowance = False, allowance - seconds
            if not self._reserve(req, num_new + num_drafts, scheduled):
                break                                           # req itself was preempted
            scheduled.append((req, num_new, num_drafts))
            budget -= num_new + num_drafts
        if not self._stats.num_preemptions:
            self._admit(scheduled, budget, allowance, first_chunk)
        return self._plan(scheduled)

    def prefill_allowance(self, decoding: list[Request], prompts: list[Request] = ()) -> float:
        """Seconds of prompt chunks this step may run beside its decoding requests. Each step
        earns (s - 1) times a step of decoding alone, s = `max_decode_slowdown`, as measured
        (`decode_step_s`), and pays what its prompt chunks measurably added
        (`_settle_prefill_credit`), so a decoding request's token takes about s times its time
        alone at most. The credit is saved up to PREFILL_CREDIT_STEPS steps' earnings and spent
        when full: fewer, longer chunks (on this CPU a chunk's fixed cost is most of a decode
        step's), no step longer than ~1 + PREFILL_CREDIT_STEPS * (s - 1) decode steps, and decode
        steps between them to measure. Before it is full it is spent where it already covers
        every pending prompt to its end (`_pending_prefill_s`; `prompts`: the running ones): a
        few short prompts, or prompts mostly found in the prefix cache, start at once instead of
        waiting for the credit to fill. Otherwise 0 while the credit fills; unbounded in a step
        with nothing to decode, or with no slowdown bound."""
        slowdown = self.config.max_decode_slowdown
        if slowdown is None or not decoding:
            return math.inf
        earn = (slowdown - 1) * self.decode_step_s
        if earn <= 0:
            return 0.0
        credit = self.prefill_credit + earn
        if credit >= PREFILL_CREDIT_STEPS * earn or credit >= self._pending_prefill_s(prompts,
                                                                                     credit):
            return credit
        return 0.0

    def _pending_prefill_s(self, prompts: list[Request], limit: float) -> float:
        """What finishing every pending prompt costs at `prompt_row_s` a row: the running
        prompts' remainders and those of the waiting requests there are sequence slots for (each
        less its cached prefix, as `_admit` would match it). inf before a chunk beside decodes
        was measured, where nothing is pending, or once the sum passes `limit`."""
        if not self.prompt_row_s:
            return math.inf
        free = max(self.config.max_num_seqs - len(self.running), 0)
        need = sum(r.num_tokens - r.num_computed_tokens for r in prompts) * self.prompt_row_s
        pending = bool(prompts)
        for req in islice(self.waiting, free):
            if need > limit:
                break
            start = req.num_computed_tokens
            if self._matches_prefix(req):
                start = self.kv.cached_prefix_tokens(req.all_token_ids)
            need += (req.num_tokens - start) * self.prompt_row_s
            pending = True
        return need if pending and need <= limit else math.inf

    def _matches_prefix(self, req: Request) -> bool:
        """Whether admitting req looks its prompt up in the prefix cache: not where it holds
        blocks already, nor where its prompt's logprobs must be computed."""
        return not self.kv.block_ids(req.request_id) and not req.want_prompt_logprobs

    def _settle_prefill_credit(self, plan: StepPlan, seconds: float) -> None:
        """The step's earnings less what its prompt chunks took beyond a decode step
        (`prefill_allowance`); a step that decoded and ran no prompt chunk updates
        `decode_step_s` (an exponential average), one that ran chunks `prompt_row_s`."""
        slowdown = self.config.max_decode_slowdown
        if slowdown is None or all(r.num_new_tokens > 1 for r in plan.requests):
            self.prefill_credit = 0.0
            return
        chunked = any(r.num_new_tokens > 1 for r in plan.requests)
        if not chunked:
            self.decode_step_s += (seconds - self.decode_step_s) * (
                DECODE_STEP_EMA if self.decode_step_s else 1.0)
        earn = (slowdown - 1) * self.decode_step_s
        spent = max(seconds - self.decode_step_s, 0.0) if chunked else 0.0
        if chunked:
            self.prompt_row_s = spent / sum(r.num_new_tokens for r in plan.requests
                                            if r.num_new_tokens > 1)
        # the debt of a chunk that overran is paid in full: the bound holds over time
        self.prefill_credit = min(self.prefill_credit + earn - spent, PREFILL_CREDIT_STEPS * earn)

    def _chunk(self, req: Request, budget: int, allowance: float,
               first: bool) -> tuple[int, float]:
        """The rows of req's next prompt chunk and their price: at most `budget`, and within
        `allowance` at the measured seconds a row of the last chunks beside decodes took
        (`prompt_row_s`, their fixed costs included: chunks that took less than their allowance
        grow by allowance / seconds, towards the size that takes it all; the first chunk beside
        decodes FIRST_CHUNK_ROWS rows, priced by the cost model). The first chunk of a step that
        allows any takes at least one row, so prompts always advance. Beside decodes a later
        chunk must finish its prompt within what is left (one partial prefill a step, as vLLM's
        max_num_partial_prefills = 1, the oldest prompt's first; a prompt mostly found in the
        prefix cache does not wait a step for each one before it), else it gets no rows."""
        start = req.num_computed_tokens
        remaining = req.num_tokens - start
        rows = min(remaining, budget)
        if allowance == math.inf:
            return rows, 0.0
        if allowance <= 0:
            return 0, 0.0
        if not self.prompt_row_s:
            rows = min(rows, FIRST_CHUNK_ROWS)
            seconds = self.cost.prefill_price(start, rows)
        else:
            rows = min(rows, int(allowance / self.prompt_row_s))
            if first:
                rows = max(rows, min(remaining, budget, 1))
            seconds = rows * self.prompt_row_s
        if not first and (rows < remaining or seconds > allowance):
            return 0, 0.0
        return rows, seconds

    def _chunks(self, prompts: list[Request], budget: int, allowance: float) -> list[int]:
        """The chunks `schedule` would give these running prompts (for the controller's view)."""
        out = []
        for req in prompts:
            if budget <= 0:
                break
            rows, seconds = self._chunk(req, budget, allowance, not out)
            if rows == 0:
                break
            out.append(rows)
            budget, allowance = budget - rows, allowance - seconds
        return out

    def _reserve(self, req: Request, num_new: int,
                 scheduled: list[tuple[Request, int, int]]) -> bool:
        """KV slots for req's num_new more tokens, preempting the latest admitted running request
        not yet scheduled this step while they do not fit. False when req itself was preempted."""
        total = req.num_computed_tokens + num_new
        while self.kv.allocate(req.request_id, total, req.num_computed_tokens) is None:
            planned = {r.request_id for r, _, _ in scheduled}
            victim = next(r for r in reversed(self.running)
                          if r is req or r.request_id not in planned)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def draft_len(self, req: Request) -> int:
        """Draft slots for a decoding request this step: the configured k, capped per request and by
        what is left of max_tokens and of the context, and by the drafts the worker proposed for
        it (a drafter of tokens alone); FASER's controller may choose fewer."""
        if self.config.num_speculative_tokens == 0 or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        k = self.config.num_speculative_tokens
        if req.params.num_speculative_tokens is not None:
            k = min(k, req.params.num_speculative_tokens)
        k = min(k, req.params.max_tokens - req.num_output_tokens - 1,
                self.config.max_model_len - req.num_tokens - 1)
        if req.ready_drafts is not None:                # proposed already: no slot for a draft
            k = min(k, req.ready_drafts)                # that does not exist
        return max(k, 0)

    def _choose_draft_lens(self, decoding: list[Request], prefill: int) -> dict[str, int]:
        """Draft slots per decoding request; FASER's controller prices them against the step's
        decode rows, their context keys and `prefill` rows of prompt chunks."""
        caps = {r.request_id: k for r in decoding if (k := self.draft_len(r)) > 0}
        if self.controller is None or not caps:
            return caps
        ids = list(caps)
        context = {r.request_id: r.num_computed_tokens for r in decoding}
        reqs = [self.requests[i] for i in ids]
        # the last step's swap bytes: contexts move slowly
        ks = self.controller.choose(ids, [caps[i] for i in ids], len(decoding),
                                    swap_bytes=self.last_swap_h2d, prefill_tokens=prefill,
                                    row_keys=sum(context.values()),
                                    contexts=[context[i] for i in ids],
                                    unstarted=[0 if r.drafted else r.num_computed_tokens
                                               for r in reqs],
                                    remaining=[r.params.max_tokens - r.num_output_tokens
                                               for r in reqs])
        for req, k in zip(reqs, ks):
            req.drafted = req.drafted or k > 0
        return dict(zip(ids, ks))

    def _admit(self, scheduled: list[tuple[Request, int, int]], budget: int, allowance: float,
               first_chunk: bool) -> None:
        if allowance <= 0:                              # the prompt chunks' credit is filling
            return
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._matches_prefix(req):
                hit = self.kv.match_prefix(req.request_id, req.all_token_ids)
                req.num_computed_tokens = hit
                self._stats.prefix_cache_queries += req.num_tokens
                self._stats.prefix_cache_hits += hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hit
            num_new, seconds = self._chunk(req, budget, allowance, first_chunk)
            # KV for the prompt as far as the token budget reaches, however short this chunk: an
            # admitted prompt holds its blocks (no prompt trickles in where it could not fit)
            total = req.num_computed_tokens + min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0 or self.kv.allocate(req.request_id, total,
                                                req.num_computed_tokens) is None:
                self.kv.free(req.request_id)           # release prefix hits; retry next step
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:          # not a preempted one coming back
                self._stats.first_scheduled.append(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new, 0))
            budget -= num_new
            allowance -= seconds
            first_chunk = False

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to the head of the queue."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        self._preempted_ids.append(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.drafted = False                                   # the worker drops its state
        if req.num_output_tokens == 0:
            req.prompt_logprobs = []                           # recomputed with the prompt
        self._stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _plan(self, scheduled: list[tuple[Request, int, int]]) -> StepPlan:
        out = []
        for req, num_new, num_drafts in scheduled:
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start:start + num_new]
            if start < req.num_prompt_tokens:
                self._stats.num_prompt_tokens += min(num_new, req.num_prompt_tokens - start)
            prompt_logprobs = (req.want_prompt_logprobs and req.num_output_tokens == 0
                               and start < req.num_prompt_tokens)
            sample = start + num_new >= req.num_tokens
            history = needs_history(req.params, num_drafts, prompt_logprobs,
                                    self.config.proposes_ahead and sample)
            out.append(ScheduledRequest(
                request_id=req.request_id, token_ids=tuple(tokens), num_computed_tokens=start,
                num_draft_tokens=num_drafts, block_ids=tuple(self.kv.block_ids(req.request_id)),
                sample=sample, params=req.params,
                num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                history=tuple(req.all_token_ids) if history else (),
                want_prompt_logprobs=prompt_logprobs))
        finished, self._finished_ids = tuple(self._finished_ids), []
        preempted, self._preempted_ids = tuple(self._preempted_ids), []
        return StepPlan(tuple(out), frontier_size=self.config.frontier_size,
                        finished_ids=finished, preempted_ids=preempted)

    # -- commit ------------------------------------------------------------------------------
    def commit(self, plan: StepPlan,
               result: StepResult) -> tuple[list[RequestOutput], StepStats]:
        """Append accepted tokens, roll back rejected draft slots, finish, index full blocks.
        Returns one output delta per request that produced something, and the step's stats."""
        outputs = []
        stats = self._stats
        for sreq in plan.requests:
            req = self.requests.get(sreq.request_id)
            if req is None or req.status.is_finished:
                continue
            req.num_computed_tokens += sreq.num_new_tokens
            if sreq.request_id in result.prompt_logprobs:
                req.prompt_logprobs.extend(result.prompt_logprobs[sreq.request_id])
            if not sreq.sample:
                continue
            sampled = result.sampled[sreq.request_id]
            num_accepted = len(sampled.token_ids) - 1
            req.ready_drafts = result.draft_lens.get(sreq.request_id, req.ready_drafts)
            req.num_computed_tokens += num_accepted          # verified drafts; rejected roll back
            if sampled.num_drafted:
                self._count_spec(req, sampled.num_drafted, num_accepted)
                stats.num_pruned_tokens += sampled.num_pruned
                stats.num_masked_tokens += sampled.num_masked
            if self.controller is not None and sreq.num_draft_tokens:
                self.controller.observe(req.request_id, sampled.num_drafted, num_accepted)
            new_tokens = []
            for tok in sampled.token_ids:
                req.append(tok)
                new_tokens.append(tok)
                if req.check_stop(self.config.eos_token_ids, self.config.max_model_len):
                    break
            stats.num_generation_tokens += len(new_tokens)
            logprobs = sampled.logprobs[:len(new_tokens)] if sampled.logprobs is not None else None
            if req.status.is_finished:
                # its committed tokens' full blocks stay findable once freed (vLLM caches a
                # block when it is full): a one-token request's prompt too. A stop among the
                # accepted drafts leaves tokens computed past the last one kept: none past the
                # kept tokens is indexed (nor the last, whose KV exists only if it was a draft)
                self.kv.cache_full_blocks(req.request_id, req.all_token_ids,
                                          min(req.num_computed_tokens, req.num_tokens - 1))
                self._finish(req, req.status)
            else:
                self.kv.rollback(req.request_id, req.num_tokens)
                self.kv.cache_full_blocks(req.request_id, req.all_token_ids,
                                          req.num_computed_tokens)
            outputs.append(self._output(req, new_tokens, logprobs))
        stats.num_running, stats.num_waiting = len(self.running), len(self.waiting)
        stats.kv_usage = self.kv.usage()
        stats.swap_bytes_h2d, stats.swap_bytes_d2h = result.swap_bytes
        self.last_swap_h2d = result.swap_bytes[0]
        stats.step_time_s = result.step_time_s
        stats.num_frontiers = result.num_frontiers
        stats.num_drafted_ahead = result.num_drafted_ahead
        self._observe_cost(plan, result)
        self._stats = StepStats()
        return outputs, stats

    def _observe_cost(self, plan: StepPlan, result: StepResult) -> None:
        """The step's counts of `Prices`' terms and its measured seconds, to the cost model. A
        step that computed no row (it only released finished requests) is no sample: it would
        price a step at nothing."""
        if plan.num_tokens == 0:
            return
        # drafts the grammar cut were never computed: priced as no rows
        drafted = [s.num_drafted - s.num_masked for s in result.sampled.values()]
        prompt_rows = [r for r in plan.requests if r.num_new_tokens > 1]
        prefill = sum(r.num_new_tokens for r in prompt_rows)
        context = {r.request_id: r.num_computed_tokens for r in plan.requests}
        # a draft pass's rows: the requests that drafted more than the passes before it (the
        # longest drafts first), each reading its context and the drafts before
        longest = sorted(((s.num_drafted, context[rid]) for rid, s in result.sampled.items()
                          if s.num_drafted), reverse=True)
        passes = [DraftPass(rows, seconds, sum(c + j for _, c in longest[:rows]), int(j == 0))
                  for j, (rows, seconds) in enumerate(result.draft_passes)]
        self._settle_prefill_credit(plan, result.step_time_s)
        # building first-time requests' drafting states is priced apart, once (`state_price`)
        self.cost.observe(plan.num_tokens - prefill + sum(drafted), max(drafted, default=0),
                          max(result.step_time_s - result.draft_state_s, 0.0),
                          swap_bytes=result.swap_bytes[0],
                          draft_tokens=sum(drafted), draft_passes=passes, prefill_tokens=prefill,
                          row_keys=sum(r.num_computed_tokens for r in plan.requests
                                       if r.num_new_tokens == 1),
                          prefill_keys=sum(prefill_keys(r.num_computed_tokens, r.num_new_tokens)
                                           for r in prompt_rows),
                          prefill_chunks=len(prompt_rows))

    def _count_spec(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        req.num_drafts += 1
        req.num_draft_tokens += num_drafted
        req.num_accepted_tokens += num_accepted
        s = self._stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafted
        s.num_accepted_tokens += num_accepted
        s.draft_lens.append(num_drafted)
        for pos in range(num_accepted):
            for counts in (req.accepted_per_pos, s.accepted_per_pos):
                if len(counts) <= pos:
                    counts.extend([0] * (pos + 1 - len(counts)))
                counts[pos] += 1

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        if self.controller is not None:
            self.controller.release(req.request_id)
        self._finished_ids.append(req.request_id)
        self._stats.finished.append((req.request_id, status.finish_reason or ""))

    def _output(self, req: Request, new_tokens: list[int], logprobs,
                error: str | None = None) -> RequestOutput:
        first = bool(new_tokens) and req.num_output_tokens == len(new_tokens)
        prompt_logprobs = None
        if first and req.want_prompt_logprobs:
            prompt_logprobs = [None] + list(req.prompt_logprobs)
        speculating = (self.config.num_speculative_tokens > 0
                       and req.params.num_speculative_tokens != 0)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_tokens, finished=req.status.is_finished,
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
            spec=SpecStats(req.num_drafts, req.num_draft_tokens, req.num_accepted_tokens,
                           tuple(req.accepted_per_pos)) if speculating else None,
            error=error)
