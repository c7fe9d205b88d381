"""A decoder's whole state (:class:`~mlx_spec.core.snapshot.DecoderState`) as
one safetensors file: a chat session (``--prompt-cache-file``) and the
server's states kept on disk (:mod:`mlx_spec.state_store`) both use it.

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

import json
import os
import struct
import tempfile
from array import array
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Tuple

import mlx.core as mx

from .core.snapshot import DecoderState
from .core.state import GDNSlotCache
from .mlx_lm_compat import (
    ArraysCache,
    KVCache,
    load_prompt_cache,
    save_prompt_cache,
)

MAX_HEADER = 16 << 20  # bytes: a longer safetensors header is not ours


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


def state_crc(state: DecoderState) -> str:
    """CRC-32 of the shapes, types and bytes of ``state``'s (evaluated,
    contiguous) arrays, as 8 hex digits."""
    crc = zlib.crc32(array("I", state.history).tobytes())
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
    meta = {
        **metadata,
        "drafter": state.drafter,
        "n_target": str(len(state.caches)),
        "pending": str(state.pending),
        "n_deferred": str(len(state.drafter_deferred)),
        "crc32": state_crc(state),
    }
    path = Path(path)
    tmp = temp_file_beside(path)
    try:
        save_prompt_cache(str(tmp), caches, meta)
        with open(tmp, "rb+") as f:  # on disk before it has its name
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_metadata(path) -> Dict[str, str]:
    """The metadata of a state file, from its header alone (cheap: no
    array is read); ``ValueError`` for a file that is not a safetensors
    file, ``OSError`` for one that cannot be read."""
    with open(path, "rb") as f:
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
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("its header has no metadata")
    # save_prompt_cache flattens [metadata, classes, scalars]: ours is "0.*"
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


@contextmanager
def _safetensors_name(path: Path):
    """A name for ``path`` ending in ``.safetensors``: ``mx.load``, which
    ``load_prompt_cache`` calls, tells the format from the suffix."""
    if path.suffix == ".safetensors":
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp) / "session.safetensors"
        link.symlink_to(path.resolve())
        yield link


def read_state(path) -> Tuple[DecoderState, Dict[str, str]]:
    """The state and metadata of a file written by :func:`write_state`, its
    arrays evaluated. ``FileNotFoundError`` for a missing file (one another
    process removed is just gone); ``ValueError`` naming the file for any
    that is not a whole, unchanged state file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"prompt cache file {str(path)!r} is a directory")
    try:
        with _safetensors_name(path) as name:
            caches, meta = load_prompt_cache(str(name), return_metadata=True)
        n = int(meta["n_target"])
        pending, n_deferred = int(meta.get("pending", 0)), int(
            meta.get("n_deferred", 0)
        )
        history, last_hidden = caches[n].cache
        drafter_arrays = [a for a in caches[n + 1].cache if a is not None]
        rows = caches[n + 2].cache if n_deferred else []
        state = DecoderState(
            history.tolist(),
            last_hidden,
            caches[:n],
            meta["drafter"],
            drafter_arrays,
            pending,
            list(zip(rows[0::2], rows[1::2])),
        )
        if len(state.drafter_deferred) != n_deferred or pending not in (0, 1):
            raise ValueError("its layout does not match its metadata")
        mx.eval(list(_state_arrays(state)))
        if "crc32" in meta and state_crc(state) != meta["crc32"]:
            raise ValueError("its arrays do not match their checksum")
    except FileNotFoundError:
        raise
    except Exception as e:  # whatever the bytes are, the file is unreadable
        text = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(
            f"{str(path)!r} is not a readable prompt cache file ({text})"
        ) from None
    return state, meta
