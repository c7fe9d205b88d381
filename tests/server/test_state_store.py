"""The disk tier under the server's kept states (mlx_spec.states.store): a
conversation continued from disk exactly, files that must not be loaded
skipped with one warning, two stores sharing a directory, the byte budget,
a directory that refuses writes, and memory flat over many cycles."""

import logging
import os
import time

import mlx.core as mx
import pytest

from mlx_spec.drafters import draft_names
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import Started
from mlx_spec.states.store import STALE_TEMP_S, Identity, StateStore
from mlx_spec.testing.reference import prompts, reference_tokens
from mlx_spec.testing.state_files import (
    converse,
    flip_byte,
    kept_state,
    file_of,
    rewrite,
    truncate,
)

BIG = 1 << 30


def make_engine(models, family, draft, directory, max_bytes=BIG, **kwargs):
    model, tok = models[family]
    store = StateStore.for_model(directory, max_bytes, model, tok, family)
    return Engine(model, tok, draft, num_draft_tokens=3, state_store=store, **kwargs)


def started(events) -> Started:
    return next(e for e in events if isinstance(e, Started))


# dflash reads a drafter model the suite's shared models do not carry; its
# kept states are tested with one (tests/drafters/test_dflash_drafter.py).
KEPT_DRAFTS = [d for d in draft_names() if d != "dflash"]


@pytest.mark.parametrize("draft", KEPT_DRAFTS)
def test_a_restart_continues_from_disk_exactly(models, family, draft, tmp_path, no_eos):
    """An engine closes (its states written), a new one on the same
    directory continues the conversation: only the new tokens (and the
    kept pending one) are prefilled, and the tokens are plain mlx-lm's of
    the whole prompt, for every drafter (the MTP head's cache and deferred
    rows and the n-gram index restored)."""
    model, tok = models[family]
    first = prompts("mixed")
    engine = make_engine(models, family, draft, tmp_path)
    _, reply = converse(engine, first, 10)
    engine.close()
    assert engine.store.status()["written"] >= 1 and not engine.store.status()["queued"]

    engine = make_engine(models, family, draft, tmp_path)
    try:
        second = first + reply + [5, 6, 7]
        events, again = converse(engine, second, 12)
        assert started(events).cached_tokens == len(first) + len(reply) - 1
        assert engine.store.counts["loaded"] == 1
        assert again == reference_tokens(model, tok, second, 12)
    finally:
        engine.close()


def test_a_state_evicted_from_memory_comes_back_from_disk(models, tmp_path, no_eos):
    """With no room in memory every state goes to disk as it is kept; once
    written, the next turn loads it from there."""
    model, tok = models["qwen3_next"]
    engine = make_engine(models, "qwen3_next", "mtp+ngram", tmp_path, cache_bytes=0)
    try:
        first = prompts("repetitive")
        _, reply = converse(engine, first, 9)
        assert len(engine.states) == 0
        assert engine.store.flush(timeout=120)
        assert engine.store.status()["files"] >= 1
        second = first + reply + [9, 8]
        events, again = converse(engine, second, 10)
        assert started(events).cached_tokens == len(first) + len(reply) - 1
        assert engine.store.counts["loaded"] == 1
        assert again == reference_tokens(model, tok, second, 10)
    finally:
        engine.close()


@pytest.fixture
def one_file(models, tmp_path, no_eos):
    """(engine whose memory keeps nothing, a prompt continuing a state
    written to disk, that state's file, the state)."""
    engine = make_engine(models, "qwen3_next", "ngram", tmp_path, cache_bytes=0)
    state = kept_state(engine, prompts("mixed"), 6)
    assert engine.store.flush(timeout=120)
    path = file_of(engine.store, state)
    for other in tmp_path.iterdir():  # the prompt's own state: not this test's
        if other != path:
            other.unlink()
    yield engine, state.history + [11, 12], path, state
    engine.close()


def warnings_about(caplog, path):
    return [r for r in caplog.records if path.name in r.getMessage()]


@pytest.mark.parametrize(
    "damage",
    ["truncated", "header cut", "changed byte", "not safetensors", "old format"],
)
def test_a_damaged_or_old_file_is_skipped_with_one_warning(one_file, damage, caplog):
    engine, prompt, path, state = one_file
    if damage == "truncated":
        truncate(path, path.stat().st_size - 200)
    elif damage == "header cut":
        truncate(path, 40)
    elif damage == "changed byte":
        flip_byte(path)
    elif damage == "not safetensors":
        path.write_bytes(b"\xff" * 64)
    else:
        rewrite(path, format="mlx_spec.state.v0")
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    for _ in range(2):  # asked twice, said once
        assert engine.store.lookup("ngram", prompt) is None
    assert len(warnings_about(caplog, path)) == 1
    # the server goes on (the prompt is prefilled but for the prompt-end
    # state of the same conversation), and the state replaces the skipped file
    events, _ = converse(engine, prompt, 4)
    assert started(events).cached_tokens < len(state.history) - 1
    engine.store.put(state)
    assert engine.store.flush(timeout=120)
    found = engine.store.lookup("ngram", state.history + [11])
    assert found is not None and found.history == state.history


def test_a_file_of_another_model_is_never_loaded(one_file, models, caplog):
    engine, prompt, path, state = one_file
    other = Identity.of(*models["qwen3_5"], "qwen3_5")
    rewrite(path, identity=other)
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    assert engine.store.lookup("ngram", prompt) is None
    assert engine.store.lookup("ngram", prompt) is None
    (warning,) = warnings_about(caplog, path)
    assert "another model or other weights (qwen3_5)" in warning.getMessage()
    # while the other model's own store loads it
    theirs = StateStore.for_model(path.parent, BIG, *models["qwen3_5"], "qwen3_5")
    assert theirs.identity == other
    assert theirs.lookup("ngram", prompt) is not None


