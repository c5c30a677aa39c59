"""EngineCore: the synchronous step loop. schedule -> execute -> commit, one step at a time.

The engine owns the scheduler, the KV manager and the grammar manager (structured output); it
reaches the worker only through messages (spec_phases/plan.py): the worker's facts once at start,
then a plan and its result each step.

Validation of a request happens here (ParamError -> 400 at the server), so the offline `LLM` and the
HTTP server refuse the same inputs the same way.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.draft_pool import DraftBudget
from specserve.kv_cache.manager import KVCacheManager
from specserve.scheduler.config import EngineConfig, SchedulerConfig
from specserve.scheduler.messages import (EngineInfo, EngineRequest, ModelInfo, RequestOutput,
                                          StepStats)
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import Scheduler
from specserve.scheduler.structured_output import GrammarManager
from specserve.scheduler.validation import validate
from specserve.spec_phases.paths import TINY_RANDOM, resolve_model_path
from specserve.spec_phases.plan import DrafterTiming, StepPlan, StepResult, WorkerFacts
from specserve.spec_phases.sampling_params import Constraint, SamplingParams
from specserve.spec_phases.worker import Worker

logger = logging.getLogger(__name__)
WARM_UP_ROWS = 8                   # requests in the start-up batch
WARM_UP_STEPS = 3                  # decode steps timed after its prefill
WARM_UP_GRAMMAR = Constraint("regex", "[0-9]")   # loads the worker's grammar tokenizer


class StepWorker(Protocol):
    """What the engine calls on its worker, in messages of spec_phases/plan.py only: a `Worker` in
    this process, or a proxy to one in another (tests/scheduler/test_worker_process.py)."""

    def facts(self) -> WorkerFacts: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def check_integrity(self, live_ids: set[str], releasing: set[str],
                        reserved_bytes: int | None) -> None: ...

    def calibrate_drafter(self) -> DrafterTiming: ...


@dataclass(frozen=True)
class EngineStep:
    """What one engine step gives back: output deltas, and the step's stats for metrics."""
    outputs: list[RequestOutput]
    stats: StepStats | None = None           # None when the step had nothing to run


