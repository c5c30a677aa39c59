"""FASER overlap: with frontiers on, a worker thread drafts the next step for the requests the first
frontier decided. The drafts it hands over are the drafts (stateless drafter): output identical."""
from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams


def prompts():
    loop = [11, 12, 13, 14, 15] * 4                     # repetitive: n-gram drafts get accepted
    return [loop, [7, 8, 9, 10] * 3 + [7], [(13 * j) % 900 + 3 for j in range(17)], [5] * 9,
            [(3 * j) % 50 + 3 for j in range(33)], loop[::-1], [42] * 16, [400, 401, 402]]


def generate(make_engine, overlap: bool, seeded: bool) -> tuple[dict, int]:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_min=1,
                             prompt_lookup_max=3,
                             frontier_size=2, overlap_draft=overlap)
    core = make_engine(speculative=spec)
    ahead = 0
    for i, p in enumerate(prompts()):
        params = (SamplingParams(max_tokens=24, temperature=0.8, seed=100 + i,
                                 ignore_eos=True) if seeded and i % 2
                  else SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        core.add_request(EngineRequest(f"r{i}", p, params))
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        step = core.step()
        for o in step.outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        ahead += step.stats.num_drafted_ahead
    return out, ahead


def test_overlapped_drafts_give_identical_output(make_engine):
    for seeded in (False, True):
        plain, ahead_off = generate(make_engine, overlap=False, seeded=seeded)
        overlapped, ahead_on = generate(make_engine, overlap=True, seeded=seeded)
        assert overlapped == plain
        assert ahead_off == 0
        if not seeded:
            assert ahead_on > 0                           # the thread's drafts were used


def test_a_draft_made_ahead_is_used_only_for_the_context_it_was_made_for(make_engine):
    """The thread's drafts are collected at the end of the step that started them
    (`Worker._propose_next`): a request's next step takes them only where they continue its
    tokens after this step; else the worker proposes its own."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                             prompt_lookup_max=3,
                             frontier_size=1, overlap_draft=True)
    prompt = [11, 12, 13, 14, 15] * 4

    class Ready:                                          # stands in for the thread's future
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    for shift, used in ((10**6, 0), (0, 1)):
        core = make_engine(speculative=spec)
        worker, ahead = core.worker, core.worker.draft_ahead
        core.add_request(EngineRequest("r0", prompt, SamplingParams(max_tokens=8, temperature=0)))
        steps = []
        execute = worker.execute
        worker.execute = (lambda plan, execute=execute, steps=steps:      # this core's own
                          steps.append((plan, execute(plan))) or steps[-1][1])
        core.step()                                       # the prefill: one token, no drafts
        plan, result = steps[-1]
        (req,) = plan.requests
        tokens = len(req.history) + len(result.sampled["r0"].token_ids)
        ahead.pending = Ready({"r0": (tokens + shift, [99, 98, 97, 96])})
        lens = worker._propose_next(plan.requests, result.sampled)     # the step's end, again
        core.scheduler.requests["r0"].ready_drafts = lens["r0"]        # as its commit reads them
        assert (worker.next_drafts["r0"][1] == [99, 98, 97, 96]) == bool(used)
        assert ahead.pending is None                      # valid for one step only
        step = core.step()
        assert step.stats.num_drafted_ahead == used
        assert step.stats.num_draft_tokens == 4 * used


def test_the_flag_reaches_the_runner_and_bad_combinations_are_refused(make_engine):
    import pytest
    spec = SpeculativeConfig.from_json(
        '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, '
        '"num_speculative_tokens": 5, "frontier_size": 2, '
                                       '"overlap_draft": true}')
    ahead = make_engine(speculative=spec).worker.draft_ahead
    assert ahead is not None and ahead.max_len == 5
    assert make_engine(speculative=SpeculativeConfig(method="ngram", prompt_lookup_min=1,
                                                     prompt_lookup_max=4, num_speculative_tokens=5,
                                                     frontier_size=2)).worker.draft_ahead is None
    for bad in (
        '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, '
        '"num_speculative_tokens": 5, "overlap_draft": true}',
                '{"method": "layer_skip", "num_speculative_tokens": 3, "frontier_size": 1, '
                '"overlap_draft": true}'):
        with pytest.raises(ValueError, match="overlap_draft"):
            SpeculativeConfig.from_json(bad)


def test_no_drafting_ahead_for_a_drafter_the_target_teaches():
    """Token recycling's table is updated by every verified row: its drafts are not a function of
    the tokens alone, so drafting ahead refuses it."""
    import pytest

    from specserve.spec_phases.overlap import DraftAhead
    from specserve.spec_phases.proposers.token_recycling import TokenRecyclingProposer
    with pytest.raises(ValueError, match="tokens"):
        DraftAhead(TokenRecyclingProposer(vocab_size=10), 4)
