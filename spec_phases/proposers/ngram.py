"""Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the sequence's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose what followed it."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        windows = sliding_window_view(tokens[:length - 1], n)    # starts 0 .. length - 1 - n
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            begin = int(starts[-1]) + n                        # most recent occurrence
            return tokens[begin:begin + k].tolist()
    return []
