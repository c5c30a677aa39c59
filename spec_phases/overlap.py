"""Overlap of the next draft phase with verification (FASER): while later verification frontiers
run, a worker thread drafts the next step of the requests the first frontier already decided.

Only for drafters whose drafts are a function of the tokens alone (`drafts_from_tokens_only`): a
draft computed ahead is then exactly the draft the next step would compute. Each draft is keyed by
the number of tokens it was made for; the next step uses it only if the request's context is that.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from specserve.spec_phases.frontiers import Verifying
from specserve.spec_phases.proposers.base import DraftRequest, Proposer


class DraftAhead:
    def __init__(self, proposer: Proposer, max_len: int):
        """max_len: the longest draft a later step may ask for."""
        if not proposer.drafts_from_tokens_only:
            raise ValueError(f"drafting ahead needs a drafter whose drafts depend on the tokens "
                             f"alone; {proposer.name} is not one")
        self.proposer, self.max_len = proposer, max_len
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-draft")
        self.pending: Future | None = None        # -> {request_id: (num tokens, drafts)}

    def submit(self, decided: list[Verifying]) -> None:
        """Draft the next step of requests whose tokens this step are known."""
        asks = [DraftRequest(v.req.request_id, v.req.history + tuple(v.tokens), 0, ())
                for v in decided]
        if not asks:
            return

        def draft() -> dict[str, tuple[int, list[int]]]:
            out = self.proposer.propose(asks, [self.max_len] * len(asks)).token_ids
            return {a.request_id: (len(a.token_ids), d) for a, d in zip(asks, out)}

        self.pending = self.pool.submit(draft)

    def take(self) -> dict[str, tuple[int, list[int]]]:
        """The drafts the thread made during this step's verification, for the next step
        (collected at the end of the step: `Worker._propose_next`)."""
        early = self.pending.result() if self.pending is not None else {}
        self.pending = None
        return early
