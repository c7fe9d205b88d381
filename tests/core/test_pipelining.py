"""Plain passes queued ahead. Their token is evaluated on its own, before the
forward queued over it, so the host's wait for the token ends with this pass
(one evaluation of both would hold the host until the next forward is done
too, and host and device would take turns); in a batch, rows that join, stop
or leave while a pass is queued roll it back."""

import mlx.core as mx

from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.drafters import make_drafter
from mlx_spec.mlx_lm_compat import make_prompt_cache
from mlx_spec.testing.reference import (
    cache_arrays,
    fed_decoder,
    prompts,
    reference_tokens,
    run_batch,
)


def _record_async_evals(monkeypatch):
    calls = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: calls.append(a) or real(*a))
    return calls


def _token_evaluated_apart(calls, queued) -> bool:
    """Some call evaluated sampled tokens (an integer array) without the
    queued forward's outputs, and a later one evaluated those outputs."""
    forward = {id(a) for a in queued if a is not None}
    tokens_alone = [
        i
        for i, call in enumerate(calls)
        if any(mx.issubdtype(a.dtype, mx.integer) for a in call)
        and not forward & {id(a) for a in call}
    ]
    with_forward = [
        i for i, call in enumerate(calls) if forward & {id(a) for a in call}
    ]
    return bool(tokens_alone and with_forward) and tokens_alone[-1] < with_forward[-1]


def test_decoder_evaluates_the_token_apart(models, family, monkeypatch):
    model, _ = models[family]
    decoder = SpeculativeDecoder(model, None, max_draft=4)
    decoder.feed(prompts("mixed"))
    engine = BatchDecoder.alone(decoder)
    engine.add(decoder, RowOptions(8, num_draft_tokens=0))
    calls = _record_async_evals(monkeypatch)
    engine.step()
    assert engine.queued, "the next plain pass was not queued"
    assert _token_evaluated_apart(calls, engine.ahead.forward), calls


def test_batch_evaluates_the_tokens_apart(models, monkeypatch):
    model, _ = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=2, max_draft=4)
    for seed in (1, 2):
        batch.add(fed_decoder(model, prompts("mixed", seed=seed), None), RowOptions(8))
    calls = _record_async_evals(monkeypatch)
    batch.step()
    assert batch.queued, "the next plain pass was not queued"
    assert _token_evaluated_apart(calls, batch.ahead.forward), calls


def test_plain_passes_are_queued_and_undone_when_rows_change(models, family):
    """Rows without drafters: each plain pass queues the next one before
    its tokens are read. A row joining, stopping or leaving while a pass is
    queued rolls it back: every row's tokens are plain decoding's, and a row
    taken out holds plain decoding's caches."""
    model, tok = models[family]
    a, b, c = prompts("mixed", seed=1), prompts("repetitive", seed=2), [7, 8]
    want = {tuple(p): reference_tokens(model, tok, p, 20) for p in (a, b, c)}
    stop = want[tuple(a)][6]  # a stops early, on a token it emits
    want[tuple(a)] = want[tuple(a)][: want[tuple(a)].index(stop) + 1]
    batch = BatchDecoder(model, n_slots=3, max_draft=4)
    got = {}

    def add(p, stops=()):
        id = batch.add(fed_decoder(model, p, None), RowOptions(20, stop_tokens=stops))
        got[id] = []
        return id

    def step():
        for id, (tokens, _) in batch.step().items():
            got[id] += tokens
        return batch.queued

    sa, sb = add(a, {stop}), add(b)
    assert [step() for _ in range(3)] == [True] * 3
    sc = add(c)  # joins while a pass is queued
    while sa in batch.active:
        step()
    batch.take(sa)  # a stopped: the pass queued with it was undone
    assert step()
    left, n = batch.take(sb), len(got[sb])  # b leaves while one is queued
    run_batch(batch, got)
    assert got[sa] == want[tuple(a)] and got[sc] == want[tuple(c)]
    left.flush()
    plain = make_prompt_cache(model)
    assert got[sb] == reference_tokens(model, tok, b, n, prompt_cache=plain)
    for x, y in zip(cache_arrays(left.cache.caches), cache_arrays(plain)):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


def test_a_row_drafting_a_fixed_length_queues_nothing(models):
    """Control: beside a row with a fixed draft length (whose next pass may
    draft), no pass is queued."""
    model, tok = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=2, max_draft=4)
    rows, want = {}, {}
    for prompt, draft in ((prompts("mixed"), None), (prompts("random"), "ngram")):
        d = fed_decoder(model, prompt, draft and make_drafter(draft, model))
        rows[batch.add(d, RowOptions(12, num_draft_tokens=3))] = []
        want[len(rows) - 1] = reference_tokens(model, tok, prompt, 12)
    queued = []
    while batch.active:
        for b, (tokens, _) in batch.step().items():
            rows[b] += tokens
        queued.append(batch.queued)
    assert rows == want and not any(queued)


def test_a_plain_pass_not_queued_samples_its_rows_at_once(models, monkeypatch):
    """Passes never queued (``queue_ahead=False``) that draft nothing: no
    row verifies alone (one read of every row's token), and each row gets
    plain decoding's tokens. The control: a row with a logits processor
    (it sees host token lists) verifies alone, every pass."""
    import mlx_spec.core.batch_row as batch_row

    model, tok = models["qwen3_next"]
    alone = []
    real = batch_row.verify_draft
    monkeypatch.setattr(
        batch_row, "verify_draft", lambda *a, **k: alone.append(1) or real(*a, **k)
    )

    def decode(processors):
        batch = BatchDecoder(model, n_slots=2, max_draft=4)
        got, want = {}, {}
        for seed in (1, 2):
            p = prompts("mixed", seed=seed)
            options = RowOptions(10, num_draft_tokens=0, logits_processors=processors)
            got[batch.add(fed_decoder(model, p, None), options)] = []
            want[len(got) - 1] = reference_tokens(model, tok, p, 10)
        alone.clear()
        while batch.active:
            for id, (tokens, _) in batch.step(queue_ahead=False).items():
                got[id] += tokens
        assert got == want
        return len(alone)

    assert decode(None) == 0
    assert decode([lambda tokens, logits: logits]) == 20  # 2 rows x 10 passes
