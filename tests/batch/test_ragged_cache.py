"""The batch's ragged attention cache: which rows attend over their own keys,
and that doing so gives each row what it computes alone, bit for bit."""

import mlx.core as mx
import pytest
from mlx_spec.core.ragged_cache import RaggedKVCache
from mlx_spec.mlx_lm_compat import (
    KVCache,
    create_attention_mask,
    scaled_dot_product_attention,
)
from mlx_spec.models import fast_layers

H_Q, H_KV, D = 4, 2, 32


def _filled(lengths, T, window=None):
    """A ragged cache whose rows hold ``lengths`` tokens, then a pass of
    ``T`` more: the cache, each row's single-sequence ``KVCache`` fed the
    same keys, the pass's queries, the fetched keys and values, the mask."""
    mx.random.seed(3)
    ragged, alone = RaggedKVCache(window=window), []
    for n in lengths:
        single = KVCache()
        single.update_and_fetch(*(mx.random.normal((1, H_KV, n, D)) for _ in "kv"))
        ragged.append_row(single)
        alone.append(single)
    mask = ragged.make_mask(T, return_array=True)
    new = [mx.random.normal((len(lengths), H_KV, T, D)) for _ in "kv"]
    keys, values = ragged.update_and_fetch(*new)
    for b, single in enumerate(alone):
        single.update_and_fetch(new[0][b : b + 1], new[1][b : b + 1])
    queries = mx.random.normal((len(lengths), H_Q, T, D))
    return ragged, alone, queries, keys, values, mask


@pytest.mark.parametrize(
    "lengths,window,split",
    [
        ([40, 700, 35], None, True),  # far apart: waste of most of 3 x 701
        ([300, 301, 299], None, False),  # one length: nothing wasted
        ([100, 400], None, False),  # under SPLIT_WASTE positions wasted
        ([40, 700, 35], 64, False),  # a window: fetched keys start past row 0's
        ([700], None, False),  # one row
    ],
)
def test_rows_attend_alone_only_where_padding_wastes_much(lengths, window, split):
    ragged = _filled(lengths, 1, window)[0]
    counts = ragged.row_key_counts()
    assert counts == ([n + 1 for n in lengths] if split else None)


@pytest.mark.parametrize("T", [1, 4])
def test_rows_attending_alone_compute_what_they_compute_alone(T):
    """Each row over its own keys equals the row decoding alone (mlx-lm's
    attention over its own ``KVCache``, its own mask) and, with MLX's
    reference BLAS, the padded masked call over every row, bit for bit."""
    ragged, alone, q, keys, values, mask = _filled([40, 700, 35], T)
    assert ragged.row_key_counts() is not None
    got = fast_layers.scaled_dot_product_attention(q, keys, values, ragged, 0.125, mask)
    padded = scaled_dot_product_attention(q, keys, values, None, 0.125, mask)
    assert mx.array_equal(got, padded).item()
    for b, single in enumerate(alone):
        k, v = (
            single.keys[..., : single.offset, :],
            single.values[..., : single.offset, :],
        )
        own = create_attention_mask(q[b : b + 1].transpose(0, 2, 1, 3), single)
        want = scaled_dot_product_attention(q[b : b + 1], k, v, single, 0.125, own)
        assert mx.array_equal(got[b : b + 1], want).item()


def test_rows_of_one_length_keep_one_call(monkeypatch):
    """Negative control: without the split the padded call runs (once)."""
    calls = []
    real = fast_layers.attend_rows_alone
    monkeypatch.setattr(
        fast_layers, "attend_rows_alone", lambda *a: calls.append(a) or real(*a)
    )
    ragged, _, q, keys, values, mask = _filled([300, 301, 299], 1)
    fast_layers.scaled_dot_product_attention(q, keys, values, ragged, 0.125, mask)
    assert calls == []
    ragged, _, q, keys, values, mask = _filled([40, 700, 35], 1)
    fast_layers.scaled_dot_product_attention(q, keys, values, ragged, 0.125, mask)
    assert len(calls) == 1
