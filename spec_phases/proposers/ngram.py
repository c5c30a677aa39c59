"""Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the sequence's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose what followed it.

Each request keeps an index of where each token occurs (`NgramIndex`), extended by the tokens a
step adds: a lookup reads the earlier positions of the last token only, so it costs microseconds
whatever the context's length (the worker proposes every decoding request's next drafts at the
end of each step: `Worker._propose_next`)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from specserve.spec_phases.proposers.base import DraftRequest, Drafts, Proposer


class NgramIndex:
    """One request's tokens and, for each token, the positions it occurs at, the last position
    excluded (a match must end before the sequence's last token)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.at: dict[int, list[int]] = {}

    def update(self, token_ids: Sequence[int]) -> None:
        """Index token_ids, a request's tokens, which only grow: the tokens past those indexed are
        added (O(new tokens) a step, whatever the context's length). A sequence shorter than the
        indexed one, or whose token at the indexed end differs, is indexed anew."""
        seen, length = len(self.tokens), len(token_ids)
        if length < seen or (seen and token_ids[seen - 1] != self.tokens[-1]):
            self.tokens, self.at, seen = [], {}, 0
        if length == seen:
            return
        self.tokens.extend(token_ids[seen:])
        tokens, at = self.tokens, self.at
        for p in range(max(seen - 1, 0), length - 1):
            at.setdefault(tokens[p], []).append(p)

    def lookup(self, token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
        """The longest n in [min_n, max_n] whose suffix occurred before (ending at or before the
        second-to-last token), its most recent occurrence: up to k tokens that followed it. Only
        the earlier positions of the last token can end a match: their backward match lengths are
        measured, most recent first, until one reaches the longest n."""
        self.update(token_ids)
        tokens = self.tokens
        length = len(tokens)
        longest = min(max_n, length - 1)
        if longest < min_n:
            return []
        best, begin = 0, 0
        for p in reversed(self.at.get(tokens[-1], ())):
            n = 1
            while n < longest and n <= p and tokens[p - n] == tokens[length - 1 - n]:
                n += 1
            if n > best:
                best, begin = n, p + 1
                if n == longest:
                    break
        return list(tokens[begin:begin + k]) if best >= min_n else []


class NgramProposer(Proposer):
    name = "ngram"
    drafts_from_tokens_only = True

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}            # per request, till `release`

    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> Drafts:
        drafts = []
        for r, k in zip(requests, max_lens):
            if k <= 0:
                drafts.append([])
                continue
            index = self.indexes.get(r.request_id)
            if index is None:
                index = self.indexes[r.request_id] = NgramIndex()
            drafts.append(index.lookup(r.token_ids, k, self.min_n, self.max_n))
        return Drafts(drafts)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.indexes.pop(request_id, None)

    def held_request_ids(self) -> set[str]:
        return set(self.indexes)
