"""A decoder's whole state (:class:`~mlx_spec.states.snapshot.DecoderState`) as
one safetensors file: a chat session (``--prompt-cache-file``) and the
server's states kept on disk (:mod:`mlx_spec.states.store`) both use it.

The layout is mlx-lm's prompt-cache file (``mlx_lm.models.cache.
save_prompt_cache``): the first ``n_target`` entries are the target's layer
caches in mlx-lm's own classes, so ``mlx_lm.models.cache.load_prompt_cache``
reads them (for a state whose pending token was processed, they are exactly
what plain decoding's prompt cache would hold). After them come three
``ArraysCache`` entries: the token history and the hidden state of its last
token (or none while that token is pending); the drafter's own arrays; the
drafter's deferred rows (tokens and hidden states of each pass, in turn).
The metadata says how many of each there are, how many tokens are pending,
and carries a CRC-32 of every array's bytes: a file whose arrays changed on
disk is refused, not decoded from.

Writing is atomic: the file is written beside its final name and renamed
onto it when complete, so a reader (another process included) sees either
the old file or the new one whole, never a part.
"""

import errno
import json
import os
import stat
import struct
import tempfile
import zlib
from array import array
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Dict, Iterator, List, Tuple

import mlx.core as mx
from mlx.utils import tree_unflatten

from .snapshot import DecoderState
from ..core.state import GDNSlotCache
from ..mlx_lm_compat import ArraysCache, KVCache, save_prompt_cache

MAX_HEADER = 16 << 20  # bytes: a longer safetensors header is not ours
MAX_DEFERRED = 1 << 20  # deferred passes a file may say it holds
CACHE_CLASSES = ("KVCache", "ArraysCache")  # what write_state writes


def _plain_cache(cache):
    """``cache`` in mlx-lm's own class, its arrays exactly the rows it holds."""
    if isinstance(cache, GDNSlotCache) or type(cache) is ArraysCache:
        plain = ArraysCache(len(cache.cache))
        plain.cache = [None if a is None else mx.contiguous(a) for a in cache.cache]
        return plain
    if type(cache) is KVCache:
        plain = KVCache()
        if cache.keys is not None:
            n = cache.offset
            plain.keys = mx.contiguous(cache.keys[..., :n, :])
            plain.values = mx.contiguous(cache.values[..., :n, :])
            plain.offset = n
        return plain
    raise ValueError(f"cannot save a {type(cache).__name__} layer cache")


def plain_state(state: DecoderState) -> DecoderState:
    """A copy of ``state`` that can be written from another thread: mlx-lm
    cache classes, every array evaluated, contiguous and cut to the rows it
    holds (writing it then runs no MLX computation)."""
    copy = DecoderState(
        list(state.history),
        None if state.last_hidden is None else mx.contiguous(state.last_hidden),
        [_plain_cache(c) for c in state.caches],
        state.drafter,
        [mx.contiguous(a) for a in state.drafter_arrays],
        state.pending,
        [(mx.contiguous(t), mx.contiguous(h)) for t, h in state.drafter_deferred],
    )
    mx.eval(list(_state_arrays(copy)))
    return copy


def _state_arrays(state: DecoderState) -> Iterator[mx.array]:
    """Every array of ``state``, in one fixed order (what the CRC covers)."""
    for c in state.caches:
        if isinstance(c, ArraysCache):
            yield from (a for a in c.cache if a is not None)
        elif c.keys is not None:
            yield from (c.keys, c.values)
    if state.last_hidden is not None:
        yield state.last_hidden
    yield from state.drafter_arrays
    for t, h in state.drafter_deferred:
        yield from (t, h)


def state_crc(state: DecoderState, fields: Dict[str, str], classes: List[str]) -> str:
    """CRC-32 of everything a state file's reader reads: its metadata
    ``fields`` (but the CRC itself), its cache ``classes``, the token
    history and the shapes, types and bytes of ``state``'s (evaluated,
    contiguous) arrays, as 8 hex digits."""
    told = {k: v for k, v in fields.items() if k != "crc32"}
    crc = zlib.crc32(json.dumps([told, classes], sort_keys=True).encode())
    crc = zlib.crc32(array("I", state.history).tobytes(), crc)
    for a in _state_arrays(state):
        crc = zlib.crc32(f"{a.dtype}{a.shape}".encode(), crc)
        crc = zlib.crc32(memoryview(a), crc)
    return f"{crc:08x}"


