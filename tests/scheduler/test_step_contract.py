"""The step contract alone: schedule() -> StepPlan, commit(plan, result) -> (outputs, stats), driven
with fabricated results (no model), and the plan and result as serialisable snapshots."""
import pickle

from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.manager import KVCacheManager
from specserve.scheduler.config import SchedulerConfig
from specserve.scheduler.messages import EngineRequest
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import Scheduler
from specserve.spec_phases.plan import SampledTokens, StepResult, TokenLogprob
from specserve.spec_phases.sampling_params import SamplingParams

BS = 4


def scheduler(num_blocks=64, k=0, max_num_seqs=8, budget=4096, caching=False):
    kv = KVCacheManager([BlockPool(num_blocks, BS, caching, name="full")])
    return Scheduler(kv, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                         max_model_len=256, eos_token_ids=(2,),
                                         num_speculative_tokens=k))


def add(sched, rid, n, **params):
    params.setdefault("max_tokens", 32)
    params.setdefault("temperature", 0)
    sched.add(Request(EngineRequest(rid, [10 + j for j in range(n)], SamplingParams(**params))))


def result(plan, tokens: dict[str, list[int]], drafted: dict[str, int] | None = None):
    """The worker's answer, fabricated: `tokens[rid]` accepted drafts + one token per request."""
    drafted = drafted or {}
    sampled = {r.request_id: SampledTokens(tokens[r.request_id], drafted.get(r.request_id, 0))
               for r in plan.requests if r.sample}
    return StepResult(sampled=sampled)


def prefill(sched, rid_tokens: dict[str, int]):
    plan = sched.schedule()
    outputs, _ = sched.commit(plan, result(plan, rid_tokens and
                                           {rid: [t] for rid, t in rid_tokens.items()}))
    return outputs


def test_plan_and_result_round_trip_through_pickle():
    sched = scheduler(k=3)
    add(sched, "a", 6, temperature=0.7, seed=5, logit_bias={3: 1.5}, stop_token_ids=[9],
        repetition_penalty=1.2)
    prefill(sched, {"a": 40})
    plan = sched.schedule()
    assert plan.requests[0].num_draft_tokens == 3 and plan.requests[0].history[-1] == 40
    assert isinstance(plan.requests, tuple) and isinstance(plan.requests[0].block_ids, tuple)
    copy = pickle.loads(pickle.dumps(plan))
    assert copy == plan and copy.requests[0].params == plan.requests[0].params
    lp = TokenLogprob(41, -0.5, 1, [41], [-0.5])
    res = StepResult(sampled={"a": SampledTokens([41, 42], 3, 1, [lp, lp])},
                     draft_passes=[(1, 0.01)], swap_bytes=(10, 20), num_frontiers=2)
    assert pickle.loads(pickle.dumps(res)) == res
    outputs, stats = sched.commit(copy, pickle.loads(pickle.dumps(res)))
    assert outputs[0].new_token_ids == [41, 42]
    assert (stats.swap_bytes_h2d == 10 and stats.num_frontiers == 2
            and stats.num_accepted_tokens == 1)


def test_plain_decoding_plans_carry_no_history():
    sched = scheduler()
    add(sched, "a", 5)
    prefill(sched, {"a": 7})
    plan = sched.schedule()
    assert plan.requests[0].token_ids == (7,) and plan.requests[0].history == ()
    assert plan.requests[0].num_output_tokens == 1 and plan.requests[0].next_position == 6


def test_rejected_drafts_roll_back_across_a_block_boundary():
    sched = scheduler(k=4)
    add(sched, "a", 6)                                      # 6 prompt tokens: blocks 0-1
    prefill(sched, {"a": 50})                               # 7 tokens, the 7th not computed yet
    plan = sched.schedule()
    r = plan.requests[0]
    assert r.num_computed_tokens == 6 and r.num_draft_tokens == 4
    assert len(r.block_ids) == 3                            # slots for 7 + 4 = 11 tokens
    outputs, stats = sched.commit(plan, result(plan, {"a": [51]}, {"a": 4}))  # all rejected
    assert outputs[0].new_token_ids == [51]
    req = sched.requests["a"]
    assert req.num_computed_tokens == 7 and req.num_tokens == 8
    assert len(sched.kv.block_ids("a")) == 2                # the third block went back
    assert stats.num_draft_tokens == 4 and stats.num_accepted_tokens == 0
    sched.kv.check_integrity()


