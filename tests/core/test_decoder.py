"""State that carries across generations (chat turns) and stop tokens."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_spec.core.sequence import SpeculativeDecoder
from mlx_spec.drafters import make_drafter
from mlx_spec.testing.reference import (
    OracleDrafter,
    cache_arrays,
    prompts,
    reference_tokens,
)
from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.session import DecodeOptions, Session

TURNS = [
    prompts("mixed", seed=1),
    prompts("random", n=9, seed=2),
    prompts("repetitive", n=11, seed=3),
]


def plain_conversation(model, tok, turns, max_tokens):
    """mlx-lm chat semantics: one prompt cache across turns, each turn's
    tokens prefilled on top of it."""
    cache = make_prompt_cache(model)
    replies = [
        reference_tokens(model, tok, turn, max_tokens, prompt_cache=cache)
        for turn in turns
    ]
    return replies, cache


@pytest.mark.parametrize("drafter_kind", ["ngram", "oracle"])
@pytest.mark.slow
def test_turns_match_plain_and_state_is_exact(models, family, drafter_kind):
    model, tok = models[family]
    ref, ref_cache = plain_conversation(model, tok, TURNS, 20)
    eos = ref[1][5]  # a token of the second reply ends generation there
    tok.eos_token_ids = {eos}
    try:
        ref, ref_cache = plain_conversation(model, tok, TURNS, 20)
    finally:
        tok.eos_token_ids = {399}
    assert ref[1][-1] == eos

    sequence = [t for turn, reply in zip(TURNS, ref) for t in turn + reply]
    drafter = (
        OracleDrafter(sequence, error=0.2)
        if drafter_kind == "oracle"
        else make_drafter("ngram", model)
    )
    session = Session(model, DecodeOptions(drafter, num_draft_tokens=5))
    decoder = session.decoder
    out = []
    for turn in TURNS:
        steps = session.generate(turn, max_tokens=20, stop_tokens={eos})
        out.append([t for t, _, _ in steps])
    assert out == ref
    # Only each turn's own tokens were prefilled: the history is the conversation.
    assert decoder.history == sequence
    decoder.flush()
    a, b = cache_arrays(ref_cache), cache_arrays(decoder.cache.caches)
    mx.eval(a, b)
    assert all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))


def test_stop_token_inside_accepted_draft_leaves_plain_state(models):
    model, tok = models["qwen3_5"]
    prompt = prompts("mixed")
    ref, ref_cache = plain_conversation(model, tok, [prompt], 30)
    eos = ref[0][8]
    tok.eos_token_ids = {eos}
    try:
        ref, ref_cache = plain_conversation(model, tok, [prompt], 30)
    finally:
        tok.eos_token_ids = {399}
    oracle = OracleDrafter(prompt + ref[0] + [1] * 10)
    session = Session(model, DecodeOptions(oracle, num_draft_tokens=6))
    decoder = session.decoder
    steps = list(session.generate(prompt, max_tokens=30, stop_tokens={eos}))
    assert [t for t, _, _ in steps] == ref[0]
    assert steps[-1][2], "the stop token was an accepted draft"
    assert decoder.pending == []  # the target already processed it
    a, b = cache_arrays(ref_cache), cache_arrays(decoder.cache.caches)
    mx.eval(a, b)
    assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))


def test_feed_rejects_empty_and_step_needs_tokens(models):
    model, _ = models["qwen3_next"]
    decoder = SpeculativeDecoder(model)
    with pytest.raises(ValueError, match="empty"):
        decoder.feed([])
    with pytest.raises(ValueError, match="feed it first"):
        BatchDecoder.alone(decoder).add(decoder, RowOptions(8))


@pytest.mark.parametrize("drafter_kind", ["none", "ngram-off", "auto-off"])
@pytest.mark.slow
def test_queued_plain_passes_are_plain_decoding(
    models, family, drafter_kind, monkeypatch
):
    """Passes without drafts are queued one ahead (mlx-lm's pipelining): the
    tokens, a generation stopped by a stop token or by its caller, and the
    caches after each turn are exactly plain decoding's."""
    model, tok = models[family]

    def plain():  # turn 0's caller stops after 12 tokens
        cache = make_prompt_cache(model)
        replies = [
            reference_tokens(model, tok, turn, 20, stop_after, prompt_cache=cache)
            for turn, stop_after in zip(TURNS, (12, None, None))
        ]
        return replies, cache

    eos = plain()[0][1][5]
    tok.eos_token_ids = {eos}
    try:  # and turn 1 stops at eos
        ref, cache = plain()
    finally:
        tok.eos_token_ids = {399}
    assert ref[1][-1] == eos and len(ref[0]) == 12

    drafter, k, costs = "none", 0, None
    if drafter_kind == "ngram-off":
        drafter = make_drafter("ngram", model)
    elif drafter_kind == "auto-off":  # drafts never accepted: auto turns them off
        sequence = [t for turn, reply in zip(TURNS, ref) for t in turn + reply]
        drafter, k = OracleDrafter(sequence, error=1.0), "auto"
        costs = [1 + 0.5 * t for t in range(9)]
    queued = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(
        mx, "async_eval", lambda *a: queued.append(1) or real_async_eval(*a)
    )
    session = Session(model, DecodeOptions(drafter, num_draft_tokens=k))
    decoder = session.decoder
    out = []
    for turn, stop_after in zip(TURNS, (12, None, None)):
        steps = session.generate(
            turn, verify_costs=costs, max_tokens=20, stop_tokens={eos}
        )
        reply = []
        for t, _, _ in steps:
            reply.append(t)
            if len(reply) == stop_after:
                steps.close()  # a queued pass is in flight here
        out.append(reply)
    assert out == ref
    assert len(queued) >= sum(map(len, ref)) // 2, "plain passes were not queued"
    decoder.flush()
    a, b = cache_arrays(cache), cache_arrays(decoder.cache.caches)
    mx.eval(a, b)
    assert all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))
