"""n-gram lookup (spec_phases/proposers/ngram.py) against its definition written out naively: the
longest n in [min_n, max_n] whose last-n-token suffix occurs earlier, ending at or before the
second-to-last token; the most recent such occurrence; up to k tokens after it."""
from __future__ import annotations

import random

from specserve.spec_phases.proposers.base import DraftRequest
from specserve.spec_phases.proposers.ngram import NgramIndex, NgramProposer


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    return NgramIndex().lookup(tokens, k, min_n, max_n)           # a fresh index


def naive(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - 1 - n, -1, -1):            # most recent first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_lookup_is_the_naive_definition():
    rng = random.Random(7)
    drafted = 0
    for _ in range(5000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 5)
        hi, k = rng.randint(lo, 6), rng.randint(1, 8)
        want = naive(tokens, k, lo, hi)
        assert lookup(tokens, k, lo, hi) == want, (tokens, k, lo, hi)
        drafted += bool(want)
    assert 1000 < drafted < 5000                      # both outcomes exercised


def test_lookup_prefers_the_longest_then_the_latest_match():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 9, 3, 1, 2, 8, 4, 2]
    assert lookup(tokens, 2, 1, 3) == [8, 4]          # "2" last occurred at 6 (not 2)
    tokens = [5, 1, 2, 6, 3, 2, 7, 1, 2]
    assert lookup(tokens, 1, 1, 3) == [6]             # "1 2" at 1-2 beats the later "2" at 5
    assert lookup(tokens, 1, 3, 3) == []              # no earlier "7 1 2"
    assert lookup([4], 3, 1, 2) == []


def test_an_index_fed_a_growing_sequence_answers_as_a_fresh_one():
    """NgramIndex extends itself by the tokens a step adds (the worker keeps one per request), and
    starts over from a sequence shorter than what it indexed."""
    rng = random.Random(11)
    for _ in range(200):
        index = NgramIndex()
        tokens: list[int] = []
        vocab = rng.choice([3, 5, 20])
        for _ in range(rng.randint(1, 12)):
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            lo = rng.randint(1, 3)
            hi, k = rng.randint(lo, 5), rng.randint(1, 6)
            assert index.lookup(tokens, k, lo, hi) == naive(tokens, k, lo, hi), tokens
        other = [rng.randrange(vocab) for _ in range(rng.randint(1, len(tokens) - 1))] \
            if len(tokens) > 1 else [1]
        assert index.lookup(other, 4, 1, 3) == naive(other, 4, 1, 3)
        assert index.tokens == other


def test_the_proposer_keeps_an_index_per_request_until_released():
    prop = NgramProposer(1, 3)
    a, b = (1, 2, 3, 9, 1, 2), (4, 5, 4)
    out = prop.propose([DraftRequest("a", a, 5, ()), DraftRequest("b", b, 2, ())], [2, 2])
    assert out.token_ids == [[3, 9], [5, 4]] and set(prop.indexes) == {"a", "b"}
    assert prop.propose([DraftRequest("a", a + (3,), 6, ())], [1]).token_ids == [[9]]
    prop.release(["a", "unknown"])
    assert set(prop.indexes) == {"b"}
