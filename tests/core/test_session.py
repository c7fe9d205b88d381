"""``mlx_spec.Session``, the one way a sequence is opened: lossless for every
drafter on every family, bad options refused by name before any state
exists, kept states restored exactly, and a server's rows starting from the
evidence a lone generation starts from."""

import re

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_spec import DecodeOptions, Session, stream_generate
from mlx_spec.core.batch import BatchDecoder
from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.core.state import GDNSlotCache
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import GenerationParams, Job
from mlx_spec.states.snapshot import capture, shared
from mlx_spec.testing.reference import (
    OracleDrafter,
    cache_arrays,
    prompts,
    reference_tokens,
    tokens_of,
)
from mlx_spec.testing.server import job_events

DRAFTS = ["none", "ngram", "mtp", "mtp+ngram", "oracle"]
TURNS = [prompts("mixed", seed=4), prompts("repetitive", n=11, seed=5)]


def tokens(steps) -> list:
    return [t for t, _, _ in steps]


def options_for(draft, model, k, turns, replies) -> DecodeOptions:
    """``draft`` as a session's option; "oracle": a user's drafter object
    that knows the conversation and errs a third of the time."""
    if draft == "oracle":
        sequence = [t for turn, r in zip(turns, replies) for t in turn + r]
        draft = OracleDrafter(sequence, error=0.3, seed=1)
    return DecodeOptions(draft, num_draft_tokens=k)


@pytest.mark.parametrize("k", [3, "auto"])
@pytest.mark.parametrize("draft", DRAFTS)
def test_every_drafter_decodes_mlx_lms_tokens(models, family, draft, k):
    """Two turns of one session, each turn's tokens and the caches after it
    equal to mlx-lm's with one prompt cache for the conversation."""
    model, tok = models[family]
    cache = make_prompt_cache(model)
    want = [reference_tokens(model, tok, t, 14, prompt_cache=cache) for t in TURNS]
    session = Session(model, options_for(draft, model, k, TURNS, want))
    eos = tok.eos_token_ids
    got = [
        tokens(session.generate(turn, max_tokens=14, stop_tokens=eos, flush=True))
        for turn in TURNS
    ]
    assert got == want
    assert session.history == [t for turn, r in zip(TURNS, want) for t in turn + r]
    ours, theirs = cache_arrays(session.decoder.cache.caches), cache_arrays(cache)
    assert all(mx.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(draft="eagle"), "unknown draft 'eagle'"),
        (dict(draft=42), "unknown draft 42"),
        (dict(draft="ngram", num_draft_tokens=17), "0..16, got 17"),
        (dict(draft="ngram", num_draft_tokens=-1), "got -1"),
        (dict(draft="ngram", num_draft_tokens="many"), "got 'many'"),
        (dict(draft="mtp+ngram", num_draft_tokens=9), "got 9"),
        (dict(draft="ngram", rollback="undo"), "'undo'"),
        (dict(draft="ngram", prefill_step_size=0), "got 0"),
        (dict(draft="ngram", prefill_step_size=True), "got True"),
        (dict(draft="ngram", tuning={}), "got dict"),
    ],
)
def test_bad_options_are_refused_naming_the_value(fields, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        DecodeOptions(**fields)


def test_good_options_are_a_value():
    a = DecodeOptions("ngram", num_draft_tokens=4, tuning=DEFAULT_TUNING)
    assert a == DecodeOptions("ngram", 4) and a.max_draft == 4 and a.speculates
    assert DecodeOptions("none").max_draft == 8 and not DecodeOptions("none").speculates
    assert DecodeOptions("ngram", 0).max_draft == 1  # the caches hold one draft
    with pytest.raises(AttributeError):
        a.draft = "mtp"  # frozen


@pytest.mark.parametrize(
    "draft, max_ngram, named",
    [
        ("mtp", 3, "no MTP head"),
        ("ngram", 1, "max_ngram must be an integer >= 2, got 1"),
    ],
)
def test_a_session_is_refused_before_it_touches_a_prompt_cache(
    models, draft, max_ngram, named, monkeypatch
):
    """A drafter the model cannot have (its head taken off) or a bad drafter
    option: refused by name, the caller's prompt cache as it was, and the
    cache then serves a session as mlx-lm's own."""
    model, tok = models["qwen3_next"]
    cache = make_prompt_cache(model)
    before = list(cache)
    options = DecodeOptions(draft, num_draft_tokens=3, max_ngram=max_ngram)
    with monkeypatch.context() as m:
        m.setitem(model.__dict__, "mtp_head", None)
        with pytest.raises(ValueError, match=named):
            Session(model, options, prompt_cache=cache)
    assert all(a is b for a, b in zip(cache, before, strict=True))
    assert not any(isinstance(c, GDNSlotCache) for c in cache)
    prompt = prompts("mixed")
    session = Session(model, DecodeOptions("ngram", 3), prompt_cache=cache)
    eos = tok.eos_token_ids
    got = tokens(session.generate(prompt, max_tokens=10, stop_tokens=eos))
    assert got == reference_tokens(model, tok, prompt, 10)


@pytest.mark.parametrize("draft", ["ngram", "mtp", "mtp+ngram"])
def test_a_kept_state_is_restored_exactly_and_stays_kept(models, family, draft):
    """A state captured after a turn, restored into new sessions (twice, as
    the server restores a state it keeps), continues exactly as the session
    it was taken from; a state of another drafter is refused by name."""
    model, tok = models[family]
    options = DecodeOptions(draft, num_draft_tokens=3)
    eos = tok.eos_token_ids
    session = Session(model, options)
    first = tokens(session.generate(TURNS[0], max_tokens=12, stop_tokens=eos))
    state = capture(session.decoder, copy_caches=True, flush=False)
    want = tokens(session.generate(TURNS[1], max_tokens=12, stop_tokens=eos))
    for _ in range(2):
        again = Session(model, options, state=shared(state))
        assert again.history == TURNS[0] + first
        assert tokens(again.generate(TURNS[1], max_tokens=12, stop_tokens=eos)) == want
    other = "ngram" if draft != "ngram" else "none"
    refused = f"saved with draft '{draft}', not '{other}'"
    with pytest.raises(ValueError, match=re.escape(refused)):
        Session(model, DecodeOptions(other, 3), state=state)
    with pytest.raises(ValueError, match="before anything is fed"):
        again.restore(state)


@pytest.mark.parametrize("draft", ["mtp", "mtp+ngram"])
def test_a_server_row_starts_from_a_lone_generations_evidence(
    models, family, draft, monkeypatch
):
    """Under ``auto`` the drafter judges the prompt's rows in hindsight while
    they are fed: when a row joins its batch, the first drafts judged are
    the same for the server's request as for ``stream_generate`` of the
    same prompt (and there are some)."""
    model, tok = models[family]
    judged = []
    join = BatchDecoder.add

    def add(self, decoder, *args, **kwargs):
        judged.append(decoder.drafter.hindsight())
        return join(self, decoder, *args, **kwargs)

    monkeypatch.setattr(BatchDecoder, "add", add)
    prompt = prompts("mixed")
    lone = [
        r.token
        for r in stream_generate(
            model, tok, prompt, 6, draft=draft, num_draft_tokens="auto"
        )
    ]
    engine = Engine(model, tok, draft, num_draft_tokens="auto")
    try:
        events = job_events(engine.submit(Job(prompt, GenerationParams(6))))
    finally:
        engine.close()
    assert tokens_of(events) == lone
    alone, served = judged
    assert alone["mtp"][1] > 0  # the prompt's rows were judged
    assert served == alone
