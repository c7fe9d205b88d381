"""The MTP head's forward: rows whose output nobody reads write only their
keys and values."""

import mlx.core as mx
import pytest

from mlx_spec.drafters import mtp_rows as mtp_module  # the head rows' chunking
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.models.mtp.head import MTPDecoderLayer
from mlx_spec.testing.checkpoints import FAMILIES


def _layer_rows(monkeypatch) -> list:
    """The rows each call of a head layer (its attention and MLP) runs over,
    recorded."""
    rows, call = [], MTPDecoderLayer.__call__
    monkeypatch.setattr(
        MTPDecoderLayer,
        "__call__",
        lambda layer, x, *a, **k: rows.append(x.shape[1]) or call(layer, x, *a, **k),
    )
    return rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("window", [None, 6])
def test_the_last_rows_outputs_and_every_cache_row_are_the_full_forwards(
    models, family, window, monkeypatch
):
    """With ``outputs=3``, the head's last 3 rows and every cache row
    (keys, values, rope positions after rows already cached) are those of
    running every row through the layer, bit for bit, while its attention and
    MLP run over those 3 rows only (the control: all 20)."""
    head = models[family][0].mtp_head
    monkeypatch.setattr(head, "attention_window", window)
    mx.random.seed(3)
    ids = mx.random.randint(0, 200, (1, 25))
    hidden = mx.random.normal((1, 25, head.hidden_size))
    rows = _layer_rows(monkeypatch)
    runs = []
    for outputs in (None, 3):
        cache = head.make_cache()
        head.head_hidden(ids[:, :5], hidden[:, :5], cache)  # rows already cached
        runs.append(
            (head.head_hidden(ids[:, 5:], hidden[:, 5:], cache, outputs), cache)
        )
    (full, full_cache), (last, cache) = runs
    assert rows == [5, 20, 5, 3]
    assert last.shape[1] == 3 and mx.array_equal(last, full[:, -3:]).item()
    for got, want in zip(cache, full_cache):
        assert got.offset == want.offset == 25
        assert mx.array_equal(got.keys[..., :25, :], want.keys[..., :25, :]).item()
        assert mx.array_equal(got.values[..., :25, :], want.values[..., :25, :]).item()


def test_a_prompt_runs_the_layer_only_where_its_output_is_read(models, monkeypatch):
    """A prompt's head rows run the layer's attention and MLP only over its
    last rows, those judged in hindsight (here 4), and the chunks before the
    last only over their last row. Accepted rows run every row when some are
    judged (two passes': the second's first token began a pass), else only
    the last (one pass's: the tokens after its first were drafted)."""
    head = models["qwen3_next"][0].mtp_head
    monkeypatch.setattr(mtp_module, "JUDGED_PROMPT_ROWS", 4)
    monkeypatch.setattr(mtp_module, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(head, "attention_window", None)
    rows = _layer_rows(monkeypatch)
    drafter = MTPDrafter(head)
    drafter.hindsight()  # judging on, as auto turns it
    prompt = list(range(3, 23))  # 19 rows: chunks of 3, 8, 8
    drafter.reset(prompt, mx.random.normal((19, head.hidden_size)))
    assert rows == [1, 1, 4]
    H = head.hidden_size
    drafter.accept([5, 6], mx.random.normal((2, H)))
    drafter.accept([7], mx.random.normal((1, H)))
    drafter.rows.next_logits()
    drafter.accept([8, 9], mx.random.normal((2, H)))
    drafter.rows.next_logits()
    assert rows[3:] == [3, 1]
    assert drafter.rows.offset == 24
