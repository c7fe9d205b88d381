"""The MTP head's attention window: each head row attends to its last ``window``
positions, however rows are batched, alone or in a batch, and output tokens
never change."""

import mlx.core as mx
import mlx_lm
import pytest

import mlx_spec
from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.core.ragged_cache import RaggedKVCache
from mlx_spec.states.snapshot import capture
from mlx_spec.core.stats import SpecStats
from mlx_spec.drafters import mtp_rows as mtp_module  # the head rows' chunking
from mlx_spec.drafters.combined import MTPNgramDrafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.mtp_rows import HeadRows
from mlx_spec.generate import stream_generate
from mlx_spec.models.fast_layers import _stored_rows
from mlx_spec.models.mtp import MTPKVCache
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.mtp_heads import count_head_rows, write_predictive_checkpoint
from mlx_spec.testing.reference import decode_alone

WINDOW = 5


def _attend(cache, queries, keys, values):
    mask = cache.make_mask(queries.shape[2])
    k, v = cache.update_and_fetch(keys, values)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=0.5, mask=mask)


def _banded(queries, keys, values, window):
    """Attention of every position over its last ``window`` (all rows given)."""
    n = queries.shape[2]
    pos = mx.arange(n)
    mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - window)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=0.5, mask=mask
    )


@pytest.mark.parametrize("chunks", [[3, 4, 1, 1, 6, 2], [1] * 12, [12], [4, 8]])
def test_cache_attends_to_the_last_window_however_rows_are_chunked(chunks):
    mx.random.seed(0)
    q, k, v = (mx.random.normal((1, 2, sum(chunks), 4)) for _ in range(3))
    cache, out, at = MTPKVCache(None, WINDOW), [], 0
    for n in chunks:
        part = slice(at, at + n)
        out.append(_attend(cache, q[:, :, part], k[:, :, part], v[:, :, part]))
        at += n
    got = mx.concatenate(out, axis=2)
    assert mx.allclose(got, _banded(q, k, v, WINDOW), atol=1e-6).item()
    assert cache.offset == sum(chunks)  # every row stays stored
    # Without a window the same cache attends to everything (the negative control).
    full, out, at = MTPKVCache(None, None), [], 0
    for n in chunks:
        part = slice(at, at + n)
        out.append(_attend(full, q[:, :, part], k[:, :, part], v[:, :, part]))
        at += n
    assert not mx.allclose(mx.concatenate(out, axis=2), got, atol=1e-3).item()


def test_ragged_rows_attend_as_each_row_alone():
    """Rows at different offsets in one batch cache: each row's attention
    equals its own windowed cache's."""
    mx.random.seed(1)
    offsets, T = [0, 3, 9, 14], 3
    ragged, alone = RaggedKVCache(None, WINDOW), []
    for n in offsets:  # each row's history, written alone, then joined
        c = MTPKVCache(None, WINDOW)
        if n:
            c.update_and_fetch(*(mx.random.normal((1, 2, n, 4)) for _ in range(2)))
        alone.append(c)
        ragged.append_row(c)
    q, k, v = (mx.random.normal((len(offsets), 2, T, 4)) for _ in range(3))
    got = _attend(ragged, q, k, v)
    for b, c in enumerate(alone):
        row = slice(b, b + 1)
        want = _attend(c, q[row], k[row], v[row])
        assert mx.allclose(got[row], want, atol=1e-6).item(), b


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_window")
    return {
        f: mlx_spec.load(write_predictive_checkpoint(root / f, f)) for f in FAMILIES
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("make", [MTPDrafter, MTPNgramDrafter])
def test_a_windowed_head_changes_no_token(models, family, make, monkeypatch):
    """A window far shorter than the text: drafts change, tokens do not;
    the prefill skips the prompt's rows before the last judged ones' windows
    (zeros stand for them)."""
    model, tok = models[family]
    monkeypatch.setattr(mtp_module, "MIN_WINDOW_CHUNK", 4)
    monkeypatch.setattr(mtp_module, "JUDGED_PROMPT_ROWS", 2)
    prompt = "def push(self, value: int) -> None:\n    x = value + value\n"
    want = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=24)]
    monkeypatch.setattr(model.mtp_head, "attention_window", 4)
    for k in (1, 3, "auto"):
        drafter = make(model.mtp_head)
        stats = SpecStats()
        got = stream_generate(
            model,
            tok,
            prompt,
            max_tokens=24,
            draft=drafter,
            num_draft_tokens=k,
            stats=stats,
        )
        assert [r.token for r in got] == want, k
        assert stats.drafted > 0 or k == "auto"  # the windowed head drafted
        mtp = drafter if isinstance(drafter, MTPDrafter) else drafter.mtp
        assert (
            mtp.rows.cache[0].window == 4
            and mtp.rows.offset == len(tok.encode(prompt)) + 23
        )
        assert not mx.any(mtp.rows.cache[0].keys[..., :4, :]).item()  # skipped rows


