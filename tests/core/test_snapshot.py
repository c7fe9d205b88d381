"""Decoder states captured and restored: the server's kept states and chat
sessions."""

from dataclasses import replace

import mlx.core as mx
import pytest

from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.states.snapshot import capture, restore
from mlx_spec.drafters.combined import MTPNgramDrafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.testing.mtp_heads import count_head_rows
from mlx_spec.testing.reference import decode_alone


def _decoded(model, make, passes=3):
    """A decoder that has run ``passes`` verify passes (k = 2) after a
    prompt; its head holds the last pass's accepted rows deferred."""
    decoder = SpeculativeDecoder(model, make(model.mtp_head), max_draft=2)
    decoder.feed([3 + (5 * i) % 40 for i in range(21)])
    decode_alone(decoder, 2, max_tokens=1000, max_passes=passes)
    return decoder


def _head(drafter) -> MTPDrafter:
    return drafter if isinstance(drafter, MTPDrafter) else drafter.mtp


@pytest.mark.parametrize("make", [MTPDrafter, MTPNgramDrafter])
def test_a_kept_state_carries_the_heads_deferred_rows_unrun(models, make, monkeypatch):
    """A state kept in memory (``flush=False``) takes the head's deferred
    rows along without running them (no head forward), and a decoder
    restored from it, once it runs them, has the head state of the decoder
    that went on: the same cache rows, next logits and drafts, bit for bit.
    A session's state (``flush=True``) runs them: none are carried."""
    model, _ = models["qwen3_next"]
    ran = count_head_rows(monkeypatch)
    decoder = _decoded(model, make)
    deferred = _head(decoder.drafter).rows.pending_rows
    assert deferred > 0
    ran.clear()
    state = capture(decoder, copy_caches=True, flush=False)
    assert ran == []
    assert sum(t.size for t, _ in state.drafter_deferred) == deferred
    carried = sum(a.nbytes for pair in state.drafter_deferred for a in pair)
    assert state.nbytes - replace(state, drafter_deferred=[]).nbytes == carried > 0

    restored = SpeculativeDecoder(model, make(model.mtp_head), max_draft=2)
    restore(restored, state, copy_caches=True)
    went_on, back = _head(decoder.drafter), _head(restored.drafter)
    assert (
        back.rows.pending_rows == went_on.rows.pending_rows == deferred
    )  # still unrun
    assert mx.array_equal(back.rows.next_logits(), went_on.rows.next_logits()).item()
    for got, want in zip(back.rows.cache, went_on.rows.cache):
        n = want.offset
        assert got.offset == n
        assert mx.array_equal(got.keys[..., :n, :], want.keys[..., :n, :]).item()
    assert restored.drafter.draft(2) == decoder.drafter.draft(2)

    session = capture(_decoded(model, make), flush=True)
    assert session.drafter_deferred == [] and ran
