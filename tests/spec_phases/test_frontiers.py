"""FASER early pruning: verification in frontiers of `frontier_size` draft positions gives exactly
the tokens of one verify pass (greedy and seeded sampling), prunes the drafts after a rejection, and
leaves the KV cache as a single pass would (conftest checks block integrity after every test)."""
import math

import pytest
from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.spec_phases.proposers.base import Proposer
from specserve.spec_phases.proposers.layer_skip import LayerSkipProposer

K = 6


def prompts():
    loop = [11, 12, 13, 14, 15] * 4                     # repetitive: n-gram drafts get accepted
    return [loop, [7, 8, 9, 10] * 3 + [7], [(13 * j) % 900 + 3 for j in range(17)], [5] * 9,
            [(3 * j) % 50 + 3 for j in range(33)], [400, 401, 402], loop[::-1], [42] * 16]


def ngram(frontier_size: int, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=1,
                             prompt_lookup_max=3,
                             frontier_size=frontier_size, **kw)


class OwnGreedyDrafts(Proposer):
    """Drafts the target's own greedy continuation (every layer, so a greedy verify accepts all of
    them), except that the draft at index `wrong_at[request_id]` is replaced by another token: the
    verify pass must reject exactly there."""
    name = "own_greedy"

    def __init__(self, core, wrong_at: dict[str, int] | None = None):
        runner = core.worker.runner
        cfg = core.worker.model_config
        self.inner = LayerSkipProposer(runner.forward_rows, cfg.num_layers, ())
        self.vocab = cfg.vocab_size
        self.wrong_at = wrong_at or {}

    def propose(self, requests, max_lens):
        drafts = self.inner.propose(requests, max_lens)
        for r, d in zip(requests, drafts.token_ids):
            c = self.wrong_at.get(r.request_id)
            if c is not None and c < len(d):
                d[c] = (d[c] + 1) % self.vocab
        return drafts


def run(core, params_list, aborts=None, proposer=None, logprobs=False):
    """Every prompt with its params; `aborts` maps a step number to request ids aborted before it.
    Returns (tokens per request, logprobs per request, per-step (frontiers, pruned, draft_lens))."""
    if proposer is not None:
        core.worker.proposer = proposer                   # the worker's drafter, swapped
    for i, (ids, p) in enumerate(zip(prompts(), params_list)):
        core.add_request(EngineRequest(f"q{i}", ids, p))
    tokens = {f"q{i}": [] for i in range(len(params_list))}
    lps = {f"q{i}": [] for i in range(len(params_list))}
    steps, step = [], 0
    while core.has_unfinished():
        for rid in (aborts or {}).get(step, []):
            core.abort_request(rid)
        engine_step = core.step()
        for out in engine_step.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.new_logprobs:
                lps[out.request_id].extend((lp.token_id, lp.logprob,
                                            lp.top_token_ids) for lp in out.new_logprobs)
        s = engine_step.stats
        steps.append((s.num_frontiers, s.num_pruned_tokens, list(s.draft_lens),
                      s.num_accepted_tokens))
        core.kv.check_integrity()                         # after every step, not only at the end
        step += 1
    order = [f"q{i}" for i in range(len(params_list))]
    return [tokens[r] for r in order], [lps[r] for r in order], steps


def assert_same_logprobs(got, want):
    """Same tokens and top ids; values up to float noise (other batch shapes, other GEMM
    blocking)."""
    assert ([[(t, top) for t, _, top in r] for r in got]
            == [[(t, top) for t, _, top in r] for r in want])
    for g, w in zip(got, want):
        assert [v for _, v, _ in g] == pytest.approx([v for _, v, _ in w], abs=1e-4)


CAPS = [None, 0, 1, 2, 3, None, 4, 5]                    # ragged: a draft length per request


@pytest.mark.parametrize("size", [1, 2, 3])
def test_greedy_ngram_frontiers_are_token_identical(make_engine, size):
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             num_speculative_tokens=c,
                             repetition_penalty=1.3 if i == 4 else 1.0,
                             logprobs=2 if i == 6 else None)
              for i, c in enumerate(CAPS)]
    plain, _, _ = run(make_engine(), params)
    single, single_lp, single_steps = run(make_engine(speculative=ngram(0)), params)
    chunked, chunked_lp, steps = run(make_engine(speculative=ngram(size)), params)
    assert sum(sum(s[2]) for s in steps) > 0              # drafts were verified
    assert chunked == single == plain
    assert_same_logprobs(chunked_lp, single_lp)
    assert chunked_lp[6]                                  # logprobs of the emitted tokens too
    assert all(s[0] == 1 and s[1] == 0 for s in single_steps)   # off: one pass, nothing pruned
    # the acceptance counters count proposed drafts either way: unchanged by frontiers
    assert [s[2:] for s in steps] == [s[2:] for s in single_steps]
    # a tight token budget and KV pool (preemption) with frontiers still matches
    squeezed, _, _ = run(make_engine(speculative=ngram(size), num_kv_blocks=24, block_size=4,
                                     max_num_batched_tokens=10), params)
    assert squeezed == plain


@pytest.mark.parametrize("size,wrong_at",
                         [(1, 0), (1, 3), (2, 3), (4, 1), (4, 5), (2, None), (5, None),
                                           (0, 3)])
