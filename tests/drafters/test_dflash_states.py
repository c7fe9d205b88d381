"""Kept states and chat sessions key on the DFlash drafter model: a state
holding drafter A's context is never continued with drafter B of the same
shapes (through the server's engine and its disk tier, the store itself and
a chat session file), and is continued with A again, exactly."""

import logging
import shutil

import mlx_lm
import pytest
from mlx.utils import tree_flatten

import mlx_spec
from mlx_spec import DecodeOptions, Session
from mlx_spec.drafters.dflash import attached_draft_model
from mlx_spec.models.dflash.capture import detach_tap
from mlx_spec.models.dflash.model import DFlashDraftModel
from mlx_spec.models.identity import draft_model_fingerprint
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import Started
from mlx_spec.states.session_file import load_session, save_session
from mlx_spec.states.store import Identity, StateStore, file_name
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.dflash_drafters import write_dflash_checkpoint
from mlx_spec.testing.reference import prompts, reference_tokens, register_twin
from mlx_spec.testing.state_files import converse

FAMILY = "qwen3_5"
BIG = 1 << 30


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, tokenizer, drafter A's directory, drafter B's): A and B have
    the same config and shapes, other random weights. A model of this
    module's own (the tap stays off the suite's shared models)."""
    root = tmp_path_factory.mktemp("dflash_states")
    path = write_tiny_checkpoint(root / "target", FAMILY)
    model, tok = mlx_spec.load(path)
    plain, plain_tok = mlx_lm.load(str(path))
    register_twin(model, plain)
    tok.eos_token_ids, plain_tok.eos_token_ids = set(), set()
    a = write_dflash_checkpoint(root / "a", FAMILY, seed=0)
    b = write_dflash_checkpoint(root / "b", FAMILY, seed=1)
    yield model, tok, a, b
    detach_tap(model)


def attach(model, directory, quantize=None):
    """Drafter ``directory`` loaded anew and attached (as a restarted
    process would)."""
    return mlx_spec.loading.use_draft_model(model, str(directory), quantize)


def test_a_drafter_model_is_identified_by_its_weights(setup, tmp_path):
    """The same files (loaded again, or copied elsewhere) are the same
    drafter; other weights of the same shapes, or the same files quantised
    in memory, are another; a drafter built in memory is its weights' bytes."""
    model, tok, a, b = setup
    first = draft_model_fingerprint(mlx_spec.load_drafter(a, model))
    assert first and first == draft_model_fingerprint(mlx_spec.load_drafter(a, model))
    copy = shutil.copytree(a, tmp_path / "copy")
    assert draft_model_fingerprint(mlx_spec.load_drafter(copy, model)) == first
    other = draft_model_fingerprint(mlx_spec.load_drafter(b, model))
    eight = draft_model_fingerprint(mlx_spec.load_drafter(a, model, quantize=8))
    four = draft_model_fingerprint(mlx_spec.load_drafter(a, model, quantize=4))
    assert len({first, other, eight, four}) == 4
    assert draft_model_fingerprint(None) == ""

    def in_memory(directory):
        loaded = mlx_spec.load_drafter(directory, model)
        built = DFlashDraftModel(loaded.config)
        built.load_weights(tree_flatten(loaded.parameters()))
        return draft_model_fingerprint(built.bind(model))

    assert in_memory(a) == in_memory(a) != in_memory(b)

    # the store's identity and file names follow the attached drafter model
    ids = {}
    for name, directory in (("a", a), ("b", b), ("a again", a)):
        attach(model, directory)
        ids[name] = Identity.of(model, tok)
    assert ids["a"] == ids["a again"] and ids["a"].draft_model == first
    assert ids["a"].draft_model != ids["b"].draft_model
    tokens = prompts("mixed")
    assert file_name(ids["a"], "dflash", tokens) != file_name(
        ids["b"], "dflash", tokens
    )
    assert ids["a"].mismatch(ids["b"].metadata()) == (
        "saved with another DFlash drafter model"
    )


def make_engine(model, tok, directory):
    store = StateStore.for_model(directory, BIG, model, tok, FAMILY)
    return Engine(model, tok, "dflash", num_draft_tokens=3, state_store=store)


def test_a_restart_with_another_drafter_model_starts_cold(setup, tmp_path, caplog):
    """A conversation kept on disk with drafter A: a server restarted with B
    (same shapes) skips it with one warning and answers cold; restarted
    with A again, it continues from disk (only the new tokens prefilled)
    with the tokens of plain decoding."""
    model, tok, a, b = setup
    states = tmp_path / "states"
    first = prompts("mixed")
    attach(model, a)
    engine = make_engine(model, tok, states)
    try:
        _, reply = converse(engine, first, 10)
    finally:
        engine.close()  # its states written
    second = first + reply + [5, 6, 7]
    want = reference_tokens(model, tok, second, 12)
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    for name, directory in (("b", b), ("a", a)):
        attach(model, directory)
        engine = make_engine(model, tok, states)
        try:
            events, got = converse(engine, second, 12)
        finally:
            engine.close()
        cached = next(e for e in events if isinstance(e, Started)).cached_tokens
        assert got == want, name
        if name == "b":
            assert cached == 0 and engine.store.counts["loaded"] == 0
            said = [r.getMessage() for r in caplog.records]
            assert any("another DFlash drafter model" in m for m in said), said
            # one line per file, however often it is listed
            assert len(said) == len(set(said))
        else:  # A's own state; B's (the same prompt, kept by B) skipped
            assert cached == len(first) + len(reply) - 1
            assert engine.store.counts["loaded"] == 1


def test_a_session_file_of_another_drafter_model_is_refused(setup, tmp_path):
    """A chat session saved with drafter A: loading it with B is refused,
    naming the file, before anything is restored; with A again it continues
    with every token of the first turn kept and plain decoding's tokens."""
    model, tok, a, b = setup
    path = tmp_path / "session.safetensors"
    options = DecodeOptions("dflash", 3)
    first_turn, second_turn = prompts("mixed"), prompts("repetitive", n=7)
    attach(model, a)
    session = Session(model, options)
    first = [t for t, _, _ in session.generate(first_turn, max_tokens=10)]
    save_session(path, session)
    want = reference_tokens(model, tok, first_turn + first + second_turn, 10)

    attach(model, b)
    fresh = Session(model, options)
    with pytest.raises(ValueError) as refused:
        load_session(path, fresh)
    message = str(refused.value)
    assert str(path) in message and "another DFlash drafter model" in message
    assert "\n" not in message and fresh.decoder.history == []

    attach(model, a)
    again = Session(model, options)
    load_session(path, again)
    assert again.decoder.history == first_turn + first  # nothing prefilled again
    got = [t for t, _, _ in again.generate(second_turn, max_tokens=10)]
    assert got == want


def test_a_session_saved_without_a_drafter_model_is_refused_with_one(setup, tmp_path):
    """The other way round: a session of a model with no drafter model is
    refused once one is attached (its hidden rows lack the features)."""
    a = setup[2]
    path = tmp_path / "plain.safetensors"
    bare, _ = mlx_spec.load(write_tiny_checkpoint(tmp_path / "t", FAMILY))
    assert attached_draft_model(bare) is None
    session = Session(bare, DecodeOptions("ngram", 3))
    list(session.generate(prompts("mixed"), max_tokens=4))
    save_session(path, session)
    attach(bare, a)
    with pytest.raises(ValueError, match="without a DFlash drafter model"):
        load_session(path, Session(bare, DecodeOptions("ngram", 3)))
    detach_tap(bare)
