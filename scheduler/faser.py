"""FASER-style draft length per request each step, chosen to maximise expected goodput.

    acceptance  each request keeps p_i = P(draft i accepted | drafts before it accepted), one EMA
                per position, starting from the engine-wide estimate; a step that drafted k and
                accepted a observes positions 0..min(a, k-1): accepted for i < a, rejected at i = a.
                Positions it never reached read as its deepest observed one (optimism that
                explores), and a position first reached is updated from that estimate.
    value       E_r(k) = 1 + sum_{j=1..k} prod_{i<j} p_i   (tokens committed, the bonus included)
    calibration the drafts allocated promise their chain values at each position; what they
                realise over that (at most 1) scales the values: the requests chosen are those
                whose estimates read high, and high estimates regress.
    cost        T(step) = sum over the terms of `Prices` of price x the step's count of the term
                (`CostModel`), the prices fitted online on measured steps. Attention is priced per
                context key (a decode row's, a prompt chunk's, a draft pass's): a draft over a
                long context costs what the drafter's measured passes say it costs there.
    allocation  for each depth d = max_r k_r: hand out drafts (each request at most d) in order of
                marginal value P(all drafts so far accepted) over the draft's price (the
                request's context priced by `pass_key`) while sum_r E_r / T rises; keep the
                best depth (the once-per-step prices, `drafting_step` and `draft_pass` x d, are
                shared across the batch's drafts), and draft only where it promises MARGIN more
                goodput than no draft.
    probing     a request held at k = 0 for a few steps drafts (one token, or as many as would
                pay were each position accepted as its first is), so its estimates stay live. A
                probe rejected doubles that request's interval (8, 16, ... 64 steps), a draft
                accepted resets it, a probe accepted whole halves it (4, 2, 1: a request whose
                first drafts were rejected is not held at plain decoding for 4 x 8 steps while
                its probes say otherwise): on text that never repeats each probe is a verify
                row for nothing. Probes ride on a draft pass the step runs anyway; when none
                runs, the due probe takes every request idle for half its interval along (for a
                drafter whose pass costs a forward, staggered probes would add a pass to nearly
                every step). No probe where drafting could not pay even if every draft were
                accepted.
    exploring   while the cost model's draft prices are still priors (`unpriced_drafting_steps`,
                the scheduler's first 4 drafting steps), a request drafts at most one: a drafter
                whose pass costs a forward over a long context is priced before it drafts k_max.
                A drafter that runs the model is timed at start-up instead (`CostModel.calibrate`
                from the engine's warm-up): its passes are priced before any request drafts, so
                where a pass costs more than drafting could win, no request ever drafts.
    starting    a drafter that builds a state per request on its first round (lossy_kv encodes
                the whole context) prices that once (`state_price` a context token): until a
                request has drafted, its first draft of a step also pays its share of that
                build over the tokens it may still generate; it is probed only where the build
                costs at most a quarter of the steps between probes. Nor is any state built
                while the step prices are still priors (`unpriced_steps`: before the first fit):
                the build is paid whatever later steps measure.
Under load the rows' price dominates, every extra draft lowers goodput and k falls to 0 by itself:
no batch-size threshold, so no cliff.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, fields
from operator import attrgetter, mul
from typing import NamedTuple

import numpy as np

# the cost model's fits may take at most this share of the steps' time: a fit costs about as much
# as a step's whole controller, and the prices move slowly
FIT_SHARE = 0.003
# the goodput gain a step's drafts must promise over drafting none: what the cost model does not
# see, the controller's own time and its acceptance estimate's optimism (it predicts somewhat more
# accepted drafts than are realised)
MARGIN = 0.03
# the weight a drafting round's outcome keeps in `DraftLengthController.calibration` per later
# round: about the last 50 rounds count
CALIBRATION_DECAY = 0.98


@dataclass
class Prices:
    """Seconds a step costs per unit of each term. A step's count of each term:

    step           1
    row            the decoding or verifying requests: one row each
    draft_pass     the sequential draft passes (a drafter that runs the model: the depth; 0 for
                   n-gram and token recycling)
    swap_byte      full-KV bytes staged host -> device for verification (VeriCache); 0 elsewhere
    pass_row       the rows of those draft passes (0 for n-gram and token recycling)
    prefill_row    the rows of prompt chunks, priced apart: many rows share each weight read
    draft_row      the drafts' verify rows, priced apart from `row`: an extra row of a request
                   already in the step shares its weight reads, sampling and bookkeeping.
                   None: priced as `row` until steps with drafts are seen
    drafting_step  1 for a step that verifies any draft: what such a step pays once (multi-row
                   attention, acceptance, on a GPU a larger captured graph)
    row_key        the context keys the decoding or verifying requests attend: each request's
                   computed tokens, once per request (its draft rows ride on `draft_row`)
    prefill_key    the (row, key) pairs of the prompt chunks' causal attention: a chunk of n rows
                   from position s counts n * s + n * (n + 1) / 2
    pass_key       the context keys of the draft passes' rows, each row's request's computed
                   tokens (a drafter over a compressed cache reads fewer: the fit says how many)
    prefill_chunk  the prompt chunks: what each pays once whatever its rows (on this CPU a 1-row
                   chunk beside a decode costs most of a decode step)
    """
    step: float = 0.02
    row: float = 0.002
    draft_pass: float = 0.0
    swap_byte: float = 0.0
    pass_row: float = 0.0
    prefill_row: float = 0.0
    draft_row: float | None = None
    drafting_step: float = 0.0
    row_key: float = 0.0
    prefill_key: float = 0.0
    pass_key: float = 0.0
    prefill_chunk: float = 0.0

    def __post_init__(self) -> None:
        if self.draft_row is None:
            self.draft_row = self.row

    def values(self) -> tuple[float, ...]:
        """The prices in `TERMS` order."""
        return _prices_in_order(self)


TERMS = [f.name for f in fields(Prices)]
_prices_in_order = attrgetter(*TERMS)


def step_counts(rows: int, depth: int, swap_bytes: int = 0, draft_tokens: int = 0,
                prefill_tokens: int = 0, pass_rows: int | None = None, row_keys: int = 0,
                prefill_keys: int = 0, pass_keys: int = 0,
                prefill_chunks: int = 0) -> tuple[float, ...]:
    """A step's count of each term, in `TERMS` order. rows: decode and verify rows besides the
    drafts'; depth: the longest draft (one draft pass per position); pass_rows: rows in the draft
    passes (default: one per draft); the keys: `Prices`' *_key terms."""
    return (1.0, float(rows), float(depth), float(swap_bytes),
            float(draft_tokens if pass_rows is None else pass_rows), float(prefill_tokens),
            float(draft_tokens), float(draft_tokens > 0), float(row_keys), float(prefill_keys),
            float(pass_keys), float(prefill_chunks))


