"""The proposer protocol: every drafter answers `propose(requests, max_lens) -> list[list[int]]`.

A request's drafts continue its committed tokens; the verify pass scores them and acceptance keeps
the longest valid prefix. All drafters here are deterministic, so under sampling their draft
distribution is one-hot (papers.md §5.2) and rejection sampling stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class DraftRequest:
    request_id: str
    token_ids: list[int]          # committed tokens (prompt + output); the last is not yet in the KV cache
    num_computed_tokens: int      # == len(token_ids) - 1 when drafting
    block_ids: list[int]          # covers len(token_ids) + max_len - 1 slots


class Proposer(Protocol):
    name: str

    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> list[list[int]]:
        """At most max_lens[i] draft tokens for requests[i] (fewer, or none, is fine). A drafter that
        runs the model may also set `last_passes` to [(rows, seconds)] of each draft forward of this
        call: the FASER cost model prices draft passes from those (see `scheduler/faser.py`)."""
        ...

    def observe(self, input_token_ids: torch.Tensor, logits: torch.Tensor) -> None:
        """Called with the raw logits [rows, vocab] of every verified row and the token each row
        consumed; drafters that learn from the target (token recycling) update here."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """The requests finished (or were aborted): drop any per-request state."""
        ...

    def held_request_ids(self) -> set[str]:
        """Requests this drafter holds state for (the engine's integrity check compares)."""
        ...


class StatelessProposer:
    """Defaults for drafters that keep no per-request state (token recycling overrides `observe`).

    `drafts_from_tokens_only`: the drafts are a function of the request's tokens alone (no model, no
    shared table the target updates), so they may be computed on another thread ahead of time."""

    drafts_from_tokens_only = False

    def observe(self, input_token_ids: torch.Tensor, logits: torch.Tensor) -> None:
        pass

    def release(self, request_ids: list[str]) -> None:
        pass

    def held_request_ids(self) -> set[str]:
        return set()
