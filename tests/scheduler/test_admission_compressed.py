"""VeriCache scheduling: with the full cache in the host pool, requests are admitted and preempted
by the compressed (device) bytes of their drafting caches, so more sequences run at once than the
same device budget would hold as full KV; preemption and aborts keep the output identical and every
reservation balanced (`check_integrity` after every step)."""
from dataclasses import replace

import pytest
from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.draft_pool import DraftBudget
from specserve.kv_cache.manager import KVCacheManager
from specserve.scheduler.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import Scheduler
from specserve.spec_phases.sampling_params import SamplingParams

SPEC = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=4, kv_compressor="quant",
                         kv_compressor_config={"num_sink": 4, "window": 8, "page_size": 8,
                                               "key_bits": 4,
                                               "value_bits": 2},
                         full_kv_in_host=True)
PROMPT_LEN, MAX_TOKENS = 60, 12
# ~20K tokens of the tiny model: never the limit here
HOST_GB = 0.01
GB = 2**30


def prompts(n):
    return [[(7 * j * (i + 1) + 3 * i) % 900 + 3 for j in range(PROMPT_LEN)] for i in range(n)]


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run(core, n, max_tokens=MAX_TOKENS, abort=None, on_step=None):
    """Generate for n prompts; check integrity after every step. abort: (step, ids) aborted then."""
    for i, ids in enumerate(prompts(n)):
        core.add_request(EngineRequest(f"r{i}", ids, greedy(max_tokens)))
    outs = {f"r{i}": [] for i in range(n)}
    steps = max_running = preemptions = 0
    while core.has_work():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        steps += 1
        stats = step.stats
        max_running = max(max_running, stats.num_running)
        preemptions += stats.num_preemptions
        core.check_integrity()
        if on_step is not None:
            on_step(core, stats)
        if abort is not None and steps == abort[0]:
            for rid in abort[1]:
                core.abort_request(rid)
                core.check_integrity()
    return outs, max_running, preemptions


def peak(core, num_tokens):
    """The most compressed bytes one request's cache takes at any length up to num_tokens."""
    return max(core.worker.draft_pool.bytes_at(n) for n in range(num_tokens + 1))