def test_frontier_and_pruned_counts_follow_the_rejection(make_engine, size, wrong_at):
    """One greedy request drafting K = 6 of its own continuation with one wrong draft (or none):
    after frontier m the target has computed min(K, (m + 1) f) drafts and can verify one more, so
    a rejection at index c is seen once f * max(1, ceil(c / f)) drafts are computed."""
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)]
    plain, _, _ = run(make_engine(), params)
    core = make_engine(speculative=SpeculativeConfig(method="ngram", prompt_lookup_min=1,
                                                     prompt_lookup_max=4, num_speculative_tokens=K,
                                                     frontier_size=size))
    wrong = {} if wrong_at is None else {"q0": wrong_at}
    out, _, steps = run(core, params, proposer=OwnGreedyDrafts(core, wrong))
    assert out == plain
    full = [s for s in steps if s[2] == [K]]
    assert len(full) >= 3
    if size == 0:
        computed, frontiers = K, 1
    elif wrong_at is None:
        computed, frontiers = K, math.ceil(K / size)
    else:
        computed = min(K, size * max(1, math.ceil(wrong_at / size)))
        frontiers = math.ceil(computed / size)
    accepted = K if wrong_at is None else wrong_at
    for num_frontiers, pruned, _, num_accepted in full:
        assert (num_frontiers, pruned, num_accepted) == (frontiers, K - computed, accepted)


def test_pruned_tokens_counted_when_drafts_fail_early(make_engine):
    """Every request's drafts go wrong at the first or second position: later frontiers are
    skipped."""
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True) for _ in range(4)]
    plain, _, _ = run(make_engine(), params)
    core = make_engine(speculative=SpeculativeConfig(method="ngram", prompt_lookup_min=1,
                                                     prompt_lookup_max=4, num_speculative_tokens=K,
                                                     frontier_size=2))
    out, _, steps = run(core, params,
                        proposer=OwnGreedyDrafts(core, {"q0": 0, "q1": 1, "q2": 0, "q3": 1}))
    assert out == plain
    assert sum(s[1] for s in steps) > 0
    # a first-frontier rejection prunes K - 2 drafts of each request that had all K
    first = next(s for s in steps if s[2] == [K] * 4)
    assert first[0] == 1 and first[1] == 4 * (K - 2)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_sampling_frontiers_are_identical_for_the_same_seeds(make_engine, size):
    """Own-greedy drafts under low-temperature sampling: mostly accepted, rejected at varied
    positions, so requests leave at different frontiers. Seeded and unseeded (engine seed) alike."""
    params = [SamplingParams(max_tokens=24, temperature=t, top_k=k, seed=seed, ignore_eos=True,
                             num_speculative_tokens=c, presence_penalty=0.5 if i == 2 else 0.0,
                             logprobs=1 if i == 5 else None)
              for i,
              (t, k, seed,
               c) in enumerate([(0.3, 0, 1, None), (0.5, 20, 2, 3), (0.3, 0, None, None),
                                                   (0, 0, None, 4), (1.0, 0, 5, None),
                                (0.2, 0, 6, 2),
                                                   (0.7, 50, None, 5), (0.4, 0, 8, 1)])]

    def sampled(frontier):
        core = make_engine(speculative=SpeculativeConfig(method="ngram", prompt_lookup_min=1,
                                                         prompt_lookup_max=4,
                                                         num_speculative_tokens=K,
                                                         frontier_size=frontier))
        return run(core, params, proposer=OwnGreedyDrafts(core))
    single, single_lp, single_steps = sampled(0)
    chunked, chunked_lp, steps = sampled(size)
    assert chunked == single and chunked_lp[5]
    assert_same_logprobs(chunked_lp, single_lp)
    assert [s[2:] for s in steps] == [s[2:] for s in single_steps]
    assert sum(s[0] for s in steps) > len(steps)          # later frontiers ran
    assert sum(s[1] for s in steps) > 0                   # and rejections pruned drafts
    assert all(len(t) == 24 for t in chunked)


def test_ngram_sampling_frontiers_are_identical(make_engine):
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=i if i % 3 else None,
                             ignore_eos=True) for i in range(8)]
    single, _, _ = run(make_engine(speculative=ngram(0)), params)
    for size in (1, 2):
        chunked, _, steps = run(make_engine(speculative=ngram(size)), params)
        assert chunked == single
        assert sum(sum(s[2]) for s in steps) > 0


@pytest.mark.parametrize("size", [1, 2])
def test_aborts_mid_run_with_frontiers(make_engine, size):
    """Requests aborted while others verify in frontiers: the survivors' tokens and the aborted
    ones' partial outputs match a single verify pass; blocks balance after every step."""
    params = [SamplingParams(max_tokens=30, temperature=0 if i % 2 else 0.6, seed=i,
                             ignore_eos=True,
                             num_speculative_tokens=CAPS[i]) for i in range(8)]
    aborts = {2: ["q1", "q4"], 3: ["q6"], 5: ["q0"]}
    wrong = {"q0": 4, "q2": 2, "q3": 1, "q5": 3}

    def go(frontier):
        core = make_engine(speculative=SpeculativeConfig(method="ngram", prompt_lookup_min=1,
                                                         prompt_lookup_max=4,
                                                         num_speculative_tokens=K,
                                                         frontier_size=frontier))
        out, _, steps = run(core, params, aborts=aborts, proposer=OwnGreedyDrafts(core, wrong))
        assert not core.has_unfinished() and core.kv.num_requests_holding_blocks() == 0
        return out, steps
    single, _ = go(0)
    chunked, steps = go(size)
    assert chunked == single
    assert sum(s[0] for s in steps) > len(steps) and sum(s[1] for s in steps) > 0
    assert (all(len(single[i]) < 30 for i in (0, 1, 4, 6))
            and all(len(single[i]) == 30 for i in (2, 3, 5, 7)))
