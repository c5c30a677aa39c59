"""The worker: model, KV storage, drafter and verifier on one device. The engine reaches it only
through messages (spec_phases/plan.py): `Worker.facts() -> WorkerFacts` once at start, then
`Worker.execute(plan) -> StepResult` each step."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from specserve.kv_cache.draft_pool import DraftPool
from specserve.kv_cache.host_pool import HostKVPool
from specserve.kv_cache.storage import KVStorage, num_blocks_for_budget
from specserve.spec_phases import cpu_decoder
from specserve.spec_phases.calibration import build_compressor
from specserve.spec_phases.config import KV_CACHE_DTYPES, SpeculativeConfig, WorkerConfig
from specserve.spec_phases.frontiers import FrontierVerifier
from specserve.spec_phases.grammar import GrammarMatchers
from specserve.spec_phases.loader import load_model
from specserve.spec_phases.overlap import DraftAhead
from specserve.spec_phases.plan import (DrafterTiming, SampledTokens, ScheduledRequest, StepPlan,
                                        StepResult, WorkerFacts)
from specserve.spec_phases.proposers.base import DraftRequest, Proposer
from specserve.spec_phases.proposers.layer_skip import LayerSkipProposer, default_skip_layers
from specserve.spec_phases.proposers.lossy_kv import LossyKVProposer
from specserve.spec_phases.proposers.ngram import NgramProposer
from specserve.spec_phases.proposers.token_recycling import TokenRecyclingProposer
from specserve.spec_phases.runner import ModelRunner
from specserve.spec_phases.sampler import Sampler
from specserve.spec_phases.tokenizer import load_tokenizer
from specserve.spec_phases.verify import Verifier

if TYPE_CHECKING:
    from specserve.spec_phases.cuda_graphs import StepGraphs

logger = logging.getLogger(__name__)
ACTIVATION_RESERVE_GB = 1.0      # gpu_memory_utilization: device memory kept for forward passes
DEFAULT_KV_CACHE_GB = 1.0        # the KV budget on a CPU when none is given (kv_cache_memory_gb)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9    # CUDA, when no KV size is given: vLLM's default
CALIBRATION_CONTEXT = 2048       # the longest synthetic context a drafter's passes are timed at

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """"auto": bf16 on CUDA, fp32 on CPU. On CPU fp32 is what keeps greedy output token-identical
    with speculation on and off: bf16 rounds each row's attention output, and those roundings
    shift with how the batch is padded, so a verify row can round differently from the decode it
    replaces. `--dtype bfloat16` (prepacked for oneDNN where the CPU has AVX512-BF16 or AMX) is
    therefore opt-in."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, exact: bool = False,
                           device: str = "cpu") -> torch.dtype:
    """--kv-cache-dtype -> the full cache's element type: "auto" the model's dtype, except on the
    CPU's fast path (`--dtype auto`: float32 or int8 activations), where it is bfloat16 as
    vLLM-CPU's bf16 cache and llama.cpp's f16 one (half the bytes a step reads at long context
    or many requests; `benchmarks/accuracy_i8.py`: perplexity 7.163 against 7.170 over float32,
    with int8 activations); exact (a `--dtype` given): the model's dtype, float32 for
    `--dtype float32`, the path that matches transformers. "float32": float32 whatever the
    model's; "bfloat16" bf16 whatever the model's (on CPU the C attention widens it exactly to
    float32; on CUDA the Triton kernel reads the cache's dtype). Speculation stays lossless: the
    drafters and the verify pass read the same cache, and a row's result does not depend on its
    neighbours."""
    if kv_cache_dtype == "auto":
        return dtype if exact or device.startswith("cuda") else torch.bfloat16
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    if kv_cache_dtype == "float32":
        return torch.float32
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: one of {list(KV_CACHE_DTYPES)}")


def utilization_kv_budget(util: float, free: int, total: int) -> int:
    """Bytes of KV cache that vLLM's gpu_memory_utilization allows: util x total, less what is in
    use now (total - free: weights, other processes), less ACTIVATION_RESERVE_GB."""
    budget = int(util * total - (total - free) - ACTIVATION_RESERVE_GB * 2**30)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {util} leaves no room for the KV cache: "
                         f"{util:.2f} x {total / 2**30:.1f} GiB, {(total - free) / 2**30:.1f} GiB "
                         f"already in use, {ACTIVATION_RESERVE_GB:g} GiB kept for activations; "
                         "raise it")
    return budget


