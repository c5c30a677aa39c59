"""Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the sequence's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose what followed it."""
from __future__ import annotations

import numpy as np

from specserve.spec_phases.proposers.base import DraftRequest, Drafts, Proposer


class NgramProposer(Proposer):
    name = "ngram"
    drafts_from_tokens_only = True

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> Drafts:
        return Drafts([lookup(r.token_ids, k, self.min_n, self.max_n) if k > 0 else []
                       for r, k in zip(requests, max_lens)])


def lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n in [min_n, max_n] whose suffix occurred before (ending at or before the
    second-to-last token), its most recent occurrence: up to k tokens that followed it. Only the
    earlier positions of the last token can end a match: their backward match lengths are
    measured, max_n - 1 comparisons over those few positions (not every window of every n)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    longest = min(max_n, length - 1)
    if longest < min_n:
        return []
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])   # p: tokens[p] == last
    if not ends.size:
        return []
    matched = np.ones(ends.size, dtype=np.int64)          # suffix tokens matched, backwards
    still = np.ones(ends.size, dtype=bool)
    for j in range(1, longest):
        back = ends - j
        still &= back >= 0
        still[still] = tokens[back[still]] == tokens[length - 1 - j]
        matched += still
    for n in range(longest, min_n - 1, -1):
        found = ends[matched >= n]
        if found.size:
            begin = int(found[-1]) + 1                     # most recent occurrence
            return tokens[begin:begin + k].tolist()
    return []