class EngineCore:
    def __init__(self, config: EngineConfig, worker: StepWorker | None = None):
        """worker: None builds a `Worker` in this process from the config."""
        self.config = config
        self._fault: str | None = None             # inject_fault (tests)
        self.worker = worker if worker is not None else Worker(config.worker_config())
        facts = self.worker.facts()                # the worker's one message before the steps
        # structured output: constrained requests wait here until their grammar is compiled
        self.grammars = GrammarManager()
        max_len = facts.max_model_len
        # VeriCache with the full cache in host memory: the device budget holds the compressed
        # drafting caches, and requests are admitted and preempted by their bytes too
        budget = None
        if facts.draft_capacity_bytes is not None:
            budget = DraftBudget(facts.draft_capacity_bytes, facts.draft_bytes_at)
            fits = budget.max_tokens_alone()
            if fits < 1:
                raise ValueError(f"the KV budget ({facts.device_kv_gb:g} GiB) is too small "
                                 f"for one token's compressed drafting cache")
            if fits < max_len:
                logger.warning("max_model_len %d exceeds the compressed drafting cache (%d tokens "
                               "in %d bytes); capping it", max_len, fits, budget.capacity)
                max_len = fits
        self.max_model_len = max_len
        pool = BlockPool(facts.num_blocks, config.block_size, config.enable_prefix_caching,
                         name="full")
        self.kv = KVCacheManager([pool], draft_budget=budget)
        spec = config.speculative
        self.scheduler = Scheduler(self.kv, SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_len, eos_token_ids=facts.eos_token_ids,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            adaptive=bool(spec and spec.adaptive),
            frontier_size=spec.frontier_size if spec else 0, proposes_ahead=facts.proposes_ahead,
            max_decode_slowdown=config.max_decode_slowdown))
        path = resolve_model_path(None if config.model == TINY_RANDOM else config.model)
        name = TINY_RANDOM if config.model == TINY_RANDOM else (
            path.name if path.is_dir() else Path(path).stem)
        self.model_info = ModelInfo(name=name, path=str(path), vocab_size=facts.vocab_size,
                                    max_model_len=max_len, eos_token_ids=facts.eos_token_ids,
                                    bos_token_id=facts.bos_token_id)
        self.engine_info = EngineInfo(
            block_size=config.block_size, num_blocks=facts.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching, dtype=facts.dtype,
            device=facts.device, kv_cache_dtype=facts.kv_cache_dtype,
            kv_bytes_per_token=facts.kv_bytes_per_token,
            spec_method=spec.method if spec else None,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            kv_compressor=spec.kv_compressor if spec and spec.method == "lossy_kv" else None,
            draft_kv_bytes_per_token=facts.draft_kv_bytes_per_token)

    # -- requests ----------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> None:
        """Raise ParamError for input the engine cannot serve (the server answers 400)."""
        validate(req, self.model_info)

    def add_request(self, req: EngineRequest) -> None:
        self.validate(req)
        request = Request(req)
        constraint = req.sampling_params.constraint
        if constraint is not None:                  # structured output: compile first
            if (request.request_id in self.scheduler.requests
                    or self.grammars.is_waiting(request.request_id)):
                raise ValueError(f"duplicate request id {request.request_id}")
            if not self.grammars.submit(request, constraint):
                return                              # admitted once compiled (`step`)
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish the request now; its device-side state is released with the next step."""
        request = self.grammars.abort(request_id)
        if request is not None:
            return RequestOutput(request_id=request_id, new_token_ids=[], finished=True,
                                 finish_reason="abort",
                                 num_prompt_tokens=request.num_prompt_tokens)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.grammars.has_waiting() or self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Requests to run, or device-side state still to release: the loop steps while true."""
        return self.grammars.has_waiting() or self.scheduler.has_work()

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand requests whose grammar compiled to the scheduler, in arrival order; those whose
        grammar does not compile finish with an error (the server refuses them with a 400 before;
        an engine-only caller learns it here). With nothing else to run, wait a little for one."""
        ready, failed = self.grammars.take_compiled(block=not self.scheduler.has_work())
        for request in ready:
            self.scheduler.add(request)
        return [RequestOutput(request_id=request.request_id, new_token_ids=[], finished=True,
                              finish_reason="error", error=message,
                              num_prompt_tokens=request.num_prompt_tokens)
                for request, message in failed]

    # -- the loop ----------------------------------------------------------------------------
    def inject_fault(self, where: str) -> None:
        """Test-only fault hook (also reachable across the process boundary through
        `AsyncEngine.inject_fault`): "step" makes the next model step raise, as a kernel error
        would (its requests fail, the engine goes on); "loop" makes the next `step()` raise outside
        the model step (the loop dies)."""
        if where not in ("step", "loop"):
            raise ValueError(f"fault must be 'step' or 'loop', got {where!r}")
        self._fault = where

    def step(self) -> EngineStep:
        """schedule -> execute -> commit: the only two crossings between scheduler and worker."""
        if self._fault == "loop":
            self._fault = None
            raise RuntimeError("injected fault in the engine loop (test hook)")
        refused = self._admit_compiled()
        plan = self.scheduler.schedule()
        if plan.is_empty():
            return EngineStep(refused)
        plan = self.grammars.attach(plan)
        try:
            if self._fault == "step":
                self._fault = None
                raise RuntimeError("injected fault in a model step (test hook)")
            result = self.worker.execute(plan)
        except Exception as exc:                   # one bad step fails its requests, not the engine
            logger.exception("step failed; failing its %d requests", len(plan.requests))
            outputs = self.scheduler.fail([r.request_id for r in plan.requests],
                                          f"engine step failed: {exc}")
            return EngineStep(refused + outputs)
        outputs, stats = self.scheduler.commit(plan, result)
        stats.grammar_compile_s, stats.grammar_cache_hits = self.grammars.drain_stats()
        return EngineStep(refused + outputs, stats)

    def warm_up(self) -> float:
        """Run a small synthetic batch through whole steps (kernels' first-call set-up paid before
        the first user's request) and return the decode rate it measured, in tokens per second:
        the drain estimate's prior until real steps are measured. The prompts stay shorter than a
        block (nothing reaches the prefix cache) and draft nothing (no drafter learns from them).
        With FASER's controller, the drafter's passes are then timed over synthetic contexts
        (`Worker.calibrate_drafter`) and priced (`CostModel.calibrate`)."""
        n = min(self.config.max_num_seqs, WARM_UP_ROWS)
        vocab = self.model_info.vocab_size
        # one constrained request first: the worker's grammar tokenizer is loaded now, not by
        # the first user's constrained request (that step would wait for it)
        self.add_request(EngineRequest("specserve-warm-up-grammar", [1], SamplingParams(
            max_tokens=1, temperature=0.0, num_speculative_tokens=0,
            constraint=WARM_UP_GRAMMAR)))
        self.run_until_idle()
        # that step paid the tokenizer's load and the kernels' first calls: no price of a step
        self.scheduler.cost.forget()
        params = SamplingParams(max_tokens=WARM_UP_STEPS + 1, temperature=0.0, ignore_eos=True,
                                num_speculative_tokens=0)
        prompt_len = max(1, min(4, self.config.block_size - WARM_UP_STEPS - 2))
        for i in range(n):
            ids = [(97 * i + 13 * j + 1) % vocab for j in range(prompt_len)]
            self.add_request(EngineRequest(f"specserve-warm-up-{i}", ids, params))
        self.step()                                # the prefill
        start, tokens = time.perf_counter(), 0
        while self.has_unfinished():
            step = self.step()
            tokens += sum(len(out.new_token_ids) for out in step.outputs)
        elapsed = time.perf_counter() - start
        while self.has_work():                     # release the finished requests' state
            self.step()
        if self.scheduler.controller is not None:  # FASER: the drafter's passes priced up front
            timed = time.perf_counter()
            timing = self.worker.calibrate_drafter()
            if timing.passes:
                cost = self.scheduler.cost
                cost.calibrate(timing.passes, timing.state_per_token)
                logger.info("FASER: %d draft passes timed over contexts up to %d tokens in "
                            "%.2f s: a pass %.2f ms + %.2f us a context key, a round's set-up "
                            "%.2f ms; a request's drafting state %.2f us a context token",
                            len(timing.passes), max(p[2] for p in timing.passes),
                            time.perf_counter() - timed, cost.prices.draft_pass * 1e3,
                            cost.prices.pass_key * 1e6, cost.round_price * 1e3,
                            cost.state_price * 1e6)
        return tokens / elapsed if elapsed > 0 and tokens else 0.0

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[RequestOutput]:
        outputs = []
        for _ in range(max_steps):
            if not self.has_work():
                break
            outputs.extend(self.step().outputs)
        return outputs

    def check_integrity(self) -> None:
        """Every pool balances; per-request device state is held only for live requests."""
        self.kv.check_integrity()
        budget = self.kv.draft_budget
        live, releasing = set(self.scheduler.requests), self.scheduler.releasing()
        self.grammars.check_integrity(live | releasing)
        self.worker.check_integrity(live, releasing,
                                    budget.reserved_total if budget is not None else None)
        if not self.scheduler.has_unfinished() and self.kv.num_requests_holding_blocks():
            raise AssertionError("idle engine still has requests holding KV blocks")
