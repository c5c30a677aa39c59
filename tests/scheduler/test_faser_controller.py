"""The goodput controller with fabricated acceptance histories and cost models."""
import numpy as np
import pytest

from specserve.scheduler.faser import (FIT_SHARE, MARGIN, TERMS, CostModel, DraftLengthController,
                                       DraftPass)


def terms(*first):
    """Prices or counts in `TERMS` order: the first ones given, the context-key and chunk terms
    after them 0."""
    return [float(v) for v in first] + [0.0] * (len(TERMS) - len(first))


def controller(c0=0.02, c1=0.002, c2=0.0, prior=0.6, k_max=8):
    return DraftLengthController(k_max, prior=prior, cost=CostModel(c0, c1, c2))


def teach(ctl, request_id, rate, steps=40, k=8, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < rate:
            accepted += 1
        ctl.observe(request_id, k, accepted)


def test_zero_drafts_when_drafting_cannot_pay():
    ctl = controller(c0=0.001, c1=0.01)          # every token costs 10x the fixed step cost
    teach(ctl, "a", 0.1)
    assert ctl.choose(["a"], [8], num_other_tokens=1) == [0]


def test_more_drafts_for_requests_that_accept_more():
    ctl = controller()
    teach(ctl, "good", 0.9, seed=1)
    teach(ctl, "bad", 0.2, seed=2)
    k_good, k_bad = ctl.choose(["good", "bad"], [8, 8], num_other_tokens=2)
    assert k_good > k_bad and k_good >= 4


def test_reacts_when_acceptance_shifts():
    ctl = controller()
    teach(ctl, "r", 0.95)
    before = ctl.choose(["r"], [8], 1)[0]
    teach(ctl, "r", 0.0, steps=10)
    after = ctl.choose(["r"], [8], 1)[0]
    assert before >= 5 and after < before and after <= 1


def test_caps_are_respected():
    ctl = controller()
    teach(ctl, "r", 0.99)
    assert ctl.choose(["r", "s"], [2, 0], 2) == [2, 0]


def test_draft_lengths_shrink_smoothly_with_load():
    """No cliff: the mean draft length never rises as the batch grows, and reaches 0 under load."""
    ctl = controller(c0=0.02, c1=0.002)
    means = []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        ids = [f"r{i}" for i in range(batch)]
        for i in ids:
            ctl.accept[i] = np.full(8, 0.7)
        means.append(np.mean(ctl.choose(ids, [8] * batch, batch)))
    assert all(b <= a + 1e-9 for a, b in zip(means, means[1:]))
    assert means[0] >= 2 and means[-1] == 0


def test_cost_model_recovers_a_linear_step_time():
    model = CostModel()
    rng = np.random.default_rng(0)
    for _ in range(64):
        tokens, k = int(rng.integers(1, 200)), int(rng.integers(0, 8))
        model.observe(tokens, k, 0.01 + 0.0005 * tokens + 0.003 * k)
    assert np.allclose(model.coef, terms(0.01, 0.0005, 0.003, 0.0, 0.0, 0.0, 0.0005, 0.0),
                       rtol=1e-3)


def test_collinear_batch_one_samples_do_not_inflate_the_token_price():
    """Batch 1, n-gram drafts: tokens = 1 + max_k in every sample. The fit must stay non-negative
    and predictive (a clamped unconstrained split once priced a draft token 30x too high: k fell to
    0)."""
    model = CostModel(draft_pass=0.001)
    rng = np.random.default_rng(1)
    for _ in range(64):
        k = int(rng.integers(0, 9))
        model.observe(1 + k, k, 0.026 + 0.0003 * (1 + k) + rng.normal(0, 0.0005))
    assert (model.coef >= 0).all()
    assert abs(model.predict(9, 8) - model.predict(1, 0) - 0.0024) < 0.002
    ctl = DraftLengthController(8, cost=model)
    teach(ctl, "r", 0.9)
    assert ctl.choose(["r"], [8], 1)[0] >= 6


def test_a_request_held_at_zero_is_probed_and_recovers():
    ctl = controller(c0=0.02, c1=0.004)
    teach(ctl, "r", 0.0)
    ks = [ctl.choose(["r"], [8], 1)[0] for _ in range(3 * ctl.probe_every)]
    # one probe every probe_every steps
    assert ks.count(1) == 3 and ks.count(0) == len(ks) - 3
    for _ in range(20):                                           # the text turned repetitive
        k = max(ctl.choose(["r"], [8], 1)[0], 0)
        ctl.observe("r", k, k)
    assert ctl.choose(["r"], [8], 1)[0] >= 4


def long_context_drafter(drafting_step=0.002):
    """lossy_kv at 2.8K on this CPU: a 14 ms step, a 6 ms draft pass, a 2.5 ms verify row."""
    cost = CostModel(step=0.014, row=0.0, draft_pass=0.006, draft_row=0.0025,
                     drafting_step=drafting_step)
    return DraftLengthController(8, cost=cost)


def test_rounds_accepted_whole_reach_past_positions_left_low():
    """Early rounds left position 2 at 0.72 (from the 0.6 prior); rounds of 2 since were all
    accepted: the positions past them read as position 1 does, so k grows, where the stored
    estimates alone would hold it at 2 for good. A round that ends in a rejection reads them as
    stored again."""
    ctl = long_context_drafter()
    ctl.observe("r", 3, 3)
    for _ in range(8):
        ctl.observe("r", 2, 2)
    assert ctl.probs("r")[2] >= ctl.probs("r")[1] > 0.95
    assert ctl.choose(["r"], [8], 1)[0] >= 5
    held = dict(ctl.frontier)
    ctl.frontier.clear()                                  # the stored estimates alone
    assert ctl.choose(["r"], [8], 1)[0] == 2
    ctl.frontier.update(held)
    ctl.observe("r", 8, 2)
    assert ctl.probs("r")[2] < 0.6 and ctl.frontier["r"] == 0


def test_a_position_first_reached_starts_from_the_estimate_it_was_read_at():
    """Rounds of one draft, all accepted, raise position 0 to ~0.97 and the positions past it
    read as much; the round that first reaches positions 1-2 updates them from that, not from
    the 0.6 prior (which left them at 0.72 after a whole round accepted)."""
    ctl = DraftLengthController(8, prior=0.6)
    for _ in range(8):
        ctl.observe("r", 1, 1)
    ctl.observe("r", 3, 3)
    p = ctl.probs("r")
    assert p[1] > 0.95 and p[2] > 0.95 and p[3] > 0.95


def test_a_probe_drafts_as_deep_as_its_first_position_would_pay():
    """Held at k = 0 by low estimates past position 0, a request accepting 95% at position 0 is
    probed with several drafts (as many as pay were every position accepted as its first), so
    the positions that decide k are observed again; one accepting nothing is probed with one.
    A drafting step's own price (a round's set-up, 10 ms) makes one draft a loss."""
    ctl = long_context_drafter(drafting_step=0.01)
    ctl.accept["r"] = np.array([0.95] + [0.3] * 7)
    ctl.accept["s"] = np.array([0.0] * 8)
    ctl.depth["r"] = ctl.depth["s"] = 8
    ks = [ctl.choose(["r"], [8], 1)[0] for _ in range(ctl.probe_every)]
    assert ks[:-1] == [0] * (ctl.probe_every - 1) and ks[-1] >= 4
    ks = [ctl.choose(["s"], [8], 1)[0] for _ in range(ctl.probe_every)]
    assert ks == [0] * (ctl.probe_every - 1) + [1]


def test_an_unstarted_request_is_probed_where_its_state_is_cheap():
    """Held at k = 0 by the 0.6 prior, a request whose drafting state costs little to build (the
    window's: 18 ms at 2.8K, under a quarter of 8 steps of 15 ms) is probed after the interval
    and so can start; one whose build costs 112 ms (quant's encode) is not."""
    for state_price, probed in [(6.5e-6, True), (40e-6, False)]:
        cost = CostModel(step=0.015, row=0.0, draft_row=0.0025, drafting_step=0.002)
        cost.calibrate([(1, 0.006, 64), (1, 0.006, 65), (1, 0.006, 256), (1, 0.006, 257)],
                       state_price=state_price)
        ctl = DraftLengthController(8, cost=cost)
        ks = [ctl.choose(["r"], [8], 1, row_keys=2800, contexts=[2800], unstarted=[2800],
                         remaining=[100])[0] for _ in range(ctl.probe_every)]
        assert ks[:-1] == [0] * (ctl.probe_every - 1)
        assert (ks[-1] > 0) == probed


def test_no_drafting_state_is_built_on_prior_step_prices():
    """Before the cost model's first fit its step prices are priors (20 ms a step): a request
    whose drafting state is yet to be built waits, one already started drafts; after the fit the
    same prices let the unstarted one start."""
    cost = CostModel(draft_row=0.0005, unpriced_steps=True)
    cost.calibrate([(1, 0.001, 64), (1, 0.001, 65), (1, 0.001, 256), (1, 0.001, 257)],
                   state_price=1e-7)
    ctl = DraftLengthController(8, cost=cost)
    asks = dict(row_keys=2800, contexts=[2800, 2800], unstarted=[2800, 0], remaining=[100, 100])
    assert ctl.choose(["new", "old"], [8, 8], 2, **asks)[0] == 0
    assert ctl.choose(["new", "old"], [8, 8], 2, **asks)[1] > 0
    for rows in (1, 2, 3, 4) * 3:                             # steps priced as the priors are
        cost.observe(rows, 0, 0.02 + 0.002 * rows)
    assert not cost.unpriced_steps and cost.num_fits
    assert ctl.choose(["new", "old"], [8, 8], 2, **asks)[0] > 0


def test_rejected_probes_back_off_and_an_accepted_one_resets_the_interval():
    """On text that never repeats each probe is a verify row for nothing: the interval doubles per
    rejected probe up to 8x, an accepted draft brings it back; a probe the drafter had nothing for
    (no n-gram match: no row computed) changes nothing."""
    ctl = controller(c0=0.02, c1=0.004)
    teach(ctl, "r", 0.0)
    probes = []
    for step in range(400):
        if ctl.choose(["r"], [8], 1)[0]:
            probes.append(step)
            ctl.observe("r", 1, 0)
    gaps = np.diff([-1] + probes).tolist()
    base = ctl.probe_every
    assert gaps[:5] == [base, 2 * base, 4 * base, 8 * base, 8 * base]
    assert set(gaps[3:]) == {8 * base}
    while not ctl.choose(["r"], [8], 1)[0]:
        pass
    ctl.observe("r", 0, 0)                                      # nothing drafted
    assert ctl.probe_interval("r") == 8 * base
    ctl.observe("r", 1, 1)                                      # a draft accepted
    assert ctl.probe_interval("r") == base
    ctl.release("r")
    assert "r" not in ctl.interval and "r" not in ctl.probing


def test_unreached_positions_read_as_the_deepest_observed_one():
    ctl = controller()
    for _ in range(10):
        # only ever drafted one, always accepted
        ctl.observe("r", 1, 1)
    assert ctl.probs("r")[1:].min() > 0.9
    assert ctl.choose(["r"], [8], 1)[0] >= 4


def test_swap_bytes_are_priced_and_make_drafts_worth_more():
    """VeriCache steps also stage the full KV from host memory: the fit recovers its price per byte,
    and a step that pays a large fixed swap gets longer drafts than one that does not."""
    model = CostModel()
    rng = np.random.default_rng(2)
    for _ in range(96):
        tokens, k, swap = (int(rng.integers(1, 64)), int(rng.integers(0, 8)),
                           int(rng.integers(0, 50_000_000)))
        model.observe(tokens, k, 0.004 + 0.002 * tokens + 1e-9 * swap, swap_bytes=swap)
    assert np.allclose(model.coef, terms(0.004, 0.002, 0.0, 1e-9, 0.0, 0.0, 0.002, 0.0), rtol=1e-3,
                       atol=1e-9)
    ctl = DraftLengthController(8, cost=model)
    teach(ctl, "r", 0.6)
    no_swap = ctl.choose(["r"], [8], 1, swap_bytes=0)[0]
    heavy = ctl.choose(["r"], [8], 1, swap_bytes=200_000_000)[0]
    assert heavy > no_swap


def test_prompt_rows_are_priced_apart_from_decode_and_verify_rows():
    """A prompt chunk's rows share each weight read and cost a fraction of a decode or verify row.
    Fitted as one price, steps with prompt chunks pulled a verify row's price down to theirs and
    drafts looked cheap under load: the fit recovers both prices, and a batch of 8 decodes
    accepting 40% gets no drafts at the verify row's true price (it did at the blended one)."""
    model = CostModel()
    rng = np.random.default_rng(4)
    for _ in range(96):
        rows = int(rng.integers(4, 20))
        prefill = int(rng.integers(20, 200)) * int(rng.random() < 0.3)
        model.observe(rows, 0, 0.02 + 0.003 * rows + 0.0005 * prefill, prefill_tokens=prefill)
    assert np.allclose(model.coef, terms(0.02, 0.003, 0.0, 0.0, 0.0, 0.0005, 0.003, 0.0),
                       rtol=1e-3, atol=1e-9)
    assert model.predict(8, 0, prefill_tokens=100) == pytest.approx(0.02 + 0.024 + 0.05)
    ids = [f"r{i}" for i in range(8)]
    ctl = DraftLengthController(4, cost=model)
    for r in ids:
        ctl.accept[r] = np.full(4, 0.4)
    assert ctl.choose(ids, [4] * 8, 8) == [0] * 8
    one_price = DraftLengthController(4, cost=CostModel(0.02, 0.0005))     # the old fit's price
    for r in ids:
        one_price.accept[r] = np.full(4, 0.4)
    assert sum(one_price.choose(ids, [4] * 8, 8)) > 0


def test_a_draft_pass_cost_is_shared_across_the_batch():
    """A drafter whose every draft position costs a forward (c2): the batch's first draft alone does
    not pay for that pass, but one draft for every request does; a one-at-a-time greedy would stop
    at k = 0 for all. Brute force over uniform k confirms the controller's choice beats k = 0."""
    ctl = controller(c0=0.3, c1=0.003, c2=0.05)        # a long-context step, a cheap draft pass
    ids = [f"r{i}" for i in range(8)]
    for i, r in enumerate(ids):
        teach(ctl, r, 0.8, seed=i)
    ks = ctl.choose(ids, [8] * 8, num_other_tokens=8)
    assert min(ks) >= 1

    def goodput(k):                                      # the controller's own value and cost
        value = sum(1 + np.cumprod(ctl.probs(r)[:k]).sum() for r in ids)
        return value / ctl.cost.predict(8 + k * len(ids), k)
    assert goodput(1) > goodput(0)
    chosen = sum(1 + np.cumprod(ctl.probs(r)[:k]).sum() for r, k in zip(ids, ks)) / \
        ctl.cost.predict(8 + sum(ks), max(ks))
    assert chosen >= max(goodput(k) for k in range(9)) - 1e-9


def test_a_dear_draft_pass_still_gives_zero_to_bad_acceptors():
    ctl = controller(c0=0.3, c1=0.003, c2=0.05)        # a long-context step, a cheap draft pass
    teach(ctl, "good", 0.95, seed=1)
    teach(ctl, "bad", 0.05, seed=2)
    k_good, k_bad = ctl.choose(["good", "bad"], [8, 8], num_other_tokens=2)
    assert k_good >= 2 and k_bad == 0


def test_a_draft_row_is_priced_apart_from_a_request_row():
    """A draft's verify row and a request's row cost different amounts. Steps where many requests
    decode and few draft must not teach the controller that a draft costs a plain row: the fit
    recovers the draft row's own price, and a batch that accepts 80% at a plain row's price but
    not at the true one gets k = 0."""
    model = CostModel()
    rng = np.random.default_rng(3)
    for _ in range(96):
        batch = int(rng.integers(1, 32))
        ks = rng.integers(0, 5, size=batch) * (rng.random(batch) < 0.3)
        drafts = int(ks.sum())
        model.observe(batch + drafts, int(ks.max()), 0.02 + 0.001 * batch + 0.005 * drafts,
                      draft_tokens=drafts)
    assert np.allclose(model.coef, terms(0.02, 0.001, 0.0, 0.0, 0.0, 0.0, 0.005, 0.0), rtol=1e-3,
                       atol=1e-9)
    ids = [f"r{i}" for i in range(24)]
    ctl = DraftLengthController(8, cost=model)
    for i, r in enumerate(ids):
        teach(ctl, r, 0.8, seed=i)
    assert ctl.choose(ids, [8] * 24, num_other_tokens=24) == [0] * 24
    plain_row = DraftLengthController(8, cost=CostModel(0.02, 0.001))
    for i, r in enumerate(ids):
        teach(plain_row, r, 0.8, seed=i)
    # what one price per row would do
    assert sum(plain_row.choose(ids, [8] * 24, num_other_tokens=24)) > 0


def test_a_step_that_verifies_drafts_pays_once_for_it():
    """Prices shaped as one CPU run at 8 requests measured them (docs/history/BENCHMARKS-2026-11.md
    §9.11: a step's first draft ~5 ms, each further one ~1.3, a request's row ~4). The fit
    recovers the once-per-step price (c7) beside the draft row's (c6); a lone request accepting
    80% then gets no single draft (8.8 tokens for 37.5 ms lose to 8 for 32.5), eight of them
    share the step's price and draft, and a chain of four pays alone."""
    truth = dict(c0=0.0005, c1=0.004, c6=0.0013, c7=0.0037)
    model = CostModel()
    rng = np.random.default_rng(6)
    for _ in range(128):
        batch = int(rng.integers(4, 13))
        drafts = int(rng.integers(1, 9)) * int(rng.random() < 0.5)
        secs = (truth["c0"] + truth["c1"] * batch + truth["c6"] * drafts
                + truth["c7"] * (drafts > 0) + rng.normal(0, 1e-5))
        model.observe(batch + drafts, min(drafts, 4), secs, draft_tokens=drafts)
    assert abs(model.prices.row - 0.004) < 1e-4 and abs(model.prices.draft_row - 0.0013) < 1e-4
    assert abs(model.step_price() - 0.0037) < 2e-4 and model.prices.draft_pass < 1e-4
    ids = [f"r{i}" for i in range(8)]
    ctl = DraftLengthController(4, cost=model, margin=0.0)     # the prices alone decide
    for r in ids:
        ctl.accept[r] = np.full(4, 0.8)
    assert ctl.choose(ids, [1] + [0] * 7, 8) == [0] * 8
    assert sum(ctl.choose(ids, [1] * 8, 8)) >= 4
    assert ctl.choose(ids, [4] + [0] * 7, 8)[0] >= 3
    # one price per draft and none per step: a probe's fit on this loop read ~3 ms a draft, and
    # the lone single draft looked worth it
    one_price = DraftLengthController(4, cost=CostModel(0.0005, 0.004, draft_row=0.003), margin=0.0)
    for r in ids:
        one_price.accept[r] = np.full(4, 0.8)
    assert one_price.choose(ids, [1] + [0] * 7, 8)[0] == 1


def test_probes_share_draft_passes():
    """Requests held at k = 0 arrive one per step (staggered idle counters). A drafter whose pass
    costs a forward would pay one on nearly every step for staggered probes; grouped, the probes
    fall into step: one pass per probe interval, and every request is still probed at least that
    often."""
    ctl = controller(c0=0.1, c1=0.004, c2=0.01)       # a pass a certain draft would pay for
    ids = [f"r{i}" for i in range(8)]
    for r in ids:
        teach(ctl, r, 0.0)
    steps, passes, probes = 80, 0, {r: [] for r in ids}
    for step in range(steps):
        live = ids[:min(step + 1, len(ids))]
        ks = ctl.choose(live, [8] * len(live), len(live))
        passes += max(ks) > 0
        for r, k in zip(live, ks):
            assert k <= 1
            if k:
                probes[r].append(step)
    assert passes <= (steps - 1) // ctl.probe_every + 3
    for r in ids:
        gaps = np.diff([int(r[1:])] + probes[r])
        assert len(probes[r]) >= 8 and gaps.max() <= ctl.probe_every


def test_no_probe_where_even_certain_acceptance_cannot_pay():
    """A draft pass dearer than the whole step it joins: not even a draft accepted for sure pays, so
    probing (a pass to learn an acceptance that cannot matter) is skipped; when the pass gets cheap
    again the same requests are probed."""
    ctl = controller(c0=0.05, c1=0.001, c2=0.5)
    ids = [f"r{i}" for i in range(4)]
    for r in ids:
        teach(ctl, r, 0.0)
    assert all(max(ctl.choose(ids, [8] * 4, 4)) == 0 for _ in range(4 * ctl.probe_every))
    ctl.cost.prices.draft_pass = 0.001
    ks = [ctl.choose(ids, [8] * 4, 4) for _ in range(ctl.probe_every)]
    assert sum(map(max, ks)) >= 1


def test_drafts_must_promise_the_margin():
    """At 8 requests a chain of four drafts accepted at 80% promises 10.4 tokens for 41.4 ms
    against 8 for 32.5 (+1.6%): taken at no margin, refused at the default one (3%: what the
    model leaves out, the controller's own time and its optimism); at 90% acceptance (+8.6%)
    taken at both."""
    model = CostModel(0.0005, 0.004, draft_row=0.0013, drafting_step=0.0037)
    ids = [f"r{i}" for i in range(8)]
    caps = [4] + [0] * 7
    for p, taken in ((0.8, (True, False)), (0.9, (True, True))):
        for margin, want in zip((0.0, MARGIN), taken):
            ctl = DraftLengthController(4, cost=model, margin=margin)
            for r in ids:
                ctl.accept[r] = np.full(4, p)
            assert (ctl.choose(ids, caps, 8)[0] >= 3) == want, (p, margin)


def _greedy_allocation(ctl, ids, caps, other, swap):
    """The allocation written plainly, one draft at a time (what the search must equal)."""
    drafts = []
    for i, r in enumerate(ids):
        chain = np.cumprod(ctl.probs(r)[:min(caps[i], ctl.k_max)])
        drafts += [(float(g), j, i) for j, g in enumerate(chain) if g > 0]
    drafts.sort(key=lambda d: (-d[0], d[1], d[2]))
    # drafting must beat no draft by the margin
    # every decoding row commits a token: `other` of them, the drafting candidates among them
    best_ks, best = [0] * len(ids), (1 + ctl.margin) * other / ctl.cost.predict(other, 0, swap)
    for depth in range(1, max(min(c, ctl.k_max) for c in caps) + 1):
        ks, value, n = [0] * len(ids), float(other), 0
        goodput = value / (ctl.cost.predict(other, depth, swap) + ctl.cost.step_price())
        for gain, j, i in drafts:
            if j >= depth:
                continue
            new = (value + gain) / ctl.cost.predict(other + n + 1, depth, swap, n + 1)
            if new <= goodput:
                break
            goodput, value, n = new, value + gain, n + 1
            ks[i] += 1
        if max(ks) == depth and goodput > best:
            best, best_ks = goodput, ks
    return best_ks


def _random_batch(rng, coef, most):
    """A controller with the prices `coef` and 1..most requests of random acceptance (a tenth
    of them at 0), their caps and the step's other rows."""
    n = int(rng.integers(1, most))
    ctl = DraftLengthController(8, cost=CostModel(*coef))
    ids = [f"r{i}" for i in range(n)]
    for r in ids:
        ctl.accept[r] = np.clip(rng.uniform() + rng.normal(0, 0.1, 8), 0,
                                1) * (rng.random() > 0.1)
    caps = [int(c) for c in rng.integers(0, 9, n)]
    return ctl, ids, caps, int(rng.integers(n, 3 * n))


def test_allocation_equals_the_plain_greedy():
    """The search against the greedy written one draft at a time."""
    rng = np.random.default_rng(4)
    for _ in range(500):
        coef = [rng.uniform(0.001, 0.3), rng.uniform(0, 0.01),
                rng.choice([0.0, rng.uniform(0, 0.1)]),
                rng.choice([0.0, 1e-9]), rng.choice([0.0, rng.uniform(0, 0.01)]), 0.0,
                rng.uniform(0, 0.01), rng.choice([0.0, rng.uniform(0, 0.05)])]
        ctl, ids, caps, other = _random_batch(rng, coef, 33)
        swap = int(rng.integers(0, 10**8))
        assert (ctl._allocate(ids, caps, other, swap)
                == _greedy_allocation(ctl, ids, caps, other, swap))


def test_the_flat_allocation_equals_the_allocation_over_depths():
    """Without a per-pass cost (c2 = 0) the deepest depth's greedy alone decides; the search over
    each depth must choose the same drafts (forced here by a per-pass cost too small to change
    any price)."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        coef = [rng.uniform(0.001, 0.3), rng.uniform(0, 0.01), 0.0, 0.0,
                rng.choice([0.0, rng.uniform(0, 0.01)]), 0.0, rng.uniform(0, 0.01),
                rng.choice([0.0, rng.uniform(0, 0.05)])]
        ctl, ids, caps, other = _random_batch(rng, coef, 40)
        flat = ctl._allocate(ids, caps, other)
        ctl.cost.prices.draft_pass = 1e-300
        assert ctl._allocate(ids, caps, other) == flat


def test_nothing_pays_is_decided_without_the_arrays(monkeypatch):
    """Under load, or where a step's drafting costs more than the batch could win, the answer
    comes from one first probability per request (no per-request arrays on the step's critical
    path: on the GPU's 2-3 ms steps they cost more than the step's drafts could win). Prices as
    fitted on the H100 (a 2.7 ms per-pass cost beside 2 ms steps): requests accepting 42% pay for
    no pass (the batch's capacity bound); a draft priced above what a row earns pays nowhere
    (the mediant bound)."""
    ids = [f"r{i}" for i in range(8)]

    def no_arrays(request_id):
        raise AssertionError("the per-request arrays were built")

    dear_pass = DraftLengthController(8, cost=CostModel(0.0014, 0.00008, 0.0027,
                                                        prefill_row=0.00016))
    dear_row = DraftLengthController(8, cost=CostModel(0.02, 0.002, draft_row=0.01))
    for ctl in (dear_pass, dear_row):
        for r in ids:
            ctl.observe(r, 1, 0)
        assert ctl.first_prob("r0") == pytest.approx(0.42)
        monkeypatch.setattr(ctl, "probs", no_arrays)
        assert ctl._allocate(ids, [8] * 8, 8) == [0] * 8
    cheap = DraftLengthController(8, cost=CostModel(0.0014, 0.00008, 0.0001, prefill_row=0.00016))
    for r in ids:
        cheap.observe(r, 1, 0)
    monkeypatch.setattr(cheap, "probs", no_arrays)
    with pytest.raises(AssertionError, match="arrays"):     # a cheap pass: the full search runs
        cheap._allocate(ids, [8] * 8, 8)


def test_measured_draft_passes_price_passes_apart_from_the_rest_of_the_step():
    """Every request drafts the same k (max_k and drafts move together) and one huge prefill step
    sits among the samples: the step-level fit cannot tell a pass's fixed cost from its per-row
    cost, but passes reported as (rows, seconds) can. Truth: a pass costs 30 ms + 2 ms per row, the
    rest of a step 50 ms + 1 ms per token (the prefill took 40 s for 32K tokens)."""
    model = CostModel()
    rng = np.random.default_rng(5)
    model.observe(32768, 0, 40.0)
    for _ in range(64):
        batch, k = int(rng.integers(4, 9)), int(rng.integers(1, 9))
        passes = [(batch, 0.030 + 0.002 * batch + rng.normal(0, 1e-4)) for _ in range(k)]
        rest = 0.050 + 0.001 * batch * (k + 1)
        model.observe(batch * (k + 1), k, rest + sum(s for _, s in passes), draft_tokens=batch * k,
                      draft_passes=passes)
    assert abs(model.prices.draft_pass - 0.030) < 1e-3 and abs(model.prices.pass_row - 0.002) < 2e-4
    # a single request drafting 8: eight 1-row passes, 8 * 32 ms, not a share of the batch's passes
    assert abs(model.predict(9, 8, draft_tokens=8) - model.predict(1, 0)
               - 8 * 0.032 - 8 * model.prices.draft_row) < 1e-3


def test_pass_fit_stays_non_negative():
    model = CostModel()
    # faster with more rows: noise
    for rows, secs in [(1, 0.05), (2, 0.04), (4, 0.03), (8, 0.02)] * 2:
        model.observe(rows * 2, 1, secs + 0.01, draft_tokens=rows, draft_passes=[(rows, secs)])
    assert model.prices.draft_pass > 0 and model.prices.pass_row == 0.0


@pytest.mark.parametrize("step_s, gap", [(0.06, 12), (0.0021, 318), (1.0, 4)])
def test_refits_once_the_fits_have_taken_their_share_of_the_steps_time(monkeypatch, step_s, gap):
    """A fit of 2 ms waits until the steps since the last one took 2 ms / FIT_SHARE (0.3%: 0.67
    s): 12 of the CPU's 60 ms steps, 318 of a GPU's 2.1 ms ones; never fewer than 4 steps. The
    first fit's time (numpy's set-up with it) does not space the second: 4 steps later."""
    assert FIT_SHARE == 0.003
    model = CostModel()
    fits = []
    ticks = iter(np.arange(0.0, 1e3, 0.002))           # each fit "takes" 2 ms of this clock
    model.clock = lambda: float(next(ticks))
    monkeypatch.setattr(model, "fit", lambda: fits.append(len(model.samples)))
    for i in range(1200):
        model.observe(1 + i % 7, i % 3, step_s)
    # the first at 8 samples, the second at 12, then every `gap` steps (the window holds 256)
    assert fits == [8] + [min(12 + gap * i, 256) for i in range(1 + (1200 - 12) // gap)]


def test_the_fit_equals_scipy_nnls_over_every_column():
    """The fit leaves the per-step price free (centred columns): on noisy steps whose true prices
    include zeros (the unconstrained fit would go negative there) it must land where a textbook
    NNLS over every column, the intercept's included, does, in relative error (each step's row
    divided by its seconds)."""
    from scipy.optimize import nnls
    rng = np.random.default_rng(7)
    for trial in range(20):
        model = CostModel()
        truth = np.array(terms(0.02, 0.003, 0.0, 1e-10, 0.0, 0.0004, 0.001, 0.0))
        truth[rng.choice([1, 5, 6, 7], 2, replace=False)] = 0.0
        for _ in range(96):
            rows, drafts = int(rng.integers(1, 16)), int(rng.integers(0, 9))
            depth, swap = min(drafts, int(rng.integers(1, 5))), int(rng.integers(0, 10**8))
            prefill = int(rng.integers(0, 200)) * int(rng.random() < 0.3)
            x = np.array(terms(1, rows, depth, swap, 0, prefill, drafts, drafts > 0))
            model.samples.append((*x, float(x @ truth + rng.normal(0, 2e-4))))
        model.fit()
        data = np.array(model.samples)
        cols = [0, 1, 2, 3, 5, 6, 7]
        weighted = data[:, cols] / data[:, -1:]
        scale = np.abs(weighted).max(axis=0)
        ref, _ = nnls(weighted / scale, np.ones(len(data)))
        assert np.allclose(model.coef[cols], ref / scale, rtol=1e-6, atol=1e-12), trial


def test_the_draft_pass_fit_prices_the_context_a_drafter_reads():
    """Passes reported with their rows' context keys: a drafter over a cache that grows with the
    context (quantized pages) fits a price per key; one over a fixed window (its pass costs the
    same at any context) fits none."""
    rng = np.random.default_rng(9)
    for per_key in (4e-6, 0.0):
        model = CostModel()
        for _ in range(64):
            rows, context = int(rng.integers(1, 5)), int(rng.integers(100, 4000))
            passes = [DraftPass(rows, 0.002 + 0.0005 * rows + per_key * rows * (context + j)
                                + rng.normal(0, 1e-5), rows * (context + j)) for j in range(4)]
            model.observe(rows * 5, 4, 0.02 + sum(p.seconds for p in passes),
                          draft_tokens=rows * 4, draft_passes=passes)
        assert abs(model.prices.pass_key - per_key) < 2e-7
        assert abs(model.prices.draft_pass - 0.002) < 3e-4
        assert abs(model.prices.pass_row - 0.0005) < 2e-4


def _goodput(ctl, probs, k, base, context):
    """The step's tokens over its time at draft length k, written out: one request whose draft
    pass reads `context` keys."""
    p = ctl.cost.prices
    value = 1 + np.cumprod(probs[:k]).sum()
    seconds = (base + k * (p.draft_pass + ctl.cost.draft_price(context))
               + (k > 0) * p.drafting_step)
    return value / seconds


def test_adaptive_drafts_where_drafting_wins_and_not_where_it_costs_more_than_it_saves():
    """Prices shaped like lossy_kv on this CPU: a decode step grows with its context (row_key), and
    a draft pass over quantized pages grows with it too (pass_key), over a window it does not.
    Short contexts: drafting wins and k is the goodput-best one. At 2.8K a quantized pass costs
    more than the 90% chance of a token saves: k = 0 (priced as at short context, without its
    context, the controller drafted). A window drafter at 2.8K still drafts."""
    quant = CostModel(0.004, 0.001, 0.001, draft_row=0.0005, row_key=4e-6, pass_key=6e-6)
    window = CostModel(0.004, 0.001, 0.003, draft_row=0.0005, row_key=4e-6)
    for cost, context, drafts in ((quant, 100, True), (quant, 2800, False), (window, 2800, True)):
        ctl = DraftLengthController(8, cost=cost)
        ctl.accept["r"] = np.full(8, 0.9)
        k = ctl.choose(["r"], [8], 1, row_keys=context, contexts=[context])[0]
        base = cost.predict(1, 0, row_keys=context)
        rates = [_goodput(ctl, ctl.probs("r"), j, base, context) for j in range(9)]
        assert (k > 0) == drafts, (context, k, rates)
        if drafts:
            assert rates[k] == max(rates) and rates[k] > (1 + MARGIN) * rates[0]
        else:
            assert max(rates[1:]) < rates[0]
    blind = DraftLengthController(8, cost=quant)
    blind.accept["r"] = np.full(8, 0.9)
    assert blind.choose(["r"], [8], 1, row_keys=2800)[0] > 0      # the context unseen


def test_a_long_context_request_drafts_less_than_a_short_one_in_the_same_batch():
    """Per-request draft prices: beside a short-context request the long one's drafts over a
    context-priced drafter are the dearer, and the allocation gives them fewer."""
    cost = CostModel(0.004, 0.001, 0.0005, draft_row=0.0005, row_key=4e-6, pass_key=3e-6)
    ctl = DraftLengthController(8, cost=cost)
    for r in ("short", "long"):
        ctl.accept[r] = np.full(8, 0.8)
    k_short, k_long = ctl.choose(["short", "long"], [8, 8], 2, row_keys=3100,
                                 contexts=[100, 3000])
    assert k_short > k_long


def test_drafts_are_one_a_request_until_the_draft_prices_are_measured():
    """A cost model whose draft prices are priors (the scheduler's, for its first drafting
    steps) lets a request draft one token: a drafter whose passes cost seconds at a long context
    pays a few single passes, not k_max of them, before its price is known."""
    ctl = DraftLengthController(8, cost=CostModel(unpriced_drafting_steps=2))
    ctl.accept["r"] = np.full(8, 0.95)
    for _ in range(2):
        assert ctl.choose(["r"], [8], 1) == [1]
        ctl.cost.observe(2, 1, 0.02, draft_tokens=1)
    assert ctl.choose(["r"], [8], 1)[0] >= 4


def test_a_drafter_timed_up_front_is_priced_before_any_request_drafts():
    """`CostModel.calibrate`: draft passes timed at two context lengths before any request
    drafted price the pass and its context keys, and end the exploring. A drafter whose pass at
    a long context costs many steps then never drafts there (no single exploring draft either),
    while at a short context, where its pass is cheap, it drafts several at once."""
    cost = CostModel(unpriced_drafting_steps=4)
    cost.calibrate([(1, 0.011, 512), (1, 0.011, 513), (1, 0.041, 2048), (1, 0.041, 2049)])
    assert cost.unpriced_drafting_steps == 0
    assert cost.prices.pass_key == pytest.approx(0.03 / 1536, rel=1e-3)
    assert cost.prices.draft_pass == pytest.approx(0.011 - 512.5 * 0.03 / 1536, rel=1e-3)
    ctl = DraftLengthController(8, cost=cost)
    ctl.accept["r"] = np.full(8, 0.95)
    assert ctl.choose(["r"], [8], 1, row_keys=2800, contexts=[2800]) == [0]
    cheap = CostModel(unpriced_drafting_steps=4)
    cheap.calibrate([(1, 0.0004, 64), (1, 0.0004, 65), (1, 0.0005, 256), (1, 0.0005, 257)])
    ctl = DraftLengthController(8, cost=cheap)
    ctl.accept["r"] = np.full(8, 0.95)
    assert ctl.choose(["r"], [8], 1, row_keys=100, contexts=[100])[0] >= 4
    # too few passes to fit: the prices stay priors, and exploring stays on
    few = CostModel(unpriced_drafting_steps=4)
    few.calibrate([(1, 0.5, 2048)])
    assert few.unpriced_drafting_steps == 4 and few.prices.pass_key == 0.0


def test_a_request_starts_drafting_only_where_its_drafts_win_back_its_state():
    """A drafter that builds a request's state on its first draft round (lossy_kv encodes the
    whole context) prices that once (`CostModel.state_price` a context token), shared out over
    the tokens the request may still generate: where drafting wins ~7% a step, a 2.8K context
    with 10 tokens left does not start (a one-token probe neither), with 4000 left it does, and
    a request already started drafts as before."""
    cost = CostModel(step=0.015, row=0.002, draft_row=0.002)
    cost.calibrate([(1, 0.008, 64), (1, 0.008, 65), (1, 0.008, 256), (1, 0.008, 257)],
                   state_price=40e-6)                        # 2.8K tokens: 112 ms once
    ctl = DraftLengthController(8, cost=cost)
    ctl.accept["r"] = np.full(8, 0.9)
    started = ctl.choose(["r"], [8], 1, row_keys=2800, contexts=[2800], unstarted=[0],
                         remaining=[10])
    assert started[0] >= 2
    for _ in range(40):                                      # past any probe interval
        assert ctl.choose(["r"], [8], 1, row_keys=2800, contexts=[2800], unstarted=[2800],
                          remaining=[10]) == [0]
    assert ctl.choose(["r"], [8], 1, row_keys=2800, contexts=[2800], unstarted=[2800],
                      remaining=[4000]) == started
    # a batch: two started requests share the pass; an unstarted one is left out
    ctl.accept["a"] = ctl.accept["b"] = np.full(8, 0.9)
    both = ctl.choose(["a", "b"], [8, 8], 2, row_keys=5600, contexts=[2800, 2800],
                      unstarted=[0, 0], remaining=[10, 10])
    assert min(both) >= 2
    mixed = ctl.choose(["a", "b"], [8, 8], 2, row_keys=5600, contexts=[2800, 2800],
                       unstarted=[2800, 0], remaining=[10, 10])
    assert mixed[0] == 0


def test_a_round_s_set_up_is_priced_once_a_drafting_step_not_per_pass():
    """A round's first pass also holds its set-up (`DraftPass.first`): the pass fit prices that
    apart (`round_price`, paid once a drafting step with `drafting_step`), so a deep round is not
    priced as if every pass paid it."""
    cost = CostModel()
    passes = [DraftPass(1, 0.006 + 0.003 * (j == 0), 1000, int(j == 0))
              for depth in (1, 2, 8) for j in range(depth)]
    cost.calibrate(passes)
    assert cost.prices.draft_pass == pytest.approx(0.006, rel=1e-6)
    assert cost.round_price == pytest.approx(0.003, rel=1e-6)
    assert cost.step_price() == pytest.approx(cost.prices.drafting_step + 0.003)


def test_a_negative_intercept_is_refitted_not_floored():
    """Steps whose seconds grow faster than their rows (a free intercept fits -1 ms) are priced
    by a non-negative intercept fitted with the rest: flooring the negative one would add its
    1 ms to every prediction (the 1-row step priced at twice its seconds)."""
    cost = CostModel()
    for _ in range(3):
        for rows, seconds in ((1, 0.001), (2, 0.003), (3, 0.005)):
            cost.observe(rows, 0, seconds)
    cost.fit()
    assert cost.prices.step >= 0
    for rows, seconds in ((1, 0.001), (2, 0.003), (3, 0.005)):
        assert abs(cost.predict(rows, 0) - seconds) < 0.5 * seconds


def test_requests_that_cannot_draft_still_count_in_the_step():
    """The scheduler passes only the requests that may draft (n-gram: those whose context
    matches), with the step's decoding rows as num_other_tokens. Every decoding row commits a
    token, so the allocation must equal the one over every row with the others capped at 0: a
    step of 8 rows valued as 1 made a lone request's 80% drafts look like a gain."""
    model = CostModel(0.0005, 0.004, draft_row=0.0035)
    ids = [f"r{i}" for i in range(8)]
    rng = np.random.default_rng(3)
    for p in (0.8, 0.9, 0.97):
        ctl = DraftLengthController(4, cost=model, margin=0.0)
        for r in ids:
            ctl.accept[r] = np.clip(p + rng.normal(0, 0.02, 4), 0, 1)
        full = ctl._allocate(ids, [4, 0, 4, 0, 0, 0, 0, 0], 8)
        assert ctl._allocate(["r0", "r2"], [4, 4], 8) == [full[0], full[2]]
    # 80%: a draft (0.8 tokens for 3.5 ms) is worth less than a decode row (1 for 4 ms)
    ctl.accept["r0"] = np.full(4, 0.8)
    assert ctl._allocate(["r0"], [4], 8) == [0]


def test_estimates_that_regress_are_calibrated():
    """Each new request arrives with estimates of 90% at every position, and each round it is
    given realises its first draft and never its second. The controller keeps what the drafts
    it allocated promised per position against what they realised: after such rounds a new
    request with the same estimates drafts one, where a fresh controller drafts four."""
    cost = CostModel(0.02, 0.002, draft_row=0.002)
    fresh, ctl = DraftLengthController(4, cost=cost), DraftLengthController(4, cost=cost)
    for c in (fresh, ctl):
        c.accept["new"] = np.full(4, 0.9)
    assert fresh.choose(["new"], [4], 1) == [4]
    for t in range(40):
        ctl.accept[f"r{t}"] = np.full(4, 0.9)
        k = ctl.choose([f"r{t}"], [4], 1)[0]
        ctl.observe(f"r{t}", k, 1)
        ctl.release(f"r{t}")
    assert not ctl.pending                              # observed or released: none left
    assert ctl.calibration[0] == 1.0 and ctl.calibration[1] < 0.1
    assert ctl.choose(["new"], [4], 1) == [1]
