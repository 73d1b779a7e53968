"""N-gram prompt-lookup drafting as tables of token arrays (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from viasd.decoding.drafters import NgramDrafter, ngram_lookup


@pytest.mark.parametrize(
    "context, k, max_n, min_n, expected",
    [
        # suffix [1, 2] occurred at 0: propose what followed it
        ([1, 2, 3, 4, 1, 2], 2, 3, 1, [3, 4]),
        # k caps the proposal; the continuation may run into the suffix itself
        ([1, 2, 3, 1, 2], 5, 2, 1, [3, 1, 2]),
        # the latest earlier occurrence wins
        ([7, 1, 8, 7, 1, 9, 7, 1], 1, 2, 1, [9]),
        # longer n-grams are tried first: [5, 6] -> 0 beats the later unigram [6] -> 3
        ([5, 6, 0, 2, 6, 3, 5, 6], 1, 2, 1, [0]),
        # no match of any length
        ([1, 2, 3, 4], 3, 3, 1, []),
        # min_ngram 2 forbids the unigram match of 3
        ([3, 9, 4, 3], 2, 3, 2, []),
        ([3, 9, 4, 3], 2, 3, 1, [9, 4]),
        # a one-token context has nothing to look up
        ([3], 2, 3, 1, []),
    ],
)
def test_ngram_lookup(context, k, max_n, min_n, expected):
    assert ngram_lookup(np.array(context), k, max_n, min_n) == expected


def test_ngram_drafter_index_finds_what_the_lookup_finds():
    """The drafter's incremental n-gram index proposes what a search of the whole context proposes,
    as the context grows a few tokens a round, and after it is replaced by another one."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        drafter = NgramDrafter(max_ngram=3, min_ngram=1 + trial % 2)
        context = rng.integers(0, 6, size=int(rng.integers(1, 5))).tolist()
        for _ in range(40):
            k = int(rng.integers(1, 6))
            expected = ngram_lookup(np.array(context), k, 3, drafter.min_ngram)
            assert drafter.propose(context, k).tokens == expected, (trial, context)
            if rng.random() < 0.05:  # another request's context
                context = rng.integers(0, 6, size=int(rng.integers(1, 5))).tolist()
            else:
                context = context + rng.integers(0, 6, size=int(rng.integers(1, 4))).tolist()


def test_ngram_drafter_proposes_without_probabilities():
    draft = NgramDrafter(max_ngram=2).propose([4, 5, 6, 4, 5], 3)
    assert draft.tokens == [6, 4, 5] and draft.probs is None


def test_ngram_drafter_rejects_bad_sizes():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)
