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
    assert d.can_draft() == bool(brute_force(tokens, 1, max_ngram))


def _brute_first_token(history, max_ngram):
    """What ``draft(1)`` copies after ``history`` (None: no match), by scan."""
    for n in range(min(max_ngram, len(history) - 1), 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n]
    return None


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=2, max_size=60),
    split=st.integers(1, 20),
    step=st.integers(1, 5),
)
def test_hindsight_judges_the_first_token_of_each_pass(tokens, split, step):
    """Once asked, a pass's first token counts a trial where the index had a
    match before it, a hit where the copy's first token was that token; the
    other tokens of a pass, and the pass right after a hit in a pass of one
    token (a one-draft pass would have emitted it too), are not judged;
    nothing is counted before the first call."""
    split = min(split, len(tokens) - 1)
    d = drafter(tokens[:split])
    d.accept(tokens[split : split + 1])  # before the first call: not judged
    assert d.hindsight() == {}
    rest, want, skip = tokens[split + 1 :], [0, 0], False
    for i in range(0, len(rest), step):
        guess = _brute_first_token(tokens[: split + 1 + i], 3)
        judged = guess is not None and not skip
        hit = judged and guess == rest[i]
        want[0] += hit
        want[1] += judged
        skip = hit and len(rest[i : i + step]) == 1
        d.accept(rest[i : i + step])
    assert d.hindsight() == ({None: tuple(want)} if want[1] else {})
    assert d.hindsight() == {}  # taken


def test_hindsight_of_repeating_text_is_all_hits():
    d = drafter([1, 2, 3, 4, 5])
    d.hindsight()
    for t in [1, 2, 3, 4, 5, 1, 2]:  # one token a pass
        d.accept([t])
    # 1, 2: after 4 5 and 5 1, seen nowhere; 3, 5, 2 copied right; 4 and 1
    # would have been the bonus tokens of the passes that drafted 3 and 5.
    assert d.hindsight() == {None: (3, 3)}
    # 9 would have been the bonus of the pass that drafted 2 (the walk goes
    # on across calls); 7 comes after 1 2, which copies 9 by then
    for t in [9, 8, 1, 2, 7]:
        d.accept([t])
    assert d.hindsight() == {None: (0, 1)}
    d.accept([1, 2, 9, 8, 1, 2, 7])  # one pass: only its first token is judged
    assert d.hindsight() == {}  # 1 after 2 7: seen nowhere
