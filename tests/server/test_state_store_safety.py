"""The disk tier never costs a user a file or a wrong answer: the store owns
only the files it wrote (a directory holding anything else is refused, and
nothing else is ever counted or removed), a state file is continued only
when every field its reader reads checks out and its arrays fit the model,
files are opened without following links or blocking, and a state of other
weights (a fine-tune of the same model) is never continued."""

import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time

import mlx.core as mx
import pytest

import mlx_spec
from mlx_spec.states import store as state_store
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import Started
from mlx_spec.states.file import plain_state, read_metadata, read_state, write_state
from mlx_spec.states.store import STALE_TEMP_S, StateStore, check_state_dir
from mlx_spec.testing.checkpoints import fine_tune_copy
from mlx_spec.testing.reference import prompts, reference_tokens
from mlx_spec.testing.state_files import converse, file_of, kept_state

BIG = 1 << 30


def snapshot(directory):
    """Every entry of ``directory``: a file's bytes' digest, a link's target,
    or its kind."""
    out = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_symlink():
            out[entry.name] = "link to " + os.readlink(entry.path)
        elif entry.is_file(follow_symlinks=False):
            data = open(entry.path, "rb").read()
            out[entry.name] = hashlib.sha256(data).hexdigest()
        else:
            out[entry.name] = "other"
    return out


def write_adapters_dir(directory):
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text('{"fine_tune_type": "lora"}')
    mx.save_safetensors(str(directory / "adapters.safetensors"), {"a": mx.ones(4)})
    return directory


@pytest.mark.parametrize("holding", ["a model", "adapters", "a subfolder"])
def test_a_directory_holding_anything_but_states_is_refused(
    checkpoint_dirs, models, tmp_path, holding
):
    directory = tmp_path / "d"
    if holding == "a model":
        shutil.copytree(checkpoint_dirs["qwen3_next"], directory)
    elif holding == "adapters":
        write_adapters_dir(directory)
    else:
        (directory / "sub").mkdir(parents=True)
    before = snapshot(directory)
    with pytest.raises(ValueError, match="holds files that are not states"):
        check_state_dir(directory)
    model, tok = models["qwen3_next"]
    with pytest.raises(ValueError, match=str(directory)):
        StateStore.for_model(directory, 1, model, tok)
    assert snapshot(directory) == before


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_path_is_refused(path):
    with pytest.raises(ValueError, match="empty path"):
        check_state_dir(path)


def test_files_the_store_did_not_write_survive_every_trim(
    checkpoint_dirs, models, tmp_path, no_eos, caplog
):
    """Files it does not own, there when it opens (hidden files, a file named
    like a state whose header is not a state's) and added while it runs (a
    model's and adapters' files, a link and a pipe named like states): under a
    budget that forces trims at start and after every write, each one is
    left as it was and none is counted."""
    directory, outside = tmp_path / "states", tmp_path / "outside"
    directory.mkdir()
    outside.mkdir()
    (outside / "target.txt").write_text("someone else's")
    model_dir = checkpoint_dirs["qwen3_next"]
    old = time.time() - 2 * STALE_TEMP_S
    for name in (".DS_Store", ".bashrc", ".hidden.safetensors"):
        (directory / name).write_text("a user's file")
        os.utime(directory / name, (old, old))
    alike = directory / ("a" * 40 + ".safetensors")  # a model shard by that name
    shutil.copy(model_dir / "model.safetensors", alike)
    os.utime(alike, (old, old))  # the oldest: first in line if it were counted

    model, tok = models["qwen3_next"]
    engine = Engine(model, tok, "ngram", num_draft_tokens=3)
    try:
        states = [kept_state(engine, prompts("random", seed=s), 4) for s in range(5)]
    finally:
        engine.close()
    budget = int(1.5 * max(s.nbytes for s in states))  # room for one state file
    store = StateStore.for_model(directory, budget, model, tok)
    ours = {file_of(store, s).name for s in states}
    foreign = snapshot(directory)
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    try:
        for i, state in enumerate(states):
            if i == 2:  # a model, adapters, a link and a pipe put in meanwhile
                for f in ("model.safetensors", "config.json", "tokenizer.json"):
                    shutil.copy(model_dir / f, directory / f)
                write_adapters_dir(directory / "adapters")
                link = directory / ("b" * 40 + ".safetensors")
                link.symlink_to(outside / "target.txt")
                os.mkfifo(directory / ("c" * 40 + ".safetensors"))
                foreign = {
                    n: w for n, w in snapshot(directory).items() if n not in ours
                }
            store.put(state)
            assert store.flush(timeout=120)
        assert store.counts["removed"] >= 3  # the budget did act
        after = snapshot(directory)
        assert {n: after.get(n) for n in foreign} == foreign
        assert len(foreign) == 10
        assert (outside / "target.txt").read_text() == "someone else's"
        status = store.status()
        assert status["files"] == 1 and status["bytes"] <= budget
        # opening the directory again now refuses it, naming what is not ours
        with pytest.raises(ValueError, match="adapters, b+.safetensors"):
            check_state_dir(directory)
        # the one file named like a state but not one was said once; nothing
        # else was opened
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and alike.name in said[0], said
    finally:
        store.close()