def full_bytes(core, num_tokens):
    """What num_tokens of full KV take in whole blocks of the full pool."""
    bs = core.config.block_size
    return -(-num_tokens // bs) * bs * core.worker.storage.bytes_per_token


@pytest.fixture
def make_engine(make_engine):
    """The conftest's engines with a float32 full cache (`--dtype float32`): the byte figures
    below compare the compressed caches with float32 full KV."""
    return lambda **kwargs: make_engine(**{"dtype": "float32", **kwargs})


@pytest.fixture
def probe(make_engine):
    """A VeriCache engine only used to read the model's byte figures (full and compressed)."""
    return make_engine(speculative=SPEC, num_threads=1, host_kv_cache_memory_gb=HOST_GB)


def test_more_sequences_run_than_full_kv_would_allow(make_engine, probe):
    final = PROMPT_LEN + MAX_TOKENS
    # the device holds 2 sequences of full KV
    budget = 2 * full_bytes(probe, final)
    assert 8 * peak(probe, final) < budget                      # ...but 8 compressed ones
    plain, plain_running, _ = run(make_engine(kv_cache_memory_gb=budget / GB, num_threads=1), 8)
    assert plain_running == 2

    core = make_engine(speculative=SPEC, num_threads=1, kv_cache_memory_gb=budget / GB,
                       host_kv_cache_memory_gb=HOST_GB)
    assert core.kv.draft_budget.capacity == int(budget / GB * GB)
    assert (core.worker.num_blocks * core.config.block_size * core.worker.storage.bytes_per_token
            > 5 * budget)
    peak_full = []
    out, running, preemptions = run(core, 8, on_step=lambda c, s: peak_full.append(
        sum(full_bytes(c, r.num_computed_tokens) for r in c.scheduler.running)))
    assert out == plain
    assert running == 8 and preemptions == 0
    # full KV of the running set: far over budget
    assert max(peak_full) > 3 * budget


def test_preemption_when_compressed_bytes_run_out_is_lossless(make_engine, probe):
    w = probe.worker
    # three prompts fit on admission; grown by a decode step and its drafts, three do not
    capacity = 3 * w.draft_pool.bytes_at(PROMPT_LEN) + 16
    assert 3 * w.draft_pool.bytes_at(PROMPT_LEN + 1 + SPEC.num_speculative_tokens) > capacity
    plain, _, _ = run(make_engine(num_threads=1), 5)
    core = make_engine(speculative=SPEC, num_threads=1, kv_cache_memory_gb=capacity / GB,
                       host_kv_cache_memory_gb=HOST_GB, max_decode_slowdown=None)
    reserved = []
    out, running, preemptions = run(core, 5, on_step=lambda c,
                                    s: reserved.append(c.kv.draft_budget.reserved_total))
    assert out == plain
    assert preemptions > 0 and running == 3
    assert max(reserved) <= core.kv.draft_budget.capacity
    assert core.kv.usage() < 0.5                                 # blocks were never the limit
    assert core.kv.draft_budget.reserved == {} and core.kv.draft_budget.reserved_total == 0
    assert core.worker.draft_pool.usage().compressed_bytes == 0


def test_abort_mid_round_releases_reservations(make_engine, probe):
    capacity = 3 * probe.worker.draft_pool.bytes_at(PROMPT_LEN) + 16
    plain, _, _ = run(make_engine(num_threads=1), 5, max_tokens=20)
    core = make_engine(speculative=SPEC, num_threads=1, kv_cache_memory_gb=capacity / GB,
                       host_kv_cache_memory_gb=HOST_GB)
    seen = {}

    def watch(c, s):
        if s.num_draft_tokens and "held" not in seen:
            seen["held"] = set(c.kv.draft_budget.reserved)
    out, _, _ = run(core, 5, max_tokens=20, abort=(4, ["r0", "r2"]), on_step=watch)
    assert seen["held"] & {"r0", "r2"}                          # aborted while holding reservations
    for rid in ("r1", "r3", "r4"):
        assert out[rid] == plain[rid]
    assert all(len(out[rid]) < 20 for rid in ("r0", "r2"))
    assert core.kv.draft_budget.reserved == {} and core.worker.draft_pool.states == {}


def test_preempted_requests_drop_their_drafting_caches(make_engine, probe):
    """Two requests draft side by side until their growing caches no longer fit: the newest is
    preempted while it holds a drafting cache, which is dropped at once (not rebuilt later)."""
    long = 40
    capacity = 2 * peak(probe, PROMPT_LEN + MAX_TOKENS) + 16
    assert 2 * peak(probe, PROMPT_LEN + long) > capacity
    plain, _, _ = run(make_engine(num_threads=1), 2, max_tokens=long)
    core = make_engine(speculative=SPEC, num_threads=1, kv_cache_memory_gb=capacity / GB,
                       host_kv_cache_memory_gb=HOST_GB, max_decode_slowdown=None)
    worker, dropped, held_while_waiting = core.worker, [], []
    execute = worker.execute

    def spy(plan):                                           # the plan names the preempted
        dropped.append(set(plan.preempted_ids) & worker.draft_pool.held_request_ids())
        return execute(plan)
    worker.execute = spy

    def watch(c, s):
        waiting = {r.request_id for r in c.scheduler.waiting}
        held_while_waiting.append(waiting & worker.draft_pool.held_request_ids())
    out, running, preemptions = run(core, 2, max_tokens=long, on_step=watch)
    assert out == plain and running == 2 and preemptions > 0
    assert any(dropped)                                          # a preempted request held a cache
    assert not any(held_while_waiting) and worker.draft_pool.num_rebuilds == 0


# -- the scheduler alone: a fake byte model, no model at all -------------------------------------
def scheduler(capacity, num_blocks=1000, per_token=10):
    budget = DraftBudget(capacity, [per_token * n for n in range(4097)])
    kv = KVCacheManager([BlockPool(num_blocks, 16, False, name="full")], draft_budget=budget)
    return Scheduler(kv, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096,
                                         max_model_len=4096, eos_token_ids=(2,)))


