"""The proposer protocol: every drafter answers `propose(requests, max_lens) -> Drafts`.

A request's drafts continue its committed tokens; the verify pass scores them and acceptance keeps
the longest prefix that matches what the target samples. Every drafter here is deterministic (its
draft distribution is one-hot), so a draft token is accepted exactly when it equals the token plain
sampling draws at its position (`spec_phases/verify.py`): lossless, and seeded sampling gives the
same text with speculation on or off.

What a drafter is, it declares as class attributes; what it needs, it gets at construction.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from specserve.spec_phases.plan import DrafterTiming


@dataclass(frozen=True, slots=True)
class DraftRequest:
    request_id: str
    token_ids: tuple[int, ...]    # committed tokens; the last is not yet in the KV cache
    num_computed_tokens: int      # == len(token_ids) - 1 when drafting
    block_ids: tuple[int, ...]    # covers len(token_ids) + max_len - 1 slots


@dataclass(slots=True)
class Drafts:
    token_ids: list[list[int]]                   # per request, at most its max_len tokens
    passes: list[tuple[int, float]] = field(default_factory=list)   # (rows, seconds) per draft
                                                 # forward of a model-running drafter (FASER prices)
    state_s: float = 0.0                         # building the states of requests drafting for
                                                 # the first time (priced once: `state_price`)


class Proposer:
    """Base of every drafter.

    `drafts_from_tokens_only`: the drafts are a function of the request's tokens alone (no model, no
    shared table the target updates), so the worker proposes a request's next drafts at the end of
    the step that sampled its tokens, and the scheduler schedules no more than were proposed (on
    another thread during verification where frontiers overlap it: `spec_phases/overlap.py`).
    `learns_from_target`: `observe` wants the raw logits of every verified row (token
    recycling)."""

    name = "base"
    drafts_from_tokens_only = False
    learns_from_target = False

    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> Drafts:
        raise NotImplementedError

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop what the drafter keeps for these finished requests."""

    def held_request_ids(self) -> set[str]:
        """The requests the drafter keeps something for (integrity checks)."""
        return set()

    def calibrate(self, contexts: list[int], steps: int) -> DrafterTiming:
        """Draft passes measured at these context lengths before any request drafts, and what
        building a request's drafting state costs (`CostModel.calibrate`). A drafter that runs no
        model, or whose passes cost what a decode row costs, measures none: its drafts are
        priced as they come."""
        return DrafterTiming([], 0.0)

    def observe(self, input_token_ids: torch.Tensor, logits: torch.Tensor) -> None:
        """Raw logits [rows, vocab] of verified rows and the token each row consumed."""