def prefill_keys(start: int, rows: int) -> int:
    """The (row, key) pairs of a prompt chunk of `rows` rows from position `start` (causal)."""
    return rows * start + rows * (rows + 1) // 2


class DraftPass(NamedTuple):
    """One draft forward as the worker timed it; keys: its rows' context keys (`pass_key`);
    first: 1 for a round's first pass, whose seconds also hold the round's set-up (syncing the
    states with the verified tokens, building the attention's view of them)."""
    rows: int
    seconds: float
    keys: int = 0
    first: int = 0


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0: Lawson and Hanson's active-set method (Solving Least Squares
    Problems, 1974, ch. 23; what scipy.optimize.nnls implements). Every coefficient starts held
    at 0. While a held one would lower the residual by growing (its gradient is positive), free the
    steepest and solve least squares over the free ones; where that solution has a coefficient
    <= 0, move from x towards it until the first free coefficient reaches 0, hold that one, and
    solve again. At the end no held coefficient could grow: the optimum."""
    m, n = a.shape
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 10 * max(m, n) * np.finfo(float).eps * np.abs(a).sum(axis=0).max() * np.abs(b).max()
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        grows = ~free & (gradient > tol)
        if not grows.any():
            break
        free[np.flatnonzero(grows)[np.argmax(gradient[grows])]] = True
        while True:
            s = np.zeros(n)
            s[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (s[free] > 0).all():
                break
            out = np.flatnonzero(free & (s <= 0))
            ratios = x[out] / (x[out] - s[out])
            x += ratios.min() * (s - x)
            x[out[ratios.argmin()]] = 0.0
            free &= x > 0
            x[~free] = 0.0
        x = s
    return x


def nonneg_least_squares(x: np.ndarray, y: np.ndarray, free_intercept: bool,
                         weight: np.ndarray | None = None) -> np.ndarray:
    """argmin ||w (x c - y)|| over c >= 0 (`nnls`), w the rows' weights (default 1), columns scaled
    to 1 first (swap bytes run to 1e8 beside 0/1 indicators). With free_intercept the first column
    must be ones and its coefficient may go negative: the other columns are centred on their
    w^2-weighted means (which takes the intercept out of the problem), fitted, and the intercept is
    what their means leave."""
    if free_intercept:
        w2 = np.ones_like(y) if weight is None else weight ** 2
        mean_x, mean_y = w2 @ x[:, 1:] / w2.sum(), w2 @ y / w2.sum()
        rest = nonneg_least_squares(x[:, 1:] - mean_x, y - mean_y, False, weight)
        return np.concatenate([[mean_y - mean_x @ rest], rest])
    if x.shape[1] == 0:
        return np.zeros(0)
    if weight is not None:
        x, y = x * weight[:, None], y * weight
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    return nnls(x / scale, y) / scale


class CostModel:
    """Step time = prices . step_counts(...), refitted from recent steps. Arguments: `Prices`'s.

    The callers' num_tokens counts the rows of decodes and verification, drafts included;
    draft_tokens the drafts alone; prefill_tokens the rows of prompt chunks. A step's swap does
    not depend on its draft lengths, but it raises the price of the step they share, which makes
    drafts worth more: the controller sees it through the goodput ratio.

    The fit: non-negative least squares over the recent steps, on the terms whose counts varied
    (the others keep their price), in relative error (each step's residual over its seconds: a
    3 s prompt step must not buy its fit with every 7 ms decode step's); the per-step price is the
    intercept, left free, or fitted non-negative with the rest where it came out below 1e-6 s. A
    drafter that runs the model reports each draft pass (`DraftPass`): the passes alone then fit
    draft_pass + pass_row x rows + pass_key x keys (the step-level fit cannot tell them apart
    when every request drafts the same k, and confuses their scale with prefill steps and long
    contexts), and the rest of the step fits the other prices."""

    def __init__(self, *prices: float, window: int = 256, unpriced_drafting_steps: int = 0,
                 unpriced_steps: bool = False, **named: float):
        """unpriced_drafting_steps: the draft prices are priors until this many steps that
        drafted have been observed (`DraftLengthController` drafts one a request till then).
        unpriced_steps: the step prices are priors until the first fit (`DraftLengthController`
        starts no request's drafting state till then)."""
        self.prices = Prices(*prices, **named)
        self.unpriced_drafting_steps = unpriced_drafting_steps
        self.unpriced_steps = unpriced_steps
        # seconds a context token adds to a request's first drafting round: the drafter builds
        # its state then (lossy_kv's compressed cache); not a step term, priced by the controller
        self.state_price = 0.0
        # what a draft round's set-up adds to its first pass (`DraftPass.first`): once a
        # drafting step, with `drafting_step`
        self.round_price = 0.0
        self.samples: deque[tuple[float, ...]] = deque(maxlen=window)   # TERMS' counts, seconds
        self.passes: deque[DraftPass] = deque(maxlen=window)
        self.unfitted = 0                           # samples observed since the last fit
        self.unfitted_s = 0.0                       # their steps' seconds
        self.fit_s = 0.0                            # what the last fit took
        self.num_fits = 0                           # fits made (the first is not timed)
        self.clock = time.perf_counter

    @property
    def coef(self) -> np.ndarray:
        """The prices in `TERMS` order (read-only: set prices by name)."""
        out = np.array(self.prices.values())
        out.flags.writeable = False
        return out

    def predict(self, num_tokens: int, max_draft_len: int, swap_bytes: int = 0,
                draft_tokens: int = 0, prefill_tokens: int = 0, row_keys: int = 0,
                prefill_keys: int = 0, pass_keys: int = 0, prefill_chunks: int = 0) -> float:
        counts = step_counts(num_tokens - draft_tokens, max_draft_len, swap_bytes, draft_tokens,
                             prefill_tokens, row_keys=row_keys, prefill_keys=prefill_keys,
                             pass_keys=pass_keys, prefill_chunks=prefill_chunks)
        return sum(map(mul, self.prices.values(), counts))

    def draft_price(self, context: int = 0) -> float:
        """What one more draft adds at a fixed depth: its draft row (read over `context` keys)
        and its verify row."""
        return self.prices.pass_row + self.prices.pass_key * context + self.prices.draft_row

    def prefill_price(self, start: int, rows: int) -> float:
        """What a prompt chunk of `rows` rows from position `start` adds to a step."""
        return (self.prices.prefill_chunk * (rows > 0) + self.prices.prefill_row * rows
                + self.prices.prefill_key * prefill_keys(start, rows))

    def step_price(self) -> float:
        """What a step verifying any draft pays once, besides its drafts and passes."""
        return self.prices.drafting_step + self.round_price

    def observe(self, num_tokens: int, max_draft_len: int, seconds: float, swap_bytes: int = 0,
                draft_tokens: int = 0, draft_passes: list[DraftPass] | None = None,
                prefill_tokens: int = 0, row_keys: int = 0, prefill_keys: int = 0,
                prefill_chunks: int = 0) -> None:
        """draft_passes: each draft forward the step ran (`DraftPass`: (rows, seconds[, keys])),
        where the drafter reports them: they fit the pass prices, and leave the step with depth,
        pass rows and pass keys 0."""
        self.unfitted += 1
        self.unfitted_s += seconds
        if draft_tokens and self.unpriced_drafting_steps:
            self.unpriced_drafting_steps -= 1
        if draft_passes:
            passes = [DraftPass(*p) for p in draft_passes]
            self.passes.extend(passes)
            self._fit_passes()
            seconds = max(seconds - sum(p.seconds for p in passes), 0.0)
            max_draft_len = 0
        counts = step_counts(num_tokens - draft_tokens, max_draft_len, swap_bytes, draft_tokens,
                             prefill_tokens, pass_rows=0, row_keys=row_keys,
                             prefill_keys=prefill_keys, prefill_chunks=prefill_chunks)
        self.samples.append((*counts, seconds))
        # refit every 4 steps or more, once the fits have taken at most FIT_SHARE of the steps'
        # time since the last one
        if (len(self.samples) >= 8 and self.unfitted >= 4
                and self.fit_s <= FIT_SHARE * self.unfitted_s):
            start = self.clock()
            self.fit()
            # the first fit also pays numpy's one-time set-up (~10 ms against ~1 on this CPU):
            # priced as its time, it held the warm-up's prices for seconds of long-context steps
            self.fit_s = self.clock() - start if self.num_fits else 0.0
            self.num_fits += 1
            self.unfitted, self.unfitted_s = 0, 0.0

    def forget(self) -> None:
        """Drop the steps observed so far (steps that paid one-time loads price nothing)."""
        self.samples.clear()
        self.unfitted, self.unfitted_s = 0, 0.0

    def calibrate(self, passes: list[tuple], state_price: float = 0.0) -> None:
        """Draft passes timed before any request drafted (`Proposer.calibrate`: `DraftPass`'s
        fields each): the pass prices fitted from them, and the drafts priced from the first
        drafting step on (no exploring at one draft a request). state_price: what building a
        request's drafting state costs a context token (`DrafterTiming.state_per_token`)."""
        self.state_price = state_price
        self.passes.extend(DraftPass(*p) for p in passes)
        if self._fit_passes():
            self.unpriced_drafting_steps = 0

    def _fit_passes(self) -> bool:
        """draft_pass + pass_row x rows + pass_key x keys + round_price x first over the recent
        draft passes, all >= 0. A count that did not vary across the passes is not priced apart
        (passes that all had the same rows and keys price the pass alone). False: too few
        passes to fit yet."""
        if len(self.passes) < 4:
            return False
        rows, secs, keys, first = np.array(self.passes, dtype=float).T
        x = np.stack([np.ones_like(rows), rows, keys, first], 1)
        varied = np.ptp(x, axis=0) > 0
        varied[0] = True
        prices = np.zeros(4)
        prices[varied] = nonneg_least_squares(x[:, varied], secs, free_intercept=False)
        (self.prices.draft_pass, self.prices.pass_row, self.prices.pass_key,
         self.round_price) = prices.tolist()
        return True

    def fit(self) -> None:
        """The step prices from the samples (the class docstring)."""
        data = np.array(self.samples)
        counts, seconds = data[:, :-1], data[:, -1]
        prices = np.array(self.prices.values())
        varied = np.ptp(counts, axis=0) > 0
        varied[0] = True                                  # the per-step price: the intercept
        rest = seconds - counts[:, ~varied] @ prices[~varied]
        # relative error; a step whose passes took nearly all of it (its rest ~ 0) weighs as a
        # tenth of the median step
        weight = 1.0 / np.maximum(seconds, 0.1 * np.median(seconds) + 1e-9)
        prices[varied] = nonneg_least_squares(counts[:, varied], rest, free_intercept=True,
                                              weight=weight)
        if prices[0] < 1e-6:
            # a negative intercept floored would move every prediction by it (a decode at a long
            # context priced at many times its measured seconds): fit it non-negative instead
            prices[varied] = nonneg_least_squares(counts[:, varied], rest, free_intercept=False,
                                                  weight=weight)
        prices[0] = max(prices[0], 1e-6)
        self.prices = Prices(*prices.tolist())
        self.unpriced_steps = False
        if not varied[TERMS.index("draft_row")]:           # no drafts seen: priced as a row
            self.prices.draft_row = self.prices.row


class DraftLengthController:
    def __init__(self, k_max: int, ema: float = 0.3, prior: float = 0.6,
                 cost: CostModel | None = None,
                 probe_every: int = 8, probe_backoff: int = 8, margin: float = MARGIN):
        self.k_max, self.ema, self.probe_every = k_max, ema, probe_every
        self.margin = margin
        self.longest_interval = probe_every * probe_backoff
        self.idle: dict[str, int] = {}                  # steps in a row given k = 0
        self.interval: dict[str, int] = {}              # a request's probe interval (backed off)
        self.probing: set[str] = set()                  # probed this step, outcome not yet seen
        self.depth: dict[str, int] = {}                 # positions observed so far
        self.frontier: dict[str, int] = {}              # drafts of a round all accepted, last
        self.prior = np.full(k_max, prior)              # engine-wide p_i
        self.accept: dict[str, np.ndarray] = {}
        self.cost = cost or CostModel()
        # what the allocated drafts' estimates promised at each position (their chain values)
        # and what was realised there (the drafts up to it all accepted), decayed per round
        self.promised = np.zeros(k_max)
        self.realised = np.zeros(k_max)
        self.pending: dict[str, np.ndarray] = {}        # allocated this step: the promise
        self.calibration = np.ones(k_max)

    def probs(self, request_id: str) -> np.ndarray:
        """Positions this request has never reached take its deepest observed estimate: a frozen
        prior there would cap k at the depth already tried (a request accepting 99% at position 0
        would never be offered position 1 while the prior says 0.6). Likewise, after a round that
        accepted all its d drafts, positions from d on read at least position d - 1's estimate:
        they were not observed, and an estimate left low by early rounds would hold k at d for
        good (lossy_kv at 2.8K drafted 2 a step, 99% accepted, for a position 2 read at 0.72)."""
        p = self.accept.get(request_id)
        if p is None:
            return self.prior
        depth = self.depth.get(request_id, self.k_max)
        top = self.frontier.get(request_id, 0)
        if depth < self.k_max or 0 < top < self.k_max:
            p = p.copy()
            p[depth:] = p[depth - 1]
            if 0 < top < self.k_max:
                np.maximum(p[top:], p[top - 1], out=p[top:])
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
        promised = self.pending.pop(request_id, None)
        if num_drafted == 0:                    # nothing drafted (no n-gram match): nothing paid
            return
        if promised is not None:
            self._calibrate(promised[:num_drafted], num_accepted)
        if probed and num_accepted == num_drafted:      # a probe accepted whole: sooner again
            self.interval[request_id] = max(min(self.probe_interval(request_id),
                                                self.probe_every) // 2, 1)
        elif num_accepted:
            self.interval.pop(request_id, None)
        elif probed:
            self.interval[request_id] = min(2 * self.probe_interval(request_id),
                                            self.longest_interval)
        p = self.accept.setdefault(request_id, self.prior.copy())
        seen = min(num_accepted + 1, num_drafted)
        self.frontier[request_id] = num_drafted if num_accepted >= num_drafted else 0
        depth = self.depth.get(request_id, 0)
        if 0 < depth < seen:            # first reached: from the estimate it read at (`probs`)
            p[depth:seen] = p[depth - 1]
        self.depth[request_id] = max(depth, seen)
        hits = (np.arange(seen) < num_accepted).astype(float)
        p[:seen] += self.ema * (hits - p[:seen])
        self.prior[:seen] += 0.05 * (hits - self.prior[:seen])

    def _calibrate(self, promised: np.ndarray, num_accepted: int) -> None:
        """`calibration`: per position, what allocated drafts realised over what their estimates
        promised, at most 1, and 1 until four drafts' worth were promised there. The requests
        chosen are those whose estimates read high, and high estimates regress: at 8 chat
        requests the n-gram drafts taken promised 615 accepted tokens and realised 568."""
        m = len(promised)
        self.promised *= CALIBRATION_DECAY
        self.realised *= CALIBRATION_DECAY
        self.promised[:m] += promised
        self.realised[:m] += np.arange(m) < num_accepted
        ratio = self.realised / np.maximum(self.promised, 1e-9)
        self.calibration = np.where(self.promised >= 4.0, np.minimum(ratio, 1.0), 1.0)

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.accept.pop(request_id, None)
        self.idle.pop(request_id, None)
        self.depth.pop(request_id, None)
        self.frontier.pop(request_id, None)
        self.interval.pop(request_id, None)
        self.probing.discard(request_id)

    def probe_interval(self, request_id: str) -> int:
        """Steps at k = 0 before this request is probed: `probe_every`, doubled by each rejected
        probe up to `probe_every * probe_backoff`, reset by an accepted draft, halved (down to
        1) by a probe accepted whole."""
        return self.interval.get(request_id, self.probe_every)

    def choose(self, request_ids: list[str], caps: list[int], num_other_tokens: int,
               swap_bytes: int = 0, prefill_tokens: int = 0, row_keys: int = 0,
               contexts: list[int] | None = None, unstarted: list[int] | None = None,
               remaining: list[int] | None = None) -> list[int]:
        """Draft length per request (see the module docstring). caps[i] bounds request i;
        num_other_tokens: the one token every decoding request computes anyway; prefill_tokens:
        the rows of the step's prompt chunks; row_keys: the context keys of those decoding rows;
        contexts[i]: request i's computed tokens, the keys its draft rows read (`pass_key`).
        unstarted[i]: the context tokens request i's first draft round would build the drafter's
        state of (0 once it has drafted), remaining[i]: the tokens it may still generate. That
        one-time cost (`CostModel.state_price` a token) is shared out over the steps left, at
        most one a token: its share rides on the request's first draft of a step; such a
        request is probed only where the whole build costs at most a quarter of the steps
        between probes (a probe pays it all).
        A request held at k = 0 for its probe interval (`probe_interval`) drafts at least one
        token: without it an estimate that fell low would never be observed again, and a request
        whose text turned repetitive would never be drafted for. Probes are grouped into as few
        draft passes as possible: a step that drafts anyway probes every due request; otherwise
        the first due request brings along every request idle for at least half its interval, so
        the batch's probes fall into step."""
        prices = [self.cost.draft_price(c) for c in contexts] if contexts else None
        starts = None
        if unstarted and self.cost.state_price and any(unstarted):
            starts = [self.cost.state_price * u / max(left, 1)
                      for u, left in zip(unstarted, remaining or [1] * len(unstarted))]
        if starts and self.cost.unpriced_steps:
            # the step prices are still priors (the warm-up's few steps fit none): a request
            # whose drafting state is yet to be built waits for measured ones, as its build is
            # paid whatever the next steps say (quant's encode of a 2.8K context, ~60 ms, was
            # started on a decode step priced at the prior's 22 ms for a real 7.6)
            caps = [0 if u else c for c, u in zip(caps, unstarted)]
        if self.cost.unpriced_drafting_steps:          # one draft a request until priced
            caps = [min(c, 1) for c in caps]
        ks = self._allocate(request_ids, caps, num_other_tokens, swap_bytes, prefill_tokens,
                            row_keys=row_keys, prices=prices, starts=starts)
        idle = []
        for i, r in enumerate(request_ids):
            if ks[i] or min(caps[i], self.k_max) < 1:
                self.idle[r] = 0
            else:
                self.idle[r] = self.idle.get(r, 0) + 1
                idle.append(i)
        waited = {i: self.idle[request_ids[i]] / self.probe_interval(request_ids[i]) for i in idle}
        # a probe pays a request's state build whole: only one dearer than a quarter of the
        # steps between probes keeps an unstarted request to the prior (quant's or Mustafar's
        # encode of a long context; the window's copy of its 68 tokens is cheap, and without a
        # probe a request the 0.6 prior keeps at k = 0 never drafted)
        if starts:
            budget = self.probe_every * self.cost.predict(num_other_tokens, 0, swap_bytes, 0,
                                                          prefill_tokens, row_keys=row_keys) / 4
            idle = [i for i in idle if not (starts[i]
                                            and self.cost.state_price * unstarted[i] > budget)]
        due = [i for i in idle if waited[i] >= 1]
        if due and not any(ks):
            due = [i for i in idle if 2 * waited[i] >= 1]
        # a probe that could not pay even if every draft were accepted is moot; one drafts as
        # deep as would pay were every position accepted as the request's first is (at least
        # one): it observes the positions whose estimates decide k, which single-draft probes
        # never refresh (a long context's self-drafts, 95% accepted, stayed at k = 0 for want
        # of position 2's estimate)
        if due:
            probs = np.stack([self.probs(r) for r in request_ids])
            certain = probs.copy()
            certain[due] = 1.0
            hopeful = self._allocate(request_ids, caps, num_other_tokens, swap_bytes,
                                     prefill_tokens, certain, row_keys, prices, starts)
            due = [i for i in due if hopeful[i] > 0]
            probs[due] = probs[due, :1]                   # each position as its first
            deep = self._allocate(request_ids, caps, num_other_tokens, swap_bytes,
                                  prefill_tokens, probs, row_keys, prices, starts)
        for i in due:
            ks[i], self.idle[request_ids[i]] = max(deep[i], 1), 0
            self.probing.add(request_ids[i])
        for r, k in zip(request_ids, ks):
            if k and r not in self.probing:
                self.pending[r] = np.cumprod(self.probs(r)[:k])
        return ks

    def _allocate(self, request_ids: list[str], caps: list[int], num_other_tokens: int,
                  swap_bytes: int = 0, prefill_tokens: int = 0,
                  probs: np.ndarray | None = None, row_keys: int = 0,
                  prices: list[float] | None = None,
                  starts: list[float] | None = None) -> list[int]:
        """The drafts of the best goodput (`_search`), against a bar of no draft raised by the
        margin. prices[i]: what each draft of request i adds (default: `draft_price()` for all);
        starts[i]: what its first draft adds besides (its share of building its state).
        It runs on every step's critical path: what decides that nothing pays comes first, from
        one number per request.

        Every set of m drafts at depth d has goodput (n + S) / (base_d + P), n the step's decoding
        rows (num_other_tokens: each commits a token, whether its request may draft or not), S
        the sum of the drafts' values, P the sum of their prices and base_d = base_0 +
        drafting_step + draft_pass * d the step before its drafts. Nothing pays when
        - every request's first draft g_i (a chain's value only falls) has g_i / price_i below
          the bar: the goodput is a mediant of n / base_d (below n / base_0) and of the drafts'
          value over price (at most the best g_i / price_i); or
        - at d = 1 and at the deepest d, (n + d * F) / base_d is below the bar, F the sum of first
          probabilities (no value in a chain exceeds its first; the bound is monotone in d): the
          once-per-step prices are more than every draft together could win."""
        n = len(request_ids)
        limits = [min(c, self.k_max) for c in caps]
        most = max(limits, default=0)
        if most <= 0:
            return [0] * n
        base0 = self.cost.predict(num_other_tokens, 0, swap_bytes, 0, prefill_tokens,
                                  row_keys=row_keys)
        if prices is None:
            prices = [self.cost.draft_price()] * n
        starts = starts or [0.0] * n
        calibration = self.calibration if probs is None else None
        firsts = [(self.first_prob(r) * calibration[0] if probs is None
                   else float(probs[i, 0]), prices[i] + starts[i])
                  for i, (r, k) in enumerate(zip(request_ids, limits)) if k > 0]
        step, per_pass = self.cost.step_price(), self.cost.prices.draft_pass
        # the tokens the step commits without a draft: one a decoding row, whether or not that
        # request may draft (n-gram offers drafts only where its context matches: counting the
        # candidates alone undervalued the step, and drafts at 73% acceptance, each dearer than
        # the decode row it would save, looked like gains)
        tokens = float(max(num_other_tokens, n))
        bar = (1.0 + self.margin) * tokens
        if all(f * base0 <= bar * price for f, price in firsts):
            return [0] * n
        total = sum(f for f, _ in firsts)
        if all((tokens + d * total) * base0 <= bar * (base0 + step + per_pass * d)
               for d in (1, most)):
            return [0] * n
        return self._search(request_ids, limits, probs, base0 + step, per_pass, prices,
                            bar / base0, starts, tokens, calibration)

    def _search(self, request_ids: list[str], limits: list[int], probs: np.ndarray | None,
                base: float, per_pass: float, prices: list[float], best: float,
                starts: list[float], tokens: float,
                calibration: np.ndarray | None) -> list[int]:
        """The candidate drafts in order of value over price (then position, then request; with
        one price for all, of value), and for each depth d a greedy over those at positions < d
        on a step of base + per_pass * d: take the next while goodput rises (a draft raises it
        exactly when its value over price beats it; with the depth fixed those ratios only fall
        and the goodput only rises, so stopping at the first loss is exact for that depth). A
        depth counts where one of its
        drafts at position d - 1 is taken; the depth of the highest goodput wins (the first on a
        tie) where it beats `best` (else no draft). Searching depth by depth matters where a step
        pays for drafting once: the batch's first draft alone looks like a loss, while k = 1 for
        every request shares the pass. Where no price grows with depth (draft_pass = 0) the
        deepest depth's candidates hold every other's, and its greedy alone decides."""
        n = len(request_ids)
        # one price for all: order by value alone (no division, the ties as before)
        same = min(prices) == max(prices) and not any(starts)
        scale = None if calibration is None else calibration.tolist()
        candidates = []
        for i, (r, k) in enumerate(zip(request_ids, limits)):
            chain, top, ratio = 1.0, math.inf, math.inf
            for j, p in enumerate((self.probs(r) if probs is None else probs[i])[:k].tolist()):
                chain *= p
                if not chain > 0:
                    break
                value = chain * scale[j] if scale else chain
                price = prices[i] + (starts[i] if j == 0 else 0.0)
                # a request's drafts stay in position order (a dearer first draft, or one less
                # calibrated, ranks its later ones no higher than itself)
                top, ratio = min(top, value), min(ratio, value / max(price, 1e-30))
                candidates.append((-top if same else -ratio, j, i, value, price))
        candidates.sort()
        most = max(limits)
        chosen = [0] * n
        for d in (range(1, most + 1) if per_pass else (most,)):
            step = base + per_pass * d
            ks, value, goodput, taken, reached = [0] * n, tokens, tokens / step, 0, not per_pass
            for _, j, i, gain, price in candidates:
                if j >= d:
                    continue
                better = (value + gain) / (step + price)
                if not better > goodput:
                    break
                value, goodput, step, taken = value + gain, better, step + price, taken + 1
                ks[i] += 1
                reached = reached or j == d - 1
            if taken and reached and goodput > best:
                best, chosen = goodput, ks
        return chosen
