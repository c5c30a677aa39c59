"""FASER-style draft length per request each step, chosen to maximise expected goodput.

    acceptance  each request keeps p_i = P(draft i accepted | drafts before it accepted), one EMA per
                position, starting from the engine-wide estimate; a step that drafted k and accepted
                a observes positions 0..min(a, k-1): accepted for i < a, rejected at i = a.
    value       E_r(k) = 1 + sum_{j=1..k} prod_{i<j} p_i   (tokens committed, the bonus included)
    cost        T(step) = c0 + c1 * tokens + c2 * max_k   fitted online by least squares on
                measured steps (c2: sequential draft passes; ~0 for n-gram and token recycling)
    allocation  start every k_r at 0; repeatedly give one more draft to the request whose next draft
                has the highest acceptance probability, keeping it only while sum_r E_r / T rises.
Under load c1 * tokens dominates, every extra draft lowers goodput and k falls to 0 by itself: no
batch-size threshold, so no cliff.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class CostModel:
    """Step time ~ c0 + c1 * num_tokens + c2 * max_draft_len, refitted from recent steps."""

    def __init__(self, c0: float = 0.02, c1: float = 0.002, c2: float = 0.0, window: int = 256):
        self.coef = np.array([c0, c1, c2])
        self.samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)

    def predict(self, num_tokens: int, max_draft_len: int) -> float:
        return float(self.coef @ np.array([1.0, num_tokens, max_draft_len]))

    def observe(self, num_tokens: int, max_draft_len: int, seconds: float) -> None:
        self.samples.append((1.0, float(num_tokens), float(max_draft_len), seconds))
        if len(self.samples) >= 8 and len(self.samples) % 4 == 0:
            self.fit()

    def fit(self) -> None:
        """Least squares on the regressors that varied; the others keep their prior value."""
        data = np.array(self.samples)
        x, y = data[:, :3], data[:, 3]
        free = [0] + [j for j in (1, 2) if np.ptp(x[:, j]) > 0]
        fixed = [j for j in range(3) if j not in free]
        coef, *_ = np.linalg.lstsq(x[:, free], y - x[:, fixed] @ self.coef[fixed], rcond=None)
        self.coef[free] = np.maximum(coef, np.array([1e-6, 1e-7, 0.0])[free])   # never negative


class DraftLengthController:
    def __init__(self, k_max: int, ema: float = 0.3, prior: float = 0.6, cost: CostModel | None = None):
        self.k_max, self.ema = k_max, ema
        self.prior = np.full(k_max, prior)                               # engine-wide p_i
        self.accept: dict[str, np.ndarray] = {}
        self.cost = cost or CostModel()

    def probs(self, request_id: str) -> np.ndarray:
        return self.accept.get(request_id, self.prior)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        p = self.accept.setdefault(request_id, self.prior.copy())
        seen = min(num_accepted + 1, num_drafted)
        hits = (np.arange(seen) < num_accepted).astype(float)
        p[:seen] += self.ema * (hits - p[:seen])
        self.prior[:seen] += 0.05 * (hits - self.prior[:seen])

    def release(self, request_id: str) -> None:
        self.accept.pop(request_id, None)

    def choose(self, request_ids: list[str], caps: list[int], num_other_tokens: int) -> list[int]:
        """Draft length per request. caps[i] bounds request i; num_other_tokens: prefill tokens and
        the one token every decoding request computes anyway."""
        ks = [0] * len(request_ids)
        probs = [self.probs(r) for r in request_ids]
        chain = [1.0] * len(request_ids)                 # P(all drafts so far accepted)
        value = float(len(request_ids))                  # sum of E_r(0) = 1 each
        tokens, max_k = num_other_tokens, 0
        best = value / self.cost.predict(tokens, max_k)
        while True:
            gains = [chain[i] * probs[i][ks[i]] if ks[i] < min(caps[i], self.k_max) else -1.0
                     for i in range(len(ks))]
            i = int(np.argmax(gains)) if gains else 0
            if not gains or gains[i] <= 0:
                return ks
            new_max = max(max_k, ks[i] + 1)
            goodput = (value + gains[i]) / self.cost.predict(tokens + 1, new_max)
            if goodput <= best:
                return ks
            best, value, tokens, max_k = goodput, value + gains[i], tokens + 1, new_max
            chain[i] = gains[i]
            ks[i] += 1