def temp_file_beside(path: Path) -> Path:
    """A new empty file in ``path``'s directory, named ``.NAME.*.safetensors``
    (the suffix ``mx.save_safetensors`` would otherwise append)."""
    fd, name = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".safetensors"
    )
    os.close(fd)
    return Path(name)


def check_writable(path):
    """Raise ``ValueError`` naming ``path`` if a state cannot be saved there
    (checked by creating a file beside it, so it fails before a state is lost)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"prompt cache file {str(path)!r} is a directory")
    try:
        temp_file_beside(path).unlink()
    except OSError as e:
        raise ValueError(
            f"cannot write the prompt cache file {str(path)!r}: {e.strerror}"
        ) from None


def _entry(arrays) -> ArraysCache:
    entry = ArraysCache(max(len(arrays), 1))
    entry.cache = list(arrays) or [None]
    return entry


def write_state(path, state: DecoderState, metadata: Dict[str, str]):
    """Write ``state`` (from :func:`plain_state`) and ``metadata`` to exactly
    ``path`` (safetensors, whatever its suffix), atomically. ``OSError`` when
    the disk refuses (nothing is left behind then)."""
    history = _entry([mx.array(state.history, mx.uint32), state.last_hidden])
    deferred = [a for rows in state.drafter_deferred for a in rows]
    caches = state.caches + [history, _entry(state.drafter_arrays), _entry(deferred)]
    fields = {
        **metadata,
        "drafter": state.drafter,
        "n_target": str(len(state.caches)),
        "pending": str(state.pending),
        "n_deferred": str(len(state.drafter_deferred)),
    }
    fields["crc32"] = state_crc(state, fields, [type(c).__name__ for c in caches])
    path = Path(path)
    tmp = temp_file_beside(path)
    try:
        save_prompt_cache(str(tmp), caches, fields)
        with open(tmp, "rb+") as f:  # on disk before it has its name
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def open_regular(path) -> Iterator[BinaryIO]:
    """``path`` opened for reading if it is a regular file: never a link
    (its last part), a pipe or a device, and without blocking on one.
    ``FileNotFoundError`` for a missing file, ``ValueError`` for anything
    that is not a regular file, ``OSError`` for one that cannot be read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{str(path)!r} is a link, not a state file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{str(path)!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        yield f


def _header(f: BinaryIO) -> dict:
    """The JSON header of the safetensors file ``f``."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER:
        raise ValueError(f"a safetensors header of {n} bytes")
    text = f.read(n)
    if len(text) < n:
        raise ValueError("truncated in its header")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("its header is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ValueError("its header has no metadata")
    return header["__metadata__"]


def _fields(raw: Dict[str, str]) -> Dict[str, str]:
    # save_prompt_cache flattens [metadata, classes, scalars]: ours is "0.*"
    return {k[2:]: v for k, v in raw.items() if k.startswith("0.")}


def read_metadata(path) -> Dict[str, str]:
    """The metadata of a state file, from its header alone (cheap: no
    array is read; not checked against the CRC, which covers the arrays
    too); ``ValueError`` for a file that is not a regular safetensors file,
    ``OSError`` for one that cannot be read."""
    with open_regular(path) as f:
        return _fields(_header(f))


def _count(fields: Dict[str, str], name: str, most: int) -> int:
    """The metadata field ``name``: a whole number in 0..``most``."""
    text = fields.get(name)
    if not isinstance(text, str) or not text.isdecimal() or int(text) > most:
        raise ValueError(f"its metadata field {name!r} is {text!r:.40}")
    return int(text)


def _caches(arrays: Dict[str, mx.array], raw: Dict[str, str]) -> Tuple[list, list]:
    """``(layer caches, class names)`` of a file written by
    :func:`write_state`, read as ``save_prompt_cache`` flattened them: only
    the two mlx-lm cache classes it writes are built, each by its own state
    setter, and only from arrays and whole numbers."""
    _, classes, scalars = tree_unflatten(list(raw.items()))
    if not isinstance(classes, list) or any(c not in CACHE_CLASSES for c in classes):
        raise ValueError("it names cache classes a state file does not hold")
    for item in scalars[1:]:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in arrays):
            raise ValueError("its list of scalar values is damaged")
        position, kind = item
        if kind == "none":
            arrays[position] = None
        elif kind == "scalar" and arrays[position].size == 1:
            arrays[position] = int(arrays[position].item())
        else:
            raise ValueError(f"it holds a {kind!r:.20} value a state file does not")
    states = tree_unflatten(list(arrays.items()))
    if not isinstance(states, list) or len(states) != len(classes):
        raise ValueError("its arrays do not match its cache classes")
    caches = []
    for i, (name, state) in enumerate(zip(classes, states)):
        if name == "KVCache":
            cache = KVCache.from_state(state)
            whole = isinstance(cache.offset, int) and all(
                isinstance(a, mx.array) and a.ndim == 4
                for a in (cache.keys, cache.values)
            )
        else:
            cache = ArraysCache.from_state(state)
            whole = (
                isinstance(cache.cache, list)
                and all(a is None or isinstance(a, mx.array) for a in cache.cache)
                and cache.left_padding is None
                and cache.lengths is None
            )
        if not whole:
            raise ValueError(f"its cache {i} is not a whole {name}")
        caches.append(cache)
    return caches, classes


def _check_layout(state: DecoderState):
    """Refuse a state whose parts do not fit together (whatever the file's
    bytes, a state that loads can be restored and decoded from)."""
    n = len(state.history)
    if n < 1 or n < state.pending:
        raise ValueError(f"its history holds {n} tokens")
    if state.pending and state.last_hidden is not None:
        raise ValueError("it has a hidden state for its pending token")
    if state.last_hidden is not None and state.last_hidden.ndim != 2:
        raise ValueError(f"its hidden state has shape {state.last_hidden.shape}")
    for i, c in enumerate(state.caches):
        if isinstance(c, KVCache) and (
            c.keys.shape != c.values.shape
            or c.offset != n - state.pending
            or c.keys.shape[2] != c.offset
        ):
            raise ValueError(
                f"its layer {i} holds {c.offset} positions, its history "
                f"{n - state.pending}"
            )
    for tokens, hidden in state.drafter_deferred:
        if tokens.ndim != 1 or hidden.ndim != 2 or hidden.shape[0] != tokens.size:
            raise ValueError("its deferred rows do not fit together")


def _read_open(f: BinaryIO) -> Tuple[DecoderState, Dict[str, str]]:
    """:func:`read_state` of the opened file ``f``, every array evaluated
    while it is open. MLX reads it by the descriptor's path (``/dev/fd/N``,
    the open file itself, whatever its name is now), not through a Python
    file object: its reader thread then holds no Python object, which it
    could release after the interpreter has begun to exit (an abort)."""
    arrays, raw = mx.load(
        f"/dev/fd/{f.fileno()}", format="safetensors", return_metadata=True
    )
    fields = _fields(raw)
    caches, classes = _caches(arrays, raw)
    n = _count(fields, "n_target", len(caches) - 3)
    if len(caches) != n + 3:
        raise ValueError("its layout does not match its metadata")
    pending = _count(fields, "pending", 1)
    n_deferred = _count(fields, "n_deferred", MAX_DEFERRED)
    history, last_hidden = (caches[n].cache + [None])[:2]
    if history is None or history.ndim != 1 or history.dtype != mx.uint32:
        raise ValueError("it holds no token history")
    rows = [a for a in caches[n + 2].cache if a is not None]
    if len(rows) != 2 * n_deferred or len(caches[n].cache) != 2:
        raise ValueError("its layout does not match its metadata")
    if "crc32" not in fields or not isinstance(fields.get("drafter"), str):
        raise ValueError("its metadata has no checksum or drafter")
    state = DecoderState(
        history.tolist(),
        last_hidden,
        caches[:n],
        fields["drafter"],
        [a for a in caches[n + 1].cache if a is not None],
        pending,
        list(zip(rows[0::2], rows[1::2])),
    )
    mx.eval(list(_state_arrays(state)))
    if state_crc(state, fields, classes) != fields["crc32"]:
        raise ValueError("its contents do not match their checksum")
    _check_layout(state)
    return state, fields


def read_state(path) -> Tuple[DecoderState, Dict[str, str]]:
    """The state and metadata of a file written by :func:`write_state`, its
    arrays evaluated. ``path`` must be a regular file, not a link (resolve a
    link the user gave first). ``FileNotFoundError`` for a missing file (one
    another process removed is just gone); ``ValueError`` naming the file
    for any that is not a whole, unchanged state file."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            state, fields = _read_open(f)
    except FileNotFoundError:
        raise
    except Exception as e:  # whatever the bytes are, the file is unreadable
        text = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(
            f"{str(path)!r} is not a readable prompt cache file ({text})"
        ) from None
    return state, fields
