"""The worker in another process, reached through the step contract alone: a spawned process
builds a `Worker`, sends its facts once (plain data), then answers each pickled `StepPlan` with
its `StepResult`. The scheduler and KV manager here plan and commit; nothing else crosses. The
text equals an in-process `EngineCore`'s on the same requests (greedy, seeded sampling, n-gram
drafts, a constrained request)."""
import multiprocessing

from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.manager import KVCacheManager
from specserve.scheduler.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import Scheduler
from specserve.spec_phases.sampling_params import Constraint, SamplingParams

CONFIG = EngineConfig(model="tiny-random", kv_cache_memory_gb=0.05, max_model_len=256,
                      num_threads=1, speculative=SpeculativeConfig(
                          method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                          prompt_lookup_max=3))
REQUESTS = [
    EngineRequest("greedy", [11, 12, 13, 14, 15] * 4,
                  SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
    EngineRequest("seeded", [7, 8, 9, 10] * 3,
                  SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)),
    EngineRequest("choice", [5, 6, 7],
                  SamplingParams(max_tokens=8, temperature=0,
                                 constraint=Constraint("choice", choices=("yes", "no")))),
]


def worker_main(conn) -> None:
    """The worker's side: its facts once, then a result for every plan until None."""
    from specserve.spec_phases.worker import Worker
    worker = Worker(CONFIG.worker_config())
    cfg = worker.model_config
    conn.send({"num_blocks": worker.num_blocks, "eos_token_ids": tuple(cfg.eos_token_ids),
               "max_position": cfg.max_position})
    while (plan := conn.recv()) is not None:
        conn.send(worker.execute(plan))


def run_remote() -> dict[str, list[int]]:
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=worker_main, args=(child,), daemon=True)
    process.start()
    try:
        facts = conn.recv()
        kv = KVCacheManager([BlockPool(facts["num_blocks"], CONFIG.block_size,
                                       CONFIG.enable_prefix_caching, name="full")])
        sched = Scheduler(kv, SchedulerConfig(
            max_num_seqs=CONFIG.max_num_seqs,
            max_num_batched_tokens=CONFIG.max_num_batched_tokens,
            max_model_len=min(CONFIG.max_model_len, facts["max_position"]),
            eos_token_ids=facts["eos_token_ids"], num_speculative_tokens=3))
        for req in REQUESTS:
            sched.add(Request(req))
        out: dict[str, list[int]] = {r.request_id: [] for r in REQUESTS}
        while sched.has_work():
            plan = sched.schedule()
            if plan.is_empty():
                continue
            conn.send(plan)
            outputs, _ = sched.commit(plan, conn.recv())
            for o in outputs:
                out[o.request_id].extend(o.new_token_ids)
        conn.send(None)
        kv.check_integrity()
        return out
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def test_a_worker_in_another_process_serves_through_plans_and_results(engines):
    remote = run_remote()
    core = engines.core(CONFIG)
    for req in REQUESTS:
        core.add_request(req)
    local: dict[str, list[int]] = {r.request_id: [] for r in REQUESTS}
    for o in core.run_until_idle():
        local[o.request_id].extend(o.new_token_ids)
    assert remote == local
    assert len(remote["greedy"]) == 20 and len(remote["seeded"]) == 20
    assert remote["choice"]