def lookup_bounded(store, drafter, prompt):
    """``store.lookup`` on a thread, joined within a generous bound (a read
    that blocks would hang the test otherwise)."""
    found = []
    thread = threading.Thread(
        target=lambda: found.append(store.lookup(drafter, prompt)), daemon=True
    )
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the lookup blocked"
    return found[0]


@pytest.mark.parametrize("kind", ["link", "pipe"])
def test_a_link_or_pipe_named_as_a_state_is_never_opened(
    models, tmp_path, no_eos, kind, caplog
):
    """A link to a valid state of this very model, or a pipe, under the name
    of a state: the lookup neither follows nor blocks, and finds nothing."""
    model, tok = models["qwen3_next"]
    engine = Engine(model, tok, "ngram", num_draft_tokens=3)
    store = StateStore.for_model(tmp_path / "states", BIG, model, tok)
    try:
        state = kept_state(engine, prompts("mixed"), 6)
        store.put(state)
        assert store.flush(timeout=120)
        path = file_of(store, state)
        prompt = state.history + [7]
        moved = tmp_path / "elsewhere.safetensors"
        os.replace(path, moved)
        if kind == "link":
            path.symlink_to(moved)
        else:
            os.mkfifo(path)
        caplog.set_level(logging.WARNING, "mlx_spec.states")
        assert lookup_bounded(store, "ngram", prompt) is None
        assert path.is_symlink() if kind == "link" else path.is_fifo()
        with pytest.raises(ValueError, match=path.name):  # no longer its own
            check_state_dir(store.directory)
    finally:
        engine.close()
        store.close()


def bounded(call, *args):
    """``call(*args)``'s exception (or None), on a thread joined within a
    generous bound: a read that blocks fails the test instead of hanging it."""
    raised = []

    def run():
        try:
            call(*args)
            raised.append(None)
        except Exception as e:
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), f"{call.__name__} blocked"
    return raised[0]


@pytest.mark.parametrize("kind", ["link", "pipe", "directory"])
def test_the_reader_opens_regular_files_only(mtp_file, tmp_path, kind):
    """Whatever a directory listing said a moment before: the reader itself
    refuses a link (even to a valid state), a pipe (without blocking on it)
    and a directory, naming the path."""
    _, _, path = mtp_file
    odd = tmp_path / "odd.safetensors"
    if kind == "link":
        odd.symlink_to(path)
    elif kind == "pipe":
        os.mkfifo(odd)
    else:
        odd.mkdir()
    for read in (read_state, read_metadata):
        error = bounded(read, odd)
        assert isinstance(error, ValueError) and str(odd) in str(error), error


def edit_header(path, key: str, value: str):
    """Set metadata field ``key`` of the safetensors file ``path`` to
    ``value`` (the arrays' bytes unchanged), as a flipped bit there would."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    assert header["__metadata__"][f"0.{key}"] != value
    header["__metadata__"][f"0.{key}"] = value
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


@pytest.fixture
def mtp_file(models, tmp_path, no_eos):
    """An engine with a disk tier, and one state of it on disk: with its last
    token pending and the MTP head's rows deferred (every field in use)."""
    model, tok = models["qwen3_next"]
    store = StateStore.for_model(tmp_path / "states", BIG, model, tok, "qwen3_next")
    engine = Engine(
        model, tok, "mtp+ngram", num_draft_tokens=3, state_store=store, cache_bytes=0
    )
    prompt = prompts("mixed")
    state = kept_state(engine, prompt, 8)
    assert state.pending == 1 and state.drafter_deferred
    assert store.flush(timeout=120)
    path = file_of(store, state)
    for other in path.parent.iterdir():  # the prompt's own state: not this test's
        if other != path:
            other.unlink()
    yield engine, state, path
    engine.close()


def changed(meta, key):
    if key == "tokens":  # one token another, its hash with it
        tokens = meta["tokens"].split(",")
        tokens[3] = str((int(tokens[3]) + 1) % 256)
        return ",".join(tokens)
    if key == "drafter":
        return "mtp"
    if key == "model_name":
        return meta[key] + "x"
    return {"0": "1", "1": "0"}.get(meta[key], str(int(meta[key]) - 1))