def test_preemption_takes_the_newest_running_request_and_names_it_in_the_plan():
    sched = scheduler(num_blocks=6)
    for rid in "abc":
        add(sched, rid, 8)                                  # two blocks each: all six
    prefill(sched, {"a": 1, "b": 1, "c": 1})                # each now needs a third block
    plan = sched.schedule()                                 # c's two blocks go to a and b
    assert [r.request_id for r in plan.requests] == ["a", "b"] and plan.preempted_ids == ("c",)
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.requests["c"].num_computed_tokens == 0 and sched.kv.block_ids("c") == []
    outputs, stats = sched.commit(plan, result(plan, {"a": [3], "b": [4]}))
    assert stats.num_preemptions == 1 and [o.new_token_ids for o in outputs] == [[3], [4]]
    assert sched.schedule().preempted_ids == ()             # named once


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    sched = scheduler(k=4)
    add(sched, "a", 5, stop_token_ids=[77])
    prefill(sched, {"a": 60})
    plan = sched.schedule()
    outputs, stats = sched.commit(plan, result(plan, {"a": [61, 77, 62, 63, 64]}, {"a": 4}))
    out = outputs[0]
    assert out.new_token_ids == [61, 77] and out.finished and out.finish_reason == "stop"
    assert out.stop_reason == 77 and "a" not in sched.requests
    assert stats.finished == [("a", "stop")]
    follow = sched.schedule()                               # the worker is told to release it
    assert follow.finished_ids == ("a",) and not follow.requests
    sched.kv.check_integrity()


def test_a_stop_among_accepted_drafts_indexes_only_the_kept_tokens():
    """With the prefix cache on, a request stopped at an accepted draft indexes the full blocks of
    the tokens it kept and none past them: the accepted drafts after the stop reach no cached
    block, and every cached block holds a whole block of tokens."""
    sched = scheduler(k=4, caching=True)
    add(sched, "a", 7, stop_token_ids=[77])
    prefill(sched, {"a": 60})
    plan = sched.schedule()
    assert plan.requests[0].num_draft_tokens == 4
    outputs, _ = sched.commit(plan, result(plan, {"a": [61, 77, 62, 63, 64]}, {"a": 4}))
    assert outputs[0].new_token_ids == [61, 77] and outputs[0].finish_reason == "stop"
    kept = [10 + j for j in range(7)] + [60, 61, 77]        # 10 tokens, 12 computed
    pool = sched.kv.primary
    assert sched.kv.cached_prefix_tokens(kept + [5]) == 8
    assert pool.cached and all(len(pool.block_tokens[b]) == BS for b in pool.cached.values())
    sched.kv.check_integrity()


def test_max_tokens_reached_mid_draft_finishes_with_length():
    sched = scheduler(k=4)
    add(sched, "a", 5, max_tokens=3)
    prefill(sched, {"a": 60})
    plan = sched.schedule()
    assert plan.requests[0].num_draft_tokens == 1           # capped by what max_tokens leaves
    outputs, _ = sched.commit(plan, result(plan, {"a": [61, 62, 63, 64]}, {"a": 1}))
    assert outputs[0].new_token_ids == [61, 62] and outputs[0].finish_reason == "length"
    assert sched.kv.num_requests_holding_blocks() == 0


def test_an_aborted_request_is_released_by_the_next_plan():
    sched = scheduler()
    add(sched, "a", 5)
    add(sched, "b", 5)
    prefill(sched, {"a": 1, "b": 1})
    sched.abort("a")
    assert sched.has_work() and sched.releasing() == {"a"}
    plan = sched.schedule()
    assert plan.finished_ids == ("a",) and [r.request_id for r in plan.requests] == ["b"]
    assert sched.releasing() == set()


def drafting_scheduler() -> Scheduler:
    """A FASER scheduler (k <= 4, its priors taken as prices) with request "a" decoding."""
    kv = KVCacheManager([BlockPool(64, BS, False, name="full")])
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096,
                                          max_model_len=256, eos_token_ids=(2,),
                                          num_speculative_tokens=4, adaptive=True))
    sched.cost.unpriced_drafting_steps = 0
    add(sched, "a", 6)
    prefill(sched, {"a": 40})
    return sched


