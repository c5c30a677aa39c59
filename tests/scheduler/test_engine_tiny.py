"""The engine end to end on the tiny random model: batching, chunking, preemption, stops, aborts."""
import pytest

from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import ParamError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n, base=10):
    return [[(base + 7 * i + 3 * j) % 40000 + 3 for j in range(5 + 9 * i)] for i in range(n)]


def run(core, token_lists, params=GREEDY, prefix="r"):
    outs = {f"{prefix}{i}": [] for i in range(len(token_lists))}
    for i, ids in enumerate(token_lists):
        core.add_request(EngineRequest(f"{prefix}{i}", ids, params))
    finish = {}
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            if out.request_id not in outs:                 # another caller's request
                continue
            outs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return [outs[f"{prefix}{i}"] for i in range(len(token_lists))], finish


def test_batching_chunking_and_preemption_do_not_change_greedy_output(make_engine):
    ps = prompts(6)
    alone = [run(make_engine(), [p])[0][0] for p in ps]
    together, _ = run(make_engine(), ps)
    assert together == alone
    # tiny token budget -> chunked prefill; few blocks -> preemption by recompute
    squeezed = make_engine(num_kv_blocks=20, block_size=4, max_num_batched_tokens=7)
    chunked, finish = run(squeezed, ps)
    assert chunked == alone
    assert set(finish.values()) == {"length"}
    assert sum(len(o) for o in chunked) == 6 * 12


def test_preemption_happens_and_is_lossless(make_engine):
    # the token budget alone schedules prompt chunks: the steps (and preemptions) do not depend
    # on measured step times
    core = make_engine(num_kv_blocks=16, block_size=4, max_num_batched_tokens=64,
                       max_decode_slowdown=None)
    ps = prompts(4)
    preemptions = 0
    for i, p in enumerate(ps):
        core.add_request(EngineRequest(f"p{i}", p, GREEDY))
    outs = {f"p{i}": [] for i in range(4)}
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        preemptions += step.stats.num_preemptions
    assert preemptions > 0
    alone = [run(make_engine(), [p])[0][0] for p in ps]
    assert [outs[f"p{i}"] for i in range(4)] == alone


@pytest.mark.parametrize("length", [15, 16, 17, 32, 33])
def test_block_boundary_prompt_lengths(make_engine, length):
    """length % block_size in {0, 1} and neighbours, with chunks ending on a block boundary."""
    prompt = [(5 * j) % 1000 + 3 for j in range(length)]
    want = run(make_engine(), [prompt])[0][0]
    core = make_engine(block_size=16, max_num_batched_tokens=16)
    assert run(core, [prompt])[0][0] == want


def test_prefix_cache_hit_reuses_blocks_and_keeps_output(make_engine):
    core = make_engine(block_size=4)
    prompt = [(11 * j) % 500 + 3 for j in range(23)]
    first, _ = run(core, [prompt], prefix="a")
    step = core.step()
    core.add_request(EngineRequest("b0", prompt, GREEDY))
    step = core.step()
    hits = step.stats.prefix_cache_hits
    assert hits == 20                                   # 5 full blocks of 4 tokens
    second = []
    second.extend(core.scheduler.requests["b0"].output_token_ids)
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            pass
    assert core.scheduler.requests.get("b0") is None
    again, _ = run(core, [prompt], prefix="c")
    assert again[0] == first[0]


def test_a_request_finished_by_its_prompt_step_leaves_its_blocks_cached(make_engine):
    """A one-token request finishes in the step that computes its prompt: its full blocks are
    indexed before they are freed, so the same prompt next hits them, with the same output, and
    the pool's books still balance (`check_integrity`)."""
    core = make_engine(block_size=4)
    prompt = [(13 * j) % 500 + 3 for j in range(23)]
    one = SamplingParams(max_tokens=1, temperature=0)
    first, _ = run(core, [prompt], one, "a")
    assert core.scheduler.kv.cached_prefix_tokens(prompt) == 20
    core.add_request(EngineRequest("b0", prompt, one))
    step = core.step()
    assert step.stats.prefix_cache_hits == 20
    while core.has_unfinished():
        core.step()
    again, _ = run(core, [prompt], one, "c")
    assert again[0] == first[0]
    core.check_integrity()


