"""FASER-style draft length per request each step, chosen to maximise expected goodput.

    acceptance  each request keeps p_i = P(draft i accepted | drafts before it accepted), one EMA
                per position, starting from the engine-wide estimate; a step that drafted k and
                accepted a observes positions 0..min(a, k-1): accepted for i < a, rejected at i = a.
                Positions it never reached read as its deepest observed one (optimism that
                explores).
    value       E_r(k) = 1 + sum_{j=1..k} prod_{i<j} p_i   (tokens committed, the bonus included)
    cost        T(step) = c0 + c1 * rows + c2 * max_k + c3 * swap + c4 * pass_rows + c5 * prefill
                          + c6 * drafts + c7 * [drafts > 0]
                fitted online (non-negative least squares) on measured steps. rows: one per
                decoding or verifying request; drafts: the verify rows of drafts, priced apart
                (an extra row of a request already in the step costs less than a request's row:
                its weights are read anyway, its sampling and bookkeeping shared); c7: what a
                step that verifies any draft pays once (multi-row attention, acceptance, on a GPU
                a larger captured graph: ~0.3 ms of a 2.3 ms step at 8 requests, whatever the
                number of drafts; docs/BENCHMARKS.md §7.6, §9.12). prefill: the rows of prompt
                chunks, priced apart because many rows share each weight read. c2: sequential
                draft passes and c4: a row in them, both 0 for n-gram and token recycling; c3:
                VeriCache's host -> device bytes, predicted from the last step. A drafter that
                runs the model reports each draft pass (rows, seconds): c2 + c4 * rows is then
                fitted on the passes alone, and the rest on the rest of the step
    allocation  for each depth d = max_r k_r: hand out drafts (each request at most d) in order of
                marginal value P(all drafts so far accepted) while sum_r E_r / T rises; keep the
                best depth (the per-step costs c7 and c2 * d are shared across the batch's
                drafts), and draft only where it promises MARGIN more goodput than no draft: the
                drafting the model calls a gain of a few percent also pays what the model does
                not see (the controller's own time, the acceptance estimate's optimism).
    probing     a request held at k = 0 for a few steps drafts one token, so its estimate stays
                live. A probe rejected doubles that request's interval (8, 16, ... 64 steps), one
                accepted resets it: on text that never repeats, probes at a fixed interval cost a
                verify row each for little (16 requests probed every 8 steps: 2 verify rows a
                step on top of 16). Probes ride on a draft pass the step runs anyway; when none
                runs, the due probe takes every request idle for half its interval along (for a
                drafter whose pass costs a forward, staggered probes would add a pass to nearly
                every step). No probe where drafting could not pay even if every draft were
                accepted (the cost model says so).
Under load c1 * rows dominates, every extra draft lowers goodput and k falls to 0 by itself: no
batch-size threshold, so no cliff.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np


FIT_SHARE = 0.003               # the cost model's fits: at most this share of the steps' time
# the goodput gain a step's drafts must promise over drafting none. What the model leaves out:
# the controller's own time (choose, observe, refits: 0.5-0.6 ms of a ~40 ms step at 8 requests
# on the AVX2 host, 0.8-1.0 before §9.13's cuts) and its acceptance estimate's optimism (~5%
# more accepted drafts predicted than realised at 8 requests, §9.12); docs/BENCHMARKS.md §9.13
MARGIN = 0.03
# candidates x depths up to which `_allocate`'s search runs in plain Python (faster below it, numpy
# above: docs/BENCHMARKS.md §9.13)
PYTHON_SEARCH = 1024


class CostModel:
    """Step time ~ c0 + c1 * rows + c2 * max_draft_len + c3 * swap_bytes + c4 * pass_rows
    + c5 * prefill_tokens + c6 * draft_tokens + c7 * [draft_tokens > 0], refitted from recent
    steps (columns as in the module docstring). The callers' num_tokens counts the rows of decodes
    and verification, drafts included; draft_tokens the drafts alone; prefill_tokens the rows of
    prompt chunks. A drafter that runs the model (lossy_kv, layer_skip) also pays a row in each
    draft pass (c4, fitted on the passes it reports). swap_bytes: full-KV bytes staged host ->
    device for verification (VeriCache); 0 elsewhere. A step's swap does not depend on its draft
    lengths, but it raises the price of the step they share, which makes drafts worth more: the
    controller sees it through the goodput ratio. Until steps with drafts are seen, c6 follows c1
    (a draft's verify row priced as a row)."""

    def __init__(self, c0: float = 0.02, c1: float = 0.002, c2: float = 0.0, c3: float = 0.0,
                 c4: float = 0.0, c5: float = 0.0, c6: float | None = None, c7: float = 0.0,
                 window: int = 256):
        self.coef = np.array([c0, c1, c2, c3, c4, c5, c1 if c6 is None else c6, c7])
        self.samples: deque[tuple[float, ...]] = deque(maxlen=window)
        self.unfitted = 0                           # samples observed since the last fit
        self.unfitted_s = 0.0                       # their steps' seconds
        self.fit_s = 0.0                            # what the last fit took
        self.clock = time.perf_counter
        # (rows, seconds) per draft pass
        self.passes: deque[tuple[float, float]] = deque(maxlen=window)

    def predict(self, num_tokens: int, max_draft_len: int, swap_bytes: int = 0,
                draft_tokens: int = 0, prefill_tokens: int = 0) -> float:
        return float(self.coef @ np.array([1.0, num_tokens - draft_tokens, max_draft_len,
                                           swap_bytes, draft_tokens, prefill_tokens,
                                           draft_tokens, float(draft_tokens > 0)]))

    def draft_price(self) -> float:
        """What one more draft adds at a fixed depth: its draft row and its verify row."""
        return float(self.coef[4] + self.coef[6])

    def step_price(self) -> float:
        """What a step verifying any draft pays once, besides its drafts and passes."""
        return float(self.coef[7])

    def observe(self, num_tokens: int, max_draft_len: int, seconds: float, swap_bytes: int = 0,
                draft_tokens: int = 0, draft_passes: list[tuple[int, float]] | None = None,
                prefill_tokens: int = 0) -> None:
        """draft_passes: (rows, seconds) of each draft forward the step ran, where the drafter
        reports them. Then the passes alone fit c2 (per pass) and c4 (per row): a pass of r rows
        costs c2 + c4 * r, which the step-level fit cannot separate when every request drafts the
        same k (max_k and drafts move together) and whose scale it confuses with prefill steps and
        long contexts. The rest of the step (verify, sampling, cache upkeep) then fits the other
        coefficients with c2, c4 fixed. Without passes c4 keeps its value (0: no draft rows)."""
        self.unfitted += 1
        self.unfitted_s += seconds
        if draft_passes:
            self.passes.extend((float(r), float(s)) for r, s in draft_passes)
            self._fit_passes()
            seconds = max(seconds - sum(s for _, s in draft_passes), 0.0)
            max_draft_len = 0                         # priced by the pass fit: held at zero
        self.samples.append((1.0, float(num_tokens - draft_tokens), float(max_draft_len),
                             float(swap_bytes), 0.0, float(prefill_tokens), float(draft_tokens),
                             float(draft_tokens > 0), seconds))
        # refit every 4 steps or more, when the fits have taken at most FIT_SHARE of the steps'
        # time since the last one: about every 0.5-0.7 s of steps, a dozen of the CPU's ~40-60
        # ms at 8 requests, a few hundred of a GPU's 2-3 ms (refits every 4 to 16 steps took
        # ~0.2 ms a GPU step, more than the choice they steer could win back: docs/BENCHMARKS.md
        # §7.5, §7.6; at 1% a CPU step at 8 requests still paid ~0.3 ms: §9.13)
        if (len(self.samples) >= 8 and self.unfitted >= 4
                and self.fit_s <= FIT_SHARE * self.unfitted_s):
            start = self.clock()
            self.fit()
            self.fit_s = self.clock() - start
            self.unfitted, self.unfitted_s = 0, 0.0

    def _fit_passes(self) -> None:
        """c2 + c4 * rows over the recent draft passes, both >= 0 (NNLS on two columns)."""
        if len(self.passes) < 4:
            return
        rows, secs = np.array(self.passes).T
        if np.ptp(rows) > 0:
            (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(rows), rows], 1), secs, rcond=None)
        else:
            a, b = -1.0, 0.0
        if a < 0 or b < 0:                           # the better of the two one-column fits
            a_only = (float(secs.mean()), 0.0)
            b_only = (0.0, float(rows @ secs / (rows @ rows)))
            a, b = min(a_only, b_only,
                       key=lambda ab: float(np.sum((ab[0] + ab[1] * rows - secs) ** 2)))
        self.coef[2], self.coef[4] = a, b

    def fit(self) -> None:
        """Non-negative least squares over the regressors that varied (the others keep their value).

        Exact NNLS by enumeration (eight coefficients): every subset of the free columns that keeps
        the intercept is solved, solutions with a negative coefficient are discarded, the smallest
        residual wins and, on a tie, the smaller subset (then the first in enumeration order).
        Clamping an unconstrained solution is wrong when columns are collinear: at batch 1 with an
        n-gram drafter, tokens = 1 + max_k exactly, and a split like c1 = 9 ms, c2 = -8.7 ms
        clamped to c2 = 0 prices each draft token 30x too high.
        """
        data = np.array(self.samples)
        n = len(self.coef)
        x, y = data[:, :n], data[:, n]
        free = [0] + [j for j in range(1, n) if np.ptp(x[:, j]) > 0]
        fixed = [j for j in range(n) if j not in free]
        target = y - x[:, fixed] @ self.coef[fixed]
        # every subset at once, through the normal equations of the columns scaled to 1 (swap
        # bytes run to 1e8 beside indicators): one batched pseudo-inverse, not a least-squares
        # call per subset (1.3 against 4.4 ms a fit on the AVX2 host)
        scale = np.abs(x[:, free]).max(axis=0)
        xs = x[:, free] / scale
        gram, moment = xs.T @ xs, xs.T @ target
        masks = (np.arange(1 << (len(free) - 1))[:, None] >> np.arange(len(free) - 1)) & 1
        keep = np.concatenate([np.ones((len(masks), 1)), masks], axis=1)     # intercept always
        coef = np.einsum("mij,mj->mi", np.linalg.pinv(gram * keep[:, :, None] * keep[:, None, :]),
                         moment * keep) * keep           # exact zeros where left out (not -1e-16)
        resid = (target @ target - 2 * coef @ moment
                 + np.einsum("mi,ij,mj->m", coef, gram, coef))
        ok = ~(coef[:, 1:] < 0).any(axis=1)           # the intercept alone always qualifies
        order = np.lexsort((np.arange(len(masks)), keep.sum(axis=1), np.round(resid, 12)))
        best = order[ok[order]][0]
        self.coef[free] = coef[best] / scale            # 0 where the best subset left a column
        self.coef[0] = max(self.coef[0], 1e-6)
        if 6 not in free:               # no drafts in the window: a draft's row priced as a row
            self.coef[6] = self.coef[1]