def test_two_stores_share_a_directory(one_file, models, tmp_path, caplog):
    """What one store (process) writes another finds; a file the other
    removes between listing and reading is a miss, without a warning; a
    half-written (hidden) temporary file is never read."""
    engine, prompt, path, state = one_file
    other = StateStore(path.parent, BIG, engine.store.identity, engine.store.check)
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    found = other.lookup("ngram", prompt)
    assert found is not None and found.history == prompt[:-2]
    assert engine.store.lookup("ngram", prompt) is not None  # listed and read
    path.unlink()  # the other's budget removed it
    assert engine.store.lookup("ngram", prompt) is None
    partial = path.parent / f".{path.name}.tmp123.safetensors"
    partial.write_bytes(b"\x00" * 10)
    assert other.lookup("ngram", prompt) is None
    assert not caplog.records
    # a crashed writer's temporary file is removed once stale
    old = time.time() - STALE_TEMP_S - 10
    os.utime(partial, (old, old))
    other.trim()
    assert not partial.exists()


def test_the_byte_budget_removes_the_least_recently_used(models, tmp_path, no_eos):
    model, tok = models["qwen3_next"]
    engine = Engine(model, tok, "ngram", num_draft_tokens=3)
    store = StateStore.for_model(tmp_path, BIG, model, tok)
    try:
        a, b, c, d = (
            kept_state(engine, prompts("random", seed=s), 4) for s in range(4)
        )
        for state in (a, b, c):
            store.put(state)
        assert store.flush(timeout=120)
        sizes = sorted(p.stat().st_size for p in tmp_path.iterdir())
        assert len(sizes) == 3
        store.max_bytes = sizes[-1] + sizes[-2]  # room for two
        assert store.lookup("ngram", a.history + [1]) is not None  # a used again
        store.put(d)
        assert store.flush(timeout=120)
        status = store.status()
        assert status["files"] == 2 and status["removed"] == 2
        assert status["bytes"] <= store.max_bytes
        assert file_of(store, a).exists() and file_of(store, d).exists()
    finally:
        engine.close()
        store.close()


def test_a_directory_refusing_writes_costs_a_warning_not_a_request(
    models, tmp_path, no_eos, caplog
):
    model, tok = models["qwen3_next"]
    directory = tmp_path / "states"
    engine = make_engine(models, "qwen3_next", "ngram", directory, cache_bytes=0)
    try:
        directory.rmdir()  # gone under the server
        directory.write_text("not a directory")
        caplog.set_level(logging.WARNING, "mlx_spec.states")
        for seed in range(2):
            prompt = prompts("random", seed=seed)
            _, reply = converse(engine, prompt, 5)
            assert reply == reference_tokens(model, tok, prompt, 5)
        assert engine.store.flush(timeout=120)
        assert engine.store.counts["write_failures"] >= 2
        assert len([r for r in caplog.records if "cannot write" in r.message]) == 1
    finally:
        engine.close()


def test_memory_stays_flat_over_many_writes_and_loads(models, tmp_path, no_eos):
    model, tok = models["qwen3_next"]
    engine = make_engine(models, "qwen3_next", "mtp+ngram", tmp_path, cache_bytes=0)
    # A store of its own: the engine's writer may still be writing its
    # states, whose files the cycles below would remove under it.
    cycles = tmp_path / "cycles"
    store = StateStore.for_model(cycles, BIG, model, tok, "qwen3_next")
    try:
        state = kept_state(engine, prompts("mixed"), 8)
        prompt = state.history + [3]

        def cycle():
            for p in cycles.iterdir():
                p.unlink()
            store.put(state)
            assert store.flush(timeout=120)
            loaded = store.lookup(state.drafter, prompt)
            assert loaded is not None and loaded.history == state.history

        for _ in range(3):
            cycle()
        before = mx.get_active_memory()
        for _ in range(30):
            cycle()
        grown = mx.get_active_memory() - before
        # a leak of one state per cycle would be 30 of them
        assert grown < state.nbytes, (grown, state.nbytes)
        assert store.counts["written"] >= 33 and store.counts["loaded"] >= 33
    finally:
        store.close()
        engine.close()


def test_a_state_round_trips_whole(models, family, tmp_path, no_eos):
    """Every part of a kept state comes back from disk bit for bit: the
    target's caches, the pending token, the MTP head's rows and its deferred
    rows (which decide what it drafts next, not what is emitted)."""
    model, tok = models[family]
    engine = Engine(model, tok, "mtp+ngram", num_draft_tokens=3)
    store = StateStore.for_model(tmp_path, BIG, model, tok)
    try:
        state = kept_state(engine, prompts("mixed"), 10)
        assert state.pending == 1 and state.drafter_deferred
        store.put(state)
        assert store.flush(timeout=120)
        loaded = store.lookup("mtp+ngram", state.history)
        assert loaded is not state and loaded.history == state.history
        assert loaded.pending == 1 and loaded.last_hidden is None

        def arrays(s):
            out = []
            for c in s.caches:
                if hasattr(c, "keys"):
                    out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
                else:
                    out += [a for a in c.cache if a is not None]
            return out + s.drafter_arrays + [a for r in s.drafter_deferred for a in r]

        want, got = arrays(state), arrays(loaded)
        assert len(want) == len(got)
        for a, b in zip(want, got):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert mx.array_equal(a, b).item()
    finally:
        engine.close()
        store.close()