def add(sched, rid, n):
    sched.add(Request(EngineRequest(rid, list(range(3, 3 + n)), greedy())))


def test_admission_stops_where_the_compressed_bytes_run_out():
    sched = scheduler(capacity=2500)
    for i in range(4):
        add(sched, f"s{i}", 100)                               # 1000 bytes each at admission
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["s0", "s1"]
    assert (sched.kv.draft_budget.reserved == {"s0": 1000, "s1": 1000}
            and sched.kv.draft_budget.reserved_total == 2000)
    assert [r.request_id for r in sched.waiting] == ["s2", "s3"]
    assert sched.kv.block_ids("s2") == []                      # refused before any block was taken
    sched.kv.check_integrity()
    sched.abort("s0")
    assert (sched.kv.draft_budget.reserved == {"s1": 1000}
            and sched.kv.draft_budget.reserved_total == 1000)
    sched.kv.check_integrity()
    sched.kv.draft_budget.reserved_total += 1                                 # a leak is caught
    with pytest.raises(AssertionError, match="reserved total"):
        sched.kv.check_integrity()


def test_growth_past_the_capacity_preempts_the_newest():
    sched = scheduler(capacity=3005)
    for rid in "abc":
        add(sched, rid, 100)
    sched.schedule()
    assert sched.kv.draft_budget.reserved_total == 3000
    # as if the prompts were computed and sampled
    for rid in "abc":
        req = sched.requests[rid]
        req.num_computed_tokens = 100
        req.append(7)
    # a needs 1010: c (newest) is preempted
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["a", "b"]
    assert plan.preempted_ids == ("c",)
    assert (sched.kv.draft_budget.reserved == {"a": 1010, "b": 1010}
            and sched.requests["c"].num_computed_tokens == 0)
    assert sched.kv.block_ids("c") == [] and [r.request_id for r in sched.waiting] == ["c"]
    sched.kv.check_integrity()


def test_reservation_covers_the_cache_held_when_bytes_shrink():
    """A page forming can make the predicted bytes fall: the reservation never drops below them."""
    sizes = [0] * 50 + [900, 400]
    kv = KVCacheManager([BlockPool(100, 16, False, name="full")],
                        draft_budget=DraftBudget(1000, sizes))
    sched = Scheduler(kv, SchedulerConfig(8, 4096, 4096, (2,)))
    add(sched, "a", 50)
    sched.schedule()
    req = sched.requests["a"]
    req.num_computed_tokens = 50
    req.append(7)
    sched.schedule()
    assert sched.kv.draft_budget.reserved["a"] == 900


def test_max_draft_len_uses_the_peak_up_to_each_length():
    sizes = [0, 5, 10, 15, 8, 9, 30]
    assert DraftBudget(15, sizes).max_tokens_alone() == 5       # 5 fit even though 4 < 3's peak
    assert DraftBudget(100, sizes).max_tokens_alone() == 6
    assert DraftBudget(4, sizes).max_tokens_alone() == 0


# -- configuration ---------------------------------------------------------------------------
def test_the_host_budget_sizes_the_full_pool_and_the_device_budget_the_compressed_caches(
    make_engine):
    core = make_engine(speculative=SPEC, num_threads=1, kv_cache_memory_gb=0.001,
                       host_kv_cache_memory_gb=0.004)
    bpt, bs = core.worker.storage.bytes_per_token, core.config.block_size
    assert core.worker.num_blocks == int(0.004 * GB) // (bpt * bs)
    assert core.kv.draft_budget.capacity == int(0.001 * GB)
    # without the flag the host pool is sized from kv_cache_memory_gb, as before
    same = make_engine(speculative=SPEC, num_threads=1, kv_cache_memory_gb=0.004)
    assert same.worker.num_blocks == core.worker.num_blocks
    # not lossy_kv with the host pool: no compressed-byte admission
    plain = make_engine(num_threads=1)
    assert plain.kv.draft_budget is None
    resident = make_engine(speculative=replace(SPEC, full_kv_in_host=False), num_threads=1)
    assert resident.kv.draft_budget is None


