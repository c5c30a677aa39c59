"""EngineCore: the synchronous step loop. schedule -> execute -> commit, one step at a time.

Validation of a request happens here (ParamError -> 400 at the server), so the offline `LLM` and the
HTTP server refuse the same inputs the same way.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path

from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.manager import KVCacheManager
from specserve.scheduler.config import EngineConfig, SchedulerConfig
from specserve.scheduler.messages import (EngineInfo, EngineRequest, ModelInfo, RequestOutput,
                                          StepStats)
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import Scheduler
from specserve.scheduler.validation import validate
from specserve.spec_phases.paths import TINY_RANDOM, resolve_model_path
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.spec_phases.worker import Worker

logger = logging.getLogger(__name__)
WARM_UP_ROWS = 8                   # requests in the start-up batch
WARM_UP_STEPS = 3                  # decode steps timed after its prefill


@dataclass(frozen=True)
class EngineStep:
    """What one engine step gives back: output deltas, and the step's stats for metrics."""
    outputs: list[RequestOutput]
    stats: StepStats | None = None           # None when the step had nothing to run


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._fault: str | None = None             # inject_fault (tests)
        # constrained requests whose grammar is still compiling: admitted once it is ready, so a
        # slow compile never stalls the steps of other requests
        self._compiling: list[tuple[Future, Request]] = []
        self.worker = Worker(config.worker_config())
        cfg = self.worker.model_config
        max_len = min(config.max_model_len or cfg.max_position, cfg.max_position)
        capacity = self.worker.num_blocks * config.block_size
        if max_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it",
                           max_len, capacity)
            max_len = capacity
        # VeriCache with the full cache in host memory: the device budget holds the compressed
        # drafting caches, and requests are admitted and preempted by their bytes too
        budget = self.worker.draft_budget(max_len)
        if budget is not None:
            fits = budget.max_tokens_alone()
            if fits < 1:
                raise ValueError(f"the KV budget ({self.worker.device_kv_gb:g} GiB) is too small "
                                 f"for one token's compressed drafting cache")
            if fits < max_len:
                logger.warning("max_model_len %d exceeds the compressed drafting cache (%d tokens "
                               "in %d bytes); capping it", max_len, fits, budget.capacity)
                max_len = fits
        self.max_model_len = max_len
        pool = BlockPool(self.worker.num_blocks, config.block_size, config.enable_prefix_caching,
                         name="full")
        self.kv = KVCacheManager([pool], draft_budget=budget)
        spec = config.speculative
        self.scheduler = Scheduler(self.kv, SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_len, eos_token_ids=cfg.eos_token_ids,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            adaptive=bool(spec and spec.adaptive),
            frontier_size=spec.frontier_size if spec else 0))
        path = resolve_model_path(None if config.model == TINY_RANDOM else config.model)
        name = TINY_RANDOM if config.model == TINY_RANDOM else (
            path.name if path.is_dir() else Path(path).stem)
        self.model_info = ModelInfo(name=name, path=str(path), vocab_size=cfg.vocab_size,
                                    max_model_len=max_len, eos_token_ids=cfg.eos_token_ids,
                                    bos_token_id=cfg.bos_token_id)
        worker = self.worker
        draft = worker.draft_pool.usage() if worker.draft_pool is not None else None
        self.engine_info = EngineInfo(
            block_size=config.block_size, num_blocks=worker.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            dtype=str(worker.dtype).removeprefix("torch."), device=worker.device,
            kv_cache_dtype=str(worker.kv_dtype).removeprefix("torch."),
            kv_bytes_per_token=cfg.kv_bytes_per_token(worker.kv_dtype),
            spec_method=spec.method if spec else None,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            kv_compressor=spec.kv_compressor if spec and spec.method == "lossy_kv" else None,
            draft_kv_bytes_per_token=draft.compressed_page_bytes_per_token if draft else None)

    # -- requests ----------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> None:
        """Raise ParamError for input the engine cannot serve (the server answers 400)."""
        validate(req, self.model_info)

    def add_request(self, req: EngineRequest) -> None:
        self.validate(req)
        request = Request(req)
        constraint = req.sampling_params.constraint
        if constraint is not None:                  # structured output: compile first
            future = self.worker.grammars.prepare(constraint, use=False)
            if not future.done():
                if request.request_id in self.scheduler.requests or any(
                        r.request_id == request.request_id for _, r in self._compiling):
                    raise ValueError(f"duplicate request id {request.request_id}")
                self._compiling.append((future, request))
                return
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish the request now; its device-side state is released with the next step."""
        for i, (_, request) in enumerate(self._compiling):
            if request.request_id == request_id:
                del self._compiling[i]
                return RequestOutput(request_id=request_id, new_token_ids=[], finished=True,
                                     finish_reason="abort",
                                     num_prompt_tokens=request.num_prompt_tokens)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._compiling) or self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Requests to run, or device-side state still to release: the loop steps while true."""
        return bool(self._compiling) or self.scheduler.has_work()

    def _admit_compiled(self) -> None:
        """Hand requests whose grammar compiled (or failed: the worker then ends them) to the
        scheduler, in arrival order. With nothing else to run, wait a little for one."""
        if not self._compiling:
            return
        if not self.scheduler.has_work():
            wait([f for f, _ in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        still = []
        for future, request in self._compiling:
            if future.done():
                self.scheduler.add(request)
            else:
                still.append((future, request))
        self._compiling = still

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
        self._admit_compiled()
        plan = self.scheduler.schedule()
        if plan.is_empty():
            return EngineStep([])
        try:
            if self._fault == "step":
                self._fault = None
                raise RuntimeError("injected fault in a model step (test hook)")
            result = self.worker.execute(plan)
        except Exception as exc:                   # one bad step fails its requests, not the engine
            logger.exception("step failed; failing its %d requests", len(plan.requests))
            outputs = self.scheduler.fail([r.request_id for r in plan.requests],
                                          f"engine step failed: {exc}")
            return EngineStep(outputs)
        outputs, stats = self.scheduler.commit(plan, result)
        return EngineStep(outputs, stats)

    def warm_up(self) -> float:
        """Run a small synthetic batch through whole steps (kernels' first-call set-up paid before
        the first user's request) and return the decode rate it measured, in tokens per second:
        the drain estimate's prior until real steps are measured. The prompts stay shorter than a
        block (nothing reaches the prefix cache) and draft nothing (no drafter learns from them)."""
        n = min(self.config.max_num_seqs, WARM_UP_ROWS)
        vocab = self.model_info.vocab_size
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
        self.worker.check_integrity(set(self.scheduler.requests), self.scheduler.releasing(),
                                    budget.reserved_total if budget is not None else None)
        if not self.scheduler.has_unfinished() and self.kv.num_requests_holding_blocks():
            raise AssertionError("idle engine still has requests holding KV blocks")