class Worker:
    def __init__(self, config: WorkerConfig):
        """kv_cache_memory_gb budgets the device KV: the full cache, or with lossy_kv keeping the
        full cache in a HostKVPool, the compressed drafting caches; that host pool is then sized
        from host_kv_cache_memory_gb (None: kv_cache_memory_gb). num_kv_blocks sizes the full
        cache."""
        self.config = config
        spec = config.speculative
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype,
                                               exact=config.dtype != "auto", device=self.device)
        # the full cache in a host pool: opt-in (SpeculativeConfig.full_kv_in_host)
        in_host = spec is not None and spec.method == "lossy_kv" and spec.full_kv_in_host
        torch.manual_seed(config.seed)
        self.model = load_model(config.model, self.dtype, self.device,
                                tiny_seed=config.tiny_random_seed)
        # --dtype auto on a GGUF's quantized blocks: int8 dot products against per-row quantized
        # activations (rows still independent, so speculation stays lossless); an explicit
        # --dtype float32 keeps float32 activations, the path that matches transformers
        int8 = config.dtype == "auto"
        if config.cpu_weight_packing and self.model.pack_for_cpu(int8):
            layout = self.model.layers[0].qkv_proj.packed.layout
            kind = {"onednn": "oneDNN", "f32": "the C kernel",
                    "bf16": "the C kernel, bf16 panels (the checkpoint's values)"}.get(
                layout, f"the C kernel, the GGUF's {layout.split('_i8')[0].upper()} blocks "
                f"as they are{', int8 activations' if '_i8' in layout else ''}")
            logger.info("linear weights packed for %s (%s on CPU)", kind, self.dtype)
        else:
            self.model.drop_gguf_blocks()
        self.weight_bytes = self.model.bytes_per_step()      # what one forward reads
        cfg = self.model_config = self.model.config
        self.device_kv_gb = self._device_kv_budget_gb()
        budget_gb = ((config.host_kv_cache_memory_gb or config.kv_cache_memory_gb
                      or DEFAULT_KV_CACHE_GB) if in_host else self.device_kv_gb)
        bs = config.block_size
        self.num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            budget_gb * 2**30, cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
        if self.num_blocks < 1:
            raise ValueError("the KV cache budget is too small for one block")
        self.max_model_len = min(config.max_model_len or cfg.max_position, cfg.max_position)
        if self.max_model_len > self.num_blocks * bs:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it",
                           self.max_model_len, self.num_blocks * bs)
            self.max_model_len = self.num_blocks * bs
        shape = (cfg.num_layers, self.num_blocks, bs, cfg.num_kv_heads, cfg.head_dim,
                 self.kv_dtype)
        graphs = self.device.startswith("cuda") and not config.enforce_eager and not in_host
        if in_host:
            self.storage = HostKVPool(*shape)      # VeriCache: the device keeps compressed KV
        else:
            self.storage = KVStorage(*shape, self.device, padding_block=graphs)
        self.runner = ModelRunner(self.model, self.storage,
                                  self._step_graphs() if graphs else None)
        self.sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, self.device, config.seed)
        self.draft_pool: DraftPool | None = None
        if spec is not None and self.device == "cpu":
            why = cpu_decoder.batch_dependence(self.model)
            if why is not None:
                raise ValueError(f"speculative decoding needs every row computed independently "
                                 f"of its step's other rows to stay lossless, and here {why}: "
                                 f"serve without --speculative-config")
        self.proposer = self._proposer(spec, in_host)
        self.verifier = Verifier(self.runner, self.sampler, self.proposer)
        self.grammars = GrammarMatchers(lambda: load_tokenizer(config.model), cfg.vocab_size,
                                        cfg.eos_token_ids)
        self.draft_ahead = None
        if spec is not None and spec.overlap_draft and self.proposer is not None:
            self.draft_ahead = DraftAhead(self.proposer, spec.num_speculative_tokens)
        # a drafter of tokens alone proposes each request's next drafts at the end of a step
        # (`_propose_next`): request -> (the tokens they continue, drafts, from the overlap thread)
        self.next_drafts: dict[str, tuple[int, list[int], bool]] = {}
        self._swap_seen = (0, 0, 0)                # pool h2d, pool d2h, drafting tokens encoded
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s on %s)", self.num_blocks, bs,
                    self.storage.nbytes / 2**20, self.kv_dtype, self.device)

    def _step_graphs(self) -> StepGraphs | None:
        """CUDA graphs of decode and verify batches up to max_num_seqs requests (None where the
        Triton kernel does not serve the model's head size)."""
        from specserve.spec_phases import cuda_graphs      # imports triton: on CUDA only
        if not cuda_graphs.usable(self.model, self.storage):
            logger.info("decode steps run eagerly: no CUDA graphs for head size %d",
                        self.model_config.head_dim)
            return None
        config = self.config
        start = time.perf_counter()
        spec = config.speculative
        graphs = cuda_graphs.StepGraphs(self.model, self.storage, config.max_num_seqs,
                                        self.max_model_len,
                                        spec.num_speculative_tokens if spec else 0)
        logger.info("CUDA graphs: batches of %s requests x %s rows each captured in %.1f s",
                    graphs.sizes, graphs.query_lens, time.perf_counter() - start)
        return graphs

    def _device_kv_budget_gb(self) -> float:
        """GiB of device memory for KV. On CUDA as in vLLM: kv_cache_memory_gb (or
        --kv-cache-memory-bytes) when given; otherwise gpu_memory_utilization u (default 0.9) x the
        device's memory, less what is in use once the weights are loaded (by this process and any
        other), less ACTIVATION_RESERVE_GB for the forward passes. On a CPU u does not apply (as
        in vLLM-CPU; a log line says so when it is given) and the budget is kv_cache_memory_gb
        (VLLM_CPU_KVCACHE_SPACE sets it), DEFAULT_KV_CACHE_GB when not given."""
        util = self.config.gpu_memory_utilization
        given = self.config.kv_cache_memory_gb
        if not self.device.startswith("cuda"):
            budget = given if given is not None else DEFAULT_KV_CACHE_GB
            if util is not None:
                logger.info("gpu_memory_utilization %.2f does not apply on %s (as in vLLM-CPU): "
                            "the KV budget is kv_cache_memory_gb, %.2f GiB "
                            "(VLLM_CPU_KVCACHE_SPACE sets it)", util, self.device, budget)
            return budget
        if given is not None:
            if util is not None:
                logger.info("kv_cache_memory_gb %.2f GiB sizes the KV cache; "
                            "gpu_memory_utilization %.2f is not used (as in vLLM)", given, util)
            return given
        util = DEFAULT_GPU_MEMORY_UTILIZATION if util is None else util
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(torch.device(self.device))
        budget = utilization_kv_budget(util, free, total)
        logger.info("KV budget %.2f GiB = %.2f x %.1f GiB device memory - %.1f GiB in use - %g "
                    "GiB for activations", budget / 2**30, util, total / 2**30,
                    (total - free) / 2**30, ACTIVATION_RESERVE_GB)
        return budget / 2**30

    def _proposer(self, spec: SpeculativeConfig | None, in_host: bool) -> Proposer | None:
        if spec is None or spec.num_speculative_tokens == 0:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if spec.method == "token_recycling":
            return TokenRecyclingProposer(self.model_config.vocab_size, spec.recycling_top_k,
                                          self.device)
        if spec.method == "layer_skip":
            skip = spec.skip_layers
            if skip is None:
                skip = default_skip_layers(self.config.model, self.model,
                                           spec.num_speculative_tokens)
            logger.info("layer_skip drafter skips layers %s", list(skip))
            return LayerSkipProposer(self.runner.forward_rows, self.model_config.num_layers,
                                     tuple(skip))
        if spec.method == "lossy_kv":
            comp = build_compressor(spec.kv_compressor, self.model,
                                    dict(spec.kv_compressor_config))
            # with the full cache in the host pool the device budget holds only compressed caches
            capacity = int(self.device_kv_gb * 2**30) if in_host else None
            self.draft_pool = DraftPool(comp, self.storage, self.device, capacity)
            return LossyKVProposer(self.model, self.draft_pool, self.runner)
        raise ValueError(f"speculative method {spec.method!r} is not available")

    # -- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Release what the plan names, draft, verify."""
        start = time.perf_counter()
        if self.draft_pool is not None:
            self.draft_pool.release(plan.finished_ids + plan.preempted_ids)
        self.grammars.release(plan.finished_ids)     # kept across preemption: outputs are kept
        if self.proposer is not None and plan.finished_ids:
            self.proposer.release(plan.finished_ids)
            for request_id in plan.finished_ids:
                self.next_drafts.pop(request_id, None)
        for g in plan.grammars:
            self.grammars.start(g.request_id, g.grammar)
        if not plan.requests:
            return StepResult()
        drafts, passes, state_s, ahead = self._draft(plan.requests)   # draft phase
        drafts, masks, masked = self._constrain(plan.requests, drafts)
        if plan.frontier_size:                                        # verify phase
            on_decided = self.draft_ahead.submit if self.draft_ahead is not None else None
            verifier = FrontierVerifier(self.runner, self.sampler, self.proposer,
                                        frontier_size=plan.frontier_size, on_decided=on_decided)
        else:
            verifier = self.verifier
        result = verifier.verify(plan.requests, drafts, masks)
        for request_id, n in masked.items():        # cut drafts count as drafted and rejected
            sampled = result.sampled[request_id]
            sampled.num_drafted += n
            sampled.num_masked = n
        for r in plan.requests:
            if r.request_id in masks:
                self.grammars.advance(r.request_id, result.sampled[r.request_id].token_ids)
        result.draft_passes, result.num_drafted_ahead = passes, ahead
        result.draft_state_s = state_s
        result.swap_bytes = self._swap_delta()
        if self.proposes_ahead:
            result.draft_lens = self._propose_next(plan.requests, result.sampled)
        result.step_time_s = time.perf_counter() - start
        return result

    def _draft(self, reqs: tuple[ScheduledRequest, ...]
               ) -> tuple[list[list[int]], list[tuple[int, float]], float, int]:
        """Drafts per request (at most its num_draft_tokens), the drafter's passes, the seconds
        it spent building first-time requests' states, and how many requests took drafts made
        ahead by the overlap thread."""
        drafts: list[list[int]] = [[] for _ in reqs]
        wanted = [i for i, r in enumerate(reqs) if r.sample and r.num_draft_tokens > 0]
        if self.proposer is None or not wanted:
            return drafts, [], 0.0, 0
        rest, threaded = [], 0
        for i in wanted:
            made_for, draft, thread = self.next_drafts.get(reqs[i].request_id, (-1, [], False))
            if made_for == len(reqs[i].history):              # proposed ahead for this context
                drafts[i] = draft[:reqs[i].num_draft_tokens]
                threaded += thread
            else:
                rest.append(i)
        if not rest:
            return drafts, [], 0.0, threaded
        asks = [DraftRequest(reqs[i].request_id, reqs[i].history, reqs[i].num_computed_tokens,
                             reqs[i].block_ids) for i in rest]
        out = self.proposer.propose(asks, [reqs[i].num_draft_tokens for i in rest])
        for i, d in zip(rest, out.token_ids):
            drafts[i] = d[:reqs[i].num_draft_tokens]
        return drafts, out.passes, out.state_s, threaded

    def _propose_next(self, reqs: tuple[ScheduledRequest, ...],
                      sampled: dict[str, SampledTokens]) -> dict[str, int]:
        """A drafter of tokens alone: each request that sampled, its drafts for the next step
        (as many as the configured k), proposed from its tokens after this step (the overlap
        thread's where it made them during verification), kept for that step; their lengths go
        to the scheduler, which schedules no more (a request with no n-gram match reserves no
        draft slot, and FASER's controller prices only drafts that exist)."""
        made = self.draft_ahead.take() if self.draft_ahead is not None else {}
        asks, proposed = [], []
        for r in reqs:
            s = sampled.get(r.request_id)
            if s is None or not r.history:
                continue
            proposed.append(r.request_id)
            tokens = r.history + tuple(s.token_ids)
            early = made.get(r.request_id)
            if early is not None and early[0] == len(tokens):
                self.next_drafts[r.request_id] = (early[0], early[1], True)
            else:
                asks.append(DraftRequest(r.request_id, tokens, len(tokens) - 1, ()))
        if asks:
            k = self.config.speculative.num_speculative_tokens
            out = self.proposer.propose(asks, [k] * len(asks))
            for a, d in zip(asks, out.token_ids):
                self.next_drafts[a.request_id] = (len(a.token_ids), d, False)
        return {request_id: len(self.next_drafts[request_id][1]) for request_id in proposed}

    def _constrain(self, reqs: tuple[ScheduledRequest, ...], drafts: list[list[int]]
                   ) -> tuple[list[list[int]], dict, dict[str, int]]:
        """Constrained requests that sample this step: drafts cut where the grammar forbids, one
        mask per verify row, and how many drafts each lost (`spec_phases/grammar.py`)."""
        masks, masked = {}, {}
        for i, r in enumerate(reqs):
            if r.params.constraint is None or not r.sample:
                continue
            drafts[i], c = self.grammars.constrain(r.request_id, drafts[i])
            masks[r.request_id] = c.masks
            if c.num_masked:
                masked[r.request_id] = c.num_masked
        return drafts, masks, masked

    def _swap_delta(self) -> tuple[int, int]:
        """Full-cache bytes moved since the last call, with the full cache in a HostKVPool (else
        0, 0): host->device = the verify pass's staging (`HostKVPool.bytes_h2d`) plus the drafting
        pool's sync reads of newly verified tokens; device->host = write-back."""
        storage = self.storage
        if not isinstance(storage, HostKVPool):
            return 0, 0
        encoded = self.draft_pool.num_encoded_tokens if self.draft_pool is not None else 0
        h2d, d2h, seen_encoded = self._swap_seen
        self._swap_seen = (storage.bytes_h2d, storage.bytes_d2h, encoded)
        return (storage.bytes_h2d - h2d + (encoded - seen_encoded) * storage.bytes_per_token,
                storage.bytes_d2h - d2h)

    # -- what the engine asks at start-up and in integrity checks ----------------------------
    @property
    def proposes_ahead(self) -> bool:
        """The drafter proposes from tokens alone: at the end of the step that sampled them."""
        return self.proposer is not None and self.proposer.drafts_from_tokens_only

    def calibrate_drafter(self, steps: int = 2) -> DrafterTiming:
        """The drafter timed over synthetic contexts of CALIBRATION_CONTEXT tokens (or what
        max_model_len leaves) and a quarter of that: its passes, `steps` a round, and its state's
        encode a token (`Proposer.calibrate`)."""
        if self.proposer is None:
            return DrafterTiming([], 0.0)
        longest = max(min(CALIBRATION_CONTEXT, self.max_model_len - steps - 1), 4)
        return self.proposer.calibrate([longest // 4, longest], steps)

    def facts(self) -> WorkerFacts:
        """What this worker is, plain data: the engine's one message from it before the steps."""
        cfg, pool = self.model_config, self.draft_pool
        budget = pool.budget(self.max_model_len) if pool is not None else None
        return WorkerFacts(
            vocab_size=cfg.vocab_size, eos_token_ids=tuple(cfg.eos_token_ids),
            bos_token_id=cfg.bos_token_id, max_model_len=self.max_model_len,
            num_blocks=self.num_blocks, device=self.device,
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_bytes_per_token=cfg.kv_bytes_per_token(self.kv_dtype),
            device_kv_gb=self.device_kv_gb,
            draft_capacity_bytes=budget.capacity if budget is not None else None,
            draft_bytes_at=budget.bytes_at if budget is not None else (),
            draft_kv_bytes_per_token=(pool.usage().compressed_page_bytes_per_token
                                      if pool is not None else None),
            proposes_ahead=self.proposes_ahead)

    def check_integrity(self, live_ids: set[str], releasing: set[str],
                        reserved_bytes: int | None) -> None:
        """Per-request device state is held only for live requests (and those the next plan
        releases), within its reservation."""
        if self.draft_pool is not None:
            self.draft_pool.check_integrity(live_ids, releasing, reserved_bytes)
        stale = set(self.grammars.matchers) - live_ids - releasing
        if stale:
            raise AssertionError(f"grammar state held for requests no longer live: {stale}")
        held = set(self.next_drafts)
        if self.proposer is not None:
            held |= self.proposer.held_request_ids()
        stale = held - live_ids - releasing
        if stale:
            raise AssertionError(f"drafts held for requests no longer live: {sorted(stale)[:5]}")