def test_drafts_the_grammar_cut_count_as_drafted_and_rejected_but_not_as_computed_rows():
    """Structured output: a SampledTokens with num_masked drafts (cut before verification). The
    vLLM counters and FASER's acceptance see them as rejected drafts; the cost model does not
    price them as verify rows (they were never computed)."""
    sched = drafting_scheduler()
    before = sched.controller.probs("a")[0]
    plan = sched.schedule()
    k = plan.requests[0].num_draft_tokens                          # the controller's choice
    assert k >= 2
    res = StepResult(sampled={"a": SampledTokens([41], num_drafted=k, num_masked=k - 1)},
                     step_time_s=0.01)
    _, stats = sched.commit(plan, res)
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_masked_tokens) == (
        k, 0, k - 1)
    assert sched.controller.probs("a")[0] < before                 # acceptance estimate fell
    sample = sched.controller.cost.samples[-1]
    assert (sample[1], sample[6]) == (plan.num_tokens, 1)           # 1 draft row computed, not k


def test_the_cost_model_sees_prompt_rows_apart_and_each_decode_row_once(monkeypatch):
    """FASER prices a prompt chunk's rows apart from decode and verify rows: the controller is
    told both counts when it chooses, and the cost model gets both when the step is committed. A
    decoding request that may not draft is one decode row (it had been counted twice)."""
    kv = KVCacheManager([BlockPool(64, BS, False, name="full")])
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                                          max_model_len=256, eos_token_ids=(2,),
                                          num_speculative_tokens=2, adaptive=True,
                                          max_decode_slowdown=None))
    add(sched, "a", 6)
    add(sched, "c", 6, num_speculative_tokens=0)                   # decodes, never drafts
    prefill(sched, {"a": 40, "c": 50})
    add(sched, "b", 30)                                            # a prompt: chunked by 16
    seen = []
    choose = sched.controller.choose
    monkeypatch.setattr(sched.controller, "choose", lambda ids, caps, rows, **kw: (
        seen.append((ids, rows, kw["prefill_tokens"])) or choose(ids, caps, rows, **kw)))
    chunks = []
    for step in range(2):
        plan = sched.schedule()
        chunk = {r.request_id: r.num_new_tokens for r in plan.requests}
        drafts = sum(r.num_draft_tokens for r in plan.requests)
        sched.commit(plan, StepResult(sampled={
            r.request_id: SampledTokens([41 + step], r.num_draft_tokens)
            for r in plan.requests if r.sample}, step_time_s=0.01))
        sample = sched.controller.cost.samples[-1]
        assert sample[1] == chunk["a"] + chunk["c"] == 2                       # decode rows
        assert sample[6] == drafts                                             # draft rows
        assert sample[5] == chunk["b"] > 1                                     # prompt rows
        chunks.append(chunk["b"])
    # step 1 chose before b was admitted; step 2 while b's prompt had 30 - chunks[0] rows left,
    # of which the token budget less the two decode rows
    assert seen == [(["a"], 2, 0), (["a"], 2, min(30 - chunks[0], 16 - 2))]


def test_a_request_s_first_draft_marks_it_started_and_its_state_build_is_no_step_cost():
    """The scheduler tells FASER which requests have no drafting state yet (`unstarted`, their
    context) until one drafts, again after a preemption (the worker drops the state); the
    seconds the worker spent building first-time states (`StepResult.draft_state_s`) are taken
    off the step's cost sample (priced once, `CostModel.state_price`)."""
    sched = drafting_scheduler()
    seen = []
    choose = sched.controller.choose
    sched.controller.choose = lambda ids, caps, rows, **kw: (
        seen.append(kw["unstarted"]) or choose(ids, caps, rows, **kw))
    plan = sched.schedule()
    k = plan.requests[0].num_draft_tokens
    assert k >= 1 and seen[-1] == [plan.requests[0].num_computed_tokens]
    assert sched.requests["a"].drafted
    sched.commit(plan, StepResult(sampled={"a": SampledTokens([41], num_drafted=k)},
                                  step_time_s=0.05, draft_state_s=0.03))
    assert abs(sched.controller.cost.samples[-1][-1] - 0.02) < 1e-12
    sched.schedule()
    assert seen[-1] == [0]                                         # started: no build to price
    sched._preempt(sched.requests["a"])
    assert not sched.requests["a"].drafted
