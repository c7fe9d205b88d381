"""The MTP head's deferred rows: passes kept in order, their rows counted."""

import mlx.core as mx

from mlx_spec.drafters.deferred import DeferredRows


def _pass(tokens):
    tokens = mx.array(tokens, dtype=mx.uint32)
    return tokens, mx.ones((tokens.size, 4)) * tokens[:, None].astype(mx.float32)


def test_the_count_follows_the_passes_added_and_taken():
    rows = DeferredRows()
    assert not rows and rows.rows == 0 and rows.take() == []
    rows.add(*_pass([1, 2, 3]))
    rows.extend([_pass([4]), _pass([5, 6])])
    assert rows and rows.rows == 6
    assert rows.starts() == [True, False, False, True, True, False]
    taken = rows.take()
    assert [t.tolist() for t, _ in taken] == [[1, 2, 3], [4], [5, 6]]
    assert [h[:, 0].tolist() for _, h in taken] == [[1, 2, 3], [4], [5, 6]]
    assert not rows and rows.rows == 0 and rows.starts() == []
    rows.extend(taken[1:])  # handed back, as a kept state's rows are
    assert rows.rows == 3 and rows.starts() == [True, True, False]


def test_keeping_the_last_rows_drops_the_oldest_and_counts_them():
    """A suspended head keeps only its last rows: the oldest passes go first,
    a pass cut in two keeps its last rows, and the count stays exact."""
    rows = DeferredRows()
    rows.extend([_pass([1, 2, 3]), _pass([4]), _pass([5, 6])])
    assert rows.keep_last(6) == 0 and rows.rows == 6
    assert rows.keep_last(4) == 2 and rows.rows == 4
    taken = rows.take()
    assert [t.tolist() for t, _ in taken] == [[3], [4], [5, 6]]
    assert [h[:, 0].tolist() for _, h in taken] == [[3], [4], [5, 6]]
    rows.extend(taken)
    assert rows.keep_last(1) == 3 and [t.tolist() for t, _ in rows.take()] == [[6]]