def test_stop_conditions(make_engine):
    core = make_engine()
    prompt = prompts(1)[0]
    free_run, _ = run(core, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                      "x")
    stop_tok = free_run[0][4]
    first_idx = free_run[0].index(stop_tok)
    out, finish = run(core, [prompt],
                      SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_tok]), "s")
    assert out[0] == free_run[0][:first_idx + 1] and finish["s0"] == "stop"
    out, finish = run(core, [prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                      "l")
    assert len(out[0]) == 3 and finish["l0"] == "length"
    # min_tokens masks the stop token until enough tokens exist
    out, _ = run(core, [prompt],
                 SamplingParams(max_tokens=10, temperature=0, min_tokens=first_idx + 2,
                                                stop_token_ids=[stop_tok]), "m")
    assert stop_tok not in out[0][:first_idx + 2]


def test_abort_frees_blocks_mid_generation(make_engine):
    core = make_engine()
    for i, p in enumerate(prompts(3)):
        core.add_request(EngineRequest(f"a{i}", p, SamplingParams(max_tokens=50, temperature=0)))
    core.step()
    core.step()
    out = core.abort_request("a1")
    assert out.finished and out.finish_reason == "abort"
    assert core.abort_request("a1") is None               # idempotent
    assert "a1" not in core.kv.block_tables["full"]
    core.kv.check_integrity()


def test_step_failure_fails_only_its_requests(make_engine, monkeypatch):
    core = make_engine()
    core.add_request(EngineRequest("f0", prompts(1)[0], GREEDY))
    monkeypatch.setattr(core.worker, "execute",
                        lambda plan: (_ for _ in ()).throw(RuntimeError("boom")))
    step = core.step()
    outs = step.outputs
    assert [(o.request_id, o.finish_reason) for o in outs] == [("f0", "error")]
    assert "boom" in outs[0].error
    monkeypatch.undo()
    assert run(core, [prompts(1)[0]], prefix="ok")[1] == {"ok0": "length"}


def test_bad_input_is_refused_before_it_reaches_the_queue(make_engine):
    core = make_engine(max_model_len=64)
    with pytest.raises(ParamError) as e:
        core.add_request(EngineRequest("e", [], GREEDY))
    assert e.value.param == "prompt"
    with pytest.raises(ParamError) as e:
        core.add_request(EngineRequest("e", [10**6], GREEDY))
    assert e.value.param == "prompt"
    with pytest.raises(ParamError) as e:
        core.add_request(EngineRequest("e", [5] * 64, GREEDY))
    assert e.value.param == "input_tokens"
    with pytest.raises(ParamError) as e:
        core.add_request(EngineRequest("e", [5] * 60, SamplingParams(max_tokens=5)))
    assert (e.value.param == "max_tokens"
            and "maximum context length is 64 tokens" in e.value.message)
    with pytest.raises(ParamError):
        SamplingParams(max_tokens=0)
    assert not core.has_unfinished()


def test_seeded_sampling_is_independent_of_batch_composition(make_engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
    p = prompts(1)[0]
    alone, _ = run(make_engine(), [p], params)
    noisy = SamplingParams(max_tokens=8, temperature=1.0)
    core = make_engine()
    core.add_request(EngineRequest("n0", prompts(2, base=99)[1], noisy))
    core.add_request(EngineRequest("n1", prompts(3, base=7)[2], noisy))
    together, _ = run(core, [p], params, prefix="s")
    assert together[0] == alone[0]
    other_seed, _ = run(make_engine(), [p], SamplingParams(max_tokens=8, temperature=1.0, seed=99))
    assert other_seed[0] != alone[0]


def test_logprobs_and_prompt_logprobs(make_engine):
    core = make_engine(block_size=4, max_num_batched_tokens=5)   # prompt logprobs across chunks
    p = prompts(2)[1]
    core.add_request(EngineRequest("lp", p, SamplingParams(max_tokens=3, temperature=0, logprobs=3,
                                                              prompt_logprobs=2, ignore_eos=True)))
    outs = core.run_until_idle()
    first = next(o for o in outs if o.new_token_ids)
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(p)
    assert [lp.token_id for lp in first.prompt_logprobs[1:]] == p[1:]
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert len(lps) == 3
    for lp in lps:                                        # greedy: the chosen token is the top-1
        assert lp.rank == 1 and lp.top_token_ids[0] == lp.token_id and len(lp.top_token_ids) == 3
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True) and lp.logprob <= 0


def test_the_warm_up_leaves_the_cost_model_only_steps_that_computed_rows(make_engine):
    """The warm-up's grammar step (it pays the tokenizer's load) and the steps that only release
    finished requests are no cost samples: the one priced a 1-row step at seconds, the other a
    step at nothing. What is left: the warm-up batch's prompt step and its decode steps."""
    from specserve.scheduler.engine import WARM_UP_ROWS, WARM_UP_STEPS
    core = make_engine(num_threads=1)
    core.warm_up()
    samples = list(core.scheduler.cost.samples)
    rows = [s[1] for s in samples]
    assert all(s[-1] > 0 for s in samples)
    assert rows == [0] + [WARM_UP_ROWS] * WARM_UP_STEPS