class DraftLengthController:
    def __init__(self, k_max: int, ema: float = 0.3, prior: float = 0.6,
                 cost: CostModel | None = None,
                 probe_every: int = 8, probe_backoff: int = 8, margin: float = MARGIN):
        self.k_max, self.ema, self.probe_every = k_max, ema, probe_every
        self.margin = margin
        self.longest_interval = probe_every * probe_backoff
        # steps in a row given k = 0
        self.idle: dict[str, int] = {}
        self.interval: dict[str, int] = {}              # a request's probe interval (backed off)
        self.probing: set[str] = set()                  # probed this step, outcome not yet seen
        self.depth: dict[str, int] = {}                                  # positions observed so far
        self.prior = np.full(k_max, prior)                               # engine-wide p_i
        self.accept: dict[str, np.ndarray] = {}
        self.cost = cost or CostModel()

    def probs(self, request_id: str) -> np.ndarray:
        """Positions this request has never reached take its deepest observed estimate: a frozen
        prior there would cap k at the depth already tried (a request accepting 99% at position 0
        would never be offered position 1 while the prior says 0.6)."""
        p = self.accept.get(request_id)
        if p is None:
            return self.prior
        depth = self.depth.get(request_id, self.k_max)
        if depth < self.k_max:
            p = p.copy()
            p[depth:] = p[depth - 1]
        return p

    def first_prob(self, request_id: str) -> float:
        """`probs(request_id)[0]` without building the array (on every step's critical path)."""
        p = self.accept.get(request_id)
        if p is None:
            return float(self.prior[0])
        return float(p[0] if self.depth.get(request_id, self.k_max) > 0 else p[-1])

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        probed = request_id in self.probing
        self.probing.discard(request_id)
        if num_drafted == 0:                    # nothing drafted (no n-gram match): nothing paid
            return
        if num_accepted:
            self.interval.pop(request_id, None)
        elif probed:
            self.interval[request_id] = min(2 * self.probe_interval(request_id),
                                            self.longest_interval)
        p = self.accept.setdefault(request_id, self.prior.copy())
        seen = min(num_accepted + 1, num_drafted)
        self.depth[request_id] = max(self.depth.get(request_id, 0), seen)
        hits = (np.arange(seen) < num_accepted).astype(float)
        p[:seen] += self.ema * (hits - p[:seen])
        self.prior[:seen] += 0.05 * (hits - self.prior[:seen])

    def release(self, request_id: str) -> None:
        self.accept.pop(request_id, None)
        self.idle.pop(request_id, None)
        self.depth.pop(request_id, None)
        self.interval.pop(request_id, None)
        self.probing.discard(request_id)

    def probe_interval(self, request_id: str) -> int:
        """Steps at k = 0 before this request is probed: `probe_every`, doubled by each rejected
        probe up to `probe_every * probe_backoff`, reset by an accepted draft."""
        return self.interval.get(request_id, self.probe_every)

    def choose(self, request_ids: list[str], caps: list[int], num_other_tokens: int,
               swap_bytes: int = 0, prefill_tokens: int = 0) -> list[int]:
        """Draft length per request (see the module docstring). caps[i] bounds request i;
        num_other_tokens: the one token every decoding request computes anyway; prefill_tokens:
        the rows of the step's prompt chunks.
        A request held at k = 0 for its probe interval (`probe_interval`) drafts one token: without
        it an estimate that fell low would never be observed again, and a request whose text
        turned repetitive would never be drafted for. Probes are grouped into as few draft passes
        as possible: a step that drafts anyway probes every due request; otherwise the first due
        request brings along every request idle for at least half its interval, so the batch's
        probes fall into step."""
        ks = self._allocate(request_ids, caps, num_other_tokens, swap_bytes, prefill_tokens)
        idle = []
        for i, r in enumerate(request_ids):
            if ks[i] or min(caps[i], self.k_max) < 1:
                self.idle[r] = 0
            else:
                self.idle[r] = self.idle.get(r, 0) + 1
                idle.append(i)
        waited = {i: self.idle[request_ids[i]] / self.probe_interval(request_ids[i]) for i in idle}
        due = [i for i in idle if waited[i] >= 1]
        if due and not any(ks):
            due = [i for i in idle if 2 * waited[i] >= 1]
        # a probe that could not pay even if every draft were accepted is moot
        if due:
            certain = np.stack([self.probs(r) for r in request_ids])
            certain[due] = 1.0
            hopeful = self._allocate(request_ids, caps, num_other_tokens, swap_bytes,
                                     prefill_tokens, certain)
            due = [i for i in due if hopeful[i] > 0]
        for i in due:
            ks[i], self.idle[request_ids[i]] = 1, 0
            self.probing.add(request_ids[i])
        return ks

    def _allocate(self, request_ids: list[str], caps: list[int], num_other_tokens: int,
                  swap_bytes: int = 0, prefill_tokens: int = 0,
                  probs: np.ndarray | None = None) -> list[int]:
        """For each depth d (the batch's longest draft: what the c2 term prices), give drafts in
        order of marginal value, P(all drafts up to it accepted), each request at most d, while
        goodput rises; keep the best depth. With the depth fixed the marginal values only fall and
        the goodput bar only rises, so stopping at the first loss is exact for that depth. One
        greedy pass over all depths at once would be myopic where a step pays for drafting once
        (c7, and c2 > 0 per pass: lossy_kv, layer_skip): the batch's first draft pays it alone and
        looks like a loss, while k = 1 for every request shares it. It runs on every step's
        critical path: what decides that nothing pays comes first, from one number per request;
        `_greedy` searches the rest."""
        n = len(request_ids)
        limits = [min(c, self.k_max) for c in caps]
        most = max(limits, default=0)
        if most <= 0:
            return [0] * n
        # a step's predicted time at depth d >= 1 before its drafts: base_d = base_0 + c7 + c2 * d
        base0 = self.cost.predict(num_other_tokens, 0, swap_bytes, 0, prefill_tokens)
        # whether any draft can pay, from one number per request (the usual case under load,
        # decided without the arrays): every set of drafts at depth d has goodput
        # (n + S) / (base_d + price * m), S the sum of its m values
        # - a mediant of n / base_d <= n / base_0 and S / (price * m) <= g / price, g the most
        #   valuable draft (some request's first: P(all drafts so far accepted) only falls along
        #   a chain), so it beats n / base_0 only if g / price does;
        # - at most (n + d * F) / base_d, F the sum of first probabilities (no chain value
        #   exceeds its first), monotone in d: where it loses at d = 1 and at the deepest d, the
        #   per-step costs (c7, c2 * d) are more than every draft together could win
        # (both against the bar: n / base_0 raised by the margin)
        firsts = [self.first_prob(r) if probs is None else float(probs[i, 0])
                  for i, (r, k) in enumerate(zip(request_ids, limits)) if k > 0]
        price, step = self.cost.draft_price(), self.cost.step_price()
        per_pass = float(self.cost.coef[2])
        bar = (1.0 + self.margin) * n
        if max(firsts) * base0 <= bar * price:
            return [0] * n
        total = sum(firsts)
        if all((n + d * total) * base0 <= bar * (base0 + step + per_pass * d) for d in (1, most)):
            return [0] * n
        best = bar / base0
        if per_pass == 0 or sum(limits) * most <= PYTHON_SEARCH:
            return self._greedy(request_ids, limits, probs, base0 + step, per_pass, price, best)
        return self._greedy_arrays(request_ids, limits, probs, base0 + step, per_pass, price,
                                   best)

    def _greedy(self, request_ids: list[str], limits: list[int], probs: np.ndarray | None,
                base: float, per_pass: float, price: float, best: float) -> list[int]:
        """`_allocate`'s search: the candidate drafts in order of value (then position, then
        request), and for each depth d a greedy over those at positions < d on a step of
        base + per_pass * d; a depth counts where one of its drafts at position d - 1 is taken,
        and the depth of the highest goodput wins (the first on a tie) where it beats `best`
        (else no draft). Where no cost grows with depth (per_pass = 0) the deepest depth's
        candidates hold every other's, and its greedy alone decides (what it takes is what the
        shallowest depth reaching it would take). Plain Python: a few dozen candidates on every
        step's critical path, where numpy's per-call overhead made a vectorised search several
        times slower (docs/BENCHMARKS.md §9.13)."""
        n = len(request_ids)
        candidates = []
        for i, (r, k) in enumerate(zip(request_ids, limits)):
            chain = 1.0
            for j, p in enumerate((self.probs(r) if probs is None else probs[i])[:k].tolist()):
                chain *= p
                if not chain > 0:
                    break
                candidates.append((-chain, j, i))
        candidates.sort()
        most = max(limits)
        chosen = [0] * n
        for d in (range(1, most + 1) if per_pass else (most,)):
            step = base + per_pass * d
            ks, value, goodput, taken, reached = [0] * n, float(n), n / step, 0, not per_pass
            for neg, j, i in candidates:
                if j >= d:
                    continue
                better = (value - neg) / (step + price * (taken + 1))
                if not better > goodput:
                    break
                value, goodput, taken = value - neg, better, taken + 1
                ks[i] += 1
                reached = reached or j == d - 1
            if taken and reached and goodput > best:
                best, chosen = goodput, ks
        return chosen

    def _greedy_arrays(self, request_ids: list[str], limits: list[int],
                       probs: np.ndarray | None, base: float, per_pass: float, price: float,
                       best: float) -> list[int]:
        """`_greedy` vectorised over every depth and candidate at once: where there are many
        (64 requests drafting 8 with a per-pass cost: 0.5 against 1 ms in Python)."""
        n = len(request_ids)
        most = max(limits)
        if probs is None:
            probs = np.stack([self.probs(r) for r in request_ids])
        chain = np.cumprod(probs, axis=1)                                            # [n, k_max]
        limits = np.asarray(limits, dtype=np.int64)
        valid = (np.arange(self.k_max)[None, :] < limits[:, None]) & (chain > 0)
        if not valid.any():
            return [0] * n
        req, pos = np.nonzero(valid)
        gain = chain[req, pos]
        # by value; a request's drafts stay in position order
        order = np.lexsort((req, pos, -gain))
        req, pos, gain = req[order], pos[order], gain[order]
        depths = np.arange(1, most + 1)
        base = base + per_pass * depths
        # every depth at once: row d-1 takes the candidates of position < d, in value order
        take = pos[None, :] < depths[:, None]                                  # [depths, cands]
        counts = np.cumsum(take, axis=1)
        goodput = ((n + np.cumsum(np.where(take, gain, 0.0), axis=1))
                   / (base[:, None] + price * counts))
        # each taken candidate against the goodput before it (the depth's last taken, or none)
        cand = np.arange(len(gain))
        last = np.maximum.accumulate(np.where(take, cand, -1), axis=1)
        before = np.concatenate([np.full((len(depths), 1), -1), last[:, :-1]], axis=1)
        previous = np.where(before >= 0, np.take_along_axis(goodput, before.clip(0), axis=1),
                            (n / base)[:, None])
        loss = take & ~(goodput > previous)
        # the greedy stops at the first loss: candidates before it are taken
        cutoff = np.where(loss.any(axis=1), loss.argmax(axis=1), len(gain))
        taken = take & (cand[None, :] < cutoff[:, None])
        # a depth counts where it is reached (some request's draft at position d - 1 is taken);
        # its value is the goodput after its last taken draft; the first best depth wins
        reached = (taken & (pos[None, :] == depths[:, None] - 1)).any(axis=1)
        last_taken = len(gain) - 1 - taken[:, ::-1].argmax(axis=1)
        value = np.where(reached, goodput[depths - 1, last_taken], -np.inf)
        d = int(value.argmax())
        if not value[d] > best:
            return [0] * n
        return np.bincount(req[taken[d]], minlength=n).tolist()
