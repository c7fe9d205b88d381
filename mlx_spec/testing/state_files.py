"""State files for the disk tier's tests: real states from a server engine,
and the ways a file on disk goes wrong (cut short, bytes changed, written by
another model or another format version)."""

from pathlib import Path
from typing import List, Optional, Tuple

from ..states.snapshot import DecoderState
from ..server.engine import Engine
from ..server.events import GenerationParams, Job
from ..states.file import plain_state, read_state, write_state
from ..states.store import Identity, StateStore, file_name
from .reference import tokens_of
from .server import job_events


def converse(engine: Engine, prompt: List[int], max_tokens: int) -> Tuple[list, list]:
    """``(events, reply tokens)`` of one request to ``engine``."""
    events = job_events(engine.submit(Job(prompt, GenerationParams(max_tokens))))
    return events, tokens_of(events)


def kept_state(engine: Engine, prompt: List[int], max_tokens: int) -> DecoderState:
    """The state ``engine`` keeps after answering ``prompt`` (its history is
    the prompt and the reply, its last token pending), in memory or on its
    way to disk."""
    _, reply = converse(engine, prompt, max_tokens)
    state = engine.states.lookup(engine.draft, prompt + reply)
    if state is None and engine.store is not None:  # not kept in memory
        state = engine.store.lookup(engine.draft, prompt + reply)
    assert state is not None and state.history == prompt + reply
    return state


def file_of(store: StateStore, state: DecoderState) -> Path:
    """The file ``store`` writes ``state`` to."""
    return store.directory / file_name(store.identity, state.drafter, state.history)


def truncate(path: Path, keep: int):
    """Cut ``path`` to its first ``keep`` bytes (a write that never ended)."""
    data = path.read_bytes()[:keep]
    path.write_bytes(data)


def flip_byte(path: Path, from_end: int = 100):
    """Change one byte ``from_end`` bytes before the end (in an array)."""
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0x5A
    path.write_bytes(bytes(data))


def rewrite(path: Path, identity: Optional[Identity] = None, **metadata: str):
    """Write ``path`` again as another writer would have: for ``identity``
    (another model) or with some metadata changed (another format)."""
    state, meta = read_state(path)
    meta = {k: v for k, v in meta.items() if k not in ("drafter", "crc32")}
    if identity is not None:
        meta.update(identity.metadata())
    meta.update(metadata)
    write_state(path, plain_state(state), meta)
