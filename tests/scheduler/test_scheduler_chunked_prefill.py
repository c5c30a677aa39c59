"""Chunked prefill beside decodes: decodes first, prompt chunks within a measured time credit
(Scheduler.prefill_allowance), driven with fabricated step times; and on the tiny model, chunking
by time never changes greedy output."""
import pytest

from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.manager import KVCacheManager
from specserve.scheduler.config import SchedulerConfig
from specserve.scheduler.messages import EngineRequest
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import PREFILL_CREDIT_STEPS, Scheduler
from specserve.spec_phases.plan import SampledTokens, StepResult
from specserve.spec_phases.sampling_params import SamplingParams

BS = 16
DECODE_S = 0.010                     # a fabricated decode step


def scheduler(slowdown=1.8, budget=2048, k=0, adaptive=False, caching=False):
    kv = KVCacheManager([BlockPool(1024, BS, caching, name="full")])
    return Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                         max_model_len=8192, eos_token_ids=(2,),
                                         num_speculative_tokens=k, adaptive=adaptive,
                                         max_decode_slowdown=slowdown))


def add(sched, rid, n, max_tokens=4000):
    sched.add(Request(EngineRequest(rid, [10 + j % 50 for j in range(n)],
                                    SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   ignore_eos=True))))


def step_seconds(plan, per_chunk=0.004, per_row=0.001, per_key=2e-7):
    """The fabricated worker's time: a decode step, and per prompt chunk a fixed cost, its rows
    and the keys they attend."""
    secs = DECODE_S if any(r.num_new_tokens == 1 for r in plan.requests) else 0.0
    for r in plan.requests:
        if r.num_new_tokens > 1:
            n, s = r.num_new_tokens, r.num_computed_tokens
            secs += per_chunk + per_row * n + per_key * (n * s + n * (n + 1) // 2)
    return secs


def run_step(sched, **cost):
    plan = sched.schedule()
    secs = step_seconds(plan, **cost)
    sched.commit(plan, StepResult(sampled={r.request_id: SampledTokens([41])
                                           for r in plan.requests if r.sample},
                                  step_time_s=secs))
    return plan, secs


def test_decodes_are_scheduled_before_prompt_chunks():
    """A prompt admitted before a decoding request (earlier in the running list) still leaves
    the decoding row its place: the chunk fills what is left of the token budget."""
    sched = scheduler(slowdown=None, budget=64)
    add(sched, "p", 200)
    plan, _ = run_step(sched)                               # p's first chunk: 64 rows
    add(sched, "d", 8)
    sched.running.append(sched.waiting.popleft())           # d decodes after p in the list
    sched.running[-1].status = sched.running[0].status
    sched.running[-1].num_computed_tokens = 7
    assert sched.kv.allocate("d", 8) is not None
    plan = sched.schedule()
    rows = {r.request_id: r.num_new_tokens for r in plan.requests}
    assert [r.request_id for r in plan.requests] == ["d", "p"]
    assert rows == {"d": 1, "p": 63}


def test_without_a_bound_a_prompt_takes_the_token_budget_beside_a_decode():
    """vLLM's policy: the decoding row first, the prompt's chunk the rest of the budget."""
    sched = scheduler(slowdown=None, budget=2048)
    add(sched, "d", 50)
    for _ in range(5):
        run_step(sched)
    add(sched, "p", 2800)
    plan, secs = run_step(sched)
    assert {r.request_id: r.num_new_tokens for r in plan.requests} == {"d": 1, "p": 2047}
    assert secs > 100 * DECODE_S


@pytest.mark.parametrize("per_chunk", [0.004, 0.03])
def test_prompt_chunks_keep_a_decoding_request_within_its_slowdown(per_chunk):
    """A decoding request while a 2.8K-token prompt is prefilled: its mean step stays within
    the bound (measured debits make up for mispriced chunks), chunks come in bursts of about
    PREFILL_CREDIT_STEPS decode steps' earnings, and the prompt finishes. A chunk's fixed cost
    (here up to 3 decode steps) does not hold chunks at a row or two: they grow while they fit
    their credit."""
    for slowdown in (1.5, 1.8, 2.0):
        sched = scheduler(slowdown=slowdown)
        add(sched, "d", 50)
        for _ in range(40):                                 # decode-only steps: measured
            run_step(sched, per_chunk=per_chunk)
        add(sched, "p", 2800)
        times, chunks, steps = [], [], 0
        while sched.requests["p"].num_output_tokens == 0:
            plan, secs = run_step(sched, per_chunk=per_chunk)
            times.append(secs)
            chunks += [r.num_new_tokens for r in plan.requests if r.num_new_tokens > 1]
            steps += 1
            assert steps < 20000
        mean = sum(times) / len(times)
        assert mean <= slowdown * DECODE_S * 1.05, (slowdown, mean / DECODE_S)
        assert mean >= (1 + (slowdown - 1) * 0.5) * DECODE_S   # the credit is used
        assert sum(chunks) == 2800 and max(times) <= (
            1 + 2 * PREFILL_CREDIT_STEPS * (slowdown - 1)) * DECODE_S
        assert len(times) > len(chunks) * PREFILL_CREDIT_STEPS / 2  # bursts, not every step
        assert sorted(chunks)[len(chunks) // 2] >= 8


def test_a_chunk_that_overruns_its_credit_delays_the_next_and_the_chunks_shrink():
    """The debit is the measured time: when prompt rows turn twice as dear, the first chunk
    sized at the old price overruns, the credit goes negative and the next chunk waits until it
    is earned back; the chunks after it are sized at the measured new price (fewer rows, the
    usual interval)."""
    sched = scheduler(slowdown=1.5)
    add(sched, "d", 50)
    for _ in range(40):
        run_step(sched)
    add(sched, "p", 2800)
    chunks, since = [], 0
    for i in range(400):
        slow = 2.0 if i >= 200 else 1.0                 # the chunks' true cost doubles
        plan, _ = run_step(sched, per_chunk=0.004 * slow, per_row=0.001 * slow)
        since += 1
        rows = sum(r.num_new_tokens for r in plan.requests if r.num_new_tokens > 1)
        if rows:
            chunks.append((i, since, rows))
            since = 0
    before = [(g, n) for i, g, n in chunks if 40 < i < 200]
    overrun = next(j for j, (i, _, _) in enumerate(chunks) if i >= 200)
    after = [(g, n) for _, g, n in chunks[overrun + 2:]]
    assert before and len(after) >= 3
    assert chunks[overrun + 1][1] > max(g for g, _ in before) + 2            # the debt
    assert max(n for _, n in after) < min(n for _, n in before)              # repriced
    assert max(g for g, _ in after) <= PREFILL_CREDIT_STEPS + 1


@pytest.mark.parametrize("per_chunk", [0.004, 0.1])
def test_prompts_side_by_side_share_the_credit_and_each_finishes(per_chunk):
    """Several prompts beside a decode: one partial prefill a step (vLLM's
    max_num_partial_prefills = 1; a later chunk only where it finishes its prompt), of at least
    one row even where a chunk costs more than the whole credit, and every prompt's chunks add
    up to it."""
    sched = scheduler(slowdown=1.5)
    add(sched, "d", 50)
    for _ in range(40):
        run_step(sched, per_chunk=per_chunk)
    for i, n in enumerate((700, 300, 500)):
        add(sched, f"p{i}", n, max_tokens=2)
    rows = {f"p{i}": 0 for i in range(3)}
    for _ in range(20000):
        plan, _ = run_step(sched, per_chunk=per_chunk)
        assert sum(r.num_computed_tokens + r.num_new_tokens < r.num_prompt_tokens
                   for r in plan.requests) <= 1
        for r in plan.requests:
            assert r.num_new_tokens >= 1
            if r.request_id in rows and r.num_computed_tokens < r.num_prompt_tokens:
                rows[r.request_id] += r.num_new_tokens
        if not any(p in sched.requests for p in rows):
            break
    assert rows == {"p0": 700, "p1": 300, "p2": 500}


def test_a_step_with_nothing_to_decode_takes_the_token_budget():
    sched = scheduler(slowdown=1.5, budget=512)
    add(sched, "p", 2800)
    plan, _ = run_step(sched)
    assert plan.requests[0].num_new_tokens == 512


def test_the_controller_is_told_each_drafting_requests_context_and_passes_their_keys():
    """FASER prices a draft by the context its drafter reads: the scheduler tells the controller
    each drafting request's computed tokens, and gives each measured draft pass the keys of its
    rows (the longest drafts first, each row one key further per pass)."""
    sched = scheduler(slowdown=None, k=3, adaptive=True)
    add(sched, "a", 40)
    add(sched, "b", 90)
    run_step(sched)
    seen = []
    choose = sched.controller.choose
    sched.controller.choose = lambda ids, caps, rows, **kw: (
        seen.append((ids, kw["row_keys"], kw["contexts"])) or [3, 1])
    plan = sched.schedule()
    sched.controller.choose = choose
    assert seen == [(["a", "b"], 40 + 90, [40, 90])]
    assert [r.num_draft_tokens for r in plan.requests] == [3, 1]
    res = StepResult(sampled={"a": SampledTokens([41, 42], 3), "b": SampledTokens([43], 1)},
                     step_time_s=0.05, draft_passes=[(2, 0.01), (1, 0.008), (1, 0.008)])
    sched.commit(plan, res)
    assert [(p.rows, p.keys) for p in sched.cost.passes] == [(2, 40 + 90), (1, 41), (1, 42)]


def run(core, prompts, max_tokens):
    out = {f"r{i}": [] for i in range(len(prompts))}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    core.add_request(EngineRequest("r0", prompts[0], params))
    chunks, steps = [], 0
    while core.has_unfinished():
        step = core.step()
        steps += 1
        for o in step.outputs:
            out[o.request_id].extend(o.new_token_ids)
        if steps == 3:                           # long prompts arrive beside r0's decodes
            for i, ids in enumerate(prompts[1:], 1):
                core.add_request(EngineRequest(f"r{i}", ids, params))
        chunks += [n for n in [step.stats.num_prompt_tokens] if step.stats and n]
    return [out[f"r{i}"] for i in range(len(prompts))], chunks


def test_chunking_by_time_does_not_change_greedy_output(make_engine):
    """Prompts chunked by the time credit (many sizes, bursts beside decodes) and by the token
    budget alone give the same greedy tokens: a row's result never depends on its chunking."""
    prompts = [[(7 * i + 3 * j) % 30000 + 3 for j in range(9 + 120 * i)] for i in range(4)]
    by_budget = make_engine(max_decode_slowdown=None)
    expected, budget_chunks = run(by_budget, prompts, 40)
    by_time = make_engine()
    got, time_chunks = run(by_time, prompts, 40)
    assert got == expected
    assert len(time_chunks) > len(budget_chunks)           # the prompts were cut differently


def started_prompts(sched, ids, steps):
    """The step (from 0) at which each of `ids` first ran a prompt chunk."""
    first = {}
    for i in range(steps):
        plan, _ = run_step(sched)
        for r in plan.requests:
            if r.request_id in ids and r.num_new_tokens >= 1:
                first.setdefault(r.request_id, i)
        if len(first) == len(ids):
            break
    return first


def test_short_prompts_beside_a_decode_start_in_one_step():
    """Prompts whose whole remainder fits the step's credit all run in it (each finishes: no
    second partial prefill); before, one prompt a step made the last of 6 wait 6 steps."""
    sched = scheduler(slowdown=1.5)
    add(sched, "d", 50)
    for _ in range(40):
        run_step(sched)
    add(sched, "warm", 300, max_tokens=2)               # measures a chunk's row price
    while "warm" in sched.requests:
        run_step(sched)
    for _ in range(PREFILL_CREDIT_STEPS + 1):          # the credit full again
        run_step(sched)
    ids = [f"s{i}" for i in range(6)]
    for rid in ids:
        add(sched, rid, 3, max_tokens=2)
    plan = sched.schedule()
    rows = {r.request_id: r.num_new_tokens for r in plan.requests}
    assert all(rows.get(rid) == 3 for rid in ids), rows
    assert rows["d"] == 1


def test_the_credit_is_spent_early_where_it_covers_every_pending_prompt():
    """Right after a long prompt drained the credit, a few short prompts start once the credit
    covers them all, a few steps later, not after PREFILL_CREDIT_STEPS steps of saving; a long
    prompt still waits for the full credit."""
    sched = scheduler(slowdown=1.5)
    add(sched, "d", 50)
    for _ in range(40):
        run_step(sched)
    add(sched, "long", 2800, max_tokens=2)
    while "long" in sched.requests:
        run_step(sched)
    ids = ["a", "b", "c"]
    for rid in ids:
        add(sched, rid, 4, max_tokens=2)
    first = started_prompts(sched, ids, 100)
    assert set(first) == set(ids) and max(first.values()) < PREFILL_CREDIT_STEPS // 2, first
    add(sched, "long2", 2800, max_tokens=2)
    assert started_prompts(sched, ["long2"], 100)["long2"] >= PREFILL_CREDIT_STEPS // 2


def test_a_prompt_found_in_the_prefix_cache_is_priced_by_its_remainder():
    """A waiting prompt whose blocks are cached counts only what is left to compute: it starts
    early as a short prompt does, and the kv manager's estimate takes no block."""
    sched = scheduler(slowdown=1.5, caching=True)
    add(sched, "d", 50)
    for _ in range(40):
        run_step(sched)
    prompt = [300 + j for j in range(200)]
    sched.add(Request(EngineRequest("first", prompt, SamplingParams(max_tokens=2,
                                                                     temperature=0))))
    while "first" in sched.requests:
        run_step(sched)
    free = sched.kv.primary.num_free_blocks
    assert sched.kv.cached_prefix_tokens(prompt) == 192
    assert sched.kv.primary.num_free_blocks == free and not sched.kv.block_ids("again")
    sched.add(Request(EngineRequest("again", prompt, SamplingParams(max_tokens=1,
                                                                     temperature=0))))
    first = started_prompts(sched, ["again"], 100)
    assert first["again"] < PREFILL_CREDIT_STEPS // 2