@pytest.mark.parametrize("window", [0, -3, 2.5, "512", True])
def test_a_bad_window_is_refused_by_value(models, window):
    head = models["qwen3_next"][0].mtp_head
    with pytest.raises(ValueError, match=repr(window).replace(".", r"\.")):
        head.attention_window = window
    assert head.attention_window is None  # unchanged


@pytest.mark.parametrize("window", [None, WINDOW])
def test_the_kernel_reads_the_stored_rows_it_was_handed(window):
    """The Metal path reads the float16 rows as stored: the same rows (the
    window's, or all) that ``update_and_fetch`` handed attention upcast."""
    mx.random.seed(2)
    cache = MTPKVCache(mx.float16, window)
    for n in (3, 4, 1, 6):
        keys, values = (mx.random.normal((1, 2, n, 4)) for _ in range(2))
        k, v = cache.update_and_fetch(keys, values)
        stored_k, stored_v = _stored_rows(cache, k, v)
        assert stored_k.dtype == mx.float16 and stored_k.shape == k.shape
        assert mx.array_equal(stored_k.astype(k.dtype), k).item()
        assert mx.array_equal(stored_v.astype(v.dtype), v).item()


@pytest.mark.parametrize("window", [None, 6])
def test_a_prompt_prefilled_in_chunks_leaves_the_head_as_one_forward(
    models, window, monkeypatch
):
    """The head's prompt rows run in chunks (of the window's size when it has
    one, the shorter chunk first): its cache and next logits are those of one
    forward over every row."""
    model, _ = models["qwen3_next"]
    head = model.mtp_head
    monkeypatch.setattr(head, "attention_window", window)
    monkeypatch.setattr(mtp_module, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(mtp_module, "MIN_WINDOW_CHUNK", 4)
    mx.random.seed(3)
    prompt = list(range(3, 33))  # 29 rows: chunks of 8 (6) after a shorter one
    hidden = mx.random.normal((len(prompt) - 1, head.hidden_size))
    drafter = MTPDrafter(head)
    drafter.reset(prompt, hidden)
    cache = head.make_cache()
    hm = head.head_hidden(mx.array(prompt[1:])[None], hidden[None], cache)
    P = len(prompt) - 1
    assert drafter.rows.offset == P
    seen = P - (window or P)  # rows any later row attends to: [seen, P)
    got, want = (
        drafter.rows.cache[0].keys[..., seen:P, :],
        cache[0].keys[..., seen:P, :],
    )
    assert mx.allclose(got, want, atol=1e-5).item()
    fresh = head.logits(hm[:, -1:])[0, 0]
    assert mx.allclose(drafter.rows.next_logits(), fresh, atol=1e-4).item()


def _windowed_counting_rows(model, monkeypatch):
    """The model's head with a window of 6 (chunks of 6), a prompt's last 4
    rows judged, and the list that records how many rows each head forward
    over verified rows runs."""
    head = model.mtp_head
    monkeypatch.setattr(head, "attention_window", 6)
    monkeypatch.setattr(mtp_module, "MIN_WINDOW_CHUNK", 4)
    monkeypatch.setattr(mtp_module, "JUDGED_PROMPT_ROWS", 4)
    return head, count_head_rows(monkeypatch)


def _prefilled(head, prompt, hidden):
    drafter = MTPDrafter(head)
    drafter.hindsight()  # judge the prompt's last rows, as auto does
    drafter.reset(prompt, hidden)
    assert drafter.rows.offset == drafter.rows.verified == len(prompt) - 1
    judged = drafter.hindsight()["mtp"]
    return drafter, (drafter.rows.next_logits(), judged), drafter.draft(3)


def test_a_windowed_prefill_skips_the_rows_no_later_row_sees(models, monkeypatch):
    """With a window, the prompt's head rows before the windows of its last
    (judged) rows are never attended to again: they are not run (zeros stand
    for them), and the cache rows later rows see, the next logits, the
    hindsight judgments of the prompt's last rows and the drafts are bit for
    bit those of running every chunk. Negative control: blanking one row more,
    the first the last row attends to, changes the logits."""
    model, _ = models["qwen3_next"]
    head, calls = _windowed_counting_rows(model, monkeypatch)
    mx.random.seed(5)
    prompt = list(range(3, 40))  # 36 rows: the last 4 judged, window 6
    hidden = mx.random.normal((len(prompt) - 1, head.hidden_size))
    skipping, logits, draft = _prefilled(head, prompt, hidden)
    assert calls == [4, 6]  # rows 26..35 (row 32 attends back to row 27)
    assert not mx.any(skipping.rows.cache[0].keys[..., :26, :]).item()  # zeros

    every_chunk = list(range(0, 37, 6))
    monkeypatch.setattr(HeadRows, "seen_chunks", lambda r, n: every_chunk)
    every, want_logits, want_draft = _prefilled(head, prompt, hidden)
    assert mx.array_equal(logits[0], want_logits[0]).item() and draft == want_draft
    assert logits[1] == want_logits[1] and logits[1][1] == 3  # 4 rows judged
    for got, want in zip(skipping.rows.cache, every.rows.cache):
        assert mx.array_equal(got.keys[..., 30:36, :], want.keys[..., 30:36, :]).item()

    # the last chunk's first row, which row 35 sees, blanked too
    monkeypatch.setattr(HeadRows, "seen_chunks", lambda r, n: [31, 36])
    _, short_logits, _ = _prefilled(head, prompt, hidden)
    assert not mx.array_equal(short_logits[0], want_logits[0]).item()


def _head_of(drafter) -> MTPDrafter:
    return drafter if isinstance(drafter, MTPDrafter) else drafter.mtp


@pytest.mark.parametrize("make", [MTPDrafter, MTPNgramDrafter])
def test_a_prompt_fed_in_chunks_reaches_the_drafter_in_one_piece(
    models, make, monkeypatch
):
    """Fed in chunks with ``more``, a prompt reaches the drafter as one feed
    of the whole: the windowed head runs only the last two chunks' rows, and
    its cache, next logits and drafts are those of one feed. Negative
    control: chunks whose rows run as they come run every row."""
    model, _ = models["qwen3_next"]
    head, calls = _windowed_counting_rows(model, monkeypatch)
    prompt = [3 + (7 * i) % 50 for i in range(37)]  # 36 rows: the last 10 run

    def fed(chunk, more=True, limit=None):
        """A decoder fed the prompt in chunks of ``chunk``, its head's rows
        run; ``limit``: the head runs its rows once this many are deferred."""
        decoder = SpeculativeDecoder(model, make(head), max_draft=3)
        mtp = _head_of(decoder.drafter)
        mtp.rows.pending_limit = limit or mtp.rows.pending_limit
        for at in range(0, len(prompt), chunk):
            last = at + chunk >= len(prompt)
            decoder.feed(prompt[at : at + chunk], more=more and not last)
        mtp.rows.next_logits()
        return decoder, mtp

    given = []
    reset = MTPDrafter.reset
    monkeypatch.setattr(
        MTPDrafter, "reset", lambda d, t, h: given.append(h) or reset(d, t, h)
    )
    whole, whole_head = fed(len(prompt))
    assert calls == [4, 6]
    # the rows it never reads come as zeros; the others are the target's
    real = model.model(mx.array(prompt[:-1])[None])[0]
    assert not mx.any(given[-1][:26]).item()
    assert mx.array_equal(given[-1][26:], real[26:]).item()
    calls.clear()
    chunked, chunked_head = fed(8)
    assert calls == [4, 6]
    assert chunked.history == whole.history == prompt
    assert mx.array_equal(
        chunked_head.rows.next_logits(), whole_head.rows.next_logits()
    ).item()
    for got, want in zip(chunked_head.rows.cache, whole_head.rows.cache):
        assert mx.array_equal(got.keys[..., 30:36, :], want.keys[..., 30:36, :]).item()
    assert chunked.drafter.draft(3) == whole.drafter.draft(3)

    calls.clear()
    fed(8, more=False, limit=1)  # each chunk's rows run as they come
    assert sum(calls) == len(prompt) - 1


def test_a_state_kept_mid_prompt_holds_the_drafters_rows(models):
    """Capturing (or verifying) a decoder fed with ``more`` first hands the
    drafter the rows it holds."""
    model, _ = models["qwen3_next"]
    decoder = SpeculativeDecoder(model, MTPDrafter(model.mtp_head), max_draft=3)
    decoder.feed(list(range(3, 20)), more=True)
    assert decoder.drafter.rows.cache is None  # not reset yet: it holds them
    state = capture(decoder, copy_caches=True, flush=False)
    assert decoder.drafter.rows.offset == 16 and state.drafter_arrays
    decoder.feed(list(range(20, 30)), more=True)
    decode_alone(decoder, 2, max_tokens=8, max_passes=1)
    assert decoder.drafter.rows.verified >= 16 + 10
