"""Rate-distortion retention (RDR): greedy tier downgrades under a bit budget.

Each unit (a page of one layer) sits at a tier; moving it one step down the ladder
1 → 2 → 3 → 0 (drop) saves ΔC bits and adds ΔD = weight × (λ[new] − λ[old]) distortion, where
weight is the page's attention-mass EMA (floored at 0.1) times its mean radius sum / sqrt(D) and
λ = {1: 0.05, 2: 0.10, 3: 0.30, 0: 10.0} (the Spherical-KV code's constants; dropping is the last
resort). While the total is over budget, a min-heap pops the step with the least ΔD per bit saved.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

LAMBDA = {1: 0.05, 2: 0.10, 3: 0.30, 0: 10.0}
NEXT_TIER = {1: 2, 2: 3, 3: 0}


@dataclass(frozen=True)
class Unit:
    layer: int
    index: int          # page index within the layer
    tier: int
    weight: float       # distortion weight (attention mass × radius scale)


def plan_downgrades(units: list[Unit], budget_bits: float, page_bits: Callable[[int], int]
                    ) -> list[tuple[int, int, int]]:
    """-> [(layer, index, final_tier)] for the units that change, least distortion per bit first.

    page_bits(tier) gives a page's bits at a tier; must decrease along the ladder.
    """
    tiers = {(u.layer, u.index): u.tier for u in units}
    total = sum(page_bits(u.tier) for u in units)
    heap: list[tuple[float, int, Unit]] = []

    def push(u: Unit, tier: int, order: int) -> None:
        if tier in NEXT_TIER:
            new = NEXT_TIER[tier]
            saved = page_bits(tier) - page_bits(new)
            added = u.weight * (LAMBDA[new] - LAMBDA[tier])
            heapq.heappush(heap, (added / saved, order, u))

    for order, u in enumerate(units):
        push(u, u.tier, order)
    while total > budget_bits and heap:
        _, order, u = heapq.heappop(heap)
        key = (u.layer, u.index)
        old = tiers[key]
        tiers[key] = NEXT_TIER[old]
        total -= page_bits(old) - page_bits(tiers[key])
        push(u, tiers[key], order)
    final = [(u.layer, u.index, tiers[(u.layer, u.index)]) for u in units]
    return [move for move, u in zip(final, units) if move[2] != u.tier]