@pytest.mark.parametrize(
    "key", ["pending", "n_deferred", "n_target", "drafter", "tokens", "model_name"]
)
def test_a_changed_header_field_is_refused_once_and_the_request_goes_on_cold(
    mtp_file, models, key, caplog, monkeypatch
):
    engine, state, path = mtp_file
    meta = read_metadata(path)
    edit_header(path, key, changed(meta, key))
    if key == "tokens":  # consistent with itself: only the checksum tells
        tokens = [int(t) for t in read_metadata(path)["tokens"].split(",")]
        edit_header(path, "tokens_sha256", state_store.tokens_hash(tokens))
    reads = []
    real_read = state_store.read_state
    monkeypatch.setattr(
        state_store, "read_state", lambda p: reads.append(p) or real_read(p)
    )
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    history = [int(t) for t in read_metadata(path)["tokens"].split(",")]
    prompt = history + [11, 12]
    model, tok = models["qwen3_next"]
    for turn in range(2):  # the file is read once; the request goes on cold
        events, reply = converse(engine, prompt, 6)
        started = next(e for e in events if isinstance(e, Started))
        assert started.cached_tokens == 0 or turn == 1  # then: its own state
        assert reply == reference_tokens(model, tok, prompt, 6)
    assert reads.count(path) <= 1
    said = [r for r in caplog.records if path.name in r.getMessage()]
    # a file naming another drafter is no candidate at all: never read
    assert len(said) == (key != "drafter") == reads.count(path)


def misfit(state, how: str):
    """``state`` with one part of the wrong shape (or a token id outside the
    vocabulary), written as a whole, checksummed file would hold it."""
    state = plain_state(state)
    if how == "attention heads":
        c = next(c for c in state.caches if hasattr(c, "keys"))
        c.keys, c.values = c.keys[:, :1], c.values[:, :1]
    elif how == "recurrent state":
        c = next(c for c in state.caches if not hasattr(c, "keys"))
        c.cache = [c.cache[0], c.cache[1][..., :-1]] + list(c.cache[2:])
    elif how == "layers":
        state.caches = state.caches[:-1]
    elif how == "head rows":
        state.drafter_arrays[0] = state.drafter_arrays[0][:, :, :, :-1]
    elif how == "deferred rows":
        tokens, hidden = state.drafter_deferred[0]
        state.drafter_deferred[0] = (tokens, hidden[:, :-1])
    elif how == "token id":
        state.history[2] = 1 << 30
    return plain_state(state)  # contiguous again, as a writer leaves it


@pytest.mark.parametrize(
    "how",
    [
        "attention heads",
        "recurrent state",
        "layers",
        "head rows",
        "deferred rows",
        "token id",
    ],
)
def test_a_state_that_does_not_fit_the_model_is_never_decoded_from(
    mtp_file, models, how, caplog
):
    engine, state, path = mtp_file
    bad = misfit(state, how)
    meta = {
        **engine.store.identity.metadata(),
        "tokens": ",".join(map(str, bad.history)),
        "tokens_sha256": state_store.tokens_hash(bad.history),
    }
    write_state(path, bad, meta)
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    prompt = bad.history + [11, 12]
    assert engine.store.lookup("mtp+ngram", prompt) is None
    (warning,) = [r for r in caplog.records if path.name in r.getMessage()]
    assert "does not fit the model" in warning.getMessage()
    if how != "token id":  # a prompt of valid ids goes on cold, exactly
        model, tok = models["qwen3_next"]
        events, reply = converse(engine, prompt, 6)
        assert reply == reference_tokens(model, tok, prompt, 6)


@pytest.fixture(scope="module")
def tuned_dirs(checkpoint_dirs, tmp_path_factory):
    """family -> (base directory, a fine-tune of one of its layers)."""
    root = tmp_path_factory.mktemp("tuned")
    out = {}
    for family, base in checkpoint_dirs.items():
        fine_tune_copy(base, root / family)
        out[family] = (base, root / family)
    return out


def test_a_fine_tune_never_continues_its_base_state(
    tuned_dirs, family, tmp_path, caplog
):
    """A conversation kept by the base model: a restart on the base continues
    it from disk with the cold base's tokens; the fine-tune, on the same
    directory, starts cold and answers as the cold fine-tune does."""
    base_dir, tuned_dir = tuned_dirs[family]
    states = tmp_path / "states"

    def engine_on(directory):
        model, tok = mlx_spec.load(directory)
        tok.eos_token_ids = set()
        store = StateStore.for_model(states, BIG, model, tok, directory.name)
        return Engine(model, tok, "ngram", num_draft_tokens=3, state_store=store)

    first = prompts("mixed")
    engine = engine_on(base_dir)
    _, reply = converse(engine, first, 8)
    engine.close()  # its states written
    second = first + reply + [5, 6, 7]
    caplog.set_level(logging.WARNING, "mlx_spec.states")
    answers = {}
    for name, directory in (("tuned", tuned_dir), ("base", base_dir)):
        engine = engine_on(directory)
        try:
            events, answers[name] = converse(engine, second, 10)
            cached = next(e for e in events if isinstance(e, Started)).cached_tokens
            model, tok = engine.model, engine.tokenizer
            assert answers[name] == reference_tokens(model, tok, second, 10)
        finally:
            engine.close()
        if name == "tuned":
            assert cached == 0
            assert any("other weights" in r.getMessage() for r in caplog.records)
        else:
            assert cached == len(first) + len(reply) - 1
    assert answers["tuned"] != answers["base"]