@pytest.mark.parametrize("kwargs", [
    {"host_kv_cache_memory_gb": 1.0},
    {"host_kv_cache_memory_gb": 1.0,
     "speculative": SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=4)},
    {"host_kv_cache_memory_gb": 1.0, "speculative": replace(SPEC, full_kv_in_host=False)},
    {"host_kv_cache_memory_gb": 1.0, "speculative": replace(SPEC, full_kv_in_host=None)},
    {"host_kv_cache_memory_gb": 0.0, "speculative": SPEC},
])
def test_a_host_budget_without_the_host_pool_is_refused(kwargs):
    with pytest.raises(ValueError, match="host_kv_cache_memory_gb"):
        EngineConfig(model="tiny-random", **kwargs)


def test_the_full_cache_stays_on_the_device_unless_asked(make_engine):
    """The host pool is opt-in on every device (unset: the resident cache)."""
    from specserve.kv_cache.host_pool import HostKVPool
    core = make_engine(speculative=replace(SPEC, full_kv_in_host=None), num_threads=1)
    assert not isinstance(core.worker.storage, HostKVPool)


def test_the_cli_flag_maps_onto_the_config():
    from specserve.server.cli import build_parser, engine_config
    args = build_parser().parse_args([
        "serve", "tiny-random", "--speculative-config",
        '{"method": "lossy_kv", "full_kv_in_host": true}', "--host-kv-cache-memory-gb", "8",
        "--kv-cache-memory-gb", "0.5"])
    config = engine_config(args)
    assert config.host_kv_cache_memory_gb == 8.0 and config.kv_cache_memory_gb == 0.5
    args = build_parser().parse_args(["serve", "tiny-random", "--host-kv-cache-memory-gb", "8"])
    with pytest.raises(SystemExit, match="host_kv_cache_memory_gb"):
        engine_config(args)
    assert engine_config(build_parser().parse_args(["serve"])).host_kv_cache_memory_gb is None


# -- swap traffic ----------------------------------------------------------------------------
def test_swap_bytes_per_step_add_up_to_the_pool_counters_and_reach_the_metric(make_engine):
    from types import SimpleNamespace

    from specserve.server.metrics import ServerMetrics
    from specserve.server.settings import ServerSettings

    core = make_engine(speculative=SPEC, num_threads=1, host_kv_cache_memory_gb=HOST_GB)
    engine = SimpleNamespace(model_info=core.model_info, engine_info=core.engine_info, on_step=None)
    metrics = ServerMetrics(engine, ServerSettings(served_model_names=("tiny",)))
    steps = []
    run(core, 3, on_step=lambda c, s: (steps.append(s), metrics.steps.record(s)))
    pool, prop = core.worker.storage, core.worker.draft_pool
    h2d, d2h = sum(s.swap_bytes_h2d for s in steps), sum(s.swap_bytes_d2h for s in steps)
    # write-back of every computed token
    assert d2h == pool.bytes_d2h > 0
    assert (h2d == pool.bytes_h2d + prop.num_encoded_tokens * pool.bytes_per_token > pool.bytes_h2d
            > 0)
    assert all(s.swap_bytes_h2d > 0 for s in steps if s.num_generation_tokens)
    found = {(m.name, s.name): s.value for m in metrics.registry.collect() for s in m.samples}
    assert found[("specserve:full_kv_swap_bytes", "specserve:full_kv_swap_bytes_total")] == h2d

    resident = make_engine(speculative=replace(SPEC, full_kv_in_host=False), num_threads=1)
    steps.clear()
    run(resident, 2, on_step=lambda c, s: steps.append(s))
    assert steps and all(s.swap_bytes_h2d == s.swap_bytes_d2h == 0 for s in steps)
