"""N-gram prompt-lookup drafter."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_spec.drafters.ngram import NgramDrafter


def drafter(tokens, max_ngram=3):
    d = NgramDrafter(max_ngram)
    d.reset(tokens)
    return d


def test_basic_match_and_limit():
    d = drafter([1, 2, 3, 4, 5, 9, 2, 3])
    assert d.draft(2) == [4, 5]
    assert d.draft(1) == [4]
    assert d.draft(0) == []


def test_no_match_gives_empty_draft():
    assert drafter([1, 2, 3, 4]).draft(4) == []
    assert drafter([7]).draft(4) == []
    assert drafter([]).draft(4) == []


def test_longest_ngram_wins_over_more_recent_shorter():
    # suffix [1, 2, 3]: the 3-gram occurs at the start (-> 40), the 2-gram
    # [2, 3] occurs more recently (-> 50); the longer match is preferred.
    d = drafter([1, 2, 3, 40, 2, 3, 50, 1, 2, 3])
    assert d.draft(1) == [40]


def test_most_recent_occurrence_wins():
    d = drafter([5, 6, 1, 5, 6, 2, 5, 6])
    assert d.draft(1) == [2]


def test_generated_tokens_are_indexed():
    d = drafter([10, 11, 12])
    d.accept([13, 10, 11])
    assert d.draft(3) == [12, 13, 10]


def test_continuation_running_into_the_end_keeps_its_period():
    d = drafter([1, 2, 3, 1, 2, 3, 1, 2])
    assert d.draft(7) == [3, 1, 2, 3, 1, 2, 3]
    assert drafter([4, 4, 4]).draft(5) == [4] * 5


def test_max_ngram_validation():
    for bad in (1, 0, -2, 2.5, "3"):
        with pytest.raises(ValueError, match="max_ngram"):
            NgramDrafter(bad)


def brute_force(tokens, k, max_ngram):
    """Reference: scan for the longest suffix n-gram, latest earlier occurrence."""
    L = len(tokens)
    for n in range(min(max_ngram, L), 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[L:]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    split=st.integers(0, 40),
    k=st.integers(0, 8),
    max_ngram=st.integers(2, 5),
)
def test_incremental_index_equals_brute_force(tokens, split, k, max_ngram):
    d = drafter(tokens[:split], max_ngram)
    d.accept(tokens[split:])
    assert d.draft(k) == brute_force(tokens, k, max_ngram)
