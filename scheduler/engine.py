"""EngineCore: the synchronous step loop. schedule -> execute -> commit, one step at a time.

Validation of a request happens here (ParamError -> 400 at the server), so the offline `LLM` and the
HTTP server refuse the same inputs the same way.
"""
from __future__ import annotations

import logging
from pathlib import Path

from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.manager import KVCacheManager
from specserve.scheduler.config import EngineConfig
from specserve.scheduler.messages import EngineRequest, ModelInfo, RequestOutput
from specserve.scheduler.request import Request
from specserve.scheduler.sampling_params import ParamError
from specserve.scheduler.scheduler import Scheduler
from specserve.spec_phases.paths import TINY_RANDOM, resolve_model_path
from specserve.spec_phases.worker import Worker

logger = logging.getLogger(__name__)


def max_draft_len(bytes_for, capacity: int, limit: int) -> int:
    """The longest context n <= limit whose compressed cache fits `capacity` on its own, the bytes
    taken as the peak over every length up to n (not monotonic: pages replace dense tokens)."""
    peak = 0
    for n in range(1, limit + 1):
        peak = max(peak, bytes_for(n))
        if peak > capacity:
            return n - 1
    return limit


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.async_owner = None                   # the AsyncEngine driving this core, if any
        self.worker = Worker(config.model, config.device, config.dtype, config.block_size,
                             config.kv_cache_memory_gb, config.num_kv_blocks, config.seed, config.num_threads,
                             config.tiny_random_seed, config.speculative,
                             host_kv_cache_memory_gb=config.host_kv_cache_memory_gb,
                             cpu_weight_packing=config.cpu_weight_packing)
        cfg = self.worker.config
        max_len = min(config.max_model_len or cfg.max_position, cfg.max_position)
        capacity = self.worker.num_blocks * config.block_size
        if max_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it", max_len, capacity)
            max_len = capacity
        # VeriCache with the full cache in host memory: the device budget holds the compressed drafting
        # caches, and the scheduler admits and preempts by their bytes too
        usage = self.worker.draft_cache_usage()
        draft_capacity = usage["capacity_bytes"] if usage is not None else None
        draft_bytes_for = self.worker.draft_cache_bytes_for if draft_capacity is not None else None
        if draft_bytes_for is not None:
            fits = max_draft_len(draft_bytes_for, draft_capacity, max_len)
            if fits < 1:
                raise ValueError(f"kv_cache_memory_gb ({config.kv_cache_memory_gb}) is too small for one "
                                 f"token's compressed drafting cache")
            if fits < max_len:
                logger.warning("max_model_len %d exceeds the compressed drafting cache (%d tokens in %d bytes); "
                               "capping it", max_len, fits, draft_capacity)
                max_len = fits
        self.max_model_len = max_len
        pool = BlockPool(self.worker.num_blocks, config.block_size, config.enable_prefix_caching, name="full")
        self.kv = KVCacheManager([pool])
        spec = config.speculative
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                   cfg.eos_token_ids, spec.num_speculative_tokens if spec else 0,
                                   adaptive=bool(spec and spec.adaptive),
                                   frontier_size=spec.frontier_size if spec else 0,
                                   draft_bytes_for=draft_bytes_for, draft_capacity=draft_capacity)
        path = resolve_model_path(None if config.model == TINY_RANDOM else config.model)
        name = TINY_RANDOM if config.model == TINY_RANDOM else (
            path.name if path.is_dir() else Path(path).stem)
        self.model_info = ModelInfo(name=name, path=str(path), vocab_size=cfg.vocab_size, max_model_len=max_len,
                                    eos_token_ids=cfg.eos_token_ids, bos_token_id=cfg.bos_token_id)

    # -- requests ----------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> None:
        """Raise ParamError for input the engine cannot serve (the server answers 400)."""
        prompt, n_ctx = req.prompt_token_ids, self.max_model_len
        if not prompt:
            raise ParamError("prompt", "prompt must be provided and non-empty.")
        vocab = self.model_info.vocab_size
        bad = next((t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is out of vocabulary (size {vocab}).")
        num_prompt, max_tokens = len(prompt), req.sampling_params.max_tokens
        if num_prompt + max_tokens > n_ctx:
            raise ParamError(
                "input_tokens" if num_prompt >= n_ctx else "max_tokens",
                f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.")
        req.sampling_params.check_vocab(vocab)

    def add_request(self, req: EngineRequest) -> None:
        self.validate(req)
        self.scheduler.add(Request(req))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        out = self.scheduler.abort(request_id)
        self.worker.release(self.scheduler.take_finished_ids())
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self.worker.release_drafts(self.scheduler.take_preempted_ids())   # preempted: compressed cache too
        if plan.is_empty():
            return []
        try:
            result = self.worker.execute(plan)
        except Exception as exc:                   # one bad step fails its requests, not the engine
            logger.exception("step failed; failing its %d requests", len(plan.requests))
            outputs = self.scheduler.fail([r.request_id for r in plan.requests], f"engine step failed: {exc}")
        else:
            outputs = self.scheduler.commit(plan, result, swap_bytes=self.worker.last_swap_bytes)
        self.worker.release(self.scheduler.take_finished_ids())   # per-request device state, now
        return outputs

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[RequestOutput]:
        outputs = []
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            outputs.extend(self.step())
        return outputs

    def check_integrity(self) -> None:
        """Every pool balances; drafter state (the compressed cache) is held only for live requests."""
        self.kv.check_integrity()
        self.scheduler.check_integrity()
        usage = self.worker.draft_cache_usage()
        if self.scheduler.draft_capacity is not None and usage["compressed_bytes"] > self.scheduler.reserved_total:
            raise AssertionError(f"drafting caches hold {usage['compressed_bytes']} compressed bytes, more than "
                                 f"the {self.scheduler.reserved_total} reserved")
        if not self.has_unfinished() and self.kv.num_requests_holding_blocks():
            raise AssertionError("idle engine still has requests holding KV blocks")
        stale = self.worker.held_request_ids() - set(self.scheduler.requests)
        if stale:
            raise AssertionError(f"drafter state held for finished requests: {sorted(stale)[:5]}")
