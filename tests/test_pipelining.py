"""A queued plain pass: its token is evaluated on its own, before the
forward queued over it, so the host's wait for the token ends with this pass
(one evaluation of both would hold the host until the next forward is done
too, and host and device would take turns)."""

import mlx.core as mx

from mlx_spec.core.batch import BatchDecoder
from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.core.sampling import make_sampler
from mlx_spec.testing.reference import prompts


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
    calls = _record_async_evals(monkeypatch)
    emitted, _, _ = decoder.verify(0, make_sampler(0.0), queue_plain=True)
    assert decoder._queued is not None, "the next plain pass was not queued"
    assert _token_evaluated_apart(calls, decoder._queued), calls
    decoder.commit(emitted)


def test_batch_evaluates_the_tokens_apart(models, monkeypatch):
    model, _ = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=2, max_draft=4)
    for seed in (1, 2):
        d = SpeculativeDecoder(model, None, max_draft=4)
        d.feed(prompts("mixed", seed=seed))
        batch.add(d, 8)
    calls = _record_async_evals(monkeypatch)
    batch.step()
    assert batch.queued, "the next plain pass was not queued"
    assert _token_evaluated_apart(calls, batch._queued), calls
